"""Ranking with lexical weights (xc/models/lexical_rank.py): the labels a query's features reach against every
label scored, each label's lexical score against the sparse product, and the top k against dense + lexical brute
force, with negative weights and query values, repeated support features, zero weights and labels on one shard."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from xc.eval.inference import dense_scores_of
from xc.models.classifier import ClassifierShard
from xc.models.lexical import LexicalRows
from xc.models.lexical_rank import FeatureLists, lexical_of, reaching, rerank_block, sorted_queries


def _weights(rng, labels, width, num_features, repeats=False, zeros=0.3):
    support = np.stack([rng.choice(num_features, width, replace=repeats) for _ in range(labels)]).astype(np.int32)
    support[rng.random(support.shape) < 0.1] = -1  # pads
    weights = (rng.standard_normal(support.shape) * 2).astype(np.float32)
    weights[rng.random(support.shape) < zeros] = 0.0  # slots that never left zero
    return support, weights


def _dense_lexical(support, weights, queries):
    """(M, n) every label's lexical score by the sparse product (the reference)."""
    keep = (support >= 0) & (weights != 0)
    w = sp.csr_matrix((weights[keep].astype(np.float64), (support[keep], np.nonzero(keep)[0])),
                      shape=(queries.shape[1], support.shape[0]))
    return (queries.astype(np.float64) @ w).toarray()


def _queries(rng, m, num_features, negative=False):
    dense = rng.random((m, num_features)) * (rng.random((m, num_features)) < 0.2)
    if negative:
        dense *= np.where(rng.random(dense.shape) < 0.3, -1.0, 1.0)
    dense[0] = 0.0  # a query without features
    return sp.csr_matrix(dense.astype(np.float32))


@pytest.mark.parametrize("repeats, negative", [(False, False), (True, False), (False, True)])
def test_lexical_of_equals_the_sparse_product(repeats, negative):
    rng = np.random.default_rng(0)
    support, weights = _weights(rng, 50, 6, 30, repeats)
    queries = sorted_queries(_queries(rng, 9, 30, negative))
    want = _dense_lexical(support, weights, queries)
    rows, local = np.divmod(np.arange(9 * 50), 50)
    np.testing.assert_allclose(lexical_of(queries, support, weights, rows, local), want.ravel(), atol=1e-5)


@pytest.mark.parametrize("repeats, negative", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("reads_per_entry", [0.0, 3.0, np.inf])
def test_reaching_finds_every_label_over_delta(repeats, negative, reads_per_entry, monkeypatch):
    """Each query's labels with lexical score > delta are all reached, for delta >= 0, by the S-term bound's
    prefixes (an entry costing inf: never summed), by the sums over the lists MaxScore keeps (costing 0: every query
    with delta >= 0 summed, where no label holds a feature twice) or by either as the cost model picks; with
    delta < 0 every label sharing a feature; with delta +inf none."""
    monkeypatch.setattr("xc.models.lexical_rank.READS_PER_ENTRY", reads_per_entry)
    rng = np.random.default_rng(1)
    support, weights = _weights(rng, 80, 5, 25, repeats)
    queries = sorted_queries(_queries(rng, 12, 25, negative))
    lexical = _dense_lexical(support, weights, queries)
    lists = FeatureLists.build(support, weights, 25)
    assert lists.distinct is not repeats  # a label holding a feature twice: one feature may give two terms
    delta = np.array([0.0, 0.0, 0.3, 1.0, 2.5, -0.5, np.inf, 0.1, 0.0, 5.0, -np.inf, 0.7])
    rows, local = reaching(lists, queries, delta, support.shape[1], 80)
    found = set(zip(rows.tolist(), local.tolist()))
    assert len(found) == len(rows)  # each pair once
    assert np.all(np.diff(rows * 80 + local) > 0)  # sorted by query, then label
    shares = (abs(queries) @ _shares(support, weights, 25)).toarray() > 0  # (M, n): shares a feature
    for q in range(12):
        if delta[q] == np.inf:
            assert not any(r == q for r, _ in found)
            continue
        want = {(q, l) for l in range(80) if lexical[q, l] > delta[q]} if delta[q] >= 0 else \
            {(q, l) for l in range(80) if shares[q, l]}
        assert want <= found, (q, want - found)
    assert 0 < len(found) < 12 * 80  # the bound left labels out


@pytest.mark.parametrize("skip_share", [0.0, 0.75, 1.0])
def test_summed_lists_find_every_label_over_delta_and_fewer_pairs_than_the_prefixes_where_weights_are_large(
        skip_share, monkeypatch):
    """Weights large against delta (labels started at their centroids): a term above delta / S is common, so the
    prefixes hold most of each list; the sums over the lists MaxScore keeps, the rest bounded by their largest
    terms, find every label over delta and hand fewer pairs to be scored, whatever share of delta the skipped
    lists may give (up to all of it)."""
    monkeypatch.setattr("xc.models.lexical_rank.SKIP_SHARE", skip_share)
    rng = np.random.default_rng(7)
    n, width, num_features = 400, 6, 40
    support = np.stack([rng.choice(num_features, width, replace=False) for _ in range(n)]).astype(np.int32)
    weights = (rng.random(support.shape) * 10).astype(np.float32)
    queries = sorted_queries(_queries(rng, 15, num_features))
    lexical = _dense_lexical(support, weights, queries)
    lists = FeatureLists.build(support, weights, num_features)
    delta = np.quantile(lexical, 0.97, axis=1)  # a handful of labels over delta a query
    delta[0] = 1.0  # the query without features
    found = {}
    for reads in (np.inf, 3.0):
        monkeypatch.setattr("xc.models.lexical_rank.READS_PER_ENTRY", reads)
        rows, local = reaching(lists, queries, delta, width, n)
        assert np.all(np.diff(rows * n + local) > 0)
        found[reads] = set(zip(rows.tolist(), local.tolist()))
    want = {(q, l) for q in range(15) for l in range(n) if lexical[q, l] > delta[q]}
    assert len(want) > 15
    assert want <= found[3.0] and want <= found[np.inf]
    assert len(found[3.0]) < len(found[np.inf])


def _shares(support, weights, num_features):
    """(F, n) 1 where a label has a non-zero weight on a feature."""
    keep = (support >= 0) & (weights != 0)
    return sp.csr_matrix((np.ones(int(keep.sum())), (support[keep], np.nonzero(keep)[0])),
                         shape=(num_features, support.shape[0]))


@pytest.mark.parametrize("seed, k, depth", [(0, 3, 5), (1, 5, 8), (2, 1, 2), (3, 4, 40)])
@pytest.mark.parametrize("reads_per_entry", [0.0, np.inf])
def test_rerank_block_is_the_top_k_of_dense_plus_lexical_where_settled(seed, k, depth, reads_per_entry,
                                                                        monkeypatch):
    """Labels [lo, lo + n) of one shard; a settled query's top k is brute force's, an unsettled one (negative
    weights took its k-th below the dense floor) is reported so; whether the labels that can enter are found by
    the prefixes or by the sums."""
    monkeypatch.setattr("xc.models.lexical_rank.READS_PER_ENTRY", reads_per_entry)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    labels, dim, lo = 40, 6, 1000
    shard = ClassifierShard(lo, lo + labels, lo + labels, dim, 1.0, 0, torch.device("cpu"))
    support, weights = _weights(rng, labels, 4, 30, repeats=seed == 1)
    queries = sorted_queries(_queries(rng, 20, 30, negative=seed == 2))
    emb = torch.randn(20, dim, generator=gen)
    dense = (emb @ shard.weight.t()).double().numpy()
    total = dense + _dense_lexical(support, weights, queries)
    top, local = torch.topk(torch.from_numpy(dense).float(), depth)
    scores, ids, exact = rerank_block(queries, support, weights, FeatureLists.build(support, weights, 30), lo,
                                      emb, top, local + lo, lambda i, e: dense_scores_of(shard, i, e), k)
    want = np.argsort(-total, axis=1, kind="stable")[:, :k]
    for q in np.nonzero(exact)[0]:
        np.testing.assert_allclose(scores[q].numpy(), total[q, want[q]], atol=1e-4)
        assert set(ids[q].tolist()) == set((want[q] + lo).tolist())
    if depth == 40:
        assert exact.all()  # every label in the dense top


def test_lexical_rows_caches_by_feature_until_training_writes():
    rng = np.random.default_rng(4)
    support, weights = _weights(rng, 10, 3, 12, zeros=0.0)
    lexical = LexicalRows.build(support, 0, 10, 10, 12, 0, torch.device("cpu"))
    assert lexical.by_feature().labels.size == 0  # weights start at zero: no list holds a label
    lexical.values.weight.copy_(torch.from_numpy(weights))  # an in-place write, as the optimiser's
    lists = lexical.by_feature()
    assert lists.labels.size == int(((support >= 0) & (weights != 0)).sum())
    assert lexical.by_feature() is lists  # unchanged weights: the same lists
    for f in range(12):  # each feature's labels, largest weight first
        neg = lists.neg_weights[lists.ptr[f]:lists.ptr[f + 1]]
        assert np.all(np.diff(neg) >= 0)


def test_feature_lists_built_a_block_of_labels_at_a_time_are_the_whole_builds(monkeypatch):
    """The per-label checks (distinct supports, |w_l|) made a few labels at a time give what one pass gives, a
    label holding a feature twice found in a later block, and each feature's labels sorted by weight, largest first."""
    rng = np.random.default_rng(4)
    support, weights = _weights(rng, 40, 5, 20, False)  # zero weights (slots that never moved) among them
    whole = FeatureLists.build(support, weights, 20)
    monkeypatch.setattr("xc.models.lexical_rank.LABELS_PER_CHECK", 3)
    blocks = FeatureLists.build(support, weights, 20)
    for name in ("ptr", "labels", "neg_weights", "norms"):
        np.testing.assert_array_equal(getattr(blocks, name), getattr(whole, name))
    assert whole.distinct and blocks.distinct
    assert whole.labels.size == ((support >= 0) & (weights != 0)).sum() < (support >= 0).sum()  # zeros left out
    np.testing.assert_allclose(whole.norms, np.sqrt((weights ** 2 * (support >= 0)).sum(1)), rtol=1e-6)
    for f in range(20):
        seg = whole.neg_weights[whole.ptr[f]:whole.ptr[f + 1]]
        assert (np.diff(seg) >= 0).all()
    repeated = support.copy()
    repeated[37, 1] = repeated[37, 0]  # in the last block
    assert not FeatureLists.build(repeated, weights, 20).distinct


def test_reached_pairs_are_each_pair_sharing_a_feature_once_in_order_where_every_label_can_enter():
    rng = np.random.default_rng(5)
    support, weights = _weights(rng, 60, 5, 20, False)
    queries = sorted_queries(_queries(rng, 10, 20))
    lists = FeatureLists.build(support, weights, 20)
    rows, local = reaching(lists, queries, np.full(10, -np.inf), support.shape[1], 60)
    holds = np.zeros((60, 20), bool)  # label x feature: a non-zero weight
    for label in range(60):
        real = (support[label] >= 0) & (weights[label] != 0)
        holds[label, support[label][real]] = True
    shares = (queries.toarray() != 0).astype(int) @ holds.T.astype(int) > 0  # (10, 60)
    want_rows, want_local = np.nonzero(shares)
    np.testing.assert_array_equal(rows, want_rows)  # ascending by query, then label, each pair once
    np.testing.assert_array_equal(local, want_local)
    assert len(rows) > 100


def test_feature_lists_hold_each_feature_s_weights_largest_first():
    rng = np.random.default_rng(8)
    support, weights = _weights(rng, 300, 6, 25, False)
    weights[:, 0] = np.round(weights[:, 0], 1)  # ties within a feature
    lists = FeatureLists.build(support, weights, 25)
    for f in range(25):
        labels, neg = lists.labels[lists.ptr[f]:lists.ptr[f + 1]], lists.neg_weights[lists.ptr[f]:lists.ptr[f + 1]]
        holders = np.nonzero(((support == f) & (weights != 0)).any(1))[0]
        assert sorted(labels.tolist()) == sorted(holders.tolist())
        np.testing.assert_array_equal(-neg, weights[labels, np.nonzero(support[labels] == f)[1]])
        assert (np.diff(neg) >= 0).all()  # largest weight first, negative weights last
    assert (lists.neg_weights > 0).any() and (lists.neg_weights < 0).any()
