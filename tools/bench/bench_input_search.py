"""The kNN's input-space search (the fusion's and `xc-baseline knn`'s) on a preset's tf-idf: the sparse product alone
against the split search (xc/fitting/split_search.py: the most frequent features by a dense product), both in this one
process on the same queries, so compare them as ratios.

    python tools/bench/bench_input_search.py --data synthetic --queries 500 --override data.name=scale-1000000-xor \\
        data.cache_dir=.cache/xc-scale data.synthetic.num_labels=1000000 data.synthetic.num_train=2000000 \\
        data.synthetic.num_features=200000 data.synthetic.num_test=5000 data.synthetic.xor_pairs=1 \\
        --out tools/results/bench_input_search.json

The memory is the training points after the validation carve-out (as the fusion's test search uses every training
point, within 10%), the queries the first `--queries` test points, k 50. Reports seconds of each, the split's
features and the share of neighbours both find (float rounding breaks a few ties differently).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # xc and tools.* of this checkout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="synthetic", help="a preset (bibtex, delicious, debian_deps, synthetic) or "
                        "KIND:PATH, as tools/experiments/bench_peers.py reads it")
    parser.add_argument("--override", nargs="*", default=[], help="hydra overrides (data.synthetic.num_labels=...)")
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--out", default=None, help="JSON here")
    args = parser.parse_args()

    import torch
    from tools.experiments.bench_peers import prepare
    import xc.fitting.split_search as split
    from xc.fitting.knn import sparse_neighbours

    data = prepare(args.data, overrides=tuple(args.override))
    memory, queries = data["x_train"], data["x_test"][:args.queries]
    memory_t = memory.T.tocsr()
    products = split.exact_products(queries, memory_t)
    rule = split.frequent_features(queries, memory_t) is not None  # whether the search would split on its own
    split.SPLIT_MIN_POINTS, split.SPLIT_MIN_LINKS = 0, 0.0  # force the split on the same queries
    frequent = split.frequent_features(queries, memory_t)
    result = {"data": args.data, "override": args.override, "memory_points": memory.shape[0],
              "features": memory.shape[1], "queries": queries.shape[0], "k": args.k, "threads": torch.get_num_threads(),
              "exact_products": products, "dense_features": 0 if frequent is None else len(frequent),
              "split_by_rule": rule}
    print(f"{memory.shape[0]} memory points, {queries.shape[0]} queries, {products:.3g} products; "
          f"{result['dense_features']} features multiplied densely", flush=True)

    timings, found = {}, {}
    for name, links in (("sparse", float("inf")), ("split", 0.0)):
        split.SPLIT_MIN_LINKS = links  # each path on the same queries
        start = time.perf_counter()
        found[name] = sparse_neighbours(queries, memory, args.k)
        timings[name] = time.perf_counter() - start
        print(f"{name}: {timings[name]:.1f} s", flush=True)
    same = np.mean([len(set(a[a >= 0]) & set(b[b >= 0])) / max(1, (a >= 0).sum())
                    for a, b in zip(found["sparse"].ids, found["split"].ids)])
    result.update(sparse_seconds=round(timings["sparse"], 2), split_seconds=round(timings["split"], 2),
                  speedup=round(timings["sparse"] / timings["split"], 2), same_neighbours=round(float(same), 4))
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
