"""Training stall at a refresh epoch boundary: snapshot files written synchronously vs in the background.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_snapshot.py                      # L = 1e6 and 1e7, d = 64
    PYTHONPATH=$PWD .venv/bin/python tools/bench_snapshot.py --labels 100000 --dir /tmp/snap

Builds one label shard's rows with ClassifierShard (L x d float32) and query embeddings Q (N x d), then
publishes a snapshot generation into a Stage (fsync + sha256 per file, manifest last, rename) the two
ways the trainer does (xc.refresh.schedule):
  sync   training waits for every file: stall = the whole write + publish;
  async  the boundary takes a host copy of the rows and starts the writer thread (stall = that); the
         main thread then runs stand-in optimizer steps (sparse row updates on the live shard, as the
         classifier's SGD does) until the writer is done, then joins and publishes.
Also times a stand-in step alone and while the writer runs (they share the CPU cores and memory
bandwidth). Writes JSON and a PNG (stall and write seconds per L, sync vs async).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from xc.handoff import Stage
from xc.models.classifier import ClassifierShard
from xc.refresh.writer import ShardRows, SnapshotWrite


def _step(weight: torch.Tensor, gen: torch.Generator, touched: int) -> None:
    """A stand-in classifier update: `touched` random rows get a small SGD-like step (index_add_)."""
    ids = torch.randint(0, weight.shape[0], (touched,), generator=gen)
    weight.index_add_(0, ids, torch.randn(touched, weight.shape[1], generator=gen) * 1e-3)


def _step_seconds(weight, gen, touched, repeats=50) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        _step(weight, gen, touched)
    return (time.perf_counter() - start) / repeats


def measure(labels: int, dim: int, queries: int, touched: int, root: Path) -> dict:
    shard = ClassifierShard(0, labels, labels, dim, 0.02, seed=0, device=torch.device("cpu"))
    q = np.random.default_rng(0).standard_normal((queries, dim)).astype(np.float32)
    gen = torch.Generator().manual_seed(0)
    out = {"labels": labels, "dim": dim, "queries": queries}
    out["step_seconds_alone"] = _step_seconds(shard.weight, gen, touched)
    for mode in ("sync", "async"):
        shutil.rmtree(root, ignore_errors=True)
        stage = Stage(root, "gen-000001")
        rows = [ShardRows(0, 0, labels, shard.weight.numpy())]  # a view of the live rows, as label_vectors gives
        start = time.perf_counter()
        writer = SnapshotWrite(stage, rows, q, background=mode == "async")
        boundary = time.perf_counter() - start
        steps, step_time = 0, 0.0
        while not writer.done:  # training goes on meanwhile (async only)
            t = time.perf_counter()
            _step(shard.weight, gen, touched)
            step_time += time.perf_counter() - t
            steps += 1
        wait = time.perf_counter()
        entries, q_entry = writer.join()
        stage.publish({"kind": "snapshot", "shards": entries, "queries": q_entry})
        publish = time.perf_counter() - wait
        out["bytes"] = writer.bytes  # W.shard0.npy + Q.npy
        out[mode] = {"stall_seconds": boundary + publish, "boundary_seconds": boundary, "publish_seconds": publish,
                     "write_seconds": writer.write_seconds, "total_seconds": time.perf_counter() - start,
                     "steps_during_write": steps,
                     "step_seconds_during_write": step_time / steps if steps else None}
        print(f"L={labels:.0e} {mode}: {out[mode]}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--queries", type=int, default=100_000, help="rows of Q (N, d) written by rank 0")
    parser.add_argument("--touched", type=int, default=4096, help="rows a stand-in optimizer step updates")
    parser.add_argument("--dir", default="/tmp/xc-bench-snapshot", help="where to stage (the disk being measured)")
    parser.add_argument("--out", default="tools/results/bench_snapshot.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [measure(n, args.dim, args.queries, args.touched, Path(args.dir) / "snapshots") for n in args.labels]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": "tools/bench_snapshot.py " + " ".join(f"--labels {n}" for n in args.labels),
              "dim": args.dim, "queries": args.queries, "touched": args.touched, "results": results}
    out.write_text(json.dumps(report, indent=1))
    from plots import pyplot  # matplotlib is the `plots` extra: one line where it is missing

    plt = pyplot(__file__)
    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(len(results))
    for i, (key, label) in enumerate([("sync", "sync: stall"), ("async", "async: stall")]):
        ax.bar(x + (i - 1) * 0.27, [r[key]["stall_seconds"] for r in results], 0.27, label=label)
    ax.bar(x + 0.27, [r["async"]["write_seconds"] for r in results], 0.27, label="async: background write")
    ax.set_xticks(x, [f"L={r['labels']:.0e}\n{r['bytes'] / 1e9:.2f} GB" for r in results])
    ax.set_ylabel("seconds")
    ax.set_title(f"Refresh snapshot at an epoch boundary (d={args.dim}, 1 shard)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
