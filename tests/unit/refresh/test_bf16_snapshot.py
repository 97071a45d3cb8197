"""Snapshots of bfloat16 rows: their bit patterns on disk, streamed in blocks, checksummed, read back without a copy."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch

from xc.handoff import BF16, HandoffError, Snapshot, Stage, open_snapshot, verify_entry
from xc.miner.task import snapshot_rows
from xc.refresh import writer
from xc.refresh.writer import ShardRows, SnapshotWrite


def _rows(n=1000, d=8, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _publish(tmp_path, rows, background=False):
    stage = Stage(tmp_path / "handoff" / "snapshots", "gen-000001")
    queries = np.ones((4, rows.shape[1]), np.float32)
    entries, q_entry = SnapshotWrite(stage, [ShardRows(0, 0, rows.shape[0], rows)], queries, background).join()
    stage.publish({"kind": "snapshot", "generation": 1, "shards": entries, "queries": q_entry})
    return entries[0]


@pytest.mark.parametrize("background", [False, True])
def test_bf16_rows_round_trip_bit_for_bit_in_blocks(tmp_path, monkeypatch, background):
    monkeypatch.setattr(writer, "WRITE_BLOCK_ROWS", 300)  # 1,000 rows: four blocks, the last one short
    rows = _rows()
    entry = _publish(tmp_path, rows, background)
    assert entry["dtype"] == BF16 and entry["shape"] == [1000, 8] and entry["bytes"] < 1000 * 8 * 3
    snapshot = open_snapshot(tmp_path, 1)  # every checksum verified
    assert snapshot.shard_dtype(0) == BF16 and snapshot.shard_rows(0).dtype == np.uint16
    back = snapshot_rows(snapshot, 0)
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16), rows.view(torch.int16))


def test_a_corrupted_bf16_snapshot_is_refused(tmp_path):
    entry = _publish(tmp_path, _rows())
    path = tmp_path / "handoff" / "snapshots" / "gen-000001" / entry["file"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # one flipped bit in the last row
    path.write_bytes(bytes(data))
    with pytest.raises(HandoffError, match="xxh3_128 does not match"):
        open_snapshot(tmp_path, 1)


def test_a_bf16_entry_over_a_file_of_other_rows_is_refused(tmp_path):
    stage = Stage(tmp_path, "gen-000001")
    entry = dict(stage.write_array("W.shard0.npy", np.zeros((5, 4), np.float32)), dtype=BF16, shard=0)
    verify_entry(stage.path, entry)  # bytes and checksum are the file's
    with pytest.raises(HandoffError, match="the manifest says bfloat16"):
        Snapshot(stage.path, {"shards": [entry]}).shard_rows(0)


def test_float32_rows_keep_the_npy_they_always_had(tmp_path):
    rows = np.random.default_rng(0).standard_normal((50, 6)).astype(np.float32)
    stage = Stage(tmp_path, "gen-000001")
    entry = writer.write_rows(stage, "W.shard0.npy", rows)
    expected = io.BytesIO()
    np.save(expected, rows)
    assert (stage.path / "W.shard0.npy").read_bytes() == expected.getvalue()
    assert entry["dtype"] == "float32"
    assert Snapshot(stage.path, {"shards": [dict(entry, shard=0)]}).shard_dtype(0) == "float32"


@pytest.mark.slow  # a subprocess that builds 1M rows
def test_a_bf16_refresh_adds_a_block_not_a_float32_copy(tmp_path):
    """Snapshotting and exact-mining 1M x 64 bfloat16 rows (122 MiB; a float32 copy would be 244 MiB) in a fresh
    process: the write adds next to nothing, the search a score block (64 MiB) and its row block."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "refresh_memory.json"
    proc = subprocess.run([sys.executable, "tools/bench/refresh_memory.py", "--labels", "1000000", "--dim", "64",
                           "--queries", "64", "--tmp", str(tmp_path), "--out", str(out)], cwd=REPO,
                          env={**os.environ, "XC_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["snapshot_bytes"] == 1_000_000 * 64 * 2 + 128  # the .npy header, then 2 B an element
    assert report["snapshot_extra_mib"] < 32
    assert report["mine_extra_anon_mib"] < 0.5 * report["float32_copy_mib"]
