"""The split input-space search (xc/fitting/split_search.py) against brute-force cosines and the sparse search."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import xc.fitting.split_search as split
from xc.fitting.knn import _l2_rows, sparse_neighbours


def _zipf_rows(rng: np.random.Generator, count: int, num_features: int = 300, per_row: int = 12) -> sp.csr_matrix:
    """L2-normalised rows whose features follow a Zipf law: a few features in most rows, as background words are."""
    p = 1.0 / np.arange(1, num_features + 1) ** 1.1
    p /= p.sum()
    rows = [np.unique(rng.choice(num_features, per_row, p=p)) for _ in range(count)]
    matrix = sp.csr_matrix((np.concatenate([rng.random(len(r)) + 0.1 for r in rows]).astype(np.float32),
                            np.concatenate(rows), np.r_[0, np.cumsum([len(r) for r in rows])]),
                           shape=(count, num_features))
    return _l2_rows(matrix)


@pytest.fixture
def split_always(monkeypatch):
    """Take the split at any size (its rule is for millions of memory points)."""
    monkeypatch.setattr(split, "SPLIT_MIN_POINTS", 0)
    monkeypatch.setattr(split, "SPLIT_MIN_LINKS", 0.0)


def test_the_split_search_equals_brute_force_cosines(split_always, monkeypatch):
    rng = np.random.default_rng(0)
    memory, queries = _zipf_rows(rng, 400), _zipf_rows(rng, 90)
    monkeypatch.setattr(split, "SCORE_BLOCK_FLOATS", 400 * 16)  # blocks of 16 queries: the pipeline over 6 blocks
    frequent = split.frequent_features(queries, memory.T.tocsr())
    assert frequent is not None and 5 < len(frequent) < 300
    sims, ids = split.split_topk(queries, memory, memory.T.tocsr(), 9, frequent)
    exact = queries.toarray() @ memory.toarray().T
    for i in range(len(exact)):
        positive = np.nonzero(exact[i] > 0)[0]
        want = positive[np.lexsort((positive, -exact[i, positive]))][:9]
        np.testing.assert_allclose(sims[i, :len(want)], exact[i, want], rtol=1e-5)
        # the same neighbours in the same order, but where two cosines are equal to float rounding
        np.testing.assert_allclose(exact[i, ids[i, :len(want)]], exact[i, want], rtol=1e-5)
        assert (ids[i, :len(want)] == want).mean() > 0.8
        assert (ids[i, len(want):] == -1).all() and (sims[i, len(want):] == 0).all()


def test_sparse_neighbours_take_the_split_where_the_rule_says_and_find_the_same_neighbours(split_always):
    rng = np.random.default_rng(1)
    memory, queries = _zipf_rows(rng, 300), _zipf_rows(rng, 50)
    split_found = sparse_neighbours(queries, memory, 7)
    split.SPLIT_MIN_LINKS = float("inf")  # the sparse product alone (monkeypatch restores it)
    sparse_found = sparse_neighbours(queries, memory, 7)
    assert (split_found.ids == sparse_found.ids).mean() > 0.99
    np.testing.assert_allclose(split_found.sims, sparse_found.sims, atol=1e-6)


def test_frequent_features_are_the_most_frequent_within_the_share_and_the_cap(monkeypatch):
    rng = np.random.default_rng(2)
    memory, queries = _zipf_rows(rng, 500), _zipf_rows(rng, 40)
    memory_t = memory.T.tocsr()
    assert split.frequent_features(queries, memory_t) is None  # 500 memory points: under SPLIT_MIN_POINTS
    monkeypatch.setattr(split, "SPLIT_MIN_POINTS", 0)
    links = split.exact_products(queries, memory_t) / (40 * 500)  # products a query per memory point
    monkeypatch.setattr(split, "SPLIT_MIN_LINKS", links * 1.01)
    assert split.frequent_features(queries, memory_t) is None  # the sparse product links too few points
    monkeypatch.setattr(split, "SPLIT_MIN_LINKS", links * 0.99)
    df = np.diff(memory_t.indptr)
    chosen = split.frequent_features(queries, memory_t)
    assert (df[chosen] >= split.SPLIT_MIN_SHARE * 500).all() and list(df[chosen]) == sorted(df[chosen], reverse=True)
    assert len(chosen) == (df >= split.SPLIT_MIN_SHARE * 500).sum()
    monkeypatch.setattr(split, "SPLIT_DENSE_FLOATS", 500 * 4)  # room for 4 dense features
    assert list(split.frequent_features(queries, memory_t)) == list(chosen[:4])


def test_bounded_blocks_find_the_same_neighbours_and_hold_their_pairs_and_rows(split_always, monkeypatch):
    """Each block of the split is bounded twice, by its dense scores' floats and by its sparse product's pairs: the
    neighbours do not depend on either bound, and no block holds more than both allow (one query alone may)."""
    rng = np.random.default_rng(3)
    memory, queries = _zipf_rows(rng, 400), _zipf_rows(rng, 60)
    memory_t = memory.T.tocsr()
    frequent = split.frequent_features(queries, memory_t)
    whole = split.split_topk(queries, memory, memory_t, 8, frequent)
    seen = []
    real_blocks = split.query_blocks
    monkeypatch.setattr(split, "query_blocks", lambda *a, **kw: seen.append(real_blocks(*a, **kw)) or seen[-1])
    for floats, pairs in ((400 * 7, 1 << 40), (1 << 40, 50), (400 * 3, 1)):
        monkeypatch.setattr(split, "SCORE_BLOCK_FLOATS", floats)
        monkeypatch.setattr(split, "SPLIT_BLOCK_PAIRS", pairs)
        sims, ids = split.split_topk(queries, memory, memory_t, 8, frequent)
        np.testing.assert_array_equal(ids, whole[1])
        np.testing.assert_allclose(sims, whole[0], rtol=1e-6)
        blocks = seen[-1]
        assert blocks[0][0] == 0 and blocks[-1][1] == 60 and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        assert all(stop - start <= max(1, floats // 400) for start, stop in blocks)
        assert len(blocks) > 1
    assert len(seen[1]) > len(real_blocks(queries, memory_t, 1 << 40, max_rows=60))  # the pair bound split them


def test_query_blocks_hold_at_most_max_rows_queries():
    rng = np.random.default_rng(4)
    memory, queries = _zipf_rows(rng, 100), _zipf_rows(rng, 25)
    blocks = split.query_blocks(queries, memory.T.tocsr(), 1 << 40, max_rows=4)
    assert [stop - start for start, stop in blocks] == [4, 4, 4, 4, 4, 4, 1]
    assert split.query_blocks(queries, memory.T.tocsr(), 1 << 40) == [(0, 25)]
