"""Peak memory of one refresh of bfloat16 rows: snapshot a shard, then mine it by exact search, in one process.

    XC_THREADS=1 .venv/bin/python tools/bench/refresh_memory.py --labels 2000000 --dim 64 --queries 256
    XC_THREADS=1 .venv/bin/python tools/bench/bench_memory.py --refresh --labels 100000000 --queries 64   # 10^8 rows

The process builds (labels, dim) bfloat16 rows (generated a block at a time), writes them as a refresh snapshot
the trainer writes it (xc/refresh/writer.py, synchronously: the rows handed over as they are), opens the
published snapshot as the miner does (checksums verified) and mines `--queries` random queries against it with
the exact backend (xc/miner/task.py mine_table: float32 scores of a row block at a time). It reports, in MiB:

- rows: the resident growth while the rows are built (2 n d bytes expected);
- snapshot_extra: the peak resident set above that while the snapshot is written;
- mine_extra_anon: the peak of anonymous memory (RssAnon, sampled every 2 ms) above the rows' while mining:
  what the search allocates (one float32 row block, score blocks, the table);
- mine_extra_hwm: the peak resident set (VmHWM) above the rows' while mining, which also counts the snapshot
  file's pages the search maps (page cache the kernel can drop, shared with any other reader);
- float32_copy: what a float32 copy of the rows would have added (4 n d bytes), for comparison.

Writes --out (JSON). The snapshot goes under --tmp and is removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

MIB = 2 ** 20


def status_kib(field: str) -> int:
    """A /proc/self/status field in KiB (VmHWM, VmRSS, RssAnon)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    """Reset VmHWM to the current resident set (Linux: writing 5 to /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


class AnonPeak:
    """The largest RssAnon (KiB) seen by a thread polling every `interval` seconds while the block runs."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def __enter__(self):
        self.peak = status_kib("RssAnon")
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, status_kib("RssAnon"))
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status_kib("RssAnon"))


def bf16_rows(n: int, d: int, seed: int = 0, block: int = 1 << 20):
    """(n, d) bfloat16 rows of N(0, 1) values, drawn a block at a time (no (n, d) float32 intermediate)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = torch.empty(n, d, dtype=torch.bfloat16)
    for a in range(0, n, block):
        rows[a:a + block] = torch.randn(min(block, n - a), d, generator=gen)
    return rows


def measure(labels: int, dim: int, queries: int, k: int, tmp: str) -> dict:
    import torch

    from xc.config import AnnConfig
    from xc.handoff import Stage, open_snapshot
    from xc.miner.task import mine_table, snapshot_rows
    from xc.refresh.writer import ShardRows, SnapshotWrite

    root = Path(tempfile.mkdtemp(prefix="xc-refresh-memory-", dir=tmp))
    try:
        before = status_kib("VmRSS")
        rows = bf16_rows(labels, dim)
        with_rows = status_kib("VmRSS")
        q = torch.randn(queries, dim, generator=torch.Generator().manual_seed(1)).numpy()
        reset_peak()
        start = time.perf_counter()
        stage = Stage(root / "handoff" / "snapshots", "gen-000001")
        entries, q_entry = SnapshotWrite(stage, [ShardRows(0, 0, labels, rows)], q, background=False).join()
        stage.publish({"kind": "snapshot", "generation": 1, "shards": entries, "queries": q_entry})
        write_s = time.perf_counter() - start
        snapshot_hwm = status_kib("VmHWM")
        reset_peak()
        base_anon = status_kib("RssAnon")
        start = time.perf_counter()
        with AnonPeak() as anon:
            snapshot = open_snapshot(root, 1)
            no_positives = np.zeros(queries + 1, np.int64), np.zeros(0, np.int64)
            table, _ = mine_table(snapshot_rows(snapshot, 0), 0, snapshot.queries(), *no_positives, k,
                                  AnnConfig(backend="exact"))
        mine_s = time.perf_counter() - start
        mine_hwm = status_kib("VmHWM")
        assert table.shape == (queries, k)
        return {"labels": labels, "dim": dim, "queries": queries, "k": k, "threads": torch.get_num_threads(),
                "rows_mib": (with_rows - before) / 1024, "snapshot_bytes": entries[0]["bytes"],
                "snapshot_extra_mib": (snapshot_hwm - with_rows) / 1024,
                "mine_extra_anon_mib": (anon.peak - base_anon) / 1024,
                "mine_extra_hwm_mib": (mine_hwm - with_rows) / 1024,
                "float32_copy_mib": 4 * labels * dim / MIB, "write_seconds": write_s, "mine_seconds": mine_s}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--labels", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--tmp", default=tempfile.gettempdir())
    ap.add_argument("--out", default="")
    args, _ = ap.parse_known_args(argv)
    if os.environ.get("XC_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["XC_THREADS"]))
    report = measure(args.labels, args.dim, args.queries, args.k, args.tmp)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
