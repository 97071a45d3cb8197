"""How much of the rows' current top-16 a stale refresh snapshot's top-K still holds (K = 16 ... 256): what
re-ranking an asynchronous generation's K candidates at the switch can recover (`miner.rerank_candidates`).

    python tools/stale_coverage.py RUN_DIR CHECKPOINT SNAPSHOT_DIR [--queries 2048] [--out coverage.json]

CHECKPOINT: the model at the switch (e.g. RUN_DIR/checkpoints/step-00015584); SNAPSHOT_DIR: the generation's
snapshot (RUN_DIR/handoff/snapshots/gen-000002, kept by `miner.keep_generations`), one label shard. Both sides
are exact searches over every label, positives excluded, on a seeded sample of training queries.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

KS = (16, 32, 64, 128, 256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("checkpoint")
    ap.add_argument("snapshot")
    ap.add_argument("--queries", type=int, default=2048)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from xc.ann.exact import exact_topk
    from xc.inference import encode_rows
    from xc.predictor import TrainedModel

    model = TrainedModel(args.run_dir, checkpoint=args.checkpoint)
    c = model.components
    rows = np.sort(np.random.default_rng(0).permutation(c.train.num_rows)[:args.queries])
    indptr, indices = c.train.labels(rows)
    now_emb = encode_rows(c.encoder, c.train.inputs, rows, 512, model.ctx)
    _, now = exact_topk(now_emb, c.shard.weight.detach().float(), 16, indptr, indices)
    snapshot = Path(args.snapshot)
    queries = np.load(snapshot / "Q.npy", mmap_mode="r")
    weights = torch.from_numpy(np.load(snapshot / "W.shard0.npy"))
    _, stale = exact_topk(torch.from_numpy(np.ascontiguousarray(queries[rows])), weights, max(KS), indptr, indices)
    coverage = {k: sum(len(set(now[q].tolist()) & set(stale[q, :k].tolist())) for q in range(len(rows)))
                / (16 * len(rows)) for k in KS}
    report = {"run_dir": args.run_dir, "checkpoint": args.checkpoint, "snapshot": args.snapshot,
              "queries": len(rows), "coverage_of_current_top16_by_stale_topK": coverage}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
