"""Two trained runs on the same test points, paired: P@1/3/5 of each and the difference with its standard error
and a bootstrap 95% interval (2,000 resamples of the test points).

    python tools/experiments/paired_compare.py RUN_A RUN_B [--out tools/results/paired.json]
    python tools/experiments/paired_compare.py RUN_A RUN_B --served      # as served: kNN fusion, ranker, prior (xc-eval's top-k)
    python tools/experiments/paired_compare.py RUN_A RUN_B --plain       # the model alone, without its label prior
    python tools/experiments/paired_compare.py RUN_A RUN_B --all         # all three in one report
    python tools/experiments/paired_compare.py RUN --model-share         # one run as served against its model alone
    python tools/experiments/paired_compare.py RUN DIR/DATA-PEER.npz --all   # against a library's rankings, kept by
                                                                  # tools/experiments/bench_peers.py --save-rankings DIR
An ensemble run (train.ensemble) compares as served only. A library's rankings are the same in every mode; they pair
only with a run on the same test points (the test labels kept with them must equal the run's).

Each run is loaded as `xc.load` serves it (its final checkpoint, with the label prior training chose, no kNN
fusion) and ranks every test point by exact search. Use it where two figures differ by less than a point: at
5,000 test points one P@1 point is about two standard errors of a paired difference, not of each figure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from xc.fsutil import write_json_atomic


def model_top_ids(run_dir: str, prior: bool = True, k: int = 5) -> tuple[np.ndarray, float]:
    """(ids (N, k) the model's top k of every test point by exact search, the label prior's beta: 0.0 with
    prior=False, the plain model)."""
    from xc.eval.inference import predict
    from xc.serve.model import TrainedModel

    model = TrainedModel(run_dir)
    if not prior:
        model.use_prior(False)
    c = model.components
    n = model.dataset.test.num_points
    # exact search, with the labels' lexical weights where the model has them (model.lexical_features)
    ids = predict(model.encoder, model.shard, c.test_inputs, np.arange(n, dtype=np.int64), k, 1024, model.ctx)[1]
    return ids, model.prior_beta


def served_top_ids(run_dir: str, k: int = 5) -> np.ndarray:
    """(N, k) the fused top k that `xc-eval` reports (the kNN fusion, ranker and label prior training chose)."""
    import tempfile

    from xc.cli.evaluate import evaluate_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "served.npz"
        evaluate_checkpoint(run_dir, topk=k, predictions=str(path))
        return np.load(path)["ids"][:, :k]


def test_labels(run_dir: str) -> tuple[np.ndarray, np.ndarray]:
    """(indptr, indices) of the run's test labels (an ensemble's: member 0's data, which they share)."""
    from xc.run.readers import reading
    from xc.serve.model import open_run_data, restore_config

    if (Path(run_dir) / "ensemble.json").exists():
        from xc.serve.ensemble import member_dir

        run_dir = str(member_dir(run_dir, 0))
    # the final checkpoint's config and the run's data alone: restoring the whole model (rows, index, prior) takes
    # minutes at 10^7 labels and is not needed for the labels
    with reading(run_dir) as held:
        cfg = restore_config(held.meta, "cpu")
    labels = open_run_data(cfg).test.labels
    return np.asarray(labels.indptr), np.asarray(labels.indices)


def _hits(ids: np.ndarray, indptr: np.ndarray, indices: np.ndarray, beta: float | None) -> dict:
    """{"beta": beta, "P@k": (N,) per-point precision at k} of top-k `ids` (N, k) against CSR test labels."""
    from xc.fitting.label_prior import per_point_precision

    return {"beta": beta, **{f"P@{k}": per_point_precision(ids, indptr, indices, (k,)) for k in (1, 3, 5)}}


def per_point_hits(run_dir: str, prior: bool = True) -> dict:
    """{"beta": the run's label prior (0.0 with prior=False: the plain model), "P@k": (N,) per-point precision at k}
    over the whole test split."""
    ids, beta = model_top_ids(run_dir, prior)
    indptr, indices = test_labels(run_dir)
    return _hits(ids, indptr, indices, beta)


def served_hits(run_dir: str) -> dict:
    """{"beta": None, "P@k": (N,)} for the run as served: the fused top-k that `xc-eval` reports (the kNN fusion,
    ranker and label prior training chose), per test point."""
    ids = served_top_ids(run_dir)
    indptr, indices = test_labels(run_dir)
    return _hits(ids, indptr, indices, None)


def peer_hits(path: str, run_dir: str) -> dict:
    """{"beta": None, "P@k": (N,)} of a library's test top-k kept by bench_peers.py --save-rankings, judged against
    the test labels kept with them; ValueError (one line) where those are not `run_dir`'s test labels."""
    try:
        with np.load(path) as kept:
            ids, indptr, indices = kept["ids"], kept["truth_indptr"], kept["truth_indices"]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{path}: not a library's rankings from bench_peers.py --save-rankings ({exc})") from None
    if ids.ndim != 2 or ids.shape[0] != len(indptr) - 1 or ids.shape[1] < 5:
        raise ValueError(f"{path}: ids must be (test points, k >= 5) = ({len(indptr) - 1}, k), got {ids.shape}")
    run_indptr, run_indices = test_labels(run_dir)
    if not (np.array_equal(indptr, run_indptr) and np.array_equal(indices, run_indices)):
        raise ValueError(f"{path}: its test points are not {run_dir}'s ({len(indptr) - 1} against "
                         f"{len(run_indptr) - 1} test points, or other labels): another dataset or test split")
    return _hits(ids, indptr, indices, None)


def paired_report(a: dict, b: dict) -> dict:
    """Per-point hits of two runs (dicts as `per_point_hits` returns) -> each run's P@k, the mean difference a - b,
    its standard error (of the paired per-point difference) and a bootstrap 95% interval, in points."""
    rng = np.random.default_rng(0)
    report = {"beta_a": a["beta"], "beta_b": b["beta"]}
    for key in ("P@1", "P@3", "P@5"):
        diff = a[key] - b[key]
        boot = [diff[rng.integers(0, len(diff), len(diff))].mean() for _ in range(2000)]
        report[key] = {"a": round(100 * a[key].mean(), 2), "b": round(100 * b[key].mean(), 2),
                       "a_minus_b": round(100 * diff.mean(), 3),
                       "se": round(100 * diff.std(ddof=1) / np.sqrt(len(diff)), 3),
                       "ci95": [round(100 * float(np.percentile(boot, q)), 3) for q in (2.5, 97.5)]}
    return report


def _two_runs(ap: argparse.ArgumentParser, args) -> dict:
    """The report of RUN_A against RUN_B in the modes the flags ask for."""
    modes = ["plain", "model with its prior", "served"] if args.all else \
        ["served" if args.served else "plain" if args.plain else "model with its prior"]
    report = {"a": args.run_a, "b": args.run_b}
    ensembles = [run for run in (args.run_a, args.run_b) if (Path(run) / "ensemble.json").exists()]
    if ensembles and modes != ["served"]:
        ap.error(f"{ensembles[0]} is an ensemble: its members' models are averaged only as served; use --served")
    peer = None
    if Path(args.run_b).is_file():  # a library's rankings: the same in every mode
        try:
            peer = peer_hits(args.run_b, args.run_a)
        except ValueError as exc:
            ap.error(str(exc))
    for scored in modes:
        if scored == "served":
            a, b = served_hits(args.run_a), peer or served_hits(args.run_b)
        else:
            a = per_point_hits(args.run_a, prior=scored != "plain")
            b = peer or per_point_hits(args.run_b, prior=scored != "plain")
        if args.all:
            report[scored] = paired_report(a, b)
        else:
            report.update(scored=scored, **paired_report(a, b))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_a")
    ap.add_argument("run_b", nargs="?", help="the other run (not with --model-share)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--served", action="store_true",
                    help="compare the runs as served (kNN fusion, ranker and prior: xc-eval's top-k), not the model alone")
    ap.add_argument("--plain", action="store_true",
                    help="compare the models alone without their label priors (the figures training logs per epoch)")
    ap.add_argument("--all", action="store_true",
                    help="all three in one report: the models alone, each under its prior, and as served")
    ap.add_argument("--model-share", action="store_true",
                    help="RUN as served (a) against its own model alone under its prior (b): what the kNN vote and the "
                         "ranker add to the model")
    args = ap.parse_args()
    if args.served + args.plain + args.all + args.model_share > 1:
        ap.error("--served, --plain, --all and --model-share exclude each other")
    if (args.run_b is None) != args.model_share:
        ap.error("--model-share compares one run with itself: give RUN alone" if args.model_share else
                 "give two runs (or one with --model-share)")
    missing = next((path for path in (args.run_a, args.run_b) if path is not None and not Path(path).exists()), None)
    if missing:
        ap.error(f"{missing}: no such run directory or rankings file")
    if args.model_share and (Path(args.run_a) / "ensemble.json").exists():
        ap.error(f"{args.run_a} is an ensemble: its members' models are averaged only as served")
    if args.model_share:
        report = {"a": f"{args.run_a} as served", "b": f"{args.run_a}'s model alone",
                  **paired_report(served_hits(args.run_a), per_point_hits(args.run_a))}
    else:
        report = _two_runs(ap, args)
    print(json.dumps(report, indent=1))
    if args.out:
        write_json_atomic(args.out, report)  # whole or not at all


if __name__ == "__main__":
    main()
