"""Where a run's correct labels come from, by how many training points the label has: the share of test points whose
label at rank r (1 to 5) is correct, split by that label's training count, as served and for the model alone.

    python tools/experiments/hits_by_label_count.py RUN_DIR [--max-points N] [--embedding-vote K] [--out FILE.json]

Ranks the test split twice with `xc-eval`'s own code (the fused ranking training chose, and `--no-fusion`: the model
under the prior training chose) and attributes every hit at rank r to the training count of its label. P@k is the
sum of a column's first k ranks over all bins, divided by k: so a gap in P@3 between the two rankings splits into the
label counts where it arises (docs/negatives_that_pay.md, "Where the model's P@3 gap lies"). `--embedding-vote K`
adds a third ranking: the kNN vote over the K nearest training points by cosine of the model's own embeddings
(what the embedding keeps of a label, without the rows).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import xc  # noqa: E402
from xc.eval.inference import encode_rows  # noqa: E402
from xc.fitting.knn import LabelVotes, dense_neighbours, labels_csr  # noqa: E402

BINS = ((0, 0), (1, 1), (2, 2), (3, 5), (6, 20), (21, 100), (101, None))
RANKS = 5


def hits_by_bin(ids: np.ndarray, indptr: np.ndarray, indices: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(len(BINS), RANKS) percent of the queries whose label at rank r is correct and has a training count in the bin.
    ids (n, >= RANKS) ranked label ids (-1 pads); indptr/indices the test labels (CSR over the same n rows)."""
    out = np.zeros((len(BINS), RANKS))
    n = ids.shape[0]
    for i in range(n):
        truth = set(indices[indptr[i]:indptr[i + 1]].tolist())
        for r in range(RANKS):
            label = int(ids[i, r])
            if label >= 0 and label in truth:
                c = counts[label]
                out[next(b for b, (lo, hi) in enumerate(BINS) if c >= lo and (hi is None or c <= hi)), r] += 1
    return 100.0 * out / max(n, 1)


def ranked(run_dir: str, extra: list[str], max_points: int | None) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pred.npz"
        args = [sys.executable, "-m", "xc.cli.evaluate", run_dir, "--predictions", str(out), "--out",
                str(Path(tmp) / "m.json"), *extra] + ([] if max_points is None else ["--max-points", str(max_points)])
        proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"error: xc-eval {run_dir} failed: {proc.stderr.strip().splitlines()[-1:]}")
        return np.load(out)["ids"]


def embedding_vote(model, k: int, max_points: int | None) -> np.ndarray:
    """(n, RANKS) the test points' best-voted labels among their k nearest training points in the model's embedding
    space (every training point, as the served vote's memory)."""
    c, data = model.components, model.dataset
    n = data.test.num_points if max_points is None else min(max_points, data.test.num_points)
    memory = encode_rows(model.encoder, c.train.split_inputs, np.arange(data.train.num_points), 1024, model.ctx)
    queries = encode_rows(model.encoder, c.test_inputs, np.arange(n), 1024, model.ctx)
    votes = LabelVotes(dense_neighbours(queries, memory, k), labels_csr(data.train.labels), model.num_labels)
    return votes.top(RANKS)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--max-points", type=int, help="the first N test points only")
    parser.add_argument("--embedding-vote", type=int, metavar="K", help="also the kNN vote of K neighbours in the "
                        "model's embedding space")
    parser.add_argument("--out", help="write the table as JSON")
    args = parser.parse_args(argv)
    model = xc.load(args.run_dir)
    data = model.dataset
    counts = np.bincount(np.asarray(data.train.labels.indices), minlength=model.num_labels)
    labels = data.test.labels
    indptr, indices = np.asarray(labels.indptr), np.asarray(labels.indices)
    per_positive = counts[indices]
    top = int(per_positive.max(initial=0))
    report = {"run": args.run_dir, "bins": [[lo, hi] for lo, hi in BINS],
              "test_positives_per_bin": [int(((per_positive >= lo) & (per_positive <= (top if hi is None else hi))).sum())
                                         for lo, hi in BINS]}
    for name, extra in (("served", []), ("model", ["--no-fusion"])):
        table = hits_by_bin(ranked(args.run_dir, extra, args.max_points), indptr, indices, counts)
        report[name] = table.round(2).tolist()
        report[f"{name}_P@k"] = {f"P@{k}": round(float(table[:, :k].sum() / k), 2) for k in (1, 3, 5)}
    names = ["served", "model"]
    if args.embedding_vote:
        table = hits_by_bin(embedding_vote(model, args.embedding_vote, args.max_points), indptr, indices, counts)
        report["embedding_vote"] = table.round(2).tolist()
        report["embedding_vote_P@k"] = {f"P@{k}": round(float(table[:, :k].sum() / k), 2) for k in (1, 3, 5)}
        report["embedding_vote_k"] = args.embedding_vote
        names.append("embedding_vote")
    print(f"{'training points':>16} | " + " | ".join(f"{name + ', ranks 1-5 (% of points)':>34}" for name in names))
    for b, (lo, hi) in enumerate(BINS):
        span = f"{lo}+" if hi is None else (f"{lo}" if lo == hi else f"{lo}-{hi}")
        print(f"{span:>16} | " + " | ".join(f"{' '.join(f'{v:6.2f}' for v in report[name][b]):>34}" for name in names))
    print("  ".join(f"{name} {report[name + '_P@k']}" for name in names))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
