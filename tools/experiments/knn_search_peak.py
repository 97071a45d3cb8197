"""The resident memory the final phase's input-space kNN search adds: the test split's tf-idf neighbours among every
training point (`--memory all`, as the fused test ranking searches them: at a million points and more the split
search of xc/fitting/split_search.py) or among those less the validation carve-out (`--memory train`, as the
fusion's validation grid does), with the sparse search's product blocks at `--max-pairs` (xc/fitting/knn.py) and the
split search's dense score blocks at `--score-block-floats`. RSS is sampled every 10 ms from /proc/self/status after
the data is loaded; one setting per process, so that no measurement reuses another's freed pages.

    XC_THREADS=2 python tools/experiments/knn_search_peak.py [--memory all] [--max-pairs N] [--score-block-floats N] \
        [--k 50] [OVERRIDES ...]

OVERRIDES are the data's, as for xc-train; without them, the 10^7-label benchmark of docs/scale_1e7.md.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np

BENCHMARK_1E7 = ("data=synthetic data.name=scale-10000000 data.synthetic.num_labels=10000000 "
                 "data.synthetic.num_train=1000000 data.synthetic.num_features=200000 data.synthetic.num_test=5000 "
                 "seed=0").split()


def resident_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


class PeakSampler:
    """The highest resident memory seen while it runs, sampled every `interval` seconds on a thread."""

    def __init__(self, interval: float = 0.01):
        self.interval, self.peak, self._stop = interval, resident_gib(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, resident_gib())
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-pairs", type=int, default=None, help="the search's product block bound (default: knn.py's)")
    ap.add_argument("--memory", choices=("all", "train"), default="all",
                    help="every training point (the fused test ranking's memory) or those less the validation carve-out")
    ap.add_argument("--score-block-floats", type=int, default=None,
                    help="the split search's dense scores a block (default: split_search.py's)")
    ap.add_argument("--k", type=int, default=50, help="neighbours a query (the fusion's largest k)")
    ap.add_argument("overrides", nargs="*", help="data overrides as for xc-train (default: the 10^7 benchmark)")
    args = ap.parse_args()

    import torch

    from xc.cli.baseline import _compose
    from xc.data.inputs import validation_split
    from xc.datasets import load_configured_dataset
    from xc.distributed.host_threads import host_threads
    from xc.fitting import split_search
    from xc.fitting.knn import MAX_PRODUCT_PAIRS, input_vectors, input_weights, sparse_neighbours

    cfg = _compose(args.overrides or BENCHMARK_1E7)
    torch.set_num_threads(host_threads(cfg, mining=False)[0])
    dataset = load_configured_dataset(cfg)
    train_ids, _ = validation_split(cfg.data, dataset.train.num_points, cfg.seed)
    weights = input_weights(dataset.train.features, bool(dataset.meta.get("text_features")))
    max_pairs = args.max_pairs or MAX_PRODUCT_PAIRS
    if args.score_block_floats:
        split_search.SCORE_BLOCK_FLOATS = args.score_block_floats
    memory_rows = np.arange(dataset.train.num_points) if args.memory == "all" else train_ids
    before = resident_gib()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        queries = input_vectors(dataset.test.features, weights, np.arange(dataset.test.num_points))
        memory = input_vectors(dataset.train.features, weights, memory_rows)
        vectors_peak = sampler.peak
        found = sparse_neighbours(queries, memory, args.k, max_pairs=max_pairs)
    print(json.dumps({"data": cfg.data.name, "queries": int(queries.shape[0]), "memory_points": int(memory.shape[0]),
                      "k": args.k, "max_pairs": max_pairs, "score_block_floats": split_search.SCORE_BLOCK_FLOATS, "threads": torch.get_num_threads(),
                      "resident_before_gib": round(before, 3), "peak_added_gib": round(sampler.peak - before, 3),
                      "vectors_added_gib": round(vectors_peak - before, 3),
                      "seconds": round(time.perf_counter() - start, 1),
                      "ids_checksum": int(found.ids.sum())}))


if __name__ == "__main__":
    main()
