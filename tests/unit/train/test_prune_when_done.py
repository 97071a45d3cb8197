"""xc/train/lifecycle.py prune_when_done: what a finished run removes, and that a folder it cannot tidy ends the run
with a warning, never a traceback (the run's results are already written)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import torch

from xc.config import build_config
from xc.distributed import DistContext
from xc.handoff import Stage, gen_name, handoff_root, list_generations
from xc.run import checkpoint as ckpt
from xc.train import lifecycle


def _finished_run(run_dir, steps=(10, 20, 30)):
    for step in steps:
        digests = ckpt.write_rank_files(run_dir, step, 0, {"global_step": step, "w": torch.ones(2)}, None)
        ckpt.publish(run_dir, step, 1, {"config": {}}, keep=5, crc32=digests)
    stage = Stage(handoff_root(run_dir) / "negatives", gen_name(1))
    stage.publish({"kind": "negatives", "generation": 1, "shards": [
        dict(stage.write_array("neg.shard0.int32", np.zeros((2, 1), np.int32), raw=True), shard=0)]})


def _trainer(run_dir, **train):
    events = []
    cfg = build_config({"run_dir": str(run_dir), "train": train, "miner": {"mode": "pool"}})
    logger = SimpleNamespace(event=lambda kind, **fields: events.append((kind, fields)))
    return SimpleNamespace(cfg=cfg, ctx=DistContext(), logger=logger, global_step=30), events


def test_a_finished_run_keeps_its_newest_checkpoint_and_no_generation(tmp_path):
    _finished_run(tmp_path)
    trainer, events = _trainer(tmp_path)
    lifecycle.prune_when_done(trainer)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000030"]
    assert list_generations(handoff_root(tmp_path) / "negatives") == []
    ((kind, fields),) = events
    assert kind == "pruned" and fields["checkpoints"] == ["step-00000010", "step-00000020"]
    assert fields["generations"] == 1 and fields["freed_bytes"] > 0


def test_off_or_keep_all_leaves_the_checkpoints(tmp_path):
    _finished_run(tmp_path)
    lifecycle.prune_when_done(_trainer(tmp_path, prune_when_done=False)[0])
    assert len(ckpt.list_checkpoints(tmp_path)) == 3 and list_generations(handoff_root(tmp_path) / "negatives") == [1]
    lifecycle.prune_when_done(_trainer(tmp_path, keep_checkpoints=0)[0])
    assert len(ckpt.list_checkpoints(tmp_path)) == 3 and list_generations(handoff_root(tmp_path) / "negatives") == []


def test_a_folder_that_cannot_be_tidied_is_a_warning_not_a_traceback(tmp_path, monkeypatch, caplog):
    _finished_run(tmp_path)
    monkeypatch.setattr(ckpt, "prune_finished", lambda run_dir: (_ for _ in ()).throw(PermissionError(13, "denied")))
    trainer, events = _trainer(tmp_path)
    with caplog.at_level(logging.WARNING, logger="xc.train.lifecycle"):
        lifecycle.prune_when_done(trainer)
    assert "could not remove what the run no longer needs" in caplog.text and "denied" in caplog.text
    assert len(ckpt.list_checkpoints(tmp_path)) == 3 and events == []
