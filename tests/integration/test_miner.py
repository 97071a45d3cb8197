"""The asynchronous miner under real processes: offline worker, worker crashes, a full disk."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO, run_cli
from xc.config import MinerConfig
from xc.handoff import handoff_root, list_generations, open_negatives, open_snapshot
from xc.miner.service import MinerService

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

TINY = ["data.synthetic.num_train=3000", "data.synthetic.num_test=300", "data.synthetic.num_labels=1000",
        "data.synthetic.num_features=2000", "train.epochs=3", "train.batch_size=128", "logger.progress=false",
        "logger.wandb=disabled", "train.warmup_steps=5", "parallel.num_label_shards=2", "sampler.start_epoch=1",
        "miner.ann.backend=exact", "miner.workers=2", "miner.wait_timeout_s=300",
        "miner.late_policy=wait",  # every generation on schedule: the runs do not depend on the miner's speed
        "train.prune_when_done=false"]  # the tests read the generations after the run


def _events(run_dir):
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def test_offline_worker_generations_match_the_pool(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "XC_THREADS": "1"}
    miner = subprocess.Popen([sys.executable, "-m", "xc.miner.cli", "--run-dir", str(run_dir), "--backend", "exact",
                              "--workers", "1"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        run_cli([*TINY, "miner=external", f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"], cwd=REPO)
        out, _ = miner.communicate(timeout=120)  # exits by itself once the trainer is done
    finally:
        if miner.poll() is None:
            miner.kill()
    assert miner.returncode == 0, out
    used = [e["generation"] for e in _events(run_dir) if e["event"] == "negatives"]
    assert used == [1, 2]

    # The in-process pool mines the same snapshots into a copy of the run directory.
    copy = tmp_path / "copy"
    for part in ("static", "snapshots"):
        shutil.copytree(handoff_root(run_dir) / part, handoff_root(copy) / part)
    service = MinerService(copy, MinerConfig(workers=2))
    for generation in (1, 2):
        assert service.mine(generation) is not None
        offline, _ = open_negatives(run_dir, generation, [0, 1])
        pooled, _ = open_negatives(copy, generation, [0, 1])
        for shard in (0, 1):
            assert np.array_equal(offline[shard], pooled[shard])
            assert (offline[shard] >= 0).all()


def test_worker_killed_mid_write_training_continues(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli([*TINY, "miner=pool", f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"], cwd=REPO,
                   env={"XC_FAULT_MINER_KILL": "1"})
    assert (handoff_root(run_dir) / "control" / "fault-fired").exists()  # a worker really died mid-write
    assert "worker died while mining generation 1" in proc.stdout
    used = [e["generation"] for e in _events(run_dir) if e["event"] == "negatives"]
    assert used == [1, 2]  # the retried generation was published complete, and the next one too
    tables, _ = open_negatives(run_dir, 1, [0, 1])  # verifies sizes and checksums
    assert all((t >= 0).all() for t in tables.values())
    leftovers = [p.name for p in (handoff_root(run_dir) / "negatives").iterdir() if ".tmp-" in p.name]
    assert leftovers == []
    assert (run_dir / "metrics.json").exists()


def test_full_disk_keeps_previous_generation(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli([*TINY, "train.epochs=4", "miner=pool", f"run_dir={run_dir}",
                    f"data.cache_dir={tmp_path / 'cache'}"], cwd=REPO, env={"XC_FAULT_MINER_ENOSPC": "1"})
    late = [e for e in _events(run_dir) if e["event"] == "negatives_late"]
    assert late and ".int32: no space left on the device" in late[0]["reason"]
    assert "free space" in late[0]["reason"]
    assert 1 not in list_generations(handoff_root(run_dir) / "negatives")  # nothing half-published
    used = [e["generation"] for e in _events(run_dir) if e["event"] == "negatives"]
    assert used == [2, 3]  # training went on; the next refreshes succeeded
    assert "miner failed generation 1" in proc.stdout


def test_a_slow_miner_stalls_the_trainer_only_past_the_staleness_bound(tmp_path):
    """miner.late_policy=bounded (the default) with a miner whose every shard task takes 8 s longer
    (XC_FAULT_MINER_DELAY_S) than a tiny epoch: no epoch whose negatives trail the schedule by at most
    miner.max_lag refreshes waits; an epoch that would trail by more waits for the miner; the `refresh` event
    of every epoch says which."""
    run_dir = tmp_path / "run"
    args = [a for a in TINY if not a.startswith("miner.late_policy=")]
    run_cli([*args, "train.epochs=4", "miner=pool", "miner.late_policy=bounded", "miner.max_lag=1",
             "miner.rerank_candidates=0", "miner.first_snapshot_at=0", f"run_dir={run_dir}",
             f"data.cache_dir={tmp_path / 'cache'}"], cwd=REPO, env={"XC_FAULT_MINER_DELAY_S": "8"})
    boundaries = [e for e in _events(run_dir) if e["event"] == "refresh"]
    assert [e["epoch"] for e in boundaries] == [0, 1, 2, 3]
    hard = boundaries[1:]
    within = [e for e in hard if e["lag_before"] <= 1]
    past = [e for e in hard if e["lag_before"] > 1]
    assert within and past, hard
    assert all(e["waited_s"] < 2.0 for e in within), within  # a poll or two at most: the miner needs 8 s more
    assert all(e["waited_s"] > 2.0 and e["lag"] <= 1 for e in past), past  # waited until it was within the bound
    assert hard[0]["generation"] is None and hard[0]["lag"] == 1  # epoch 1 trains on uniform draws, no wait
    assert all(e["refreshed_share"] == (1.0 if e["generation"] is not None else 0.0) for e in past)


def test_a_second_xc_miner_on_a_run_is_refused(tmp_path):
    """Two miners would mine every shard twice and race to publish: the second stops at once, naming the first."""
    from xc.miner.lease import lease_path

    run_dir = tmp_path / "run"
    (handoff_root(run_dir) / "snapshots").mkdir(parents=True)
    cmd = [sys.executable, "-m", "xc.miner.cli", "--run-dir", str(run_dir), "--workers", "1"]
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not lease_path(run_dir).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        second = subprocess.run([*cmd, "--once"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr
        assert f"xc-miner pid {first.pid}" in second.stderr and "Stop that xc-miner first" in second.stderr
        (handoff_root(run_dir) / "control" / "stop").touch()
        out, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out
    assert not lease_path(run_dir).exists()  # released by the first on its way out


def test_trainer_gives_the_pool_its_cores_only_while_it_mines(tmp_path):
    """Without XC_THREADS, a rank runs on every core while the local pool is idle and leaves the pool its
    workers x threads_per_worker cores from a snapshot's publication to the switch to its negatives."""
    import pytest

    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("needs 2 cores: with one, trainer and pool share it either way")
    run_dir = tmp_path / "run"
    run_cli([*TINY, "miner=pool", "miner.workers=1", "miner.threads_per_worker=1", f"run_dir={run_dir}",
             f"data.cache_dir={tmp_path / 'cache'}"], cwd=REPO, env={"XC_THREADS": ""})
    events = _events(run_dir)
    order = [(e["event"], e.get("generation"), e.get("threads")) for e in events
             if e["event"] in ("snapshot", "negatives", "threads")]
    # generation 1: published at step 0 (start_epoch=1 here), mined, used from epoch 1; generation 2 likewise
    # (the threads change is logged just before the event that caused it)
    assert order == [("threads", None, cores - 1), ("snapshot", 1, None), ("threads", None, cores),
                     ("negatives", 1, None), ("threads", None, cores - 1), ("snapshot", 2, None),
                     ("threads", None, cores), ("negatives", 2, None)]


@pytest.mark.parametrize("nproc", [1, 2])
def test_switch_keeps_the_candidates_scoring_highest_under_the_rows_of_the_switch(tmp_path, nproc):
    """miner.rerank_candidates (the pool's rule: 8 x k_hard = 128, 64 per shard): the miner publishes 64
    candidates per query and shard, and the table trained with is, for every query, the k_hard / 2 = 8 of
    them that score highest under the encoder and rows of the epoch boundary that switched to it, recomputed
    here from that boundary's checkpoint. With 2 gloo ranks each re-ranks its own shard."""
    from xc.run import checkpoint as ckpt
    from xc.eval.inference import encode_rows
    from xc.serve.model import TrainedModel
    from xc.refresh.rerank import rerank_candidates

    run_dir = tmp_path / "run"
    run_cli([*TINY, "miner=pool", "miner.workers=1", "train.keep_checkpoints=5", f"run_dir={run_dir}",
             f"data.cache_dir={tmp_path / 'cache'}"], cwd=REPO, env={"XC_THREADS": "1"}, nproc=nproc)
    switches = [e for e in _events(run_dir) if e["event"] == "negatives"]
    assert [e["generation"] for e in switches] == [1, 2]
    assert all(e["rerank"]["candidates"] == 64 and e["rerank"]["kept"] == 8 for e in switches)
    # generation 2's snapshot, taken at the boundary that re-ranked generation 1, reused that encoding
    snapshots = {e["generation"]: e for e in _events(run_dir) if e["event"] == "snapshot"}
    assert not snapshots[1]["shared_queries"] and snapshots[2]["shared_queries"]
    checkpoints = sorted((run_dir / "checkpoints").iterdir())
    steps = [int(p.name.split("-")[1]) for p in checkpoints]
    per_epoch = steps[0]  # epoch-end checkpoints only: the first is the end of epoch 0
    assert steps == [per_epoch, 2 * per_epoch, 3 * per_epoch]
    # logged ages: mined from the snapshot of the epoch's start before, re-ranked at the epoch's own start
    trained = [e for e in _events(run_dir) if e["event"] == "train" and e["hard_generation"] is not None]
    assert trained and all(e["hard_ranked_age_steps"] == e["global_step"] - e["hard_generation"] * per_epoch
                           and e["hard_age_steps"] > e["hard_ranked_age_steps"] for e in trained)
    for generation in (1, 2):
        mined, _ = open_negatives(run_dir, generation, [0, 1])
        assert all(t.shape[1] == 64 for t in mined.values())
        # the table of generation g is the one in use through epoch g, saved in the checkpoint ending it
        in_use = {s: t for rank in range(nproc)
                  for s, t in ckpt.load_hard_tables(checkpoints[generation], rank).items()}
        assert sorted(in_use) == [0, 1]
        assert ckpt.load_state_file(checkpoints[generation] / "rank0.pt")["hard"]["generation"] == generation
        switch = TrainedModel(run_dir, checkpoint=checkpoints[generation - 1])  # the model at epoch g's start
        c = switch.components
        queries = encode_rows(c.encoder, c.train.inputs, np.arange(c.train.num_rows),
                              switch.cfg.sampler.mining_batch_size, switch.ctx)
        if generation == 1:  # ... and holds the queries of that boundary's model
            snapshot = open_snapshot(run_dir, 2, checksum=False)
            np.testing.assert_array_equal(snapshot.queries(), queries.numpy())
        for shard in (0, 1):
            lo, _ = c.layout.shard_range(shard)
            rows = c.shard.weight[lo - c.shard.lo:lo - c.shard.lo + c.layout.real_count(shard)].detach()
            expected, _ = rerank_candidates(mined[shard], rows, lo, queries, 8)
            assert np.array_equal(in_use[shard], expected), (generation, shard)
            assert (in_use[shard] >= 0).all() and not np.array_equal(in_use[shard], mined[shard][:, :8])


@pytest.mark.parametrize("stop", ["end", "sigterm", "error"])
def test_trainer_exits_without_waiting_for_a_shard_task_in_flight(tmp_path, stop):
    """A pool worker busy with a task that outlives training (XC_FAULT_MINER_HANG: an hour's sleep in its first
    shard task) is killed when the trainer closes: at the run's end, after a SIGTERM's checkpoint, or on an error
    (a NaN loss under train.nonfinite=stop): the process exits in seconds, the generation in flight is neither
    published nor marked failed, and no worker is left behind. Before, the interpreter's exit joined the pool's
    running task (minutes at 10^6 labels)."""
    run_dir = tmp_path / "run"
    args = [*TINY, "miner=pool", "miner.workers=1", "miner.wait_timeout_s=0", f"run_dir={run_dir}",
            f"data.cache_dir={tmp_path / 'cache'}", "train.ensemble=1"]
    env = {**os.environ, "XC_THREADS": "1", "WANDB_MODE": "disabled", "XC_FAULT_MINER_HANG": "1"}
    control = handoff_root(run_dir) / "control"
    if stop in ("end", "error"):
        if stop == "error":
            # 400 steps in: long after generation 1's task began hanging (published at step 0)
            env.update(XC_FAULT_NAN_AT_STEP="400")
        longer = ["train.epochs=30", "eval.select_epoch_patience=0"] if stop == "error" else []  # every epoch
        proc = subprocess.run([sys.executable, "-m", "xc.cli.train", *args, *longer], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=240)
        if stop == "end":
            assert proc.returncode == 0 and (run_dir / "metrics.json").exists(), proc.stderr[-2000:]
        else:
            assert proc.returncode == 2 and "non-finite" in proc.stderr, proc.stderr[-2000:]
    else:  # a scheduler's SIGTERM while the worker hangs, in a run long enough to be still training
        trainer = subprocess.Popen([sys.executable, "-m", "xc.cli.train", *args, "train.epochs=30",
                                    "eval.select_epoch_patience=0"], cwd=REPO, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not (control / "fault-hang-pid").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            trainer.send_signal(15)
            _, err = trainer.communicate(timeout=240)
        finally:
            if trainer.poll() is None:
                trainer.kill()
        assert trainer.returncode == 143 and "stopped by SIGTERM after global step" in err, err[-2000:]
    _assert_hung_worker_gone_and_generation_abandoned(run_dir, int((control / "fault-hang-pid").read_text()),
                                                      "the trainer")


def _assert_hung_worker_gone_and_generation_abandoned(run_dir, pid: int, owner: str, generation: int = 1) -> None:
    """The XC_FAULT_MINER_HANG worker `pid` is dead, `generation` unpublished and not marked failed."""
    for _ in range(50):  # the kill is sent before its owner exits; reaping may trail it by a moment
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the hung miner worker {pid} outlived {owner}")
    assert generation not in list_generations(handoff_root(run_dir) / "negatives")
    # an older generation skipped as superseded carries a marker; the halted one must not (not its fault)
    assert not (handoff_root(run_dir) / "control" / f"failed-gen-{generation:06d}.json").exists()


def test_offline_miner_stops_mid_generation_when_asked(tmp_path):
    """`xc-miner` on a run whose first shard task hangs (XC_FAULT_MINER_HANG: an hour's sleep): touching
    control/stop ends it within seconds, the hung worker killed, nothing published for the generation and no
    failure marker (the stop is not the generation's fault). Before, it finished the task in flight first."""
    run_dir = tmp_path / "run"
    control = handoff_root(run_dir) / "control"
    env = {**os.environ, "XC_THREADS": "1", "XC_FAULT_MINER_HANG": "1"}
    miner = subprocess.Popen([sys.executable, "-m", "xc.miner.cli", "--run-dir", str(run_dir), "--backend", "exact",
                              "--workers", "1"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        # the trainer does not wait for late negatives; it ends on its own while the miner's task hangs
        run_cli([*TINY, "miner=external", "miner.wait_timeout_s=0", f"run_dir={run_dir}",
                 f"data.cache_dir={tmp_path / 'cache'}"], cwd=REPO)
        deadline = time.monotonic() + 60
        while not (control / "fault-hang-pid").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        pid = int((control / "fault-hang-pid").read_text())
        (control / "stop").touch()
        out, _ = miner.communicate(timeout=60)  # the hung task would hold it for an hour
    finally:
        if miner.poll() is None:
            miner.kill()
    assert miner.returncode == 0, out
    # the miner polls for the run every few seconds; on a loaded machine the trainer may have published a newer
    # snapshot by the time it looks, and it mines only the newest: the one it halts in is whichever it started
    halted = re.search(r"miner halted while mining generation (\d+); nothing published", out)
    assert "stop requested; halting" in out and halted, out
    _assert_hung_worker_gone_and_generation_abandoned(run_dir, pid, "xc-miner", int(halted.group(1)))


BF16_SR = ["model.classifier_dtype=bfloat16", "model.classifier_master_fp32=false"]  # stochastic rounding


def test_bf16_rows_are_snapshotted_in_bf16_and_mined_as_their_float32_upcast(tmp_path):
    """A pool refresh of bfloat16 rows (no masters): the snapshot holds their bit patterns, and the negatives
    the pool published are those an exact float32 search over the upcast rows finds."""
    from xc.ann.bf16_rows import bf16_from_bits
    from xc.config import AnnConfig
    from xc.handoff import positives_of_rows, read_static_positives
    from xc.miner.task import mine_table

    run_dir = tmp_path / "run"
    run_cli([*TINY, "data.synthetic.num_labels=400", *BF16_SR, "miner=pool", "miner.keep_generations=10",
             f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"], cwd=REPO)
    root = handoff_root(run_dir)
    both = sorted(set(list_generations(root / "snapshots")) & set(list_generations(root / "negatives")))
    assert both, "no generation was both snapshotted and mined"
    for generation in both:
        snapshot = open_snapshot(run_dir, generation)
        tables, _ = open_negatives(run_dir, generation, [0, 1])
        positives = positives_of_rows(*read_static_positives(run_dir), snapshot.query_rows())
        for entry in snapshot.manifest["shards"]:
            shard = entry["shard"]
            assert entry["dtype"] == "bfloat16" and snapshot.shard_rows(shard).dtype == np.uint16
            upcast = bf16_from_bits(snapshot.shard_rows(shard)).float().numpy()
            want, _ = mine_table(upcast, entry["lo"], snapshot.queries(), *positives, tables[shard].shape[1],
                                 AnnConfig(backend="exact"))
            assert np.array_equal(np.asarray(tables[shard]), want)


def test_bf16_rows_mine_in_process_and_probe_staleness(tmp_path):
    """miner=sync over bfloat16 rows (no masters): the in-process miner searches the rows as they are and the
    staleness probe scores them block by block; the run completes with its hard negatives in use."""
    run_dir = tmp_path / "run"
    run_cli([*TINY, "data.synthetic.num_labels=400", *BF16_SR, "miner=sync", "miner.staleness_sample=64",
             f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"], cwd=REPO)
    events = _events(run_dir)
    assert [e["generation"] for e in events if e["event"] == "negatives"]
    assert any(e["event"] == "staleness" for e in events)
