"""What a learner can reach on a synthetic set, and where a run's top-1 misses lie.

    python tools/experiments/synthetic_ceiling.py RUN_DIR [RUN_DIR ...] [--served] [--rare] [--out FILE.json]
    python tools/experiments/synthetic_ceiling.py --params num_labels=10000000 num_train=1000000 num_features=200000

The generator (xc/data/synthetic.py) knows every test point's generating labels, the observed ones and those the
label noise dropped. Its oracle ranks them first, most popular first. A label no training point carries has no
evidence behind it, so the **ceiling at m** ranks only the generating labels observed at least m times in training
(m = 1: what a learner that identified every trained label exactly would reach).

With runs, every test point's top-1 (the model under its label prior; `--served` adds the served ranking) is one of:
a hit; a generating label the noise dropped (no ranking avoids it); or a label that did not generate the point (a
confusion), split by how many training points the point's best-trained generating label has (0: nothing to learn
from; many: the model chose another label over one it had seen often). The share of points whose top-1 is a
generating label, times the kept rate, is the P@1 the ranking's choices reach on average over the noise.
`found_from[m]` is the P@1 the same ranking would reach had it put, on every point it confused whose best-trained
generating label has m+ training points, that label first (a hit where the noise kept it): the most that finding the
labels seen m times or more could add to it, its other choices kept.

With two rankings or more (runs' models, served rankings, libraries' rankings), `paired_generating` gives each
ranking's share of points whose top-1 is a generating label minus the first ranking's, with its paired standard
error: the P@1 difference on average over the label noise (times its kept rate, 0.9), without the noise's draw on
which top-1 labels were dropped, so it can separate two rankings a P@1 difference cannot.

`--rankings DIR/DATA-PEER.npz`: a library's kept rankings (tools/experiments/bench_peers.py --save-rankings) broken
down the same way; their test labels must be the generator's observed ones.

`--rare`: for the points whose best-trained generating label has 1 or 2 training points, where the model (under its
prior) ranks that label (top 1 / 5 / 50), and where that label's training point ranks among all training points by
the inputs' cosine (tf-idf, as the encoder and the lexical weights read them) and by the count of features shared
with the query: how often its one piece of evidence is the nearest at all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from xc.data.synthetic import generating_labels, normalize_params  # noqa: E402
from xc.errors import ConfigError  # noqa: E402
from xc.fsutil import write_json_atomic  # noqa: E402

MIN_COUNTS = (0, 1, 2, 3, 5, 10)
BINS = ((0, 0), (1, 1), (2, 2), (3, 5), (6, 20), (21, None))


def train_counts(params: dict) -> np.ndarray:
    """(num_labels,) int64: each label's observed training points (over every training point)."""
    g = generating_labels(params, "train")
    return np.bincount(g["labels"][g["kept"]], minlength=normalize_params(params)["num_labels"])


def ceilings(test: dict, counts: np.ndarray) -> dict:
    """{m: [P@1, P@3, P@5]} in percent: the oracle ranking only the generating labels observed m+ times in training."""
    n = len(test["indptr"]) - 1
    point = np.repeat(np.arange(n), np.diff(test["indptr"]))
    out = {}
    for m in MIN_COUNTS:
        seen = counts[test["labels"]] >= m
        # place of each seen label among its point's seen labels (the arrays are sorted by point, then popularity)
        before = np.cumsum(seen) - seen
        first = np.concatenate([[0], np.cumsum(np.bincount(point[seen], minlength=n))])[:-1]
        place = before - first[point]
        out[m] = [round(100 * float(np.sum(test["kept"] & seen & (place < k)) / k / n), 2) for k in (1, 3, 5)]
    return out


def top1_breakdown(top1: np.ndarray, test: dict, counts: np.ndarray) -> dict:
    """top1 (N,) label ids -> the shares (percent of points) of hits, dropped generating labels and confusions by
    the training count of the point's best-trained generating label; the P@1 and the top-1-is-generating share."""
    indptr, labels, kept = test["indptr"], test["labels"], test["kept"]
    n = len(indptr) - 1
    hit = np.zeros(n, bool)
    generating = np.zeros(n, bool)
    best = np.zeros(n, np.int64)
    for i in range(n):
        row = slice(indptr[i], indptr[i + 1])
        match = labels[row] == top1[i]
        generating[i] = match.any()
        hit[i] = bool((match & kept[row]).any())
        best[i] = counts[labels[row]].max(initial=0)
    confused = ~generating
    out = {"P@1": round(100 * hit.mean(), 2), "top1_generating": round(100 * generating.mean(), 2),
           "generating_per_point": generating,  # (N,) bool, for paired_generating; left out of the report
           "dropped_by_noise": round(100 * (generating & ~hit).mean(), 2), "confused_by_best_count": {},
           "found_from": found_from(confused, hit, test, counts)}
    for lo, hi in BINS:
        in_bin = (best >= lo) & (best <= (hi if hi is not None else np.iinfo(np.int64).max))
        key = f"{lo}" if lo == hi else f"{lo}+" if hi is None else f"{lo}-{hi}"
        out["confused_by_best_count"][key] = {"points": round(100 * in_bin.mean(), 2),
                                              "confused": round(100 * (confused & in_bin).mean(), 2)}
    top_count = counts[np.maximum(top1, 0)]
    out["confused_top1_count_median"] = float(np.median(top_count[confused])) if confused.any() else None
    return out


def found_from(confused: np.ndarray, hit: np.ndarray, test: dict, counts: np.ndarray) -> dict:
    """{m: P@1 in percent} for m in 1, 2, 3: `hit` (N,) with every `confused` (N,) point whose best-trained
    generating label has m+ training points given that label first (a hit where the noise kept it)."""
    indptr, labels, kept = test["indptr"], test["labels"], test["kept"]
    best_count, best_kept = np.zeros(len(hit), np.int64), np.zeros(len(hit), bool)
    for i in np.nonzero(confused)[0]:
        row = slice(indptr[i], indptr[i + 1])
        if indptr[i + 1] > indptr[i]:
            j = int(np.argmax(counts[labels[row]]))  # first of the most trained: the more popular on ties
            best_count[i], best_kept[i] = counts[labels[row]][j], kept[row][j]
    return {m: round(100 * float(np.mean(hit | (confused & (best_count >= m) & best_kept))), 2) for m in (1, 2, 3)}


def paired_generating(report_runs: dict) -> dict:
    """{"B - A": {"diff", "se"}} in percentage points: each ranking's share of top-1 generating labels minus the
    first ranking's (A), paired over the test points; pops every breakdown's per-point array."""
    per_point = {f"{run} {kind}": row.pop("generating_per_point")
                 for run, rows in report_runs.items() for kind, row in rows.items() if "generating_per_point" in row}
    names = list(per_point)
    out = {}
    for name in names[1:]:
        d = per_point[name].astype(np.float64) - per_point[names[0]]
        out[f"{name} - {names[0]}"] = {"diff": round(100 * d.mean(), 2),
                                       "se": round(100 * d.std(ddof=1) / np.sqrt(len(d)), 2)}
    return out


def rankings_top1(path: Path, test: dict) -> np.ndarray:
    """(N,) the top-1 label ids of a library's kept rankings (bench_peers.py --save-rankings), after checking that
    their test labels are the generator's observed test labels; SystemExit in one line otherwise."""
    try:
        with np.load(path) as kept:
            ids, indptr, indices = kept["ids"], kept["truth_indptr"], kept["truth_indices"]
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"{path}: not a rankings file kept by bench_peers.py --save-rankings ({err})") from None
    observed = [np.sort(test["labels"][a:b][test["kept"][a:b]]) for a, b in zip(test["indptr"][:-1],
                                                                                  test["indptr"][1:])]
    same = len(indptr) == len(observed) + 1 and all(
        np.array_equal(np.sort(indices[a:b]), want) for a, b, want in zip(indptr[:-1], indptr[1:], observed))
    if not same:
        raise SystemExit(f"{path}: its test labels are not this synthetic set's test labels")
    if ids.ndim != 2 or ids.shape[0] != len(observed) or ids.shape[1] < 1:
        raise SystemExit(f"{path}: ids must be (test points, k) = ({len(observed)}, k), got {ids.shape}")
    return np.asarray(ids)[:, 0]


def point_ranks(scores: np.ndarray, points: list[np.ndarray]) -> np.ndarray:
    """(m,) for each row of scores (m, N) over the training points, how many points score strictly above the best of
    its own `points` (0: one of them is the nearest); -1 where it has none."""
    return np.array([int((row > row[own].max()).sum()) if len(own) else -1 for row, own in zip(scores, points)])


def rare_summary(model_ids: np.ndarray, labels: np.ndarray, scores: dict[str, np.ndarray],
                 points: list[np.ndarray]) -> dict:
    """The shares (percent) of queries whose label `labels` (m,) the model ranks first / in its top 5 / anywhere in
    model_ids (m, top), and, for each similarity in `scores` ({name: (m, N) over the training points}), whose label's
    training `points` are the nearest / in the nearest 5 (queries whose label has no training point left out)."""
    top = model_ids.shape[1]
    hit = model_ids == labels[:, None]
    model_rank = np.where(hit.any(1), hit.argmax(1), np.iinfo(np.int64).max)  # missing: beyond every cut

    def share(ranks, below):
        return round(100 * float(np.mean(ranks < below)), 1) if len(ranks) else None

    out = {"points": len(labels), "model_top1": share(model_rank, 1), "model_top5": share(model_rank, 5),
           f"model_top{top}": share(model_rank, top)}
    for name, similarity in scores.items():
        ranks = point_ranks(similarity, points)
        out["with_its_point"] = int((ranks >= 0).sum())
        out[f"point_nearest_by_{name}"] = share(ranks[ranks >= 0], 1)
        out[f"point_top5_by_{name}"] = share(ranks[ranks >= 0], 5)
    return out


def rare_label_ranks(run: str, test: dict, counts: np.ndarray, top: int = 50) -> dict:
    """{"1": ..., "2": ...}: `rare_summary` of the test points whose best-trained generating label has that many
    training points (the model under its prior, exact search), by the cosine of the inputs as the run's encoder
    reads them (model.feature_weighting), of their tf-idf, and by the count of shared features."""
    import scipy.sparse as sp

    from xc.data.inputs import idf_weights, sparse_inputs
    from xc.eval.inference import predict
    from xc.models.lexical import csr_of_inputs
    from xc.serve.model import TrainedModel

    model = TrainedModel(run)
    c, data = model.components, model.dataset
    idf = idf_weights(data.train.features)
    tfidf, test_tfidf = sparse_inputs(data.train.features, idf), sparse_inputs(data.test.features, idf)
    indptr, labels = test["indptr"], test["labels"]
    best_label = np.array([labels[a:b][np.argmax(counts[labels[a:b]])] if b > a else -1
                           for a, b in zip(indptr[:-1], indptr[1:])])
    best_count = np.where(best_label >= 0, counts[np.maximum(best_label, 0)], 0)
    n_train, width = data.train.num_points, data.num_features
    blocks = [np.arange(s, min(s + 8192, n_train)) for s in range(0, n_train, 8192)]
    train = csr_of_inputs((c.train.split_inputs(rows), width) for rows in blocks)
    train_tfidf = csr_of_inputs((tfidf(rows), width) for rows in blocks)
    by_label = sp.csr_matrix((np.ones(len(data.train.labels.indices)), np.asarray(data.train.labels.indices),
                              np.asarray(data.train.labels.indptr)), shape=(n_train, data.num_labels)).tocsc()
    shared = train.copy()
    shared.data[:] = 1.0
    out = {}
    for count in (1, 2):
        rows = np.nonzero(best_count == count)[0].astype(np.int64)
        if not len(rows):
            continue
        ids = predict(model.encoder, model.shard, c.test_inputs, rows, top, 1024, model.ctx)[1]
        queries = csr_of_inputs([(c.test_inputs(rows), width)])
        present = queries.copy()
        present.data[:] = 1.0
        points = [by_label[:, label].nonzero()[0] for label in best_label[rows]]
        tfidf_queries = csr_of_inputs([(test_tfidf(rows), width)])
        out[str(count)] = rare_summary(ids, best_label[rows], {
            "inputs_cosine": (queries @ train.T).toarray(), "tfidf_cosine": (tfidf_queries @ train_tfidf.T).toarray(),
            "shared_features": (present @ shared.T).toarray()}, points)
    return out


def _params_from(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = value
    return normalize_params(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", help="trained runs on one synthetic set (their config.json names it)")
    ap.add_argument("--params", nargs="*", default=None, help="KEY=VALUE generator parameters, without a run")
    ap.add_argument("--served", action="store_true", help="also break down the served ranking's top-1")
    ap.add_argument("--rare", action="store_true", help="where labels seen once or twice rank (rare_label_ranks)")
    ap.add_argument("--rankings", nargs="*", type=Path, default=[],
                    help="a library's kept rankings (bench_peers.py --save-rankings) on the same set")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if bool(args.runs) == (args.params is not None):
        ap.error("give runs, or --params without runs")
    missing = [str(r) for r in args.rankings if not r.is_file()]
    if missing:
        ap.error(f"{missing[0]}: no such rankings file")
    if args.runs:
        missing = [r for r in args.runs if not (Path(r) / "config.json").is_file()]
        if missing:
            ap.error(f"{missing[0]} is not a trained run (no config.json)")
        configs = [json.loads((Path(r) / "config.json").read_text())["data"] for r in args.runs]
        if any(c["kind"] != "synthetic" for c in configs):
            ap.error("every run must be trained on synthetic data (data=synthetic)")
        params = normalize_params(configs[0]["synthetic"])
        if any(normalize_params(c["synthetic"]) != params for c in configs[1:]):
            ap.error("the runs were trained on different synthetic sets")
    else:
        try:
            params = _params_from(args.params)
        except ConfigError as err:
            ap.error(str(err))
    counts, test = train_counts(params), generating_labels(params, "test")
    report = {"params": params, "ceiling_by_min_train_count": ceilings(test, counts), "runs": {}}
    for path in args.rankings:
        report["runs"][str(path)] = {"top-1": top1_breakdown(rankings_top1(path, test), test, counts)}
    from tools.experiments.paired_compare import model_top_ids, served_top_ids  # loads torch: only with runs

    for run in args.runs:
        ids, beta = model_top_ids(run)
        report["runs"][run] = {"model (beta %s)" % beta: top1_breakdown(ids[:, 0], test, counts)}
        if args.served:
            report["runs"][run]["served"] = top1_breakdown(served_top_ids(run)[:, 0], test, counts)
        if args.rare:
            report["runs"][run]["rare_labels"] = rare_label_ranks(run, test, counts)
    report["paired_generating"] = paired_generating(report["runs"])
    print(json.dumps(report, indent=1))
    if args.out:
        write_json_atomic(args.out, report)  # whole or not at all


if __name__ == "__main__":
    main()
