"""Tests of xc.eval.metrics: hand-computed cases plus a dense, slow port of pyxclib's formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from xc.errors import XCError
from xc.eval.metrics import (
    MetricsInputError, evaluate, label_propensities, ndcg_at_k, precision_at_k,
    psndcg_at_k, psprecision_at_k, recall_at_k,
)

LOG2_3 = math.log2(3.0)  # rank-2 discount is 1/log2(3); rank-3 discount is 1/log2(4) = 1/2


def csr(rows):
    """List of label lists -> (indptr, indices)."""
    indptr = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    indices = np.array([l for r in rows for l in r], dtype=np.int64)
    return indptr, indices


# Four points. Point 1 predicts nothing (all -1) while point 0 holds label 7, the largest id:
# a (row, label) key scheme row*8+label maps (1, -1) onto (0, 7), so this case breaks if
# padding is not masked explicitly.
TRUE = [[1, 7], [3], [3], []]
PRED = np.array([
    [1, 2, 7, 5, 6],       # hits 1 0 1 0 0
    [-1, -1, -1, -1, -1],  # no predictions
    [0, 3, -1, -1, -1],    # hits 0 1 0 0 0, padded
    [5, 6, 0, 1, 2],       # point without true labels
])


def test_precision_with_misses_and_padding():
    ip, ix = csr(TRUE)
    p = precision_at_k(PRED, ip, ix, ks=(1, 3, 5))
    # P@1 = (1 + 0 + 0 + 0) / 4
    assert p[1] == pytest.approx(1 / 4)
    # P@3 = (2/3 + 0 + 1/3 + 0) / 4 = 1/4
    assert p[3] == pytest.approx(1 / 4)
    # P@5 = (2/5 + 0 + 1/5 + 0) / 4 = 3/20
    assert p[5] == pytest.approx(3 / 20)


def test_recall():
    ip, ix = csr(TRUE)
    r = recall_at_k(PRED, ip, ix, ks=(1, 3, 5))
    # R@1 = (1/2 + 0 + 0 + 0) / 4; the label-less point divides by max(0, 1) and scores 0
    assert r[1] == pytest.approx(1 / 8)
    # R@3 = R@5 = (2/2 + 0 + 1/1 + 0) / 4
    assert r[3] == pytest.approx(1 / 2)
    assert r[5] == pytest.approx(1 / 2)


def test_ndcg_fewer_true_labels_than_k():
    ip, ix = csr(TRUE)
    n = ndcg_at_k(PRED, ip, ix, ks=(1, 3, 5))
    # point 0 (2 labels): DCG@1 = 1, IDCG@1 = 1; DCG@3 = DCG@5 = 1 + 1/log2(4) = 1.5 and
    #   IDCG@3 = IDCG@5 = 1 + 1/log2(3) (only min(k, 2) = 2 ideal positions)
    # point 2 (1 label):  DCG@1 = 0; DCG@3 = DCG@5 = 1/log2(3), IDCG = 1
    # points 1, 3: 0 (point 3 has no labels but stays in the mean)
    assert n[1] == pytest.approx(1 / 4)
    expect3 = (1.5 / (1 + 1 / LOG2_3) + (1 / LOG2_3) / 1.0) / 4  # = 0.38766...
    assert n[3] == pytest.approx(expect3)
    assert n[5] == pytest.approx(expect3)
    # An IDCG over k positions regardless of n_i would give a different value:
    wrong = (1.5 / (1 + 1 / LOG2_3 + 0.5) + (1 / LOG2_3) / (1 + 1 / LOG2_3 + 0.5)) / 4
    assert abs(n[3] - wrong) > 0.05


# Propensity-scored case: inverse propensities of labels 0..4.
INV = np.array([1.0, 2.0, 4.0, 3.0, 10.0])
PS_TRUE = [[0, 2, 4], [3], []]
PS_PRED = np.array([
    [2, 1, 0],  # hit (w=4), miss, hit (w=1); best order would be 4 (w=10), 2 (w=4), 0 (w=1)
    [3, 4, 0],  # hit (w=3) first; best is the same
    [1, 2, 3],  # no true labels: adds 0 to numerator and denominator
])


def test_psprecision_ratio_of_sums():
    ip, ix = csr(PS_TRUE)
    v = psprecision_at_k(PS_PRED, ip, ix, INV, ks=(1, 3))
    # @1: predicted (4 + 3) / best (10 + 3) = 7/13 (mean of ratios would be (0.4 + 1)/2 = 0.7)
    assert v[1] == pytest.approx(7 / 13)
    # @3: predicted (4 + 0 + 1) + 3 = 8, best (10 + 4 + 1) + 3 = 18 -> 8/18 (1/k cancels)
    assert v[3] == pytest.approx(8 / 18)
    assert abs(v[1] - 0.7) > 0.1 and abs(v[3] - (5 / 15 + 1) / 2) > 0.1


def test_psndcg_normalised_by_best():
    ip, ix = csr(PS_TRUE)
    v = psndcg_at_k(PS_PRED, ip, ix, INV, ks=(1, 3))
    # point 0: IDCG@1 = 1, IDCG@3 = 1 + 1/log2(3) + 1/2
    #   PSDCG@1 = 4,  PSDCG@3 = 4 + 0 + 1/2 = 4.5
    #   best@1 = 10,  best@3 = 10 + 4/log2(3) + 1/2
    # point 1: IDCG = 1 at every k, PSDCG = best = 3
    idcg3 = 1 + 1 / LOG2_3 + 0.5
    assert v[1] == pytest.approx((4 + 3) / (10 + 3))
    expect3 = (4.5 / idcg3 + 3) / ((10 + 4 / LOG2_3 + 0.5) / idcg3 + 3)  # = 0.5610...
    assert v[3] == pytest.approx(expect3)
    # Dropping the per-point IDCG (plain sum PSDCG / sum best) gives 0.468..., not this.
    assert abs(v[3] - (4.5 + 3) / (10 + 4 / LOG2_3 + 0.5 + 3)) > 0.05


def test_evaluate_keys_and_percent():
    ip, ix = csr(PS_TRUE)
    out = evaluate(PS_PRED, ip, ix, INV, ks=(1, 3))
    assert set(out) == {f"{m}@{k}" for m in ("P", "nDCG", "PSP", "PSnDCG", "R") for k in (1, 3)}
    # P@1 = (1 + 1 + 0) / 3 points, in percent
    assert out["P@1"] == pytest.approx(200 / 3)
    assert out["PSP@1"] == pytest.approx(700 / 13)
    no_ps = evaluate(PS_PRED, ip, ix, ks=(1, 3))
    assert not any(k.startswith("PS") for k in no_ps)
    assert no_ps["R@3"] == pytest.approx(100 * (2 / 3 + 1 + 0) / 3)


def test_propensity_formula():
    # N_l = 9, N = 1000, A = 0.55, B = 1.5:
    #   C = (ln 1000 - 1) * 2.5^0.55 = 5.907755 * 1.655264 = 9.778889
    #   (9 + 1.5)^-0.55 = 0.274376;  p = 1 / (1 + 9.778889 * 0.274376) = 0.271511
    p = label_propensities(np.array([9, 0, 100000]), 1000, a=0.55, b=1.5)
    assert p.dtype == np.float64 and p.shape == (3,)
    assert p[0] == pytest.approx(0.2715110828, rel=1e-9)
    c = (math.log(1000) - 1) * 2.5 ** 0.55
    assert p[1] == pytest.approx(1 / (1 + c * 1.5 ** -0.55))
    # frequent labels approach propensity 1, rare ones are lower
    assert p[1] < p[0] < p[2] < 1


def test_rejects_bad_input():
    ip, ix = csr([[1], [2]])
    with pytest.raises(MetricsInputError):  # a label predicted twice would count twice
        precision_at_k(np.array([[1, 1, 3], [2, 0, 4]]), ip, ix, ks=(1, 3))
    with pytest.raises(MetricsInputError):  # K < max(ks)
        precision_at_k(np.array([[1, 2], [2, 0]]), ip, ix, ks=(1, 3))
    with pytest.raises(MetricsInputError):  # duplicate true label
        precision_at_k(np.array([[1], [2]]), *csr([[1, 1], [2]]), ks=(1,))
    with pytest.raises(XCError):  # ids below the padding value
        precision_at_k(np.array([[-2], [2]]), ip, ix, ks=(1,))
    # repeated padding is fine
    assert precision_at_k(np.array([[1, -1, -1], [-1, -1, -1]]), ip, ix, ks=(1, 3))[1] == 0.5


# ---- randomized cross-check against a dense port of pyxclib's xc_metrics.py ----

def reference(pred, rows, num_labels, inv, ks):
    """Slow dense reference written after pyxclib's _eval_flags/_precision/_ndcg/_recall."""
    n, kmax = len(rows), max(ks)
    y = np.zeros((n, num_labels + 1))  # extra all-zero column catches padding (-1 -> last col)
    for i, r in enumerate(rows):
        y[i, r] = 1.0
    top = pred[:, :kmax]
    flags = np.take_along_axis(y, top, axis=1)
    total = y.sum(axis=1).astype(int)
    cums = np.cumsum(1 / np.log2(np.arange(1, max(total.max(), kmax) + 1) + 1))
    nrm = cums[total - 1]  # pyxclib's trick: total=0 indexes the last element, DCG is 0 anyway
    disc = 1 / np.log2(np.arange(kmax) + 2)

    def prec(f):
        return np.mean(np.cumsum(f, axis=1) / (np.arange(kmax) + 1), axis=0)

    def ndcg(f):
        dcg = np.cumsum(f * disc, axis=1)
        return np.array([np.mean(dcg[:, j] / np.minimum(nrm, np.cumsum(disc)[j]))
                         for j in range(kmax)])

    out = {"P": prec(flags), "nDCG": ndcg(flags),
           "R": np.mean(np.cumsum(flags, axis=1) / np.maximum(total, 1)[:, None], axis=0)}
    if inv is not None:
        inv1 = np.append(inv, 0.0)
        wy = y * inv1
        best_idx = np.argsort(-wy, axis=1, kind="stable")[:, :kmax]
        wf, bf = inv1[top] * flags, np.take_along_axis(wy, best_idx, axis=1)
        out["PSP"], out["PSnDCG"] = prec(wf) / prec(bf), ndcg(wf) / ndcg(bf)
    return {f"{m}@{k}": 100 * v[k - 1] for m, v in out.items() for k in ks}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_matches_dense_reference(seed):
    rng = np.random.default_rng(seed)
    n, num_labels, kcols, ks = 200, 40, 12, (1, 3, 5, 10)
    rows = [sorted(rng.choice(num_labels, size=rng.integers(0, 15), replace=False).tolist())
            for _ in range(n)]
    pred = np.full((n, kcols), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        # mix true labels into the candidates so that there are plenty of hits
        cand = np.unique(np.concatenate([rng.choice(num_labels, 8, replace=False), r[:4]]))
        m = int(rng.integers(0, min(len(cand), kcols) + 1))
        pred[i, :m] = rng.permutation(cand)[:m]
    inv = 1 / label_propensities(rng.integers(0, 500, num_labels), 5000)
    ip, ix = csr(rows)
    want = reference(pred, rows, num_labels, inv, ks)
    for chunk in (None, 7, 1):  # chunk boundaries must not change anything
        got = evaluate(pred, ip, ix, inv, ks=ks, chunk_rows=chunk)
        assert set(got) == set(want)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-9), key
    # unsorted CSR indices within a row give the same result
    shuffled = np.concatenate([rng.permutation(ix[ip[i]:ip[i + 1]]) for i in range(n)])
    assert evaluate(pred, ip, shuffled, inv, ks=ks) == pytest.approx(evaluate(pred, ip, ix, inv, ks=ks))


def test_true_labels_of_chosen_rows_and_of_the_first_rows():
    from xc.data.sparse import SparseMatrix
    from xc.eval.metrics import true_labels

    labels = SparseMatrix(np.array([0, 2, 2, 5, 6]), np.array([3, 1, 0, 4, 2, 7], np.int32), None, 8)
    indptr, indices = true_labels(labels, np.array([3, 0, 1]))
    assert indptr.tolist() == [0, 1, 3, 3] and indices.tolist() == [7, 3, 1]
    indptr, indices = true_labels(labels, first=3)
    assert indptr.tolist() == [0, 2, 2, 5] and indices.tolist() == [3, 1, 0, 4, 2]
    assert true_labels(labels)[0].tolist() == [0, 2, 2, 5, 6] and indices.dtype == indptr.dtype == np.int64
