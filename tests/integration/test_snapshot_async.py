"""Refresh snapshots written in the background (miner.async_snapshot) under real training runs.

Tiny synthetic data: 2000 rows / batch 128 = 15 steps per epoch, 3 epochs, 2 label shards. With
sampler.start_epoch=1 the trainer begins snapshot generation 1 at step 0 and generation 2 at step 15;
with snapshot_finish_steps=5 they are published at steps 5 and 20. miner=external with no miner
process and wait_timeout_s=0: nothing mines, training never waits, and only the snapshots matter.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import REPO, run_cli
from xc.handoff import handoff_root, open_snapshot

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

FINISH = 5
ARGS = ["data.synthetic.num_train=2000", "data.synthetic.num_test=200", "data.synthetic.num_labels=500",
        "data.synthetic.num_features=1000", "train.epochs=3", "train.batch_size=128", "train.warmup_steps=5",
        "model.embed_dim=32", "model.hidden_dims=[32]", "model.dropout=0.0", "parallel.num_label_shards=2",
        "sampler.start_epoch=1", "miner=external", "miner.wait_timeout_s=0",
        f"miner.snapshot_finish_steps={FINISH}", "train.keep_checkpoints=5", "logger.progress=false",
        "logger.wandb=disabled", "data.valid_fraction=0",  # all 2000 points train: 15 steps an epoch
        "train.prune_when_done=false"]  # the tests read the checkpoints and generations after the run


def _args(tmp_path, name: str, *extra: str) -> list[str]:
    return [*ARGS, *extra, f"run_dir={tmp_path / name}", f"data.cache_dir={tmp_path / 'cache'}"]


def _events(run_dir, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()) if e["event"] == kind]


def _digests(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if p.name != "manifest.json"}


def _manifest(directory) -> dict:
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest.pop("created")
    assert len(manifest.pop("snapshot_id")) == 32  # a fresh id per publication, like its time
    return manifest


def test_async_snapshot_is_byte_identical_to_sync(tmp_path):
    """Guards against writing rows from after the boundary (copied at finish, or a live view torn by
    training), a different Q, or a manifest that differs from the synchronous path's."""
    run_cli(_args(tmp_path, "async"), cwd=REPO)
    run_cli(_args(tmp_path, "sync", "miner.async_snapshot=false"), cwd=REPO)
    snaps = {name: handoff_root(tmp_path / name) / "snapshots" for name in ("async", "sync")}
    for generation in (1, 2):
        a, s = (snaps[name] / f"gen-{generation:06d}" for name in ("async", "sync"))
        assert sorted(_digests(a)) == ["Q.npy", "W.shard0.npy", "W.shard1.npy"]
        assert _digests(a) == _digests(s), f"generation {generation}: files differ"
        assert _manifest(a) == _manifest(s)
    bg = {e["generation"]: e for e in _events(tmp_path / "async", "snapshot")}
    fg = {e["generation"]: e for e in _events(tmp_path / "sync", "snapshot")}
    assert [(g, e["global_step"], e["finish_step"], e["background"]) for g, e in sorted(bg.items())] == \
        [(1, 0, FINISH, True), (2, 15, 15 + FINISH, True)]  # published FINISH steps later; training went on
    assert [(g, e["global_step"], e["finish_step"], e["background"]) for g, e in sorted(fg.items())] == \
        [(1, 0, 0, False), (2, 15, 15, False)]
    leftovers = [p.name for p in snaps["async"].iterdir() if ".tmp-" in p.name]
    assert leftovers == []


@pytest.mark.parametrize("background", [True, False])
def test_full_disk_while_writing_publishes_nothing_and_stops(tmp_path, background):
    """A writer that hits ENOSPC: training stops with the disk error on both paths (as the synchronous path
    always did), the stage is abandoned and no generation is published. Guards against a writer thread
    whose exception is lost (the run would finish), or a finish that publishes what was written."""
    env = {**os.environ, "XC_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
           "XC_FAULT_SNAPSHOT_ENOSPC": "1"}
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "xc.cli.train", *_args(tmp_path, "run",
                                                                    f"miner.async_snapshot={str(background).lower()}")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr  # one line naming the file, the cause and the fix (xc.handoff.storage_failed)
    assert "error: could not write the refresh snapshot file" in out and "no space left on the device" in out
    snapshots = handoff_root(run_dir) / "snapshots"
    assert sorted(p.name for p in snapshots.iterdir()) == []  # neither a generation nor a half-written stage
    failed = _events(run_dir, "snapshot_failed")
    assert len(failed) == 1 and failed[0]["generation"] == 1
    assert failed[0]["global_step"] == (FINISH if background else 0)  # surfaced at finish, not before
    assert not (run_dir / "metrics.json").exists()


def test_two_ranks_publish_at_the_same_step_rows_of_the_boundary(tmp_path):
    """2 gloo ranks, one label shard each, each writing its shard in the background. Guards against a finish
    that runs at a rank-dependent time (when its own thread is done, say): the collectives in finish would
    pair with training's and the run would hang or fail, and finish_step would not be boundary + FINISH.
    The published rows must be the classifier as of the boundary, i.e. the epoch-end checkpoint's rows."""
    run_dir = tmp_path / "run"
    run_cli(_args(tmp_path, "run"), cwd=REPO, nproc=2, timeout=300)
    events = _events(run_dir, "snapshot")
    assert [(e["generation"], e["global_step"], e["finish_step"]) for e in events] == \
        [(1, 0, FINISH), (2, 15, 15 + FINISH)]
    snapshot = open_snapshot(run_dir, 2, checksum=True)  # sizes and digests of every file
    states = [torch.load(run_dir / "checkpoints" / "step-00000015" / f"rank{r}.pt", weights_only=True)
              for r in range(2)]
    full = torch.cat([s["classifier"]["weight"] for s in states]).float().numpy()
    for entry in snapshot.manifest["shards"]:
        lo, n = entry["lo"], entry["num_real"]
        assert np.array_equal(np.asarray(snapshot.shard_rows(entry["shard"])), full[lo:lo + n])
    assert not np.array_equal(full, torch.cat([torch.load(run_dir / "checkpoints" / "step-00000030" / f"rank{r}.pt",
                                                          weights_only=True)["classifier"]["weight"]
                                               for r in range(2)]).float().numpy())  # rows did move meanwhile


def test_default_start_epoch_never_snapshots_the_untrained_rows(tmp_path):
    """sampler.start_epoch left null with an asynchronous miner. With the first snapshot at an epoch's start
    (miner.first_snapshot_at=0), generation 1 would be the rows at step 0 (as initialised), so the first
    generation is 2, snapshotted at the end of epoch 0 (step 15) and used from epoch 2. With the rules for both
    (first_snapshot_at 0.5), generation 1 is the rows half-way into epoch 0 (step 8 of 15), used from epoch 1.
    (With start_epoch=1 and first_snapshot_at=0, the test above: generations 1 and 2 from steps 0 and 15.)"""
    base = [a for a in ARGS if a != "sampler.start_epoch=1"]
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    run_cli([*base, "miner.first_snapshot_at=0", f"run_dir={tmp_path / 'at_start'}", cache], cwd=REPO)
    snaps = handoff_root(tmp_path / "at_start") / "snapshots"
    assert sorted(p.name for p in snaps.iterdir() if p.name.startswith("gen-")) == ["gen-000002"]
    assert [(e["generation"], e["global_step"]) for e in _events(tmp_path / "at_start", "snapshot")] == [(2, 15)]
    config = json.loads((tmp_path / "at_start" / "config.json").read_text())
    assert config["sampler"]["start_epoch"] in (None, 2)  # the file keeps what was asked; the log, what was derived

    run_cli([*base, f"run_dir={tmp_path / 'rules'}", cache], cwd=REPO)
    assert [(e["generation"], e["global_step"]) for e in _events(tmp_path / "rules", "snapshot")] == [(1, 8), (2, 15)]


def test_first_snapshot_partway_into_epoch_0_and_after_a_resume_before_it(tmp_path):
    """miner.first_snapshot_at=0.4 with start_epoch left to its rule: hard negatives start at epoch 1, and
    generation 1 is snapshotted 0.4 x 15 = 6 steps into epoch 0 (rows trained 6 steps, not the untrained rows),
    published FINISH steps later; generation 2 at the boundary as before. A run stopped at step 4 and resumed
    re-arms the deferred snapshot and publishes byte-identical files at the same steps. Guards against a deferral
    lost on resume (generation 1 would then be written synchronously at step 15), or taken at the resume's step."""
    args = [a for a in ARGS if a != "sampler.start_epoch=1"] + ["miner.first_snapshot_at=0.4"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    run_cli([*args, f"run_dir={whole}", cache], cwd=REPO)
    assert [(e["generation"], e["global_step"], e["finish_step"]) for e in _events(whole, "snapshot")] == \
        [(1, 6, 6 + FINISH), (2, 15, 15 + FINISH)]
    run_cli([*args, f"run_dir={parts}", cache, "train.max_steps=4"], cwd=REPO)
    assert _events(parts, "snapshot") == []
    run_cli([*args, f"run_dir={parts}", cache], cwd=REPO)
    assert [(e["generation"], e["global_step"], e["finish_step"]) for e in _events(parts, "snapshot")] == \
        [(1, 6, 6 + FINISH), (2, 15, 15 + FINISH)]
    for generation in (1, 2):
        a, b = (handoff_root(run) / "snapshots" / f"gen-{generation:06d}" for run in (whole, parts))
        assert _digests(a) == _digests(b), f"generation {generation}: files differ after the resume"
    initial = torch.load(next((parts / "checkpoints").glob("step-00000004")) / "rank0.pt", weights_only=True)
    snapshot = open_snapshot(whole, 1, checksum=True)
    entry = snapshot.manifest["shards"][0]
    assert not np.array_equal(np.asarray(snapshot.shard_rows(0)),
                              initial["classifier"]["weight"][:entry["num_real"]].float().numpy())  # 6 steps, not 4
    assert snapshot.manifest["epoch"] == 0
