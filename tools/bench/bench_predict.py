"""Prediction throughput at L = 10^6 labels: exact and DiskANN top-k through the serving path
(`xc.eval.inference.sharded_topk` with `ExactSearcher` / `xc.serve.ann.AnnSearcher`), and what a saved serving
index (`--save-index`) saves: the build against reloading it.

    .venv/bin/python tools/bench/bench_predict.py                       # L = 1e6, d = 64, 2000 queries, k = 10
    .venv/bin/python tools/bench/bench_predict.py --labels 100000 --queries 5000 --out /tmp/p.json

Synthetic classifier rows and query embeddings come from tools/bench/bench_ann.py's `make_data` (clustered
directions, log-normal norms; queries near their source label's row). Queries are searched in blocks of
`--block` (xc-predict's --block-rows), one process, `--threads` threads (torch and the ANN library).
The encoder's cost is not included: these are the search rates given query embeddings. Timings are of
this machine (a shared 2-core CPU when the figures in docs/benchmarks.md were taken), so compare the
exact and DiskANN rates as a ratio measured here in one run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # xc and tools.* of this checkout

from tools.bench.bench_ann import make_data  # noqa: E402
from xc.config import AnnConfig  # noqa: E402
from xc.distributed import DistContext  # noqa: E402
from xc.eval.inference import ExactSearcher, sharded_topk  # noqa: E402
from xc.models.classifier import ClassifierShard  # noqa: E402
from xc.serve.ann import AnnSearcher, SavedIndexes  # noqa: E402
from xc.shards import ShardLayout  # noqa: E402


def rate(searcher, queries: torch.Tensor, k: int, block: int, ctx: DistContext) -> tuple[float, np.ndarray]:
    """(queries per second, ids (N, k)) of searching every query in blocks."""
    start = time.perf_counter()
    ids = [sharded_topk(queries[i:i + block], searcher, k, ctx)[1].numpy() for i in range(0, len(queries), block)]
    return len(queries) / (time.perf_counter() - start), np.concatenate(ids)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--block", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "tools" / "results" / "bench_predict.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ctx = DistContext()

    rows, queries = make_data(args.labels, args.dim, args.queries)
    layout = ShardLayout.build(args.labels, 1)
    shard = ClassifierShard(0, layout.padded_labels, args.labels, args.dim, 0.0, 0, ctx.device)
    shard.weight[:args.labels] = torch.from_numpy(rows)
    q = torch.from_numpy(queries)

    exact_qps, exact_ids = rate(ExactSearcher(shard), q, args.k, args.block, ctx)
    print(f"exact: {exact_qps:.1f} queries/s", flush=True)

    ann = AnnConfig(backend="diskann")
    with tempfile.TemporaryDirectory(prefix="bench-predict-") as run_dir:
        store = SavedIndexes(run_dir, "diskann", {"checkpoint": "synthetic", "global_step": 0})
        built = AnnSearcher(shard, layout, range(1), ann, args.threads, store=store, save=True)
        print(f"diskann: built and saved in {built.build_seconds:.1f}s", flush=True)
        loaded = AnnSearcher(shard, layout, range(1), ann, args.threads, store=store)
        assert loaded.reused
        print(f"diskann: saved index reloaded in {loaded.build_seconds:.1f}s (fingerprint check included)", flush=True)
        ann_qps, ann_ids = rate(loaded, q, args.k, args.block, ctx)
    hits = [len(set(a.tolist()) & set(b.tolist())) / args.k for a, b in zip(ann_ids, exact_ids)]
    recall = float(np.mean(hits))
    print(f"diskann: {ann_qps:.1f} queries/s, recall@{args.k} {recall:.3f} against exact", flush=True)

    result = {
        "labels": args.labels, "dim": args.dim, "queries": args.queries, "k": args.k, "block": args.block,
        "threads": args.threads, "machine": platform.processor() or platform.machine(),
        "exact_qps": round(exact_qps, 1), "diskann_qps": round(ann_qps, 1),
        "diskann_speedup": round(ann_qps / exact_qps, 2), "diskann_recall_at_k": round(recall, 4),
        "diskann_build_and_save_seconds": round(built.build_seconds, 1),
        "diskann_reload_seconds": round(loaded.build_seconds, 2),
        "diskann_params": {k: v for k, v in vars(ann).items() if k.startswith("diskann_") or k == "center"},
        "command": "python tools/bench/bench_predict.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
