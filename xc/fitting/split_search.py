"""The input-space cosine search at millions of memory points: the most frequent features by a dense product, the rest
by a sparse one, each block of queries ranked from the dense sum.

Why: under a Zipf law of background words a query's sparse product with a large memory links it to nearly every
memory point (the 10^6-label xor family: 1.8M of 2M training points a query, 2.1·10^10 products for 5,000 test
queries), so the sparse product costs what a dense one over every point costs, at sparse speed: one thread, one hash
insert per product, and a sparse result as large as a dense one. A few hundred features make most of those links.
Multiplied as a dense (queries, f) x (f, n) block they run at the CPU's dense rate; the other features' sparse
product then links a query to a few percent of the memory (170k of 2M points there with the 100 most frequent
features taken out), computed on a second thread while the dense block of the previous queries is ranked. The 5,000
test queries of that family against its 2M training points: 332 s by the sparse product alone, 217 s split on 2
cores (`tools/bench/bench_input_search.py`; docs/training.md).

The scores are the same cosines up to float rounding (the two parts are summed in float32 in another order), so the
neighbours are the sparse search's, but for ties broken by rounding. Used where the memory holds at least a million
points and the sparse product would link a query to most of them; every shipped set and the 10^5-label benchmarks
search sparsely, as before.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import scipy.sparse as sp
import torch

SPLIT_MIN_POINTS = 1_000_000  # memory points from which the split is considered
SPLIT_MIN_LINKS = 0.5  # and taken where the sparse product makes this many products a query per memory point
SPLIT_MIN_SHARE = 0.01  # a feature is multiplied densely where it is in at least this share of the memory's rows
SPLIT_DENSE_FLOATS = 1 << 28  # n x f floats of the memory's dense columns at most (1 GiB: 134 features at 2M points)
# queries x n dense scores per block (256 MiB: 67 queries at 10^6 points). The 10^7-label final phase's peak came in
# this search (the fused test ranking, 5,000 queries over 10^6 points): 4.48 GiB added at 1 GiB blocks, 2.99 GiB at
# 256 MiB in 44 s against 47 s, 2.99 GiB at 128 MiB in 75 s (tools/results/knn_search_peak_1e7.json): the
# product's per-query cost stops falling at about 64 queries a block, and the block is then a small part of the peak
SCORE_BLOCK_FLOATS = 1 << 26
# One block's sparse product holds at most this many (query, memory point) pairs, counted before
# coincident pairs merge: about 0.8 GB of values and indices. A fixed count of queries cannot bound it,
# since frequent features link a query to most of the memory (3.7e9 pairs for 2,048 queries at 2M points).
MAX_PRODUCT_PAIRS = 1 << 26
SPLIT_BLOCK_PAIRS = 1 << 24  # the split's rare-feature product per block: under 1 GB on its way into the scores


def exact_products(queries: sp.csr_matrix, memory_t: sp.csr_matrix) -> int:
    """Multiply-adds of the exact sparse product queries (M, F) x memory_t (F, n): sum over features of the
    queries holding it times the memory rows holding it."""
    memory_df = np.diff(memory_t.indptr).astype(np.int64)
    query_df = np.bincount(queries.indices, minlength=len(memory_df)).astype(np.int64)
    return int(query_df @ memory_df)


def frequent_features(queries: sp.csr_matrix, memory_t: sp.csr_matrix) -> np.ndarray | None:
    """The features to multiply densely, most frequent first: those in at least `SPLIT_MIN_SHARE` of the memory's
    rows, at most `SPLIT_DENSE_FLOATS` / n of them; None where the sparse product alone is used: a memory under
    `SPLIT_MIN_POINTS`, a sparse product that links a query to few memory points (under `SPLIT_MIN_LINKS` products
    a query per memory point), or no feature that frequent."""
    m, n = queries.shape[0], memory_t.shape[1]
    if n == 0 or n < SPLIT_MIN_POINTS or exact_products(queries, memory_t) < SPLIT_MIN_LINKS * m * n:
        return None
    memory_df = np.diff(memory_t.indptr)
    order = np.argsort(-memory_df, kind="stable")[:max(1, SPLIT_DENSE_FLOATS // n)]
    chosen = order[memory_df[order] >= SPLIT_MIN_SHARE * n]
    return chosen if len(chosen) else None


def query_blocks(queries: sp.csr_matrix, memory_t: sp.csr_matrix, max_pairs: int = MAX_PRODUCT_PAIRS,
                 max_rows: int | None = None) -> list[tuple[int, int]]:
    """Consecutive query ranges [start, stop) whose product with `memory_t` (F, n) has at most `max_pairs`
    (query, memory point) pairs each, counting a pair once per shared feature (an upper bound on the
    product's nonzeros), and at most `max_rows` queries; a query over the pair bound alone gets a block of its own."""
    df = np.diff(memory_t.indptr).astype(np.int64)  # memory points holding each feature
    per_feature = df[queries.indices]
    # Per-row sums as differences of a running total: np.add.reduceat gives an empty row the next row's value and
    # fails outright when the last row is empty (an input line with no features), so it is not used here.
    running = np.concatenate([np.zeros(1, np.int64), np.cumsum(per_feature, dtype=np.int64)])
    pairs = running[queries.indptr[1:]] - running[queries.indptr[:-1]]
    blocks, start, total = [], 0, 0
    for i, p in enumerate(pairs.tolist()):
        if i > start and (total + p > max_pairs or (max_rows is not None and i - start >= max_rows)):
            blocks.append((start, i))
            start, total = i, 0
        total += p
    if start < queries.shape[0]:
        blocks.append((start, queries.shape[0]))
    return blocks


def split_topk(queries: sp.csr_matrix, memory: sp.csr_matrix, memory_t: sp.csr_matrix, k: int,
               frequent: np.ndarray, bar=None) -> tuple[np.ndarray, np.ndarray]:
    """(sims (M, k) float32, 0 pads; ids (M, k) int64, -1 pads) of the k largest positive cosines of L2-normalised
    queries (M, F) against memory (n, F) (memory_t its (F, n) CSR), best first, ties by memory index; `frequent`:
    the feature columns multiplied densely (`frequent_features`). `bar`: a progress bar updated per block."""
    m, n = queries.shape[0], memory.shape[0]
    sims = np.zeros((m, k), np.float32)
    ids = np.full((m, k), -1, np.int64)
    dense_memory = torch.from_numpy(memory_t[frequent].toarray().astype(np.float32))  # (f, n): 1.5x faster than (n, f).T
    dense_queries = queries[:, frequent].toarray().astype(np.float32)  # (M, f)
    kept = np.ones(memory_t.shape[0], np.float32)
    kept[frequent] = 0.0
    rare_queries = sp.csr_matrix(queries @ sp.diags(kept))  # the frequent features' columns emptied
    rare_memory_t = sp.csr_matrix(sp.diags(kept) @ memory_t)  # and their rows
    rare_queries.eliminate_zeros()
    rare_memory_t.eliminate_zeros()
    # a block's dense scores and its sparse product each bounded: two products are alive at once (the next one is
    # computed while this one is ranked), and each of their pairs costs about 40 bytes on the way into the scores
    spans = query_blocks(rare_queries, rare_memory_t, SPLIT_BLOCK_PAIRS, max_rows=max(1, SCORE_BLOCK_FLOATS // max(1, n)))
    width = min(k, n)

    def rare(span: tuple[int, int]) -> sp.coo_matrix:
        return (rare_queries[span[0]:span[1]] @ rare_memory_t).tocoo()  # scipy releases the GIL: overlaps the ranking

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(rare, spans[0]) if spans else None
        for i, (start, stop) in enumerate(spans):
            scores = torch.from_numpy(dense_queries[start:stop]) @ dense_memory  # (b, n)
            part = pending.result()
            if i + 1 < len(spans):
                pending = pool.submit(rare, spans[i + 1])
            flat = part.row.astype(np.int64)  # in place from here: a block's transient stays one int64 a pair
            flat *= n
            flat += part.col
            scores.view(-1).index_add_(0, torch.from_numpy(flat), torch.from_numpy(part.data.astype(np.float32, copy=False)))
            del part, flat
            top, where = torch.topk(scores, width, dim=1)
            top, where = top.numpy(), where.numpy().astype(np.int64)
            order = np.lexsort((where, -top), axis=1)  # ties by memory index: deterministic
            top, where = np.take_along_axis(top, order, 1), np.take_along_axis(where, order, 1)
            keep = top > 0
            sims[start:stop, :width] = np.where(keep, top, 0.0)
            ids[start:stop, :width] = np.where(keep, where, -1)
            if bar is not None:
                bar.update(stop - start)
    return sims, ids
