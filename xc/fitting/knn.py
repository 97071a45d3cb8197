"""Nearest-neighbour label votes: the kNN baseline (`xc-baseline knn`) and the instance memory that
`xc/fitting/fusion.py` fuses with a trained model's scores.

A query's vote for label l is sum_j s_j * y_jl / sum_j s_j over its k most similar training points j
(cosine similarity s_j > 0): the similarity-weighted share of its neighbours that carry l, in [0, 1].

Two spaces to search in:

* ``input``: the data's own features, as a tf-idf vector per point (`input_vectors` says how each data
  kind is turned into one), compared by cosine on sparse matrices;
* ``embedding``: the trained encoder's query embeddings, L2-normalised, compared by exact blocked top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from xc.ann.exact import exact_topk
from xc.arrays import find_sorted
from xc.data.sparse import SparseMatrix
from xc.fitting.split_search import MAX_PRODUCT_PAIRS, frequent_features, query_blocks, split_topk

DENSE_SHARE = 0.5  # rows with more than this share of their entries non-zero are dense: no idf, dense products


def _to_scipy(m: SparseMatrix, rows: np.ndarray | None = None) -> sp.csr_matrix:
    full = sp.csr_matrix((np.ones(m.nnz, np.float32) if m.values is None else np.asarray(m.values, np.float32),
                          np.asarray(m.indices), np.asarray(m.indptr)), shape=(m.num_rows, m.num_cols))
    return full if rows is None else full[rows]


def _l2_rows(m: sp.csr_matrix) -> sp.csr_matrix:
    norms = np.sqrt(np.asarray(m.multiply(m).sum(1)).ravel()).clip(1e-12)
    return sp.csr_matrix(sp.diags(1.0 / norms.astype(np.float32)) @ m)


def input_weights(train: SparseMatrix, text_features: bool) -> np.ndarray | None:
    """Per-feature weights that turn a data kind's features into tf-idf (the documented rule):

    * tf-idf features made from raw text at convert time (`text_features`) are used as they are;
    * sparse features (at most half the entries of a row non-zero on average): idf, log((1+N)/(1+df)) + 1;
    * dense features: none (cosine on the raw vectors).
    """
    if text_features or train.num_rows == 0:
        return None
    density = train.nnz / max(1, train.num_rows * train.num_cols)
    if density > DENSE_SHARE:
        return None
    df = np.bincount(np.asarray(train.indices), minlength=train.num_cols).astype(np.float64)
    return (np.log((1.0 + train.num_rows) / (1.0 + df)) + 1.0).astype(np.float32)


def input_vectors(matrix: SparseMatrix, weights: np.ndarray | None, rows: np.ndarray | None = None) -> sp.csr_matrix:
    """(n, F) L2-normalised float32 CSR vectors of `rows` (default every row, in order) of a feature matrix, weighted
    per feature. One float32 copy of the values is weighted and scaled in place a block of rows at a time: the weighted
    product and the normalisation each made whole copies, and at 10^7 labels and 10^6 training points those copies of
    the memory were the final phase's largest transient."""
    every = rows is None or _every_row(rows, matrix.num_rows)
    m = _to_scipy(matrix, None if every else rows)
    data = m.data.astype(np.float32, copy=True)
    if every:  # the matrix's own index arrays (a memory map): the result owns copies, as a taken subset does
        m = sp.csr_matrix((data, m.indices.copy(), m.indptr.copy()), shape=m.shape)
    for start in range(0, m.shape[0], _NORM_BLOCK_ROWS):
        stop = min(m.shape[0], start + _NORM_BLOCK_ROWS)
        a, b = int(m.indptr[start]), int(m.indptr[stop])
        values = data[a:b]
        if weights is not None:
            values *= weights[m.indices[a:b]]
        counts = np.diff(m.indptr[start:stop + 1])
        sums = np.bincount(np.repeat(np.arange(stop - start), counts), weights=values.astype(np.float64) ** 2,
                           minlength=stop - start)
        values *= np.repeat((1.0 / np.sqrt(sums).clip(1e-12)).astype(np.float32), counts)
    return sp.csr_matrix((data, m.indices, m.indptr), shape=m.shape)  # data: the one weighted, scaled copy


_NORM_BLOCK_ROWS = 1 << 16  # rows weighted and scaled at a time: their per-entry temporaries stay small


def _every_row(rows: np.ndarray, n: int) -> bool:
    """Whether `rows` is 0..n-1 in order (taking them would copy the matrix for nothing)."""
    return len(rows) == n and (n == 0 or (rows[0] == 0 and rows[-1] == n - 1 and bool(np.all(np.diff(rows) == 1))))


@dataclass
class Neighbours:
    """The k nearest training points of each query, best first: sims (M, k) float32 (0 pads),
    ids (M, k) int64 indices into the memory (-1 pads)."""

    sims: np.ndarray
    ids: np.ndarray

    def first(self, k: int) -> "Neighbours":
        return Neighbours(self.sims[:, :k], self.ids[:, :k])


def sparse_neighbours(queries: sp.csr_matrix, memory: sp.csr_matrix, k: int,
                      max_pairs: int = MAX_PRODUCT_PAIRS, desc: str | None = None) -> Neighbours:
    """Cosine top-k of L2-normalised sparse rows queries (M, F) against memory (n, F), one sparse product
    per block of queries, blocks sized by their product's pair count (`query_blocks`) so memory stays
    bounded whatever the features' frequencies; from a million memory points, where the sparse product would link
    a query to most of them, the most frequent features by a dense product beside it (xc/fitting/split_search.py).
    `desc`: show a progress bar over the queries (at 2M memory points and 5,000 queries the searches take minutes)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    m = queries.shape[0]
    memory_t = memory.T.tocsr()
    frequent = frequent_features(queries, memory_t)
    if frequent is not None:  # millions of memory points under frequent features: xc/fitting/split_search.py
        with tqdm(total=m, desc=desc, disable=desc is None, leave=False, mininterval=5.0) as bar:
            return Neighbours(*split_topk(queries, memory, memory_t, k, frequent, bar))
    sims = np.zeros((m, k), np.float32)
    ids = np.full((m, k), -1, np.int64)

    def search(span: tuple[int, int]) -> int:
        start, stop = span
        block = (queries[start:stop] @ memory_t).tocsr()
        for i in range(block.shape[0]):
            a, b = block.indptr[i], block.indptr[i + 1]
            vals, cols = block.data[a:b], block.indices[a:b]
            keep = vals > 0
            vals, cols = vals[keep], cols[keep]
            if len(vals) > k:
                part = np.argpartition(-vals, k - 1)[:k]
                vals, cols = vals[part], cols[part]
            # equal similarities in memory-index order; which of those tied at the k-th place are kept is
            # argpartition's choice, which a fused product and top-n does not reproduce (docs/benchmarks.md)
            order = np.lexsort((cols, -vals))
            sims[start + i, :len(order)] = vals[order]
            ids[start + i, :len(order)] = cols[order]
        return stop - start

    # scipy's sparse product releases the GIL: blocks on the rank's threads (disjoint rows of sims / ids) take the
    # ranker's all-pairs search on 2 cores from one core's time to about half of it
    threads = max(1, min(torch.get_num_threads(), 8))
    with tqdm(total=m, desc=desc, disable=desc is None, leave=False, mininterval=5.0) as bar, \
            ThreadPoolExecutor(threads) as pool:
        for done in pool.map(search, query_blocks(queries, memory_t, max_pairs)):
            bar.update(done)
    return Neighbours(sims, ids)


def dense_neighbours(queries: torch.Tensor, memory: torch.Tensor, k: int) -> Neighbours:
    """Cosine top-k of dense embeddings (queries (M, d), memory (n, d)); non-positive similarities dropped."""
    q = torch.nn.functional.normalize(queries.float(), dim=1)
    mem = torch.nn.functional.normalize(memory.float(), dim=1)
    scores, ids = exact_topk(q, mem, k)
    sims = scores.numpy().astype(np.float32)
    ids = ids.numpy()
    bad = ~(sims > 0) | (ids < 0)
    sims[bad], ids[bad] = 0.0, -1
    if sims.shape[1] < k:
        pad = k - sims.shape[1]
        sims = np.pad(sims, ((0, 0), (0, pad)))
        ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
    return Neighbours(sims, ids)


class LabelVotes:
    """Votes of each query's neighbours, stored sparsely as sorted keys query * L + label.

    memory_labels: the (n, L) label matrix of the memory points (row j = memory index j).
    """

    def __init__(self, nbrs: Neighbours, memory_labels: sp.csr_matrix, num_labels: int, power: float = 1.0):
        m, k = nbrs.ids.shape
        self.num_queries, self.num_labels = m, num_labels
        valid = nbrs.ids >= 0
        weight = np.where(valid, nbrs.sims, 0.0).astype(np.float64) ** power
        total = weight.sum(1)
        q_idx = np.repeat(np.arange(m), k)[valid.ravel()]
        w = (weight / np.where(total > 0, total, 1.0)[:, None]).ravel()[valid.ravel()]
        mem = nbrs.ids.ravel()[valid.ravel()]
        counts = np.diff(memory_labels.indptr)[mem]
        starts = memory_labels.indptr[mem]
        flat = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(counts.sum())
        labels = memory_labels.indices[flat].astype(np.int64)
        keys = np.repeat(q_idx, counts) * num_labels + labels
        self.keys, inverse = np.unique(keys, return_inverse=True)
        self.values = np.bincount(inverse, weights=np.repeat(w, counts), minlength=len(self.keys)).astype(np.float32)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Votes (M, c) float32 for candidate label ids (M, c) (-1 pads give 0)."""
        if not len(self.keys):
            return np.zeros(ids.shape, np.float32)
        keys = np.arange(ids.shape[0])[:, None] * self.num_labels + ids
        pos, found = find_sorted(self.keys, keys)
        found &= ids >= 0
        return np.where(found, self.values[pos], 0.0).astype(np.float32)

    def top(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each query's k best-voted labels: (votes (M, k) float32, ids (M, k) int64; 0 / -1 pads);
        equal votes are ordered by label id."""
        queries = self.keys // self.num_labels
        order = np.lexsort((self.keys, -self.values, queries))
        q_sorted = queries[order]
        starts = np.searchsorted(q_sorted, np.arange(self.num_queries))
        rank = np.arange(len(order)) - starts[q_sorted]
        keep = rank < k
        votes = np.zeros((self.num_queries, k), np.float32)
        ids = np.full((self.num_queries, k), -1, np.int64)
        votes[q_sorted[keep], rank[keep]] = self.values[order][keep]
        ids[q_sorted[keep], rank[keep]] = (self.keys[order] % self.num_labels)[keep]
        return votes, ids


def labels_csr(labels: SparseMatrix, rows: np.ndarray | None = None) -> sp.csr_matrix:
    """The (n, L) binary label matrix (of `rows`) as scipy CSR."""
    return _to_scipy(labels, rows)


class MixedVotes:
    """The average of several spaces' votes (e.g. tf-idf input and encoder embedding), with the same
    `lookup` / `top` as LabelVotes."""

    def __init__(self, parts: list[LabelVotes]):
        self.parts = parts

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return (sum(p.lookup(ids) for p in self.parts) / len(self.parts)).astype(np.float32)

    def top(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.concatenate([p.top(k)[1] for p in self.parts], 1)
        order = np.argsort(ids, axis=1, kind="stable")
        sorted_ids = np.take_along_axis(ids, order, 1)
        repeat = np.zeros(sorted_ids.shape, bool)
        repeat[:, 1:] = sorted_ids[:, 1:] == sorted_ids[:, :-1]
        sorted_ids = np.where(repeat, -1, sorted_ids)
        votes = np.where(sorted_ids >= 0, self.lookup(sorted_ids), -1.0)
        best = np.argsort(-votes, axis=1, kind="stable")[:, :k]  # ids ascending within equal votes
        top_ids = np.take_along_axis(sorted_ids, best, 1)
        top_votes = np.take_along_axis(votes, best, 1)
        return np.where(top_ids >= 0, top_votes, 0.0).astype(np.float32), top_ids
