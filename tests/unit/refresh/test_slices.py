"""Which training queries a generation mines (xc/refresh/slices.py), and how the trainer merges a slice into the
table in use (xc/refresh/negatives.py)."""

from __future__ import annotations

import numpy as np
import pytest

from xc.handoff import HandoffError, positives_of_rows, window_rows
from xc.refresh.negatives import merge_slice
from xc.refresh.slices import EPOCH_SHARE, MinerRate, next_window, slice_count
from xc.sampling import HardNegativeSet


def test_slice_count_follows_the_share_then_the_measured_rate_within_the_rotation_bound():
    assert slice_count(1000, 0.25, 4, None, None) == 250
    assert slice_count(1000, None, 4, None, None) == 1000  # not measured yet: every row
    # 100 s epochs; the last generation built in 10 s and searched 1000 queries in 90 s (0.09 s each):
    # (0.8 x 100 - 10) / 0.09 = 777 rows fit
    rate = MinerRate(search_seconds=90.0, build_seconds=10.0, queries=1000)
    assert slice_count(1000, None, 4, 100.0, rate) == int((EPOCH_SHARE * 100 - 10) / 0.09)
    assert slice_count(1000, None, 4, 1000.0, rate) == 1000  # a fast miner mines every row
    assert slice_count(1000, None, 4, 5.0, rate) == 250  # a slow one: never under 1 / max_rotation


def test_under_late_policy_wait_no_measured_time_sizes_the_slice():
    """late_policy=wait promises figures independent of the miner's speed; the rule sized the slice from measured
    seconds, so a loaded machine (a slower miner, a longer epoch) mined other rows and trained other negatives."""
    rate = MinerRate(search_seconds=90.0, build_seconds=10.0, queries=1000)
    assert slice_count(1000, None, 4, 100.0, rate) < 1000  # the timed rule: a slice
    assert {slice_count(1000, None, 4, epoch, rate, timed=False) for epoch in (5.0, 100.0, 1000.0)} == {1000}
    assert slice_count(1000, 0.25, 4, 100.0, rate, timed=False) == 250  # a fixed share still holds


def test_miner_rate_counts_shards_mined_side_by_side_once():
    stats = [{"build_seconds": 4.0, "search_seconds": 30.0}, {"build_seconds": 6.0, "search_seconds": 50.0}]
    assert MinerRate.of(stats, 1000, workers=1) == MinerRate(80.0, 10.0, 1000)  # one worker: one after the other
    assert MinerRate.of(stats, 1000, workers=8) == MinerRate(40.0, 5.0, 1000)  # both at once


@pytest.mark.parametrize("num_rows, count", [(10, 3), (1000, 250), (7, 7), (1001, 334)])
def test_windows_rotate_and_cover_every_row_within_the_bound(num_rows, count):
    window, seen, rounds = None, np.zeros(num_rows, dtype=int), -(-num_rows // count)
    for _ in range(rounds):
        window = next_window(window, count, num_rows)
        rows = np.arange(num_rows) if window is None else window_rows(window)
        assert len(rows) == count and len(np.unique(rows)) == count
        seen[rows] += 1
    assert (seen >= 1).all()  # every query refreshed within ceil(N / count) generations
    assert seen.max() - seen.min() <= 1


def test_window_rows_refuses_a_bad_window():
    with pytest.raises(HandoffError, match="num_rows"):
        window_rows({"start": 5, "count": 3, "num_rows": 5})


def test_positives_of_a_window_are_its_rows_in_order():
    indptr, indices = np.array([0, 2, 2, 5, 6]), np.array([1, 4, 0, 2, 3, 7])
    sub_indptr, sub_indices = positives_of_rows(indptr, indices, np.array([3, 0, 1]))
    assert sub_indptr.tolist() == [0, 1, 3, 3] and sub_indices.tolist() == [7, 1, 4]


def test_a_slice_replaces_its_rows_and_keeps_the_others():
    first, steps = merge_slice(None, {0: np.array([[1, 2], [3, 4]], np.int32)}, np.array([1, 2]), 10, 4)
    assert first[0].tolist() == [[-1, -1], [1, 2], [3, 4], [-1, -1]] and steps.tolist() == [-1, 10, 10, -1]
    current = HardNegativeSet(first, 1, 0, 10, None, steps)
    second, steps = merge_slice(current, {0: np.array([[5, 6], [7, 8]], np.int32)}, np.array([3, 0]), 20, 4)
    assert second[0].tolist() == [[7, 8], [1, 2], [3, 4], [5, 6]] and steps.tolist() == [20, 10, 10, 20]
    assert first[0].tolist()[0] == [-1, -1]  # the table in use is not modified
    whole = {0: np.zeros((4, 2), np.int32)}
    assert merge_slice(current, whole, None, 30, 4) == (whole, None)  # a full generation replaces everything
