"""Which generation the trainer takes at an epoch boundary, and when it waits (`Negatives`, xc/refresh/negatives.py):
`bounded` takes the newest generation that has arrived and waits only past miner.max_lag refreshes behind the
schedule; `wait` waits for each generation on schedule; `reuse` never waits. The miner skips snapshots that a
newer one has superseded (xc/miner/service.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.unit.test_handoff import GOOD, _publish_two_shards, _sides
from xc.config import MinerConfig, SamplerConfig
from xc.handoff import Stage, gen_name, handoff_root
from xc.sampling import HardNegativeSet


def _with(run_dir, late_policy: str, max_lag: int = 1, timeout: float = 30.0, start_epoch: int = 1,
          refresh_every: int = 1):
    """The negatives side of a Refresher with this policy and schedule."""
    return _sides(run_dir, miner=MinerConfig(late_policy=late_policy, max_lag=max_lag, wait_timeout_s=timeout,
                                             poll_seconds=0.05),
                  sampler=SamplerConfig(start_epoch=start_epoch, refresh_every=refresh_every)).negatives


def _in_use(generation: int) -> HardNegativeSet:
    return HardNegativeSet({0: GOOD[0], 1: GOOD[1]}, generation, generation - 1, 0)


def _publish_later(run_dir, generation: int, seconds: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), _publish_two_shards(run_dir, generation, GOOD)))
    thread.start()
    return thread


def test_lag_counts_refreshes_behind_the_schedule(tmp_path):
    r = _with(tmp_path, "bounded", start_epoch=2, refresh_every=2)
    assert r.scheduled_generation(1) is None and r.scheduled_generation(2) == 2 and r.scheduled_generation(5) == 4
    assert r.lag(2, 2) == 0 and r.lag(3, 2) == 0 and r.lag(4, 2) == 1 and r.lag(8, 2) == 3
    assert r.lag(2, None) == 1 and r.lag(4, None) == 2  # nothing mined yet: one refresh behind at the first


def test_bounded_does_not_wait_within_the_bound(tmp_path):
    r = _with(tmp_path, "bounded", max_lag=1)
    began = time.perf_counter()
    generation, waited, note = r._decide(2, _in_use(1))  # generation 2 not mined: one refresh behind
    assert generation is None and waited < 0.5 and time.perf_counter() - began < 0.5
    assert "not mined yet" in note and "no wait" in note and r._lag_before == 1
    assert r._decide(1, None)[0] is None and r._lag_before == 1  # the first hard epoch trains on uniform draws


def test_bounded_takes_the_newest_generation_that_has_arrived(tmp_path):
    r = _with(tmp_path, "bounded", max_lag=1)
    _publish_two_shards(tmp_path, 2, GOOD)
    _publish_two_shards(tmp_path, 3, GOOD)
    generation, waited, note = r._decide(4, _in_use(1))  # 4 not mined: 3 arrived, one refresh behind
    assert generation == 3 and waited < 0.5 and "newest arrived" in note and r._lag_before == 3


def test_bounded_waits_past_the_bound_until_a_generation_within_it_arrives(tmp_path):
    r = _with(tmp_path, "bounded", max_lag=1)
    _publish_two_shards(tmp_path, 2, GOOD)  # arrived, but 2 refreshes behind at epoch 4: over the bound
    thread = _publish_later(tmp_path, 3, 0.6)
    generation, waited, _ = r._decide(4, _in_use(1))
    thread.join()
    assert generation == 3 and waited >= 0.5 and r._lag_before == 3


def test_bounded_wait_ends_at_the_timeout_with_the_newest_that_arrived(tmp_path, caplog):
    r = _with(tmp_path, "bounded", max_lag=1, timeout=0.3)
    _publish_two_shards(tmp_path, 2, GOOD)
    with caplog.at_level("INFO", logger="xc.refresh"):
        generation, waited, note = r._decide(4, _in_use(1))
    assert generation == 2 and waited >= 0.3 and "late for generation 4" in note
    assert "waiting for the miner" in caplog.text and "over the bound of 1" in caplog.text


def test_no_wait_at_an_epoch_that_is_not_a_refresh(tmp_path):
    r = _with(tmp_path, "wait", timeout=5.0, refresh_every=2)  # refreshes at epochs 1, 3, 5
    began = time.perf_counter()
    assert r._decide(4, _in_use(1))[0] is None and time.perf_counter() - began < 0.5
    _publish_two_shards(tmp_path, 3, GOOD)  # arrived late, after its own boundary: taken at the next one
    assert r._decide(4, _in_use(1))[0] == 3


def test_wait_policy_waits_for_the_generation_on_schedule(tmp_path):
    r = _with(tmp_path, "wait")
    _publish_two_shards(tmp_path, 1, GOOD)
    thread = _publish_later(tmp_path, 2, 0.6)
    generation, waited, note = r._decide(2, _in_use(1))
    thread.join()
    assert generation == 2 and waited >= 0.5 and note == "fresh"


@pytest.mark.parametrize("policy", ["bounded", "reuse"])
def test_a_failed_generation_ends_the_wait_at_once(tmp_path, policy):
    r = _with(tmp_path, policy, max_lag=0)
    (r.root / "control").mkdir(parents=True)
    (r.root / "control" / "failed-gen-000002.json").write_text('{"reason": "superseded"}')
    began = time.perf_counter()
    generation, _, note = r._decide(2, _in_use(1))
    assert generation is None and "miner failed generation 2" in note and time.perf_counter() - began < 0.5


def test_miner_mines_the_newest_pending_snapshot_and_marks_the_older_superseded(tmp_path, monkeypatch):
    from xc.miner.service import MinerService

    for generation in (2, 3, 4):
        Stage(handoff_root(tmp_path) / "snapshots", gen_name(generation)).publish({"kind": "snapshot"})
    service = MinerService(tmp_path, MinerConfig())
    mined = []
    monkeypatch.setattr(service, "mine", lambda generation: mined.append(generation))
    stop = threading.Event()
    monkeypatch.setattr(service, "pending", lambda: [] if mined else [2, 3, 4])
    thread = threading.Thread(target=service.serve, args=(stop, False))
    thread.start()
    time.sleep(0.5)
    stop.set()
    thread.join(5)
    assert mined == [4]
    assert service.failed() == {2, 3}
    reason = (handoff_root(tmp_path) / "control" / "failed-gen-000002.json").read_text()
    assert "superseded by generation 4" in reason
    assert np.array_equal(sorted(service.failed()), [2, 3])
