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

`--paths` also takes `split-unbounded`: the split with the blocks it used before they were bounded (dense scores of
2^29 floats a block, no bound on the sparse product's pairs). Each path runs in a forked child, so the peak resident
memory it adds over the loaded data (`peak_added_gb`) is its own:

    python tools/bench/bench_input_search.py --queries 5000 --paths split split-unbounded --override \
        data.name=scale-10000000 data.synthetic.num_labels=10000000 data.synthetic.num_train=1000000 \
        data.synthetic.num_features=200000 data.synthetic.num_test=5000 --out tools/results/bench_input_search_1e7.json
"""

from __future__ import annotations

import argparse
import json
import os
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
    parser.add_argument("--paths", nargs="+", default=["sparse", "split"],
                        choices=["sparse", "split", "split-unbounded"], help="the searches to run, each in a child")
    parser.add_argument("--out", default=None, help="JSON here")
    args = parser.parse_args()

    import torch
    from tools.experiments.bench_peers import prepare
    import xc.fitting.split_search as split

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

    paths = {"sparse": (float("inf"), {}), "split": (0.0, {}),
             "split-unbounded": (0.0, {"SCORE_BLOCK_FLOATS": 1 << 29, "SPLIT_BLOCK_PAIRS": 1 << 62})}
    timings, found, peaks = {}, {}, {}
    for name in args.paths:
        links, constants = paths[name]
        timings[name], peaks[name], found[name] = _in_child(queries, memory, args.k, links, constants)
        print(f"{name}: {timings[name]:.1f} s, {peaks[name] / 1e9:.2f} GB added at the peak", flush=True)
    first = args.paths[0]
    for name in args.paths:
        same = np.mean([len(set(a[a >= 0]) & set(b[b >= 0])) / max(1, (a >= 0).sum())
                        for a, b in zip(found[first], found[name])])
        result[name] = {"seconds": round(timings[name], 2), "peak_added_gb": round(peaks[name] / 1e9, 2),
                        f"same_neighbours_as_{first}": round(float(same), 4)}
    if "sparse" in timings and "split" in timings:
        result["speedup"] = round(timings["sparse"] / timings["split"], 2)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def _peak_rss() -> int:
    """This process's peak resident bytes so far (Linux: ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _in_child(queries, memory, k: int, links: float, constants: dict) -> tuple[float, int, np.ndarray]:
    """(seconds, peak bytes added over the child's start, neighbour ids) of one search in a forked child, with
    split_search's SPLIT_MIN_LINKS = `links` and `constants` set there."""
    import multiprocessing as mp

    def run(conn) -> None:
        import xc.fitting.split_search as split
        from xc.fitting.knn import sparse_neighbours

        split.SPLIT_MIN_LINKS = links
        for name, value in constants.items():
            setattr(split, name, value)
        base = _current_rss()
        start = time.perf_counter()
        ids = sparse_neighbours(queries, memory, k).ids
        conn.send((time.perf_counter() - start, _peak_rss() - base, ids))

    here, there = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(target=run, args=(there,))
    child.start()
    out = here.recv()
    child.join()
    return out


if __name__ == "__main__":
    main()
