"""Storage failures (EROFS, EACCES, ENOSPC, EDQUOT) while a hard-negatives generation (or the trainer's refresh
snapshot) is written: one line naming the file, the cause and the fix (xc.fsutil.storage_error, as every other write path), and
nothing half-written published. The pool miner in the trainer marks the generation failed and stops (its thread is
restarted, the run stopped with that line once restarts run out); `xc-miner` exits 2 with it."""

from __future__ import annotations

import builtins
import errno
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest

from xc import handoff
from xc.config import MinerConfig
from xc.handoff import HandoffStorageError, Stage, gen_name, handoff_root, list_generations

FAILURES = {"EROFS": "read-only file system", "EACCES": "permission denied", "ENOSPC": "no space left on the device",
            "EDQUOT": "disk quota exceeded"}


def _oserror(name, path=None):
    code = getattr(errno, name)
    return OSError(code, os.strerror(code), path)


def _failing_open(module, monkeypatch, name, where, match):
    """Make `open` in `module` fail for files whose name contains `match`: at open, or at write after half a write."""
    real_open = builtins.open

    class HalfWriter:
        def __init__(self, handle):
            self.handle = handle

        def write(self, data):
            self.handle.write(bytes(data)[: len(data) // 2])
            raise _oserror(name)

        def __getattr__(self, attr):
            return getattr(self.handle, attr)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    def failing(path, *a, **k):
        if match in str(path):
            if where == "open":
                raise _oserror(name, str(path))
            return HalfWriter(real_open(path, *a, **k))
        return real_open(path, *a, **k)

    monkeypatch.setattr(module, "open", failing, raising=False)


def _assert_one_line(message: str, name: str, path) -> None:
    assert message.startswith(f"could not write the hard negatives {path}: {FAILURES[name]}; "), message
    assert "free space" in message and "nothing of this generation was published" in message and "\n" not in message


def _named_path(message: str) -> str:
    match = re.match(r"could not write the hard negatives (\S+): ", message)
    assert match, message
    return match.group(1)


def _run_with_a_snapshot(run_dir, num_rows: int = 12, num_labels: int = 20, dim: int = 4) -> None:
    """A published snapshot (generation 1, one shard) and the run's positives, as the trainer writes them."""
    rng = np.random.default_rng(0)
    indptr = np.arange(num_rows + 1, dtype=np.int64)
    handoff.write_static_positives(run_dir, indptr, (np.arange(num_rows) % num_labels).astype(np.int64))
    stage = Stage(handoff_root(run_dir) / "snapshots", gen_name(1))
    shard = stage.write_array("W.shard0.npy", rng.standard_normal((num_labels, dim)).astype(np.float32))
    queries = stage.write_array("Q.npy", rng.standard_normal((num_rows, dim)).astype(np.float32))
    stage.publish({"kind": "snapshot", "generation": 1, "epoch": 0, "global_step": 0, "k_per_shard": 3,
                   "shards": [dict(shard, shard=0, lo=0, num_real=num_labels)], "queries": queries})


def _service(run_dir, monkeypatch):
    """A MinerService whose shard tasks run in a thread of this process (the pool's spawn start is slow)."""
    from xc.miner.service import MinerService

    cfg = MinerConfig(mode="pool", workers=1)
    service = MinerService(run_dir, replace(cfg, ann=replace(cfg.ann, backend="exact")))
    monkeypatch.setattr(service, "_pool", lambda: ThreadPoolExecutor(max_workers=1))
    return service


def _nothing_published(run_dir) -> None:
    negatives = handoff_root(run_dir) / "negatives"
    assert list_generations(negatives) == []
    assert not negatives.is_dir() or [p.name for p in negatives.iterdir()] == []  # no stage left either


@pytest.mark.parametrize("name", sorted(FAILURES))
@pytest.mark.parametrize("where", ["open", "write"])
def test_a_miner_worker_on_failing_storage_fails_the_generation_in_one_line(tmp_path, monkeypatch, name, where):
    """A pool worker's write of neg.shard0.int32 fails: mine() raises the one line, the generation is marked failed
    with it (the trainer keeps its negatives), nothing is published."""
    from xc.miner import task

    _run_with_a_snapshot(tmp_path)
    service = _service(tmp_path, monkeypatch)
    _failing_open(task, monkeypatch, name, where, "neg.shard0.int32")
    with pytest.raises(HandoffStorageError) as info:
        service.mine(1)
    named = _named_path(str(info.value))
    assert named.endswith("/neg.shard0.int32") and f"{gen_name(1)}.tmp-" in named
    _assert_one_line(str(info.value), name, named)
    _nothing_published(tmp_path)
    marker = json.loads((handoff_root(tmp_path) / "control" / "failed-gen-000001.json").read_text())
    assert marker["reason"] == str(info.value)


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_publishing_a_generation_on_failing_storage_is_one_line(tmp_path, monkeypatch, name):
    """The manifest's write (or the stage's rename into place) fails: one line, nothing published."""
    _run_with_a_snapshot(tmp_path)
    service = _service(tmp_path, monkeypatch)
    _failing_open(handoff, monkeypatch, name, "open", "manifest.json.part")
    with pytest.raises(HandoffStorageError) as info:
        service.mine(1)
    assert _named_path(str(info.value)).endswith("/manifest.json.part")
    _assert_one_line(str(info.value), name, _named_path(str(info.value)))
    _nothing_published(tmp_path)


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_a_stage_that_cannot_be_made_or_renamed_is_one_line(tmp_path, monkeypatch, name):
    parent = handoff_root(tmp_path) / "negatives"

    def failing_mkdtemp(*a, **k):
        raise _oserror(name, str(parent))

    with monkeypatch.context() as patch:
        patch.setattr(handoff.tempfile, "mkdtemp", failing_mkdtemp)
        with pytest.raises(HandoffStorageError) as info:
            Stage(parent, gen_name(1))
    _assert_one_line(str(info.value), name, parent / gen_name(1))
    stage = Stage(parent, gen_name(1))
    stage.write_array("neg.shard0.int32", np.zeros((2, 3), np.int32), raw=True)
    real_replace = os.replace

    def failing_replace(src, dst, *a, **k):
        if str(dst).endswith(gen_name(1)):
            raise _oserror(name, str(src))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(handoff.os, "replace", failing_replace)
    with pytest.raises(HandoffStorageError) as info:
        stage.publish({"kind": "negatives", "generation": 1, "shards": []})
    _assert_one_line(str(info.value), name, parent / gen_name(1))
    assert list_generations(parent) == []


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_xc_miner_on_failing_storage_exits_2_with_one_line(tmp_path, monkeypatch, capsys, name):
    from xc.miner import cli, task
    from xc.miner.service import MinerService

    _run_with_a_snapshot(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    real_init = MinerService.__init__

    def in_threads(self, *a, **k):
        real_init(self, *a, **k)
        self.cfg = replace(self.cfg, ann=replace(self.cfg.ann, backend="exact"))
        self._pool = lambda: ThreadPoolExecutor(max_workers=1)

    monkeypatch.setattr(MinerService, "__init__", in_threads)
    monkeypatch.setattr(cli, "build_config", lambda raw: type("C", (), {"miner": MinerConfig()})())
    _failing_open(task, monkeypatch, name, "write", "neg.shard0.int32")
    code = cli.main(["--run-dir", str(tmp_path), "--once"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert FAILURES[name] in lines[0] and "neg.shard0.int32" in lines[0] and "free space" in lines[0]
    _nothing_published(tmp_path)


def test_the_trainers_pool_miner_stops_the_run_with_the_line_once_restarts_run_out():
    """The pool miner's thread dies on the storage failure; `check` restarts it (each failed generation marked, the
    previous negatives kept) up to miner.max_restarts, then stops the run with the failure's own line."""
    from xc.miner.background import BackgroundMiner

    miner = object.__new__(BackgroundMiner)
    miner._stop, miner._thread = threading.Event(), threading.Thread(target=lambda: None)
    miner._thread.start()
    miner._thread.join()
    line = "could not write the hard negatives /r/handoff/negatives/x/neg.shard0.int32: read-only file system; fix"
    miner.error, miner.restarts, miner.max_restarts = HandoffStorageError(line), 2, 2
    with pytest.raises(HandoffStorageError) as info:
        miner.check()
    assert str(info.value).startswith(line) and "the run stops" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_the_trainers_snapshot_write_on_failing_storage_is_one_line(tmp_path, monkeypatch, name):
    """xc/refresh/writer.py: the snapshot's W.shard file fails; join raises the one line, the stage is abandoned."""
    from xc.refresh.writer import ShardRows, SnapshotWrite

    parent = handoff_root(tmp_path) / "snapshots"
    stage = Stage(parent, gen_name(1))
    _failing_open(handoff, monkeypatch, name, "write", "W.shard0.npy")
    write = SnapshotWrite(stage, [ShardRows(0, 0, 4, np.ones((4, 3), np.float32))], None, background=True)
    with pytest.raises(HandoffStorageError) as info:
        write.join()
    message = str(info.value)
    assert message.startswith(f"could not write the refresh snapshot file {stage.path / 'W.shard0.npy'}: "
                              f"{FAILURES[name]}; ") and "run the same command to resume" in message
    assert "\n" not in message
    stage.abandon()
    assert list(parent.iterdir()) == []
