"""One training step of a bag-of-words feature table: dense AdamW, torch's SparseAdam, and xc's gathered rows
with RowTableAdam (model.sparse_features), at a large vocabulary.

    python tools/bench/bench_feature_table.py --features 200000 --widths 256 1024 --out tools/results/bench_feature_table.json

A step is the table's forward, backward and optimizer step for one batch (B rows of `--per-row` feature
occurrences drawn uniformly: the worst case for locality); the moments are touched once before timing, so
page faults of first use are not counted. All variants run in this one process, one after another: compare
them as ratios. Median of `--steps` steps.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn


def time_steps(step, features: int, batch: int, per_row: int, steps: int) -> float:
    offsets = torch.arange(0, batch * per_row, per_row)
    values = torch.rand(batch * per_row)
    times = []
    for _ in range(steps + 2):
        ids = torch.randint(0, features, (batch * per_row,))
        start = time.perf_counter()
        step(ids, offsets, values)
        times.append(time.perf_counter() - start)
    return sorted(times[2:])[len(times[2:]) // 2]


def variants(features: int, width: int):
    from xc.config import TrainConfig
    from xc.models.encoders import BowEncoder
    from xc.train.optim import build_encoder_optimizer

    def dense():
        bag = nn.EmbeddingBag(features, width, mode="sum")
        opt = torch.optim.AdamW([bag.weight], lr=1e-3, fused=True)

        def step(ids, offsets, values):
            bag(ids, offsets, per_sample_weights=values).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def sparse_adam():
        bag = nn.EmbeddingBag(features, width, mode="sum", sparse=True)
        opt = torch.optim.SparseAdam([bag.weight], lr=1e-3)

        def step(ids, offsets, values):
            bag(ids, offsets, per_sample_weights=values).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def gathered():
        enc = BowEncoder(features, width, [], 0.0, sparse_grad=True)
        opt = build_encoder_optimizer(enc.parameters(), TrainConfig(lr_encoder=1e-3), [enc])
        for table in opt.tables:
            table.exp_avg.add_(0.0)
            table.exp_avg_sq.add_(0.0)

        def step(ids, offsets, values):
            enc({"feat_ids": ids, "feat_offsets": offsets, "feat_values": values}).sum().backward()
            opt.step()
        return step

    return {"dense AdamW": dense, "SparseAdam": sparse_adam, "gathered rows + RowTableAdam": gathered}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", type=int, default=200_000)
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--per-row", type=int, default=52, help="feature occurrences per row (synthetic: ~52)")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("tools/results/bench_feature_table.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for width in args.widths:
        for name, make in variants(args.features, width).items():
            seconds = time_steps(make(), args.features, args.batch, args.per_row, args.steps)
            rows.append({"width": width, "variant": name, "ms_per_step": round(1000 * seconds, 1)})
            print(rows[-1], flush=True)
    args.out.write_text(json.dumps({"features": args.features, "batch": args.batch, "per_row": args.per_row,
                                    "threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
