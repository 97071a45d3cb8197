"""Miner recall on a trained run's classifier rows: the ANN index the miner would build, against exact search.

    python tools/miner_recall.py RUN_DIR                               # the run's miner.ann settings
    python tools/miner_recall.py RUN_DIR --set diskann_graph_degree=64 diskann_search_complexity=128
    python tools/miner_recall.py RUN_DIR --backend faiss_ivf --set ivf_nprobe=16

What the miner does at a refresh, on a sample of training queries: the rows of the run's newest checkpoint
(mean-centred as `miner.ann.center` says), one index over all of them, each query's top-k_hard excluding its
positives, recall@k_hard against exact inner-product search with the same exclusions. Build seconds are for
all L rows; search seconds are measured on the sample and extrapolated to every training row (what one
generation costs the miner with `--threads` threads). Appends one JSON record per call to `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_sets(pairs: list[str], params) -> dict:
    """key=value pairs of AnnParams fields, typed as the field's default."""
    types = {f.name: type(getattr(params, f.name)) for f in fields(params)}
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in types:
            raise SystemExit(f"--set {pair}: no ann field {key!r} (known: {', '.join(sorted(types))})")
        out[key] = types[key](value) if types[key] is not bool else value.lower() in ("1", "true", "yes")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--queries", type=int, default=2000, help="training rows sampled as queries")
    ap.add_argument("--backend", default=None, help="default: the run's miner.ann.backend")
    ap.add_argument("--set", nargs="*", default=[], help="miner.ann fields, key=value")
    ap.add_argument("--threads", type=int, default=1, help="build and search threads (the miner's per worker)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "tools" / "results" / "miner_recall.json")
    args = ap.parse_args()

    import xc
    from xc.ann.base import recall_at_k, search_excluding
    from xc.ann.centering import build_for_mips
    from xc.ann.exact import exact_topk
    from xc.inference import encode_rows

    torch.set_num_threads(max(1, args.threads))
    model = xc.load(args.run_dir)
    cfg, c = model.cfg, model.components
    k = cfg.sampler.k_hard
    params = replace(cfg.miner.ann, **parse_sets(args.set, cfg.miner.ann), num_threads=args.threads)
    backend = args.backend or params.backend
    num_labels, num_rows = model.num_labels, c.train.num_rows
    weight = c.shard.weight[:num_labels].float().cpu()
    rows = np.sort(np.random.default_rng(args.seed).choice(num_rows, min(args.queries, num_rows), replace=False))
    queries = encode_rows(c.encoder, c.train.inputs, rows, cfg.eval.batch_size, model.ctx)
    indptr, indices = c.train.labels(rows)

    start = time.perf_counter()
    _, exact_ids = exact_topk(queries, weight, k, indptr, indices)
    exact_seconds = time.perf_counter() - start
    index = build_for_mips(backend, replace(params, backend=backend), params.center)
    start = time.perf_counter()
    index.build(np.ascontiguousarray(weight.numpy()))
    build_seconds = time.perf_counter() - start
    start = time.perf_counter()
    approx_ids = search_excluding(index, queries.numpy(), k, indptr, indices)
    search_seconds = time.perf_counter() - start
    recall = recall_at_k(approx_ids, exact_ids.numpy())
    norms = weight.norm(dim=1)
    record = {
        "run_dir": str(args.run_dir), "checkpoint": str(model.checkpoint), "backend": backend,
        "center": params.center, "set": args.set, "threads": args.threads, "num_labels": num_labels,
        "dim": int(weight.shape[1]), "k": k, "queries": len(rows), "recall": round(float(recall), 4),
        "build_seconds": round(build_seconds, 1), "search_seconds_per_1k": round(1000 * search_seconds / len(rows), 3),
        "search_seconds_all_rows": round(search_seconds * num_rows / len(rows), 1),
        "exact_seconds_per_1k": round(1000 * exact_seconds / len(rows), 3),
        "row_norm_quantiles": [round(float(q), 3) for q in torch.quantile(
            norms[torch.randperm(num_labels)[:100_000]], torch.tensor([0.01, 0.5, 0.99]))],
    }
    print(json.dumps(record))
    records = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.write_text(json.dumps(records + [record], indent=1))


if __name__ == "__main__":
    main()
