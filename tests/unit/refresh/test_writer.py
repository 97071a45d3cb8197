"""SnapshotWrite: the background writer of refresh snapshots (no process group needed)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from xc.handoff import HandoffStorageError, Stage, describe
from xc.refresh.writer import ShardRows, SnapshotWrite
from xc.faults import Faults


def _gated_stage(tmp_path, monkeypatch):
    """A Stage whose write_array waits until the test opens the gate (a slow disk)."""
    gate, entered = threading.Event(), threading.Event()
    original = Stage.write_array

    def slow(self, filename, array, raw=False):
        entered.set()
        assert gate.wait(10)
        return original(self, filename, array, raw)

    monkeypatch.setattr(Stage, "write_array", slow)
    return Stage(tmp_path / "snapshots", "gen-000001"), gate, entered


def test_background_writes_the_rows_as_of_the_call(tmp_path, monkeypatch):
    """Guards against writing the caller's live array: training updates it while the thread writes."""
    stage, gate, entered = _gated_stage(tmp_path, monkeypatch)
    live = np.arange(40, dtype=np.float32).reshape(10, 4)
    before = live.copy()
    queries = np.ones((6, 4), np.float32)
    writer = SnapshotWrite(stage, [ShardRows(3, 16, 10, live)], queries, background=True)
    assert entered.wait(10)
    assert not writer.done  # the caller is free while the file is written
    live += 1.0  # an optimizer step meanwhile
    gate.set()
    entries, q_entry = writer.join()
    assert np.array_equal(np.load(stage.path / "W.shard3.npy"), before)
    assert entries == [dict(describe(stage.path / "W.shard3.npy", (10, 4), np.float32), shard=3, lo=16, num_real=10)]
    assert q_entry["file"] == "Q.npy" and np.array_equal(np.load(stage.path / "Q.npy"), queries)
    assert writer.bytes == entries[0]["bytes"] + q_entry["bytes"]


def test_writer_failure_is_raised_by_join(tmp_path):
    """Guards against an exception that dies with the thread: join must re-raise the writer's own error."""
    stage = Stage(tmp_path / "snapshots", "gen-000001")
    writer = SnapshotWrite(stage, [ShardRows(0, 0, 8, np.zeros((8, 4), np.float32))], None, background=True,
                           faults=Faults(snapshot_enospc=True))
    with pytest.raises(HandoffStorageError) as info:  # the disk error, as one line naming the file and the fix
        writer.join()
    assert f"{stage.path / 'W.shard0.npy'}: no space left on the device" in str(info.value)
    assert (stage.path / "W.shard0.npy").stat().st_size < 8 * 4 * 4  # half a file: never to be published
    assert not (stage.path / "manifest.json").exists()


def test_inline_writer_matches_background(tmp_path):
    rows = np.random.default_rng(0).standard_normal((9, 4)).astype(np.float32)
    out = []
    for name, background in (("a", True), ("b", False)):
        stage = Stage(tmp_path / name, "gen-000002")
        out.append(SnapshotWrite(stage, [ShardRows(1, 0, 9, rows)], None, background).join())
    assert out[0] == out[1]
