"""Miner recall on a trained run's classifier rows: the ANN index the miner would build, against exact search.

    python tools/experiments/miner_recall.py RUN_DIR                               # the run's miner.ann settings
    python tools/experiments/miner_recall.py RUN_DIR --set diskann_graph_degree=64 diskann_search_complexity=128
    python tools/experiments/miner_recall.py RUN_DIR --backend faiss_ivf --set ivf_nprobe=16
    python tools/experiments/miner_recall.py RUN_DIR --snapshot --set exact_head=0     # the rows the miner last indexed

What the miner does at a refresh, on a sample of training queries: the rows of the run's newest checkpoint
(mean-centred as `miner.ann.center` says), one index over all of them, each query's top-k_hard excluding its
positives, recall@k_hard against exact inner-product search with the same exclusions. Build seconds are for
all L rows; search seconds are measured on the sample and extrapolated to every training row (what one
generation costs the miner with `--threads` threads). Appends one JSON record per call to `--out`.

`--rows bfloat16`: the index is built on the rows rounded to bfloat16 (to nearest), the exact reference stays the
float32 rows: what the miner loses when the same model's rows are stored in bfloat16 (`model.classifier_dtype`).
The record adds `rounded_exact_recall`, exact search over the rounded rows against the float32 rows: the rounding's
own share of the loss.

`--snapshot`: instead of the checkpoint, the newest refresh snapshot in RUN_DIR/handoff (its rows W, the query
embeddings Q the miner searched with, the static positives): exactly what that refresh's miner saw.
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

REPO = Path(__file__).resolve().parents[2]
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
    ap.add_argument("--checkpoint", type=Path, default=None, help="a checkpoint directory (default: the newest)")
    ap.add_argument("--rows", choices=("stored", "bfloat16"), default="stored",
                    help="index the rows as stored, or rounded to bfloat16 against the float32 rows' exact top-k")
    ap.add_argument("--snapshot", action="store_true", help="the newest handoff snapshot, not the checkpoint")
    ap.add_argument("--out", type=Path, default=REPO / "tools" / "results" / "miner_recall.json")
    args = ap.parse_args()

    import xc
    from xc.ann.base import recall_at_k, search_excluding
    from xc.ann.centering import build_for_mips
    from xc.ann.exact import exact_topk
    from xc.eval.inference import encode_rows

    torch.set_num_threads(max(1, args.threads))
    if args.snapshot:
        cfg, weight, queries, indptr, indices, rows, num_rows, source = _from_snapshot(args)
    else:
        model = xc.load(args.run_dir, checkpoint=args.checkpoint)
        cfg, c = model.cfg, model.components
        num_rows = c.train.num_rows
        weight = c.shard.weight[:model.num_labels].float().cpu()
        rows = np.sort(np.random.default_rng(args.seed).choice(num_rows, min(args.queries, num_rows), replace=False))
        queries = encode_rows(c.encoder, c.train.inputs, rows, cfg.eval.batch_size, model.ctx)
        indptr, indices = c.train.labels(rows)
        source = str(model.checkpoint)
    k = cfg.sampler.k_hard
    params = replace(cfg.miner.ann, **parse_sets(args.set, cfg.miner.ann), num_threads=args.threads)
    backend = args.backend or params.backend
    num_labels = weight.shape[0]

    start = time.perf_counter()
    _, exact_ids = exact_topk(queries, weight, k, indptr, indices)
    exact_seconds = time.perf_counter() - start
    rounded_exact_recall = None
    if args.rows == "bfloat16":
        weight = weight.to(torch.bfloat16).float()
        _, rounded_ids = exact_topk(queries, weight, k, indptr, indices)
        rounded_exact_recall = round(float(recall_at_k(rounded_ids.numpy(), exact_ids.numpy())), 4)
    index = build_for_mips(backend, replace(params, backend=backend), params.center)
    start = time.perf_counter()
    index.build(weight if weight.dtype == torch.bfloat16 and backend == "clustered"
                else np.ascontiguousarray(weight.float().numpy()))
    build_seconds = time.perf_counter() - start
    start = time.perf_counter()
    if backend == "clustered":  # it clusters each search block: the sample goes inside a block of the miner's size
        approx_ids, search_rows = _in_block(index, args, queries, indptr, indices, rows, num_rows, k)
    else:
        approx_ids, search_rows = search_excluding(index, queries.numpy(), k, indptr, indices), len(rows)
    search_seconds = time.perf_counter() - start
    recall = recall_at_k(approx_ids, exact_ids.numpy())
    norms = weight[torch.randperm(num_labels)[:100_000]].float().norm(dim=1)
    record = {
        "run_dir": str(args.run_dir), "rows_from": source, "backend": backend,
        "center": params.center, "set": args.set, "rows": args.rows,
        "rounded_exact_recall": rounded_exact_recall, "threads": args.threads, "num_labels": num_labels,
        "dim": int(weight.shape[1]), "k": k, "queries": len(rows), "recall": round(float(recall), 4),
        "build_seconds": round(build_seconds, 1),
        "search_seconds_per_1k": round(1000 * search_seconds / search_rows, 3),
        "search_seconds_all_rows": round(search_seconds * num_rows / search_rows, 1),
        "exact_seconds_per_1k": round(1000 * exact_seconds / len(rows), 3),
        "row_norm_quantiles": [round(float(q), 3) for q in torch.quantile(
            norms, torch.tensor([0.01, 0.5, 0.99]))],
        "rows_scanned": (getattr(index, "last_search", None) or {}).get("rows_scanned"),
    }
    print(json.dumps(record))
    records = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.write_text(json.dumps(records + [record], indent=1))


def _in_block(index, args, queries, indptr, indices, rows, num_rows, k):
    """(ids of the sampled queries, queries searched): the sample searched together with other training queries
    up to one miner search block (xc/miner/task.py SEARCH_BLOCK), so that it is clustered as the miner's are."""
    from xc.miner.task import SEARCH_BLOCK

    if not args.snapshot:
        raise SystemExit("--backend clustered: use --snapshot (its queries are what the miner clusters)")
    all_queries = np.load(sorted((args.run_dir / "handoff" / "snapshots").glob("gen-*"))[-1] / "Q.npy", mmap_mode="r")
    others = np.setdiff1d(np.arange(num_rows), rows)
    size = min(len(others), SEARCH_BLOCK - len(rows))
    fill = np.random.default_rng(args.seed + 1).choice(others, size, replace=False)
    block = np.concatenate([queries.numpy(), np.asarray(all_queries[np.sort(fill)], dtype=np.float32)])
    block_indptr = np.concatenate([indptr, np.full(len(fill), indptr[-1])])  # the fill's positives: not checked
    ids = index.search_excluding(block, k, block_indptr, indices)[: len(rows)]
    return ids, len(block)


def _from_snapshot(args):
    """(cfg, rows (n, d), sampled queries (m, d), their positives as CSR, sampled ids, all queries, source) of
    the newest snapshot; the run's config comes from RUN_DIR/config.json."""
    from xc.config import build_config

    snapshots = sorted((args.run_dir / "handoff" / "snapshots").glob("gen-*"))
    if not snapshots:
        raise SystemExit(f"{args.run_dir}/handoff/snapshots: no snapshot (was the run's miner asynchronous? a "
                         "finished run drops its snapshots unless trained with train.prune_when_done=false)")
    snap, static = snapshots[-1], args.run_dir / "handoff" / "static"
    cfg = build_config(json.loads((args.run_dir / "config.json").read_text()))
    from xc.ann.bf16_rows import bf16_from_bits

    weight = np.ascontiguousarray(np.load(snap / "W.shard0.npy"))
    # bfloat16 rows stored as their bit patterns (xc/handoff.py): kept as a bfloat16 tensor, as the miner reads them
    # (the exact reference and the clustered search upcast a block at a time; a graph backend takes a float32 copy)
    weight = bf16_from_bits(weight) if weight.dtype == np.uint16 else torch.from_numpy(weight)
    all_queries = np.load(snap / "Q.npy", mmap_mode="r")
    pos_ptr = np.load(static / "positives.indptr.npy")
    pos_idx = np.load(static / "positives.indices.npy", mmap_mode="r")
    num_rows = all_queries.shape[0]
    rows = np.sort(np.random.default_rng(args.seed).choice(num_rows, min(args.queries, num_rows), replace=False))
    counts = pos_ptr[rows + 1] - pos_ptr[rows]
    indptr = np.concatenate([[0], np.cumsum(counts)])
    indices = np.concatenate([np.asarray(pos_idx[pos_ptr[r]:pos_ptr[r + 1]]) for r in rows])
    queries = torch.from_numpy(np.ascontiguousarray(all_queries[rows], dtype=np.float32))
    return cfg, weight, queries, indptr, indices, rows, num_rows, str(snap)


if __name__ == "__main__":
    main()
