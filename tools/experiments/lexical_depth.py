"""How deep the dense ranking a lexical-weight model's exact ranking starts from should be: the time to rank a run's
first test points at each depth, and a check that every depth gives the same top k (any depth is exact:
xc/models/lexical_rank.py).

    XC_THREADS=2 python tools/experiments/lexical_depth.py RUN_DIR --max-points 500 --extra 32 128 512 [--out F.json]
    XC_THREADS=2 python tools/experiments/lexical_depth.py RUN_DIR --extra 512 --paths   # summed lists vs prefixes

A deeper dense ranking costs more products and a wider shortlist; a shallower one leaves more labels that could
enter from outside it, each found through the weights kept by feature and scored exactly. Which is cheaper depends
on how fast each side is on the host, so it is measured here on a run with `model.lexical_features`, the model
alone (no prior, no fusion), the weights' lists built before the first timing. With --paths each depth is also
timed with every query's labels found through the prefixes alone (`READS_PER_ENTRY` = inf: never summed) and through
the sums alone (0), beside the cost model's choice.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--max-points", type=int, default=500)
    parser.add_argument("--extra", type=int, nargs="+", default=[32, 128, 512],
                        help="dense depths beyond k to try (xc.eval.inference.LEXICAL_EXACT_EXTRA)")
    parser.add_argument("--paths", action="store_true", help="also time the prefixes alone and the sums alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import xc
    import xc.eval.inference as inference
    import xc.models.lexical_rank as lexical_rank

    model = xc.load(args.run_dir)  # the run's kept checkpoint, as xc-eval and xc-predict read it
    c = model.components
    if c is None or c.lexical is None:
        print(f"{args.run_dir}: no lexical weights (model.lexical_features=0, or a dual-mode run)", file=sys.stderr)
        return 1
    model.use_prior(False)  # the model alone
    cfg, ctx, dataset = model.cfg, model.ctx, model.dataset
    c.lexical.by_feature()  # once per set of weights: not part of any depth's time
    rows = np.arange(min(args.max_points, dataset.test.num_points), dtype=np.int64)
    k = cfg.eval.topk
    results, reference = [], None
    # what the first ranking builds once (the rows' norms and blocks) is no depth's or path's time
    inference.predict(c.encoder, c.shard, c.test_inputs, rows[:8], k, cfg.eval.batch_size, ctx)
    chosen = lexical_rank.READS_PER_ENTRY
    paths = [("chosen", chosen)] + ([("prefixes", float("inf")), ("sums", 0.0)] if args.paths else [])
    for extra in args.extra:
        inference.LEXICAL_EXACT_EXTRA = extra
        for path, reads in paths:
            lexical_rank.READS_PER_ENTRY = reads
            start = time.perf_counter()
            _, ids = inference.predict(c.encoder, c.shard, c.test_inputs, rows, k, cfg.eval.batch_size, ctx)
            seconds = time.perf_counter() - start
            same = reference is None or bool(np.array_equal(ids, reference))
            reference = ids if reference is None else reference
            results.append({"extra": extra, "path": path, "seconds": round(seconds, 2), "points": len(rows),
                            "same_top_k": same})
            print(json.dumps(results[-1]), flush=True)
    lexical_rank.READS_PER_ENTRY = chosen
    if args.out:
        Path(args.out).write_text(json.dumps({"run_dir": args.run_dir, "k": k, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
