"""Exact rankings over many rows: walking the rows in blocks (xc/ann/row_blocks.py) against one block of queries.

    python tools/bench/bench_exact_rows.py --rows 10000000 --dim 64 --queries 1024 --one-block-queries 32 \
        --out tools/results/exact_row_blocks.json
    python tools/bench/bench_exact_rows.py --run RUN_DIR --queries 2000 --one-block-queries 200   # a run's rows, queries
    python tools/bench/bench_exact_rows.py --rows 2000000 --dim 256 --bf16-rows --out tools/results/exact_bf16_rows.json

A ranking block holds 2^23 bfloat16 (2^26 float32) scores, so over n rows one block takes 2^23 // n queries: one
at 10^7 rows. Both ways are timed on the same queries, k = 5, on the first pass `bf16_products_pay` chooses (the
path of every evaluation, validation ranking and kNN search); the one-block way on its own (smaller) share of them,
which must return the same labels and scores. Rows: synthetic (`--rows`, `--dim`: 1% of the rows 30x the norm of
the rest, as trained classifiers' popular rows are; Gaussian queries) or a run's (`--run`: `xc.load`'s rows and
the encodings of its training points). Appends one JSON record per call to `--out`.

`--bf16-rows`: the rows stored in bfloat16 (a 10^7-label model's), ranked by `exact_topk` (where a shortlist pays:
the canonical top-k through the row blocks, a bfloat16 first pass multiplying the rows as stored) against the
float32 ranking of a block upcast at a time (`xc.ann.bf16_rows.topk_over_row_blocks`), on the same queries; the
two may differ in the last bit of a score, so the record gives the share of equal labels.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def synthetic_rows(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """(n, dim) rows: 1% of them at 30x the norm of the rest (the popular labels of a trained classifier)."""
    gen = torch.Generator().manual_seed(seed)
    rows = 0.01 * torch.randn(n, dim, generator=gen)
    head = max(1, n // 100)
    rows[:head] = 0.3 * torch.randn(head, dim, generator=gen)
    return rows


def run_rows_and_queries(run_dir: str, num_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (n, d) float32, queries (m, d)): a run's classifier rows (`xc.load`: its kept checkpoint) and the
    encodings of m of its training points drawn with seed 0."""
    import numpy as np

    import xc
    from xc.eval.inference import encode_rows

    model = xc.load(run_dir)
    cfg, c = model.cfg, model.components
    rows = c.shard.weight[:model.num_labels].float().cpu()
    picked = np.sort(np.random.default_rng(0).choice(c.train.num_rows, min(num_queries, c.train.num_rows),
                                                     replace=False))
    return rows, encode_rows(c.encoder, c.train.inputs, picked, cfg.eval.batch_size, model.ctx).float().cpu()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--run", help="a run directory: its rows and training queries instead of synthetic ones")
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--one-block-queries", type=int, default=32)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--bf16-rows", action="store_true", help="rows in bfloat16: exact_topk against a block-upcast ranking")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    from xc.ann import exact
    from xc.ann.exact import exact_topk

    if args.run:
        rows, queries = run_rows_and_queries(args.run, args.queries)
    else:
        rows = synthetic_rows(args.rows, args.dim)
        queries = torch.randn(args.queries, rows.shape[1], generator=torch.Generator().manual_seed(1))
    if args.bf16_rows:
        return _bf16_rows(rows.bfloat16(), queries, args)
    start = time.perf_counter()
    walked = exact_topk(queries, rows, args.k)
    walked_s = time.perf_counter() - start
    real_rule = exact.row_blocks_pay
    exact.row_blocks_pay = lambda *a: False
    try:
        few = queries[:args.one_block_queries]
        start = time.perf_counter()
        one_block = exact_topk(few, rows, args.k)
        one_block_s = time.perf_counter() - start
    finally:
        exact.row_blocks_pay = real_rule
    same = (torch.equal(one_block[1], walked[1][:len(few)]) and torch.equal(one_block[0], walked[0][:len(few)]))
    record = {
        "rows": list(rows.shape), "source": args.run or "synthetic", "k": args.k,
        "first_pass": str(exact.first_pass_dtype("cpu")).replace("torch.", ""),
        "row_blocks": {"queries": args.queries, "seconds": round(walked_s, 2),
                       "seconds_per_1000": round(1000 * walked_s / args.queries, 2)},
        "one_block": {"queries": len(few), "seconds": round(one_block_s, 2),
                      "seconds_per_1000": round(1000 * one_block_s / len(few), 2)},
        "speedup": round((one_block_s / len(few)) / (walked_s / args.queries), 2),
        "same_answer": bool(same),
        "machine": _machine(),
    }
    if not same:
        print(json.dumps(record, indent=1))
        raise SystemExit("the two ways returned different rankings")
    return _emit(record, args.out)


def _machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def _emit(record: dict, out: str | None) -> dict:
    """Print the record and append it to `out` (one JSON line) where given; returns it."""
    print(json.dumps(record, indent=1))
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def _bf16_rows(rows: torch.Tensor, queries: torch.Tensor, args) -> dict:
    """exact_topk over bfloat16 rows against the block-upcast float32 ranking, the same queries; one JSON record."""
    from xc.ann import exact
    from xc.ann.bf16_rows import topk_over_row_blocks

    start = time.perf_counter()
    canonical = exact.exact_topk(queries, rows, args.k)
    canonical_s = time.perf_counter() - start
    start = time.perf_counter()
    upcast = topk_over_row_blocks(queries, rows, args.k, lambda a, b: None, exact.BLOCK_FLOATS, None)
    upcast_s = time.perf_counter() - start
    record = {
        "rows": list(rows.shape), "dtype": "bfloat16", "source": args.run or "synthetic", "k": args.k,
        "queries": len(queries), "first_pass": str(exact.first_pass_dtype("cpu")).replace("torch.", ""),
        "exact_topk_seconds": round(canonical_s, 2), "block_upcast_seconds": round(upcast_s, 2),
        "speedup": round(upcast_s / canonical_s, 2),
        "equal_labels": round(float((canonical[1] == upcast[1]).float().mean()), 5),
        "machine": _machine(),
    }
    return _emit(record, args.out)


if __name__ == "__main__":
    main()
