"""tools/bench/bench_snapshot.py: both digest paths publish generations a reader verifies, and the report compares
them."""

from __future__ import annotations

import numpy as np

from xc.handoff import Stage, handoff_root, verify_entry

from tools.bench.bench_snapshot import ReadBackStage, measure


def test_the_read_back_path_records_sha256_and_verifies(tmp_path):
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    old = ReadBackStage(handoff_root(tmp_path) / "snapshots", "gen-000001")
    entry = old.write_array("W.shard0.npy", rows)
    assert "sha256" in entry and "xxh3_128" not in entry
    new = Stage(handoff_root(tmp_path) / "snapshots", "gen-000002")
    assert (new.path / new.write_array("W.shard0.npy", rows)["file"]).read_bytes() == \
        (old.path / entry["file"]).read_bytes()  # the same bytes either way: only the digest differs
    verify_entry(old.path, entry)


def test_measure_times_both_digests_both_ways(tmp_path):
    out = measure(2000, 8, 50, 16, tmp_path / "run", repeats=1)
    for digest in ("read_back", "as_written"):
        for mode in ("sync", "async"):
            assert out[digest][mode]["bytes"] == out["bytes"] > 2000 * 8 * 4 and out[digest][mode]["verify_seconds"] > 0
    assert set(out["ratio_read_back_over_as_written"]) == {"sync_stall", "digest", "async_write", "verify"}
    assert out["read_back"]["sync"]["digest_seconds"] > 0
    assert not (tmp_path / "run").exists()  # the files are deleted after each publish
