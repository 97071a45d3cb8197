"""What ranking the long rows first (xc/ann/long_rows.py) saves on a finished run: the time to rank its first test
points exactly (the model alone, no prior, no fusion; with lexical weights the dense ranking they start from and any
deeper one) with the split and with every row read, alternated so that neither side runs on a warmer host, and a
check that both give the same top k with the same scores. `--prior`: the label prior's ranking of the same points
under every beta it tries (xc/fitting/label_prior.py; several betas rank the plain float32 products, so the scores
are compared within rounding).

    XC_THREADS=2 python tools/experiments/long_rows_speed.py RUN_DIR --max-points 500 [--repeats 2] [--prior] \
        [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np


class _Counts(logging.Handler):
    """Collects the split's debug lines: (rows long, rows, queries read over every row, queries)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[int, ...]] = []

    def emit(self, record):
        self.seen.append(tuple(int(a) for a in record.args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--max-points", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prior", action="store_true", help="time the label prior's ranking under every beta")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import xc
    import xc.ann.long_rows as long_rows
    import xc.eval.inference as inference

    counts = _Counts()
    logger = logging.getLogger(long_rows.__name__)
    logger.addHandler(counts)
    logger.setLevel(logging.DEBUG)
    model = xc.load(args.run_dir)
    model.use_prior(False)  # the model alone
    c, cfg, ctx = model.components, model.cfg, model.ctx
    if c.lexical is not None:
        c.lexical.by_feature()  # once per set of weights: not part of either side's time
    rows = np.arange(min(args.max_points, model.dataset.test.num_points), dtype=np.int64)
    k, default_min_rows = cfg.eval.topk, long_rows.MIN_ROWS
    rank = lambda: inference.predict(c.encoder, c.shard, c.test_inputs, rows, k, cfg.eval.batch_size, ctx)  # noqa: E731
    if args.prior:
        rank = _prior_ranking(model, rows)
    results, answers = [], {}
    for _ in range(args.repeats):
        for side, min_rows in (("every row", 1 << 62), ("long rows first", default_min_rows)):
            long_rows.MIN_ROWS = min_rows
            counts.seen.clear()
            start = time.perf_counter()
            scores, ids = rank()
            seconds = time.perf_counter() - start
            answers.setdefault(side, (scores, ids))
            split = [dict(zip(("long_rows", "rows", "queries_over_every_row", "queries"), s)) for s in counts.seen]
            results.append({"side": side, "seconds": round(seconds, 2), "points": len(rows), "rankings": split})
            print(json.dumps(results[-1]), flush=True)
    long_rows.MIN_ROWS = default_min_rows
    (s_all, i_all), (s_split, i_split) = answers["every row"], answers["long rows first"]
    same = bool(np.array_equal(i_all, i_split) and (np.allclose(s_all, s_split, rtol=1e-5, atol=1e-5) if args.prior
                                                      else np.array_equal(s_all, s_split)))
    best = {side: min(r["seconds"] for r in results if r["side"] == side) for side in answers}
    summary = {"run_dir": args.run_dir, "k": k, "ranking": "label prior, every beta" if args.prior else "model",
               "same_top_k_and_scores": same, "best_seconds": best,
               "speedup": round(best["every row"] / best["long rows first"], 2), "results": results}
    print(json.dumps({key: summary[key] for key in ("same_top_k_and_scores", "best_seconds", "speedup")}))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if same else 1


def _prior_ranking(model, rows: np.ndarray):
    """A callable giving the label prior's rankings of test points `rows` under every beta it tries, stacked
    (scores (B * n, w), ids (B * n, w)), as its choice ranks the validation points (xc/fitting/label_prior.py)."""
    from xc.eval.inference import encode_rows
    from xc.fitting import label_prior

    c, cfg, ctx = model.components, model.cfg, model.ctx
    log_counts = label_prior.training_log_counts(model.dataset.train.labels, c.train.train_ids, model.num_labels)
    betas, width = label_prior.betas_to_try(cfg.eval.label_prior), max(cfg.eval.ks)
    emb = encode_rows(c.encoder, c.test_inputs, rows, cfg.eval.batch_size, ctx)

    def rank():
        if c.lexical is not None:
            tops = label_prior.lexical_topk_per_beta(emb, c.shard, c.test_inputs, rows, log_counts, betas, width, ctx)
        else:
            tops = {b: (s.numpy(), i.numpy()) for b, (s, i) in
                    label_prior.topk_per_beta(emb, c.shard, log_counts, betas, width, ctx, with_scores=True).items()}
        return tuple(np.concatenate([np.asarray(tops[b][j]) for b in betas]) for j in (0, 1))

    return rank


if __name__ == "__main__":
    raise SystemExit(main())
