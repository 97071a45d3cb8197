"""Extreme-classification ranking metrics: P@k, nDCG@k, PSP@k, PSnDCG@k and R@k.

Definitions follow the Extreme Classification Repository's reference code
(pyxclib, ``xclib/evaluation/xc_metrics.py``) so that numbers are comparable
with published tables:

* P@k       = mean_i  hits_i@k / k
* nDCG@k    = mean_i  DCG_i@k / IDCG_i@k, with DCG_i@k = sum_{j<=k} y_ij / log2(j+1)
              and IDCG_i@k = sum_{j<=min(k, n_i)} 1 / log2(j+1)  (n_i = #true labels of i)
* PSP@k     = sum_i PSHits_i@k / sum_i BestPSHits_i@k, where PSHits weights each hit by
              the label's inverse propensity and BestPSHits is the same sum for the
              ideal ranking (the point's true labels sorted by inverse propensity).
              pyxclib computes mean/mean, i.e. a ratio of sums over all points,
              not a mean of per-point ratios.
* PSnDCG@k  = sum_i (PSDCG_i@k / IDCG_i@k) / sum_i (BestPSDCG_i@k / IDCG_i@k); note that
              pyxclib divides both terms by the *unweighted* IDCG_i@k before the ratio.
* R@k       = mean_i hits_i@k / max(n_i, 1)

Points with no true labels (pyxclib convention): they stay in the denominator N of
every mean and contribute 0 to every numerator (P, nDCG, R); for PSP/PSnDCG they add 0
to both sums. Evaluation therefore never drops points; a model cannot score on them.

All work is vectorised over a chunk of rows (no per-point Python loop) and memory is
O(chunk_rows * max(ks) + nnz of the chunk); no dense N x L matrix is built.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from xc.arrays import find_sorted
from xc.errors import XCError

__all__ = [
    "MetricsInputError", "label_propensities", "precision_at_k", "ndcg_at_k",
    "psprecision_at_k", "psndcg_at_k", "recall_at_k", "evaluate",
]

# Rows per chunk are chosen so that each (rows, max(ks)) float64 work array is ~32 MiB.
_CHUNK_ELEMS = 1 << 22


class MetricsInputError(XCError, ValueError):
    """Predictions, ground truth or propensities that the metrics cannot be computed on."""


def label_propensities(label_counts: np.ndarray, num_points: int,
                       a: float = 0.55, b: float = 1.5) -> np.ndarray:
    """Propensity model of Jain, Prabhu, Varma (KDD 2016).

    p_l = 1 / (1 + C * (N_l + B)^-A),  C = (log N - 1) * (B + 1)^A   (natural log)

    label_counts: (L,) number of training points carrying each label (N_l).
    num_points: N, number of training points. Returns (L,) float64 propensities;
    ``1 / label_propensities(...)`` equals pyxclib's ``compute_inv_propesity``.
    Typical (A, B): Wikipedia (0.5, 0.4), Amazon (0.6, 2.6), otherwise (0.55, 1.5).
    """
    counts = np.asarray(label_counts, dtype=np.float64).ravel()
    if num_points < 1:
        raise MetricsInputError(f"num_points must be >= 1, got {num_points}")
    if counts.size and (not np.all(np.isfinite(counts)) or counts.min() < 0):
        raise MetricsInputError("label_counts must be finite and non-negative")
    c = (np.log(num_points) - 1.0) * (b + 1.0) ** a
    return 1.0 / (1.0 + c * np.power(counts + b, -a))



def inverse_propensities(train_split, a: float = 0.55, b: float = 1.5) -> np.ndarray:
    """(L,) inverse propensities of a training split (anything with `.labels.column_counts()` and
    `.num_points`), what PSP@k and PSnDCG@k weigh labels by."""
    return 1.0 / label_propensities(train_split.labels.column_counts(), train_split.num_points, a, b)

def _check_inputs(pred_ids, true_indptr, true_indices, inv_propensity, ks):
    """Validate and normalise the arguments; returns (pred, indptr, indices, inv, ks)."""
    ks = tuple(sorted({int(k) for k in ks}))
    if not ks or ks[0] < 1:
        raise MetricsInputError(f"ks must be non-empty positive integers, got {ks}")
    pred = np.asarray(pred_ids)
    if pred.ndim != 2 or not np.issubdtype(pred.dtype, np.integer):
        raise MetricsInputError(f"pred_ids must be a 2-D integer array, got {pred.dtype} {pred.shape}")
    n, kcols = pred.shape
    if kcols < ks[-1]:
        raise MetricsInputError(f"pred_ids has {kcols} columns < max(ks)={ks[-1]}")
    indptr = np.asarray(true_indptr, dtype=np.int64).ravel()
    indices = np.asarray(true_indices)
    if indices.ndim != 1 or (indices.size and not np.issubdtype(indices.dtype, np.integer)):
        raise MetricsInputError("true_indices must be a 1-D integer array")
    indices = indices.astype(np.int64, copy=False)
    if indptr.size != n + 1 or indptr[0] != 0 or indptr[-1] != indices.size \
            or np.any(np.diff(indptr) < 0):
        raise MetricsInputError(
            f"true_indptr must be non-decreasing, of length N+1={n + 1}, from 0 to nnz={indices.size}")
    if n == 0:
        raise MetricsInputError("no test points to evaluate")
    if indices.size and indices.min() < 0:
        raise MetricsInputError("true_indices must be non-negative label ids")
    pred = pred[:, :ks[-1]].astype(np.int64, copy=False)  # columns past max(ks) never matter
    if pred.min() < -1:
        raise MetricsInputError("pred_ids must be label ids >= 0 or -1 for padding")
    inv = None
    if inv_propensity is not None:
        inv = np.asarray(inv_propensity, dtype=np.float64).ravel()
        if indices.size and indices.max() >= inv.size:
            raise MetricsInputError(
                f"true label id {indices.max()} out of range of inv_propensity ({inv.size} labels)")
    return pred, indptr, indices, inv, ks


def _hit_matrix(pred: np.ndarray, row_of: np.ndarray, labels: np.ndarray, stride: int,
                check: bool = False) -> np.ndarray:
    """(M, K) bool: whether pred[i, j] is a true label of row i (padding -1 never is); the truth as (row, label)
    pairs (row_of, labels), stride > every id. One sorted key array, not a dense rows x L indicator. `check`:
    refuse a duplicate (row, label) pair in the truth."""
    true_keys = np.sort(row_of * stride + labels)
    if check and np.any(true_keys[1:] == true_keys[:-1]):
        raise MetricsInputError("true labels contain a duplicate (row, label) entry")
    pred_keys = np.arange(len(pred), dtype=np.int64)[:, None] * stride + pred
    return find_sorted(true_keys, pred_keys)[1] & (pred >= 0)


def hits_per_point(pred_ids, true_indptr, true_indices) -> np.ndarray:
    """(N, K) bool: pred_ids[i, j] (best first, -1 pads) is one of point i's true labels (CSR true_indptr,
    true_indices), for per-point figures (the label prior's paired comparison, xc/fitting/label_prior.py)."""
    pred = np.asarray(pred_ids, dtype=np.int64)
    indptr = np.asarray(true_indptr, dtype=np.int64)
    labels = np.asarray(true_indices, dtype=np.int64)[indptr[0]:indptr[len(pred)]]
    stride = int(max(pred.max(initial=0), labels.max(initial=0))) + 1
    row_of = np.repeat(np.arange(len(pred), dtype=np.int64), np.diff(indptr[:len(pred) + 1]))
    return _hit_matrix(pred, row_of, labels, stride)


def _accumulate(pred, indptr, indices, inv, ks, chunk_rows=None):
    """Sum every metric's per-point numerator (and PS denominators) over all points.

    Returns dict name -> (len(ks),) float64 sums; names: P, nDCG, R, and if ``inv`` is
    given PSP, PSP_best, PSnDCG, PSnDCG_best.
    """
    n, kmax = pred.shape
    kidx = np.asarray(ks) - 1
    kdiv = np.asarray(ks, dtype=np.float64)
    disc = 1.0 / np.log2(np.arange(kmax) + 2.0)  # 1/log2(j+1) for ranks j = 1..kmax
    cdisc = np.cumsum(disc)
    # Stride for (row, label) keys; +1 so that the largest id still gets its own slot.
    stride = int(max(pred.max(), indices.max() if indices.size else 0)) + 1
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_ELEMS // kmax)
    chunk_rows = min(chunk_rows, max(1, (2 ** 62) // stride))  # keys must fit in int64
    names = ["P", "nDCG", "R"] + (["PSP", "PSP_best", "PSnDCG", "PSnDCG_best"] if inv is not None else [])
    acc = {name: np.zeros(len(ks)) for name in names}

    for start in range(0, n, chunk_rows):
        stop = min(n, start + chunk_rows)
        rows = stop - start
        p = pred[start:stop]
        ip = indptr[start:stop + 1] - indptr[start]
        lab = indices[indptr[start]:indptr[stop]]
        n_true = np.diff(ip)
        row_of = np.repeat(np.arange(rows, dtype=np.int64), n_true)

        # A label predicted twice would be counted twice (pyxclib would do so silently).
        ps = np.sort(p, axis=1)
        if np.any((ps[:, 1:] == ps[:, :-1]) & (ps[:, 1:] >= 0)):
            raise MetricsInputError("pred_ids has a label predicted twice for the same point")

        hit = _hit_matrix(p, row_of, lab, stride, check=True)
        hits = hit.astype(np.float64)

        has = n_true > 0
        # IDCG_i@k = cdisc[min(n_i, k) - 1]; rows without labels get 1 (their DCG is 0).
        idcg = cdisc[np.clip(np.minimum(n_true[:, None], np.asarray(ks)[None, :]) - 1, 0, None)]
        idcg[~has] = 1.0
        cum_hits = np.cumsum(hits, axis=1)[:, kidx]
        dcg = np.cumsum(hits * disc, axis=1)[:, kidx]
        acc["P"] += cum_hits.sum(axis=0) / kdiv
        acc["R"] += (cum_hits / np.maximum(n_true, 1)[:, None]).sum(axis=0)
        acc["nDCG"] += (dcg / idcg).sum(axis=0)

        if inv is None:
            continue
        # Hit weights: index inv only where hit, so predicted ids beyond len(inv) are harmless.
        w = np.where(hit, inv[np.where(hit, p, 0)], 0.0)
        acc["PSP"] += np.cumsum(w, axis=1)[:, kidx].sum(axis=0)
        acc["PSnDCG"] += (np.cumsum(w * disc, axis=1)[:, kidx] / idcg).sum(axis=0)
        # Best achievable ranking: each point's true labels by decreasing inverse propensity,
        # truncated to kmax and zero-padded (pyxclib's top-k of the propensity-weighted truth).
        lw = inv[lab]
        order = np.lexsort((-lw, row_of))
        rank = np.arange(lab.size) - ip[row_of]  # row_of is sorted, so order keeps rows grouped
        keep = rank < kmax
        best = np.zeros((rows, kmax))
        best[row_of[keep], rank[keep]] = lw[order][keep]
        acc["PSP_best"] += np.cumsum(best, axis=1)[:, kidx].sum(axis=0)
        acc["PSnDCG_best"] += (np.cumsum(best * disc, axis=1)[:, kidx] / idcg).sum(axis=0)
    return acc


def _ratio(num, den):
    """Elementwise num/den with 0 where den == 0 (no point has a weighted true label)."""
    out = np.zeros_like(num)
    np.divide(num, den, out=out, where=den > 0)
    return out


def _compute(pred_ids, true_indptr, true_indices, inv_propensity, ks, chunk_rows=None):
    """Return (ks, dict metric -> (len(ks),) fractions in [0, 1])."""
    pred, indptr, indices, inv, ks = _check_inputs(
        pred_ids, true_indptr, true_indices, inv_propensity, ks)
    acc = _accumulate(pred, indptr, indices, inv, ks, chunk_rows)
    n = pred.shape[0]
    out = {"P": acc["P"] / n, "nDCG": acc["nDCG"] / n, "R": acc["R"] / n}
    if inv is not None:
        # Ratio of sums over all points (pyxclib: mean(num)/mean(best), same N cancels).
        out["PSP"] = _ratio(acc["PSP"], acc["PSP_best"])
        out["PSnDCG"] = _ratio(acc["PSnDCG"], acc["PSnDCG_best"])
    return ks, out


def _one(name, pred_ids, true_indptr, true_indices, inv_propensity, ks, chunk_rows):
    ks, out = _compute(pred_ids, true_indptr, true_indices, inv_propensity, ks, chunk_rows)
    return {k: float(v) for k, v in zip(ks, out[name])}


def precision_at_k(pred_ids, true_indptr, true_indices, ks=(1, 3, 5), *, chunk_rows=None):
    """P@k as a fraction in [0, 1] for each k in ks.

    pred_ids: (N, K) integer label ids, best first, -1 = padding; K >= max(ks).
    true_indptr: (N+1,), true_indices: (nnz,) CSR of each point's true label ids.
    Returns {k: value}. (``evaluate`` reports the same numbers as percentages.)
    """
    return _one("P", pred_ids, true_indptr, true_indices, None, ks, chunk_rows)


def ndcg_at_k(pred_ids, true_indptr, true_indices, ks=(1, 3, 5), *, chunk_rows=None):
    """nDCG@k as a fraction; the ideal DCG sums only min(k, n_i) discounts. Shapes as P@k."""
    return _one("nDCG", pred_ids, true_indptr, true_indices, None, ks, chunk_rows)


def psprecision_at_k(pred_ids, true_indptr, true_indices, inv_propensity, ks=(1, 3, 5),
                     *, chunk_rows=None):
    """PSP@k as a fraction, normalised by the best achievable value (ratio of sums).

    inv_propensity: (L,) float, 1/p_l for every label id that occurs in the truth.
    Returns 0 for a k where the best achievable value is 0 (pyxclib would give nan).
    """
    return _one("PSP", pred_ids, true_indptr, true_indices, inv_propensity, ks, chunk_rows)


def psndcg_at_k(pred_ids, true_indptr, true_indices, inv_propensity, ks=(1, 3, 5),
                *, chunk_rows=None):
    """PSnDCG@k as a fraction, normalised by the best achievable value as pyxclib does."""
    return _one("PSnDCG", pred_ids, true_indptr, true_indices, inv_propensity, ks, chunk_rows)


def recall_at_k(pred_ids, true_indptr, true_indices, ks=(1, 3, 5), *, chunk_rows=None):
    """R@k as a fraction: mean_i hits_i@k / n_i (points without labels count as 0)."""
    return _one("R", pred_ids, true_indptr, true_indices, None, ks, chunk_rows)


def evaluate(pred_ids: np.ndarray, true_indptr: np.ndarray, true_indices: np.ndarray,
             inv_propensity: np.ndarray | None = None, ks: Sequence[int] = (1, 3, 5),
             *, chunk_rows: int | None = None) -> dict[str, float]:
    """All metrics in one pass, as percentages.

    pred_ids: (N, K) int predicted label ids, best first; K >= max(ks); -1 = no
    prediction (padding), never a hit. A label repeated within a row raises
    MetricsInputError, as does a duplicate (row, label) in the truth.
    true_indptr: (N+1,) and true_indices: (nnz,) CSR of true label ids.
    inv_propensity: (L,) inverse propensities (e.g. ``1 / label_propensities(...)``), or None.
    Returns {"P@k", "nDCG@k", ["PSP@k", "PSnDCG@k",] "R@k"} for k in ks, in percent.
    Points with no true labels count in N and score 0 (see the module docstring).
    """
    ks, out = _compute(pred_ids, true_indptr, true_indices, inv_propensity, ks, chunk_rows)
    result: dict[str, float] = {}
    for name in ("P", "nDCG", "PSP", "PSnDCG", "R"):
        if name in out:
            for k, v in zip(ks, out[name]):
                result[f"{name}@{k}"] = float(100.0 * v)
    return result


def true_labels(labels, rows: np.ndarray | None = None, first: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The ground truth metrics read: (indptr (n + 1,), indices) int64 of the given `rows` of a label matrix
    (a CSR SparseMatrix: `indptr`, `indices`, `gather`), or of its first `first` rows (all rows when both are None)."""
    if rows is None:
        n = labels.num_rows if first is None else first
        indptr = np.asarray(labels.indptr[:n + 1], dtype=np.int64)
        return indptr, np.asarray(labels.indices[:indptr[-1]], dtype=np.int64)
    flat, offsets, _ = labels.gather(np.asarray(rows, dtype=np.int64))
    return np.append(offsets, len(flat)).astype(np.int64), np.asarray(flat, dtype=np.int64)


def paired_gain(better: np.ndarray, base: np.ndarray) -> tuple[float, float]:
    """(mean of better - base, standard error of that mean), both in % points, of two (N,) per-point figures."""
    diff = better - base
    se = float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else 0.0
    return 100.0 * float(diff.mean()), 100.0 * se
