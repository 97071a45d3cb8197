"""`xc-baseline knn`: the tf-idf nearest-neighbour vote, the floor every xc model must clear;
`xc-baseline popularity`: every test point gets the training split's most frequent labels (the floor of floors).

    xc-baseline knn data=debian_deps                   # any data the trainer reads, by the same overrides
    xc-baseline knn data.kind=xc_sparse data.path=/data/Eurlex --k 10 --out knn.json
    xc-baseline popularity data=debian_deps

Each test point's k most similar training points (cosine on tf-idf vectors: `xc/fitting/knn.py` gives the rule
per data kind) vote for their labels, weighted by similarity. Without --k, k is chosen from 5, 10, 20, 50
on the validation split the trainer would carve (`data.valid_fraction`), with the other training points
as memory; the test run then searches all training points. The metrics (P@k, nDCG@k, PSP@k, ...) and
JSON are those of `xc-eval`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from xc.errors import ConfigError, XCError
from xc.eval.metrics import evaluate, inverse_propensities, precision_at_k

log = logging.getLogger("xc.cli.baseline")

CHOICES_K = (5, 10, 20, 50)


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from xc.config import build_config  # lazy: loads torch (xc.ann); xc-baseline's --help imports without it
    from xc.cli.train import CONF_DIR  # lazy: loads hydra and torch, as above

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        raw = compose(config_name="config", overrides=overrides)
    return build_config(OmegaConf.to_container(raw, resolve=True))


def knn_baseline(cfg, k: int | None = None) -> dict:
    """Metrics of the tf-idf kNN vote on the test split, plus the chosen k and timings."""
    from xc.data.inputs import validation_split  # lazy: loads torch; xc-baseline's --help imports without it
    from xc.fitting.knn import LabelVotes, input_vectors, input_weights, labels_csr, sparse_neighbours  # lazy: torch
    from xc.datasets import load_configured_dataset  # lazy: loads torch, as above

    start = time.perf_counter()
    dataset = load_configured_dataset(cfg)
    train = dataset.train
    if train.features is None:
        raise ConfigError("data.kind", f"data '{cfg.data.name}' has no features to search (raw text is featurised "
                          "at convert time: re-convert it with this version of xc)")
    weights = input_weights(train.features, bool(dataset.meta.get("text_features")))
    ks = tuple(cfg.eval.ks)
    topk = max(ks)
    train_ids, valid_ids = validation_split(cfg.data, train.num_points, cfg.seed)
    tried = {}
    if k is None and len(valid_ids):
        nbrs = sparse_neighbours(input_vectors(train.features, weights, valid_ids),
                                 input_vectors(train.features, weights, train_ids), max(CHOICES_K),
                                 desc="kNN: validation points")
        memory = labels_csr(train.labels, train_ids)
        truth = labels_csr(train.labels, valid_ids)
        for kk in CHOICES_K:
            ids = LabelVotes(nbrs.first(kk), memory, dataset.num_labels).top(topk)[1]
            tried[kk] = float(np.mean(list(precision_at_k(ids, truth.indptr, truth.indices, ks).values())))
        k = max(tried, key=lambda kk: (tried[kk], -kk))
    k = k or 10
    chosen = time.perf_counter()
    test = dataset.test
    n = test.num_points if not cfg.eval.max_points else min(cfg.eval.max_points, test.num_points)
    rows = np.arange(n, dtype=np.int64)
    nbrs = sparse_neighbours(input_vectors(test.features, weights, rows), input_vectors(train.features, weights), k,
                             desc="kNN: test points")
    ids = LabelVotes(nbrs, labels_csr(train.labels), dataset.num_labels).top(max(topk, cfg.eval.topk))[1]
    truth = labels_csr(test.labels, rows)
    inv = inverse_propensities(train, cfg.eval.propensity_a, cfg.eval.propensity_b)
    metrics = evaluate(ids, truth.indptr.astype(np.int64), truth.indices.astype(np.int64), inv, ks=ks)
    metrics.update(k=k, valid_points=int(len(valid_ids)), choose_seconds=round(chosen - start, 2),
                   test_seconds=round(time.perf_counter() - chosen, 2))
    if tried:
        metrics["valid_mean_P"] = {str(kk): round(v * 100, 2) for kk, v in tried.items()}
    return metrics


def popular_labels(counts: np.ndarray, k: int) -> np.ndarray:
    """(min(k, L),) int64 label ids of the (L,) training counts, most frequent first, ties to the lower id."""
    return np.argsort(-np.asarray(counts, dtype=np.int64), kind="stable")[:k].astype(np.int64)


def popularity_baseline(cfg) -> dict:
    """Metrics on the test split of ranking every point's labels by their count among all training points."""
    from xc.fitting.knn import labels_csr  # lazy: loads torch; xc-baseline's --help imports without it
    from xc.datasets import load_configured_dataset  # lazy: loads torch, as above

    start = time.perf_counter()
    dataset = load_configured_dataset(cfg)
    train, test = dataset.train, dataset.test
    ks = tuple(cfg.eval.ks)
    top = popular_labels(train.labels.column_counts()[:dataset.num_labels], max(max(ks), cfg.eval.topk))
    n = test.num_points if not cfg.eval.max_points else min(cfg.eval.max_points, test.num_points)
    rows = np.arange(n, dtype=np.int64)
    truth = labels_csr(test.labels, rows)
    inv = inverse_propensities(train, cfg.eval.propensity_a, cfg.eval.propensity_b)
    metrics = evaluate(np.broadcast_to(top, (n, len(top))).copy(), truth.indptr.astype(np.int64),
                       truth.indices.astype(np.int64), inv, ks=ks)
    metrics.update(test_seconds=round(time.perf_counter() - start, 2))
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xc-baseline", description=__doc__.split("\n\n")[0])
    parser.add_argument("method", choices=["knn", "popularity"], help="the baseline to run")
    parser.add_argument("--k", type=int, help="knn: neighbours (default: chosen on the validation split)")
    parser.add_argument("--out", help="write the metrics to this JSON file")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for xc-train (data=..., data.path=...)")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        if args.k is not None and args.k < 1:
            raise ConfigError("--k", f"must be >= 1, got {args.k}")
        if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
            raise ConfigError("--out", f"directory of {args.out} does not exist")
        if args.method == "popularity" and args.k is not None:
            raise ConfigError("--k", "is the kNN's neighbour count; the popularity baseline takes none")
        cfg = _compose(args.overrides)
        metrics = knn_baseline(cfg, args.k) if args.method == "knn" else popularity_baseline(cfg)
    except XCError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # hydra's own override errors (unknown group, bad syntax)
        if type(exc).__module__.startswith(("hydra", "omegaconf")):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise
    if args.out:
        Path(args.out).write_text(json.dumps(metrics, indent=1))
    shown = "  ".join(f"{k}={v:.2f}" for k, v in metrics.items() if isinstance(v, float))
    print(shown + (f"  k={metrics['k']}" if "k" in metrics else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
