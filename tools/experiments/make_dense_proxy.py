"""A dense-feature set made from a shipped sparse one, to check the defaults on dense features:
the tf-idf rows (as `xc-baseline knn` weighs them), L2-normalised, under one fixed Gaussian projection.

    python tools/experiments/make_dense_proxy.py --data ../shared/data/bibtex --out /tmp/bibtex-dense128 --dim 128
    xc-train data.kind=npz data.path=/tmp/bibtex-dense128 data.name=bibtex_dense

Writes train_X.npz / train_Y.npz / test_X.npz / test_Y.npz (scipy sparse; X holds every value, so the set
reads as dense), the layout a user's own dense features take (`data.kind=npz`). Nothing is written into
the source directory.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _read_xc(path: Path) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """(X, Y) of an XC-repository sparse file (header `N F L`, then `labels id:value ...` lines)."""
    with open(path, encoding="utf-8") as handle:
        n, f, num_labels = map(int, handle.readline().split())
        xr, xc, xv, yr, yc = [], [], [], [], []
        for i, line in enumerate(handle):
            parts = line.split()
            if parts and ":" not in parts[0]:
                for lab in parts[0].split(","):
                    yr.append(i)
                    yc.append(int(lab))
                parts = parts[1:]
            for item in parts:
                a, b = item.split(":")
                xr.append(i)
                xc.append(int(a))
                xv.append(float(b))
    x = sp.csr_matrix((xv, (xr, xc)), shape=(n, f), dtype=np.float32)
    y = sp.csr_matrix((np.ones(len(yr), np.float32), (yr, yc)), shape=(n, num_labels))
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="an XC-repository directory (train.txt, test.txt)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    x_train, y_train = _read_xc(Path(args.data) / "train.txt")
    x_test, y_test = _read_xc(Path(args.data) / "test.txt")
    df = np.asarray((x_train > 0).sum(0)).ravel()
    idf = np.log((1 + x_train.shape[0]) / (1 + df)) + 1.0
    proj = np.random.default_rng(args.seed).standard_normal((x_train.shape[1], args.dim)).astype(np.float32)
    os.makedirs(args.out, exist_ok=True)
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        tfidf = x.multiply(idf[None, :]).tocsr()
        norms = np.sqrt(np.asarray(tfidf.multiply(tfidf).sum(1))).ravel()
        tfidf = sp.diags(1.0 / np.maximum(norms, 1e-12)) @ tfidf
        dense = np.asarray(tfidf @ proj, np.float32) / np.sqrt(args.dim)
        dense[dense == 0] = 1e-12  # every value stored: the rows read as dense
        sp.save_npz(os.path.join(args.out, f"{split}_X.npz"), sp.csr_matrix(dense))
        sp.save_npz(os.path.join(args.out, f"{split}_Y.npz"), y.tocsr())
    print(f"wrote {args.out}: {x_train.shape[0]} train / {x_test.shape[0]} test points, {args.dim} dense features, "
          f"{y_train.shape[1]} labels")


if __name__ == "__main__":
    main()
