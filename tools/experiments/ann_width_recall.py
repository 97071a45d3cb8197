"""How well a graph index serves a trained model's rows, by search effort: recall@k of `--ann diskann` serving
against exact search over the same rows, and P@1 of each, for several DiskANN search complexities (L_s) on one
built index per run, and then the breadth serving tunes itself (`miner.ann.serve_recall`, xc/ann/breadth.py) on
the first queries: what `xc-eval RUN --ann diskann` serves at.

    XC_THREADS=2 .venv/bin/python tools/experiments/ann_width_recall.py runs/width-128 runs/width-1024 \
        --max-points 2000 --search-complexity 64 128 256 512 --out tools/results/ann_width_recall.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np


def _diskann_indexes(searcher) -> list:
    """The DiskANN indexes inside a searcher's per-shard wrappers (centering, exact head)."""
    from xc.ann.diskann_backend import DiskannIndex

    found, stack = [], [index for _, index in searcher.indexes]  # (first label, index) per shard
    while stack:
        index = stack.pop()
        if isinstance(index, DiskannIndex):
            found.append(index)
        elif getattr(index, "inner", None) is not None:
            stack.append(index.inner)
    return found


def measure(run_dir: str, max_points: int, complexities: list[int], topk: int, build: dict | None = None) -> dict:
    """One run's sweep; `build` overrides ANN build settings (diskann_graph_degree, diskann_build_complexity)."""
    from xc.config import build_config
    from xc.datasets import load_configured_dataset
    from xc.distributed import init_distributed
    from xc.eval.inference import predict
    from xc.eval.metrics import evaluate, true_labels
    from xc.run.resume import load_serving_weights
    from xc.run.checkpoint import final_checkpoint
    from xc.serve.ann import AnnSearcher
    from xc.train.components import build_components

    path, meta = final_checkpoint(run_dir)
    raw = meta["config"]
    raw["parallel"]["num_label_shards"] = meta["num_label_shards"]
    raw["logger"]["wandb"] = "disabled"
    raw["eval"]["max_points"] = max_points
    cfg = build_config(raw)
    ctx = init_distributed(cfg.parallel.backend, cfg.train.device)
    dataset = load_configured_dataset(cfg)
    c = build_components(cfg, ctx, dataset, optimizers=False)
    load_serving_weights(path, meta, c.encoder, c.shard)
    n = min(max_points, dataset.test.num_points)
    rows = np.arange(n, dtype=np.int64)
    indptr, truth = true_labels(dataset.test.labels, first=n)
    start = time.perf_counter()
    _, exact_ids = predict(c.encoder, c.shard, c.test_inputs, rows, topk, cfg.eval.batch_size, ctx)
    exact_seconds = time.perf_counter() - start
    exact = evaluate(exact_ids, indptr, truth, c.inv_propensity, ks=(1, 3, 5))
    served = dataclasses.replace(cfg.miner.ann, backend="diskann", **(build or {}))
    ann = dataclasses.replace(served, serve_recall=0.0)  # the sweep's breadths as given
    searcher = AnnSearcher(c.shard, c.layout, c.my_shards, ann)
    graphs = _diskann_indexes(searcher)
    if not graphs:  # every row in the exact head, say: nothing to sweep
        raise SystemExit(f"{run_dir}: the served index holds no DiskANN graph to sweep")
    out = {"run_dir": run_dir, "width": int(c.shard.weight.shape[1]), "num_labels": int(dataset.num_labels),
           "dtype": cfg.model.classifier_dtype, "points": n, "exact": {k: exact[k] for k in ("P@1", "P@3", "P@5")},
           "exact_seconds": exact_seconds, "build_seconds": searcher.build_seconds,
           "graph_degree": ann.diskann_graph_degree, "build_complexity": ann.diskann_build_complexity, "sweep": []}
    for complexity in [*complexities, "tuned"]:
        if complexity == "tuned":  # as served: the breadth tuned on the first queries from the configured one
            searcher.ann = served
            complexity = searcher.ann.diskann_search_complexity
        for index in graphs:
            index.params = dataclasses.replace(index.params, diskann_search_complexity=complexity)
        start = time.perf_counter()
        _, ids = predict(c.encoder, c.shard, c.test_inputs, rows, topk, cfg.eval.batch_size, ctx, searcher=searcher)
        seconds = time.perf_counter() - start
        hits = [len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist())) for a, b in zip(ids, exact_ids)]
        metrics = evaluate(ids, indptr, truth, c.inv_propensity, ks=(1, 3, 5))
        out["sweep"].append({"search_complexity": complexity, f"recall@{topk}": 100.0 * float(np.mean(hits)) / topk,
                             "P@1": metrics["P@1"], "P@3": metrics["P@3"], "P@5": metrics["P@5"],
                             "ms_per_query": 1000.0 * seconds / n})
        if searcher.tuning is not None:
            out["sweep"][-1].update(search_complexity=searcher.tuning.chosen, tuned=searcher.tuning.summary(),
                                    exact_is_faster=searcher.tuning.exact_is_faster,
                                    tuning_seconds=searcher.tuning.seconds,
                                    ms_per_query=1000.0 * (seconds - searcher.tuning.seconds) / n)
        print(json.dumps(out["sweep"][-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories holding checkpoints/")
    parser.add_argument("--max-points", type=int, default=2000, help="test points (the first N)")
    parser.add_argument("--search-complexity", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--topk", type=int, default=5, help="recall@k against exact search")
    parser.add_argument("--graph-degree", type=int, help="build with this DiskANN graph degree R (default: the run's)")
    parser.add_argument("--build-complexity", type=int, help="build with this L_build (default: the run's)")
    parser.add_argument("--out", help="write the results to this JSON file")
    args = parser.parse_args(argv)
    build = {key: value for key, value in (("diskann_graph_degree", args.graph_degree),
                                           ("diskann_build_complexity", args.build_complexity)) if value}
    results = [measure(run, args.max_points, args.search_complexity, args.topk, build) for run in args.runs]
    if args.out:
        Path(args.out).write_text(json.dumps({"what": __doc__.splitlines()[0], "runs": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
