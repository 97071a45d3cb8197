"""Norm-range partitioning for inner-product search: the largest-norm rows exactly, an index for the rest.

Why: a query's top inner products over trained classifier rows are mostly rows of large norm. Rows of
frequent labels grow long (their norm carries the label's prior), and at 10^6 labels 91% of the training
queries' exact top-16 (positives excluded) lay among the 1,024 longest rows, 0.1% of them (docs/miner_search.md,
"The miner's recall: hubs and an exact head"). A graph built on the rows' own neighbourhoods reaches those few rows
poorly from the queries: DiskANN found 0.51 of the exact top-16 there. Searching the 1,024 longest rows exactly,
everything else through a graph built without them, and merging by score found 0.95. This is the norm-ranging
idea of Yan et al. (NeurIPS 2018) with two ranges, the upper one small enough to scan.

Cost per query: `head` inner products of width d, against the graph's own few thousand distance computations
(L_search 64 x degree 32): measured, no extra search time at 10^6 x 128, twice the graph's at 10^5 x 1024. The
build is the inner index's over n - head rows. Scores returned are true inner products, as every `AnnIndex`'s.

`head_rows(params, n)`: `params.exact_head` rows, at most an eighth of n, so that the inner index always
serves the bulk of the rows (and small shards still exercise it).

Head only (`head_only_rows`, `NormHeadIndex.head_only`): where the head alone holds nearly all of the queries'
top-k, the index over the rest is most of a generation's cost (at 10^6 labels, build and 2M searches: 350 of
the miner's 376 s on one core) for what the head already finds. Before building, the miner measures on a probe
sample of queries (exact search over all rows) what share of their top-k the longest exact_head x 1, 2, 4 or 8
rows hold, and searches only the smallest head that reaches `params.head_only_recall`; otherwise it builds the
index as before. The probe is drawn apart from the sample the logged recall is measured on, so that figure stays
an independent estimate. Measured shares (docs/miner_search.md): 10^5 labels, 1024 rows: 0.952 (head + graph 0.971);
10^6 (Zipf 1), 1024 / 8192 / 65536 rows: 0.883 / 0.932 / 0.967 (head + graph 0.950); 10^6 with a flat
popularity (Zipf 0.5), 8192 rows: 0.571 (head + graph 0.478). The default, 0.97, skips the index only where the
head alone does as well as head + index did at best.
"""

from __future__ import annotations

import os
import time
import warnings

import numpy as np

from xc.ann.base import AnnIndex, _check_exclusions, _search_excluding_generic
from xc.ann.exact import exact_topk

_SCORE_BLOCK_FLOATS = 1 << 24  # queries x head scores per block (64 MiB of float32)


def head_rows(params, n: int) -> int:
    """How many of n rows the exact head takes: exact_head, at most n // 8 (0 = no partition)."""
    return int(min(params.exact_head, n // 8))


def norm_order(vectors: np.ndarray) -> np.ndarray:
    """(n,) row ids, longest first (ties by id): the order every head is cut from."""
    return np.argsort(-np.einsum("ij,ij->i", vectors, vectors), kind="stable")


def head_only_rows(vectors: np.ndarray, probe: np.ndarray, exclude_indptr, exclude_indices, k: int,
                   params, truth: np.ndarray | None = None) -> tuple[int, float | None]:
    """(h, share): the smallest head among exact_head x 1, 2, 4, 8 (at most n // 8) whose rows hold at least
    `params.head_only_recall` of the probe queries' exact top-k (exclusions as CSR of row ids over the probe),
    and that share; (0, the largest head's share) when none does; (0, None) when off or nothing to probe.

    vectors (n, d) float32; probe (m, d) float32. Cost: one exact search of m queries over the n rows, unless
    `truth` (m, k) gives the probe's exact top-k ids already (-1 padded)."""
    import torch

    n = vectors.shape[0]
    sizes = sorted({min(params.exact_head << j, n // 8) for j in range(4)} - {0})
    if params.head_only_recall <= 0 or not sizes or len(probe) == 0:
        return 0, None
    rank = np.empty(n, dtype=np.int64)
    rank[norm_order(vectors)] = np.arange(n)
    if truth is None:
        with warnings.catch_warnings():  # a snapshot's rows are a read-only memmap; they are only read here
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            rows = torch.from_numpy(vectors)
        probe_t = torch.from_numpy(np.array(probe, dtype=np.float32))
        truth = exact_topk(probe_t, rows, k, exclude_indptr, exclude_indices)[1].numpy()
    truth = truth[truth >= 0]
    share = 1.0
    for h in sizes:
        share = float((rank[truth] < h).mean()) if len(truth) else 1.0
        if share >= params.head_only_recall:
            return h, share
    return 0, share


class NormHeadIndex(AnnIndex):
    """Wraps an AnnIndex: the `head_rows` longest rows are scored exactly, the rest go to `inner`.

    Ids are the caller's row ids 0 <= id < n; results of the two parts are merged by score.
    """

    def __init__(self, inner: AnnIndex):
        super().__init__(inner.params)
        self.inner: AnnIndex | None = inner  # None: head only (the rest of the rows is not searched)
        self._head_size: int | None = None  # fixed head size (head only), else head_rows(params, n)
        self.name = f"norm_head({getattr(inner, 'name', type(inner).__name__)})"
        self.head_ids = np.zeros(0, np.int64)  # (h,) row ids of the exact part, longest first
        self.rest_ids = np.zeros(0, np.int64)  # (n - h,) row ids the inner index holds, ascending
        self.head_vectors = np.zeros((0, 0), np.float32)  # (h, d)
        self.vectors: np.ndarray | None = None  # (n, d) rows as built (None once loaded), to score the rest's ids
        self._where: np.ndarray | None = None  # (n,) int64: head position (>= 0) or -(rest position) - 1

    def head_only(self, size: int) -> NormHeadIndex:
        """Make this index search only its `size` longest rows (exactly); the rest are never returned."""
        self.inner, self._head_size = None, int(size)
        self.name = f"norm_head(head only, {size})"
        return self

    # -- build and persistence -----------------------------------------------------------------
    def build(self, vectors: np.ndarray) -> None:
        start = time.perf_counter()
        vectors = self._check_vectors(vectors)
        n = vectors.shape[0]
        h = min(n, self._head_size) if self._head_size is not None else head_rows(self.params, n)
        head = norm_order(vectors)[:h]
        self._set_parts(n, head, vectors[head], vectors)
        self.dim = vectors.shape[1]
        if self.inner is not None:
            self.inner.build(vectors[self.rest_ids])
        self._finish(start)

    def build_and_save(self, vectors: np.ndarray, directory: str) -> None:
        self.build(vectors)
        self.save(directory)

    def save(self, directory: str) -> None:
        """The inner index, the head's ids and vectors (not the rest's rows: the inner index holds those)."""
        self._write_info(directory, backend="norm_head", head=len(self.head_ids), head_only=self.inner is None)
        if self.inner is not None:
            self.inner.save(os.path.join(directory, "inner"))
        np.save(os.path.join(directory, "head_ids.npy"), self.head_ids)
        np.save(os.path.join(directory, "head_vectors.npy"), self.head_vectors)

    def load(self, directory: str) -> None:
        shown = (f"{_innermost(self.inner)!r} with an exact head (miner.ann.exact_head)" if self.inner is not None
                 else "an exact head alone")
        info = self._read_info(directory, "norm_head", shown)
        start = time.perf_counter()
        self._set_parts(int(info["n"]), np.load(os.path.join(directory, "head_ids.npy")),
                        np.load(os.path.join(directory, "head_vectors.npy")), None)
        if info.get("head_only"):
            self.head_only(len(self.head_ids))
        else:
            self.inner.load(os.path.join(directory, "inner"))
        self._finish(start)

    def _set_parts(self, n: int, head: np.ndarray, head_vectors: np.ndarray, vectors: np.ndarray | None) -> None:
        is_head = np.zeros(n, dtype=bool)
        is_head[head] = True
        self.head_ids = head.astype(np.int64)
        self.rest_ids = np.flatnonzero(~is_head).astype(np.int64)
        self.head_vectors = np.ascontiguousarray(head_vectors, dtype=np.float32)
        self.vectors = vectors
        where = np.empty(n, dtype=np.int64)
        where[head] = np.arange(len(head))
        where[self.rest_ids] = -np.arange(len(self.rest_ids)) - 1
        self._where = where
        self.n = n

    def _finish(self, start: float) -> None:
        self._built = True
        self.build_seconds = time.perf_counter() - start
        inner_bytes = getattr(self.inner, "memory_bytes", 0) if self.inner is not None else 0
        self.memory_bytes = inner_bytes + self.head_vectors.nbytes + self._where.nbytes

    # -- search --------------------------------------------------------------------------------
    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        queries = self._check_queries(queries, k)
        head_scores, head_ids = self._search_head(queries, k, None, None)
        rest_scores, rest_ids = self._empty_result(queries.shape[0], k)
        if len(self.rest_ids) and self.inner is not None:
            rest_scores, local = self.inner.search(queries, k)
            rest_ids = np.where(local >= 0, self.rest_ids[np.maximum(local, 0)], -1)
        return _merge(head_scores, head_ids, rest_scores, rest_ids, k)

    def search_excluding(self, queries: np.ndarray, k: int, exclude_indptr, exclude_indices) -> np.ndarray:
        """Top-k ids per query other than its excluded rows (ids outside [0, n) are ignored)."""
        if self.vectors is None:  # a loaded index keeps no rows to score the rest's ids: widen and filter
            return _search_excluding_generic(self, queries, k, exclude_indptr, exclude_indices)
        queries = self._check_queries(queries, k)
        m = queries.shape[0]
        indptr, indices = _check_exclusions(m, exclude_indptr, exclude_indices)
        qrow = np.repeat(np.arange(m, dtype=np.int64), np.diff(indptr))
        cols = indices[: indptr[-1]]
        inside = (cols >= 0) & (cols < self.n)
        qrow, where = qrow[inside], self._where[cols[inside]]
        head_scores, head_ids = self._search_head(queries, k, qrow[where >= 0], where[where >= 0])
        rest_scores, rest_ids = self._empty_result(m, k)
        if len(self.rest_ids) and self.inner is not None:
            in_rest = where < 0
            rest_indptr = np.concatenate([[0], np.cumsum(np.bincount(qrow[in_rest], minlength=m))])
            local = self.inner.search_excluding(queries, k, rest_indptr, -where[in_rest] - 1)
            rest_ids = np.where(local >= 0, self.rest_ids[np.maximum(local, 0)], -1)
            rest_scores = self._scores_of(queries, rest_ids)
        return _merge(head_scores, head_ids, rest_scores, rest_ids, k)[1]

    def _search_head(self, queries: np.ndarray, k: int, ex_rows, ex_pos) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k over the head rows: (scores (m, k), ids (m, k)), -inf / -1 padded; exclusions as
        (query row, head position) pairs."""
        m, h = queries.shape[0], len(self.head_ids)
        scores_out, ids_out = self._empty_result(m, k)
        if h == 0 or m == 0:
            return scores_out, ids_out
        kk = min(k, h)
        chunk = max(1, _SCORE_BLOCK_FLOATS // h)
        if ex_rows is not None and len(ex_rows):
            order = np.argsort(ex_rows, kind="stable")
            ex_rows, ex_pos = ex_rows[order], ex_pos[order]
        for start in range(0, m, chunk):
            stop = min(m, start + chunk)
            scores = queries[start:stop] @ self.head_vectors.T  # (c, h)
            if ex_rows is not None and len(ex_rows):
                lo, hi = np.searchsorted(ex_rows, [start, stop])
                scores[ex_rows[lo:hi] - start, ex_pos[lo:hi]] = -np.inf
            top = np.argpartition(-scores, kk - 1, axis=1)[:, :kk] if kk < h else np.broadcast_to(
                np.arange(h), (stop - start, h))
            top_scores = np.take_along_axis(scores, top, axis=1)
            best = np.argsort(-top_scores, axis=1, kind="stable")
            top, top_scores = np.take_along_axis(top, best, axis=1), np.take_along_axis(top_scores, best, axis=1)
            scores_out[start:stop, :kk] = top_scores
            ids_out[start:stop, :kk] = np.where(np.isneginf(top_scores), -1, self.head_ids[top])
        return scores_out, ids_out

    def _scores_of(self, queries: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """<query, row> for the (m, k) ids (-inf where -1), gathered in blocks."""
        out = np.full(ids.shape, -np.inf, dtype=np.float32)
        chunk = max(1, _SCORE_BLOCK_FLOATS // max(1, ids.shape[1] * self.dim))
        for start in range(0, ids.shape[0], chunk):
            block = ids[start:start + chunk]
            rows = np.asarray(self.vectors[np.maximum(block, 0).ravel()], dtype=np.float32).reshape(*block.shape, -1)
            scores = np.einsum("qkd,qd->qk", rows, queries[start:start + chunk])
            out[start:start + chunk] = np.where(block >= 0, scores, -np.inf)
        return out


def _innermost(index: AnnIndex) -> str:
    while getattr(index, "inner", None) is not None:
        index = index.inner
    return index.name


def _merge(scores_a, ids_a, scores_b, ids_b, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of two disjoint (scores, ids) lists per query, best first."""
    scores = np.concatenate([scores_a, scores_b], axis=1)
    ids = np.concatenate([ids_a, ids_b], axis=1)
    best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    scores, ids = np.take_along_axis(scores, best, axis=1), np.take_along_axis(ids, best, axis=1)
    return scores.astype(np.float32), np.where(np.isneginf(scores), -1, ids).astype(np.int64)
