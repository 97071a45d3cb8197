"""Batch preparation and the prefetch thread (xc.train.modes.classifier.batches), and the per-phase step timer
(xc.train.phases)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from xc.train.modes.classifier.batches import PREFETCH_DEPTH, BatchPreparer, Prefetcher, can_draw_ahead
from xc.config import build_config
from xc.train.phases import PHASES, NullTimer, PhaseTimer, make_timer
from xc.sampling import HardNegativeSet, StepKey, build_sampler
from xc.shards import ShardLayout


def test_prefetcher_yields_in_order_and_stays_bounded():
    made: list[int] = []

    def prepare(i):
        made.append(i)
        return i * 10

    ahead = Prefetcher(prepare, range(3, 20))
    deadline = time.monotonic() + 10
    while len(made) < PREFETCH_DEPTH + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the thread runs ahead only until the queue is full
    assert made == list(range(3, 3 + PREFETCH_DEPTH + 1))  # depth queued + one waiting to be put
    assert [ahead.get() for _ in range(5)] == [30, 40, 50, 60, 70]
    ahead.close()  # mid-epoch stop (max_steps): the blocked thread ends
    assert not ahead._thread.is_alive()


def test_prefetcher_reraises_the_threads_error_in_order():
    def prepare(i):
        if i == 2:
            raise ValueError("bad row 2")
        return i

    ahead = Prefetcher(prepare, range(5))
    assert ahead.get() == 0 and ahead.get() == 1
    with pytest.raises(ValueError, match="bad row 2"):
        ahead.get()
    ahead.close()


@pytest.mark.parametrize("name,ahead", [
    ("uniform", True), ("astra", True), ("hard", True), ("curriculum", True), ("popularity", True),
    ("inbatch", True), ("snm", False), ("midx_pq", False), ("lsh_embedding", False), ("lsh_label", False),
    ("full", False),
])
def test_which_samplers_draw_ahead(name, ahead):
    cfg = build_config({"sampler": {"name": name, "k_hard": 4, "k_random": 8}})
    sampler = build_sampler(cfg.sampler, ShardLayout.build(100, 2, 16), 0, np.ones(100, dtype=np.int64))
    assert can_draw_ahead(sampler) is ahead


class _Split:
    """Just enough of TrainingView / Components for BatchPreparer."""

    def __init__(self, n, labels):
        rng = np.random.default_rng(0)
        self.num_rows = n
        self.lists = [rng.choice(labels, size=rng.integers(1, 12), replace=False) for _ in range(n)]

    def inputs(self, rows):
        return {"x": torch.from_numpy(np.asarray(rows, dtype=np.float32))}

    def labels(self, rows):
        parts = [self.lists[r] for r in rows]
        return np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64), \
            np.concatenate(parts).astype(np.int64)


class _Shard:
    lo, hi = 0, 112


def test_prepared_batches_are_reproducible_and_drawn_ahead_for_astra():
    """Preparing a micro-step twice (or on another thread) gives identical tensors: every draw is keyed."""
    from types import SimpleNamespace

    cfg = build_config({"sampler": {"name": "astra", "k_hard": 4, "k_random": 8, "k_pos": 4}})
    layout = ShardLayout.build(100, 2, 16)
    sampler = build_sampler(cfg.sampler, layout, 0, np.ones(100, dtype=np.int64))
    tables = {s: np.random.default_rng(s).integers(0, 100, (40, 2)).astype(np.int32) for s in (0, 1)}
    sampler.update(1, HardNegativeSet(tables, 1, 0, 0))
    c = SimpleNamespace(sampler=sampler, train=_Split(40, 100), micro_batch=8, layout=layout, my_shards=range(2),
                        shard=_Shard())
    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), active=False)
    prep = BatchPreparer(cfg, c, ctx)
    assert prep.draw_ahead and not prep.pin
    rows = np.arange(8, 16)
    a = prep(1, rows, StepKey(0, 1, 1))
    b = Prefetcher(lambda i: prep(i, rows, StepKey(0, 1, i)), range(1, 2)).get()
    assert a.cand is not None and a.cand.local_ids.shape == (8, 4 + 2 * (2 + 4))
    for x, y in [(a.positives.ids, b.positives.ids), (a.positives.weight, b.positives.weight),
                 (a.cand.local_ids, b.cand.local_ids), (a.cand.weight, b.cand.weight), (a.inputs["x"], b.inputs["x"])]:
        assert torch.equal(x, y)
    other = prep(2, rows, StepKey(0, 1, 2))  # another step: other draws
    assert not torch.equal(other.cand.local_ids, a.cand.local_ids)


def test_phase_timer_averages_over_the_window_and_resets():
    timer = make_timer(True, torch.device("cpu"))
    assert isinstance(timer, PhaseTimer) and timer.window() is None
    for _ in range(2):
        timer.start()
        time.sleep(0.02)
        timer.mark("data")
        timer.mark("h2d")
        time.sleep(0.01)
        timer.mark("backward")
        timer.end_step()
    window = timer.window()
    assert set(window) == set(PHASES)
    assert 0.015 < window["data"] < 0.2 and 0.005 < window["backward"] < 0.2 and window["h2d"] < 0.005
    assert window["loss"] == 0.0 and timer.window() is None
    off = make_timer(False, torch.device("cpu"))
    assert isinstance(off, NullTimer) and not off.enabled
    off.start(), off.mark("data"), off.end_step()
    assert off.window() is None
