"""Ranking with the labels' lexical weights (xc/models/lexical.py): each query's exact top k of dense + lexical
scores, from its dense top K' and the few labels whose lexical score could lift them into it.

A label outside the dense top K' scores at most d_K' + lex (d_K' the K'-th dense score), so it can enter the top k
only where lex > delta = t - d_K', t the k-th best combined score among the dense top. Those labels are found
without scoring every label: lex = sum_s v[l, s] x[f[l, s]] has at most S terms, so lex > delta >= 0 needs one term
above delta / S; where a label holds each feature once (the supports' rule), that term must also pass delta less
the largest terms the query's other features can give (MaxScore's bound). The weights are kept by feature, largest
first (`FeatureLists`); each of the query's features gives the labels whose weight on it makes such a term (a prefix
of its list, a suffix where the query's value is negative); a label so found whose |q| |w_l| cannot pass delta
(Cauchy-Schwarz) is dropped, and the others' lex is summed exactly from their own S weights (`lexical_of`). Where
negative weights took t below d_K' (delta < 0) every label sharing a feature with the query is scored, and the
query is reported unsettled: a deeper dense ranking settles it (xc/eval/inference.py).

Where the weights are large against delta (labels started at their centroids: xc/models/lexical.py) one term
above delta / S is common and those prefixes hold a third of a frequent feature's list; such a query's labels are
found by summing instead (`_accumulated`, MaxScore's split): the features whose largest terms together give at most
part of delta are left out, the others' whole lists summed exactly, and only labels whose sums pass delta less that
part are scored. Each query takes whichever reads fewer entries.

Why: the sparse product of the queries with every label's weights reads every label that shares a feature with
the query. At 10^7 labels that was about 1.6 million labels a query (frequent words sit in many labels'
supports), and ranking 5,000 validation points took over ten minutes against 1.5 for the dense rows alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from xc.arrays import unique_ints

# (query, label) pairs a block of queries gathers at once: each costs about S x 24 B in `lexical_of`
PAIRS_PER_BLOCK = 1 << 16
# float64 values of the queries `lexical_of` lays out densely at once (32 MiB): 20 queries over 200k features
GROUP_FLOATS = 1 << 22
# labels whose supports `FeatureLists.build` checks at a time
LABELS_PER_CHECK = 1 << 18
# a query's features whose largest terms sum to at most this share of delta are left out of `_accumulated`'s sums:
# the rest must pass delta less that sum. At 10^7 labels with centroid-started weights (norm 17.9, delta about 10)
# 0.5 and 0.8 summed 40 and 35 ms a query against 100 ms with no list left out; the share left to the others
# decides how many labels are scored exactly afterwards (280 and 5,400 a query).
SKIP_SHARE = 0.75
# an entry summed costs about three reads of a pair's S scored by `lexical_of` (an add, a read and a reset in an
# array of all labels, each a cache miss: 55 ns against 530 ns a pair of S = 32 at 10^7 labels)
READS_PER_ENTRY = 3


@dataclass(frozen=True)
class FeatureLists:
    """The non-zero lexical weights by feature: feature f's labels are labels[ptr[f]:ptr[f + 1]] (local ids, int32),
    largest weight first; neg_weights the same entries' weights negated (ascending within each feature)."""

    ptr: np.ndarray
    labels: np.ndarray
    neg_weights: np.ndarray
    distinct: bool = True  # no label holds a feature twice (the supports' rule): its term on a feature is one weight
    norms: np.ndarray | None = None  # (n,) float32 |w_l|: a label's lexical score is at most |q| |w_l| where distinct

    @classmethod
    def build(cls, support: np.ndarray, weights: np.ndarray, num_features: int) -> "FeatureLists":
        """From support (n, S) feature ids (-1 pads) and weights (n, S) float32 of n labels. Built in int32 ids and
        float32 weights, the per-label checks a block of labels at a time: at 10^7 labels and S = 32 each (n, S)
        temporary in int64 is 2.6 GB, and the ranking builds these lists at every validation."""
        keep = (support >= 0) & (weights != 0)
        labels = np.repeat(np.arange(support.shape[0], dtype=np.int32), keep.sum(1))
        features = support[keep].astype(np.int32, copy=False)
        neg = np.negative(weights[keep], dtype=np.float32)
        del keep
        order = _by_feature_then_value(features, neg)
        ptr = np.zeros(num_features + 1, np.int64)
        np.cumsum(np.bincount(features, minlength=num_features), out=ptr[1:])
        del features
        labels, neg = labels[order], neg[order]
        del order
        distinct, norms = True, np.empty(support.shape[0], np.float32)
        pads = -1 - np.arange(support.shape[1], dtype=np.int64)  # distinct stand-ins: pads never repeat a feature
        for a in range(0, support.shape[0], LABELS_PER_CHECK):
            sup, w = support[a:a + LABELS_PER_CHECK], weights[a:a + LABELS_PER_CHECK]
            ordered = np.sort(np.where(sup >= 0, sup, pads), axis=1)
            distinct = distinct and bool((np.diff(ordered, axis=1) != 0).all())
            norms[a:a + LABELS_PER_CHECK] = np.sqrt(np.einsum("ns,ns->n", w, w * (sup >= 0), dtype=np.float64))
        return cls(ptr, labels, neg, distinct, norms)


def _by_feature_then_value(features: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The order that sorts entries by feature (int32, >= 0), then by value (float32, finite), ties in any order: one
    argsort of uint64 keys feature << 32 | the value's bits mapped to an order-preserving uint32. At 2 x 10^7
    entries that is 3x faster than np.lexsort's two stable passes, and the ranking builds the lists at every
    validation."""
    bits = values.view(np.uint32)
    ordered = np.where(bits >> np.uint32(31) != 0, ~bits, bits | np.uint32(1 << 31))  # negatives reversed, below
    return np.argsort((features.astype(np.uint64) << np.uint64(32)) | ordered)


def sorted_queries(queries: sp.csr_matrix) -> sp.csr_matrix:
    """A copy of the queries (M, F) CSR with sorted, merged features: a feature repeated in a row counts once."""
    queries = sp.csr_matrix(queries, copy=True)
    queries.sum_duplicates()
    return queries


def lexical_of(queries: sp.csr_matrix, support: np.ndarray, weights: np.ndarray,
               rows: np.ndarray, local: np.ndarray) -> np.ndarray:
    """(P,) float64 lexical scores of the pairs (query rows[p], local label local[p]): the label's S weights times
    the query's values on its support. queries: `sorted_queries` (merged features); support, weights (n, S) of the
    labels. A group of queries is laid out densely (GROUP_FLOATS at most) and each pair's S values read from it
    directly: a binary search of the queries' sorted features for each of the S cost about 10x more at 10^7 labels."""
    out = np.zeros(len(rows), np.float64)
    if not queries.nnz or not len(rows):
        return out
    rows = np.asarray(rows, np.int64)
    order = None if (np.diff(rows) >= 0).all() else np.argsort(rows, kind="stable")
    by_row = rows if order is None else rows[order]
    num_features = queries.shape[1]
    group = max(1, GROUP_FLOATS // (num_features + 1))
    dense = np.zeros((group, num_features + 1), np.float64)  # column num_features stays 0: where -1 pads read
    starts = np.searchsorted(by_row, np.arange(0, queries.shape[0] + group, group))
    for g, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        if a == b:
            continue
        q0 = g * group
        part = queries[q0:q0 + group]
        at_row = np.repeat(np.arange(part.shape[0]), np.diff(part.indptr))
        dense[at_row, part.indices] = part.data
        for c in range(a, b, PAIRS_PER_BLOCK):
            pick = slice(c, min(b, c + PAIRS_PER_BLOCK)) if order is None else order[c:min(b, c + PAIRS_PER_BLOCK)]
            labels = local[pick]
            values = dense[(rows[pick] - q0)[:, None], support[labels]]  # (p, S); -1 pads read the zero column
            out[pick] = (weights[labels].astype(np.float64) * values).sum(1)
        dense[at_row, part.indices] = 0.0
    return out


def _first_at(neg: np.ndarray, lo: np.ndarray, hi: np.ndarray, target: np.ndarray, strict: bool) -> np.ndarray:
    """Per range [lo, hi) of `neg` (ascending within each): the first index whose value is > target (strict) or
    >= target, hi where none; a binary search over every range at once."""
    lo, hi = lo.copy(), hi.copy()
    last = max(neg.size - 1, 0)
    while True:
        active = lo < hi
        if not active.any():
            return lo
        mid = (lo + hi) >> 1
        value = neg[np.minimum(mid, last)]
        before = (value <= target) if strict else (value < target)
        lo = np.where(active & before, mid + 1, lo)
        hi = np.where(active & ~before, mid, hi)


def reaching(lists: FeatureLists, queries: sp.csr_matrix, delta: np.ndarray, width: int,
             num_labels: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, local) of every (query, label) pair whose label has a term above delta[q] / width on one of the query's
    features (every label on its features where delta[q] < 0; none where delta[q] is +inf or nan), each pair once,
    sorted by query then label. queries (M, F) CSR with merged features (`sorted_queries`); labels [0, num_labels)."""
    row_of = np.repeat(np.arange(queries.shape[0], dtype=np.int64), np.diff(queries.indptr))
    f, q = queries.indices.astype(np.int64), queries.data.astype(np.float64)
    d = delta[row_of]
    live = np.isfinite(d) | (d == -np.inf)
    row_of, f, q, d = row_of[live], f[live], q[live], d[live]
    if not lists.neg_weights.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    start, stop = lists.ptr[f], lists.ptr[f + 1]
    # the largest term each feature can give (its largest weight, or its most negative where q < 0), and all of a
    # query's: a label's other terms add at most the rest, so its term here must pass d - (total - this one)
    filled = stop > start
    top = np.where(filled, -lists.neg_weights[np.minimum(start, lists.neg_weights.size - 1)], 0.0)
    bottom = np.where(filled, lists.neg_weights[np.maximum(stop - 1, 0)], 0.0)
    largest = np.maximum(np.where(q > 0, q * top, np.where(q < 0, -q * bottom, 0.0)), 0.0)
    most = np.bincount(row_of, weights=largest, minlength=queries.shape[0])[row_of]
    with np.errstate(divide="ignore", invalid="ignore"):
        # a term q w must exceed d / width (one of at most `width` terms does) and, where each feature is one term,
        # d less what the query's other features can give
        term = np.maximum(d / width, d - (most - largest)) if lists.distinct else d / width
        tau = term / q  # w > tau where q > 0, w < tau where q < 0
    cut = _first_at(lists.neg_weights, start, stop, -tau, strict=False)  # q > 0: [start, cut) has -w < -tau
    cut_neg = _first_at(lists.neg_weights, start, stop, -tau, strict=True)  # q < 0: [cut_neg, stop) has -w > -tau
    everything = d < 0
    lo = np.where(everything | (q < 0), np.where(everything, start, cut_neg), start)
    hi = np.where(everything | (q < 0), stop, np.where(q > 0, cut, start))
    counts = np.maximum(hi - lo, 0)
    keys = []
    if lists.distinct:  # a query whose whole essential lists read less than its prefixes' pairs: accumulated
        summed, accumulated = _accumulated(lists, queries.shape[0], row_of, q, d, start, stop, largest, counts,
                                           width, num_labels)
        counts = np.where(accumulated[row_of], 0, counts)
        keys.append(summed)
    total = int(counts.sum())
    if total:
        owner = np.repeat(row_of, counts)
        at = np.repeat(lo - (np.cumsum(counts) - counts), counts) + np.arange(total, dtype=np.int64)
        keys.append(owner * num_labels + lists.labels[at])
    if not sum(key.size for key in keys):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return _unique_pairs(np.concatenate(keys), num_labels)


def _accumulated(lists: FeatureLists, m: int, row_of: np.ndarray, q: np.ndarray, d: np.ndarray, start: np.ndarray,
                 stop: np.ndarray, largest: np.ndarray, prefix: np.ndarray, width: int, num_labels: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """`reaching` by summing: (keys row * num_labels + label of the labels that can pass, accumulated (m,) bool:
    the queries so handled). Per (query, feature) entry, sorted by query: row_of, q its value, d the query's delta,
    [start, stop) its list, largest its largest term, prefix the pairs `reaching`'s bound would read.

    MaxScore's split: a query's features whose largest terms sum to at most SKIP_SHARE x delta are skipped (the
    longest lists for what they can give first); a label reaches delta only if its terms on the others (their whole
    lists, summed exactly) pass delta less that sum. Chosen per query where it reads less than the bound's pairs:
    where the weights are large against delta, one term above delta / S is common and a frequent feature's prefix
    runs to a third of its list."""
    accumulated = np.zeros(m, bool)
    live = np.isfinite(d) & (d >= 0)
    if not live.any():
        return np.zeros(0, np.int64), accumulated
    length = (stop - start).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):  # 0 / 0 where a list is empty
        saved = np.where(largest > 0, length / largest, np.inf)  # entries skipped per unit of bound spent
    order = np.lexsort((-saved, row_of))
    spent = np.cumsum(largest[order])
    first = np.searchsorted(row_of[order], row_of[order])
    skip = np.empty(len(order), bool)
    skip[order] = spent - (spent[first] - largest[order][first]) <= SKIP_SHARE * d[order]
    skip &= live
    reads = np.bincount(row_of, weights=np.where(skip, 0.0, length), minlength=m) * READS_PER_ENTRY
    pairs = np.bincount(row_of, weights=prefix.astype(np.float64), minlength=m) * width
    accumulated[np.unique(row_of[live])] = True
    accumulated &= reads < pairs
    given = np.bincount(row_of, weights=np.where(skip, largest, 0.0), minlength=m)  # what skipped lists can give
    bounds = np.searchsorted(row_of, np.arange(m + 1))
    total = np.zeros(num_labels, np.float64)  # pages touched only where summed
    keys = []
    for r in np.nonzero(accumulated)[0]:
        a, b = bounds[r], bounds[r + 1]
        at = np.arange(a, b)[~skip[a:b]]
        if not at.size:
            continue
        labels = np.concatenate([lists.labels[start[e]:stop[e]] for e in at])
        values = np.concatenate([lists.neg_weights[start[e]:stop[e]] * -q[e] for e in at])
        np.add.at(total, labels, values)
        floor = d[a] - given[r]
        # the sums' order differs from lexical_of's, which scores the labels found: a margin for rounding
        found = labels[total[labels] > floor - 1e-9 * (1.0 + abs(d[a]))]
        total[labels] = 0.0
        keys.append(r * np.int64(num_labels) + found.astype(np.int64))
    return (np.concatenate(keys) if keys else np.zeros(0, np.int64)), accumulated


def _unique_pairs(key: np.ndarray, num_labels: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, local) of the distinct keys row * num_labels + label, ascending. By one sort (xc/arrays.py
    `unique_ints`): np.unique finds distinct values through a hash table from numpy 2.3 on, and at 10^7 labels,
    where a block of queries reaches tens of millions of pairs, that was most of the ranking's time."""
    key = unique_ints(key)
    return key // num_labels, key % num_labels


def rerank_block(queries: sp.csr_matrix, support: np.ndarray, weights: np.ndarray,
                 lists: FeatureLists, lo: int, embeddings: torch.Tensor, dense_scores: torch.Tensor,
                 dense_ids: torch.Tensor, dense_of, k: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """The exact top k (scores (M, k), global ids (M, k), -inf / -1 pads) of dense + lexical scores of a block of
    queries (`sorted_queries`), from their dense top K' (scores, global ids (M, K'), -1 pads, falling), and exact
    (M,) bool: t >= d_K' (module docstring). support, weights (n, S) of this shard's labels [lo, lo + n);
    dense_of(global ids (P,), embedding (d,)) -> (P,) dense scores of labels outside the dense top."""
    return rerank_block_each(queries, support, weights, lists, lo, embeddings,
                             [(dense_scores, dense_ids, dense_of)], k)[0]


def rerank_block_each(queries: sp.csr_matrix, support: np.ndarray, weights: np.ndarray,
                      lists: FeatureLists, lo: int, embeddings: torch.Tensor, rankings: list[tuple], k: int
                      ) -> list[tuple[torch.Tensor, torch.Tensor, np.ndarray]]:
    """`rerank_block` of several dense rankings [(scores (M, K'), ids (M, K'), dense_of)] of the same queries (one
    per label-prior beta). The labels that could enter are found and their lexical scores summed once, for the
    lowest delta of any ranking (a superset of each ranking's), then kept per ranking where they pass its own:
    finding and scoring them is most of the ranking's time, and eleven betas did it eleven times."""
    n = support.shape[0]
    parts = [_dense_part(queries, support, weights, lo, scores, ids, k) for scores, ids, _ in rankings]
    lowest = np.min(np.stack([part[3] for part in parts]), axis=0) if parts else np.zeros(0)
    rows, local = reaching(lists, queries, lowest, support.shape[1], n)
    if lists.distinct and lists.norms is not None and len(rows):  # Cauchy-Schwarz: |lex| <= |q| |w_l|
        query_norms = np.sqrt(np.asarray(queries.multiply(queries).sum(1)).ravel())
        could = (query_norms[rows] * lists.norms[local] * (1 + 1e-5) > lowest[rows]) | (lowest[rows] < 0)
        rows, local = rows[could], local[could]
    lexical = lexical_of(queries, support, weights, rows, local)
    out = []
    for (_, _, dense_of), (ids, combined, exact, delta, at_q, at_c) in zip(rankings, parts):
        keep = lexical > delta[rows]
        if len(rows):  # a label already in this ranking's dense top is scored there
            taken = unique_ints(at_q.astype(np.int64) * n + (ids[at_q, at_c] - lo))
            if taken.size:
                where = np.searchsorted(taken, rows * n + local).clip(max=taken.size - 1)
                keep &= taken[where] != rows * n + local
        out.append((*_assemble(ids, combined, rows[keep], local[keep] + lo, lexical[keep], embeddings, dense_of,
                               k), exact))
    return out


def _dense_part(queries, support, weights, lo, dense_scores, dense_ids, k):
    """A dense top's side of `rerank_block_each`: (ids (M, K'), combined scores (M, K') with their lexical scores,
    exact (M,), delta (M,): what a label outside the top must score lexically to enter, at_q, at_c: the entries of
    this shard's labels)."""
    m, k_wide = dense_ids.shape
    n = support.shape[0]
    ids, dense = dense_ids.numpy(), dense_scores.numpy().astype(np.float64)
    mine = (ids >= lo) & (ids < lo + n)
    at_q, at_c = np.nonzero(mine)
    lexical = np.zeros(ids.shape, np.float64)
    lexical[at_q, at_c] = lexical_of(queries, support, weights, at_q, ids[at_q, at_c] - lo)
    combined = np.where(ids >= 0, dense + lexical, -np.inf)
    full = (ids >= 0).sum(1) == k_wide
    floor = np.where(full, dense[:, -1], -np.inf)
    threshold = (-np.sort(-combined, axis=1)[:, k - 1]) if k_wide >= k else np.full(m, -np.inf)
    # negative lexical weights may take the dense top below its own floor: a label deeper in the dense ranking
    # without lexical weight could then still enter, and only a deeper dense ranking settles it
    exact = threshold >= floor
    with np.errstate(invalid="ignore"):
        delta = np.where(full, threshold - floor, np.inf)  # a dense top that is not full holds every label
    return ids, combined, exact, delta, at_q, at_c


def _assemble(ids: np.ndarray, combined: np.ndarray, rows: np.ndarray, extra_ids: np.ndarray,
              extra_lexical: np.ndarray, embeddings: torch.Tensor, dense_of, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's top k of its dense top (ids, combined (M, K')) and the labels that enter from outside it
    (rows (P,) ascending, global extra_ids (P,), their lexical scores), those dense-scored by dense_of."""
    m = ids.shape[0]
    bounds = np.searchsorted(rows, np.arange(m + 1))
    out_scores = torch.full((m, k), float("-inf"))
    out_ids = torch.full((m, k), -1, dtype=torch.int64)
    for q in range(m):
        real = ids[q] >= 0
        q_ids, q_scores = ids[q][real], combined[q][real]
        a, b = bounds[q], bounds[q + 1]
        if b > a:
            rescored = dense_of(torch.from_numpy(extra_ids[a:b]), embeddings[q].float()).numpy().astype(np.float64)
            q_ids = np.concatenate([q_ids, extra_ids[a:b]])
            q_scores = np.concatenate([q_scores, rescored + extra_lexical[a:b]])
        take = min(k, q_ids.size)
        pick = np.argsort(-q_scores, kind="stable")[:take]
        out_scores[q, :take] = torch.from_numpy(q_scores[pick].astype(np.float32))
        out_ids[q, :take] = torch.from_numpy(q_ids[pick])
    return out_scores, out_ids
