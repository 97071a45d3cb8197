"""Readers of a live run (xc-eval, xc-predict, xc.load, all through `xc.run.readers.reading`) keep the checkpoint they
chose: its files are held (hard links, else open descriptors) before they are read, so a trainer pruning it meanwhile
takes nothing away; a reader killed outright leaves a folder the next reader sweeps and discovery never sees."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from xc.errors import CheckpointError
from xc.handoff import host_name
from xc.run import checkpoint as ckpt
from xc.run import readers


def _publish(run_dir, step: int, keep: int = 2) -> None:
    """A 2-rank checkpoint of step `step` through the trainer's own writing functions: every tensor holds `step`."""
    crcs = {}
    for rank in range(2):
        state = {"global_step": step, "w": torch.full((64, 256), float(step))}  # 64 KiB a rank file
        crcs.update(ckpt.write_rank_files(run_dir, step, rank, state, {rank: np.full((32, 4), step, np.int32)}))
    ckpt.publish(run_dir, step, 2, {"config": {}}, keep=keep, crc32=crcs)


def _trainer(run_dir: str, stop, published) -> None:
    """A trainer checkpointing as fast as it can (train.keep_checkpoints=2): each publish prunes the oldest."""
    torch.set_num_threads(1)  # a forked child: no OpenMP pool of the parent's
    step = 2
    while not stop.is_set():
        step += 1
        _publish(run_dir, step)
        published.value = step


def _read_exactly(held: readers.Held) -> int:
    """Read every file of the held checkpoint and check it is the chosen step's, tensor for tensor."""
    step = int(held.meta["global_step"])
    assert held.path.name == f"step-{step:08d}"
    for rank in range(2):
        state = ckpt.load_state_file(held.files / f"rank{rank}.pt")
        assert state["global_step"] == step and torch.equal(state["w"], torch.full((64, 256), float(step)))
        assert np.array_equal(ckpt.load_hard_tables(held.files, rank)[rank], np.full((32, 4), step, np.int32))
    return step


@pytest.mark.parametrize("hold", ["links", "descriptors"])
def test_every_read_beside_a_pruning_trainer_gets_the_chosen_checkpoint(tmp_path, monkeypatch, hold):
    """A trainer process publishes (and prunes, keeping 2) in a tight loop while this process reads 100 times, lingering
    in each read while the trainer prunes what it chose: every read succeeds, with the chosen step's exact tensors.
    `descriptors`: hard links cannot be made (EPERM), so the files are held open instead."""
    if hold == "descriptors":
        def no_links(source, target):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM), str(source))

        monkeypatch.setattr(readers.os, "link", no_links)
    _publish(tmp_path, 1)
    _publish(tmp_path, 2)
    ctx = mp.get_context("fork")
    stop, published = ctx.Event(), ctx.Value("i", 0)
    trainer = ctx.Process(target=_trainer, args=(str(tmp_path), stop, published), daemon=True)
    trainer.start()
    steps, outlived = [], 0
    try:
        deadline = time.monotonic() + 30
        while published.value < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(100):
            with readers.reading(tmp_path) as held:
                chosen = int(held.meta["global_step"])
                until = time.monotonic() + 1.0
                while published.value < chosen + 3 and time.monotonic() < until:  # the trainer prunes it meanwhile
                    time.sleep(0.002)
                outlived += not held.path.exists()
                steps.append(_read_exactly(held))
    finally:
        stop.set()
        trainer.join(30)
    assert len(steps) == 100 and steps == sorted(steps)
    assert outlived >= 50, outlived  # most reads outlived their checkpoint: the race was real
    assert not (tmp_path / "checkpoints" / readers.READERS_DIR).exists()  # every hold released


def test_a_checkpoint_that_keeps_vanishing_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    """Pruned before each of the 5 tries could hold it: one line naming the cause and the fix."""
    (tmp_path / "config.json").write_text(json.dumps({"train": {"keep_checkpoints": 2}}))
    _publish(tmp_path, 1)
    real_link, step = os.link, [1]

    def link(source, target):  # every checkpoint is pruned while it is linked, a newer one published
        if source.name == "meta.json":
            step[0] += 1
            _publish(tmp_path, step[0], keep=1)
        return real_link(source, target)

    monkeypatch.setattr(readers.os, "link", link)
    with pytest.raises(CheckpointError) as info:
        with readers.reading(tmp_path):
            pytest.fail("a checkpoint pruned before every try must not be held")
    message = str(info.value)
    assert "the trainer still running there pruned step-00000001, step-00000002" in message
    assert "train.keep_checkpoints (now 2)" in message and "\n" not in message
    assert not (tmp_path / "checkpoints" / readers.READERS_DIR).exists()


def test_holds_are_released_when_the_read_fails(tmp_path):
    _publish(tmp_path, 1)
    with pytest.raises(RuntimeError):
        with readers.reading(tmp_path) as held:
            assert held.files != held.path and (held.files / "rank0.pt").exists()
            raise RuntimeError("the reader's own failure")
    assert not (tmp_path / "checkpoints" / readers.READERS_DIR).exists()


def test_a_nested_read_of_the_held_checkpoint_reuses_the_hold(tmp_path):
    """xc-eval of a dual-mode checkpoint loads it again through xc.load, naming the checkpoint it holds."""
    _publish(tmp_path, 1)
    with readers.reading(tmp_path) as outer:
        with readers.reading(tmp_path, outer.path) as inner:
            assert inner is outer


def test_a_damaged_checkpoint_is_named_by_its_own_path_not_the_private_copy(tmp_path, caplog):
    _publish(tmp_path, 1)
    _publish(tmp_path, 2)
    damaged = ckpt.step_dir(tmp_path, 2) / "rank1.pt"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"x")
    with caplog.at_level(logging.WARNING, logger="xc.run.checkpoint"):
        with readers.reading(tmp_path) as held:
            assert held.path.name == "step-00000001"
    assert f"{damaged}: CRC-32 does not match" in caplog.text and readers.READERS_DIR not in caplog.text


def test_a_dead_readers_folder_is_swept_by_the_next_reader_and_ignored_by_discovery(tmp_path):
    """A reader killed outright (SIGKILL, OOM) leaves checkpoints/.readers/<pid>@<host>-*/step-N/ of hard links:
    discovery, the trainer's start-up sweep and the run guard ignore it; the next reader removes it (its pid is dead);
    a live reader's folder stays."""
    from xc.run.guard import holds_xc_run

    _publish(tmp_path, 1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    root = tmp_path / "checkpoints" / readers.READERS_DIR
    stale = root / f"{int(dead.stdout)}@{host_name()}-abc123" / "step-00000001"
    stale.mkdir(parents=True)
    for file in ckpt.step_dir(tmp_path, 1).iterdir():
        os.link(file, stale / file.name)
    live = root / f"{os.getppid()}@{host_name()}-def456"
    live.mkdir()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000001"]
    assert ckpt.latest_valid(tmp_path)[0] == ckpt.step_dir(tmp_path, 1)
    assert ckpt.sweep_partial(tmp_path) == [] and stale.exists()  # the trainer's start-up sweep leaves it alone
    assert holds_xc_run(tmp_path)
    with readers.reading(tmp_path) as held:
        assert held.path == ckpt.step_dir(tmp_path, 1)
        assert not stale.parent.exists() and live.exists()
    assert sorted(p.name for p in root.iterdir()) == [live.name]
