"""Lexical weights (xc/models/lexical.py): supports against hand-counted sums, step scores and their gradients
against dense brute force, and the inference's top-k against every label scored exactly."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from xc.distributed import DistContext
from xc.eval.inference import ExactSearcher, dense_scores_of, lexical_topk
from xc.models.classifier import ClassifierShard
from xc.models.lexical import (BatchFeatures, LexicalRows, centroid_weights, explained_inputs, label_supports,
                               query_blocks)


@pytest.mark.parametrize("block", [1 << 18, 1, 3])
def test_supports_are_the_largest_summed_features_ties_to_the_lower_id(monkeypatch, block):
    monkeypatch.setattr("xc.models.lexical._SUPPORT_LABELS", block)  # labels summed a block at a time: the same
    # 3 points x 5 features; labels: point 0 -> {0, 1}, point 1 -> {0}, point 2 -> {2}; label 3 has no point
    x = sp.csr_matrix(np.array([[0.5, 0.0, 0.2, 0.0, 0.1],
                                [0.1, 0.3, 0.0, 0.0, 0.3],
                                [0.0, 0.0, 0.0, 0.7, 0.0]], np.float32))
    y = sp.csr_matrix(np.array([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]], np.float32))
    # label 0 sums: f0 0.6, f1 0.3, f2 0.2, f4 0.4 -> f0, f4, f1; label 1: f0 0.5, f2 0.2, f4 0.1
    assert label_supports(x, y, 0, 4, 3).tolist() == [[0, 4, 1], [0, 2, 4], [3, -1, -1], [-1, -1, -1]]
    assert label_supports(x, y, 1, 3, 2).tolist() == [[0, 2], [3, -1]]  # a range [lo, hi) of labels
    tie = sp.csr_matrix(np.array([[0.3, 0.3, 0.3]], np.float32))
    assert label_supports(tie, sp.csr_matrix(np.ones((1, 1), np.float32)), 0, 1, 2).tolist() == [[0, 1]]
    sums = np.full((4, 3), 9.0, np.float32)  # overwritten: each support's summed values, 0 at the pads
    label_supports(x, y, 0, 4, 3, sums)
    np.testing.assert_allclose(sums, [[0.6, 0.4, 0.3], [0.5, 0.2, 0.1], [0.7, 0, 0], [0, 0, 0]], rtol=1e-6)


@pytest.mark.parametrize("block", [1 << 18, 3])
def test_explained_inputs_and_shares_equal_the_dense_em_step(monkeypatch, block):
    """x / (sum of the point's labels' means + the mean input), and each label's share mean_l * (Y^T z), against
    dense products; a block of labels at a time gives the same (3 labels a block over 25)."""
    monkeypatch.setattr("xc.models.lexical._SUPPORT_LABELS", block)
    x = sp.random(60, 40, density=0.2, random_state=1, format="csr", dtype=np.float64)
    y = sp.random(60, 25, density=0.1, random_state=2, format="csr")
    y.data[:] = 1.0
    z = explained_inputs(x, y)
    xd, yd = x.toarray(), y.toarray()
    means = (yd.T @ xd) / np.maximum(yd.sum(0), 1)[:, None]
    zd = np.where(xd > 0, xd / (yd @ means + xd.mean(0)), 0.0)
    np.testing.assert_allclose(z.toarray(), zd, rtol=1e-12, atol=1e-15)
    shares = means * (yd.T @ zd)
    sums = np.zeros((25, 5), np.float32)
    support = label_supports(x.astype(np.float32), y, 0, 25, 5, sums, explained=z)
    for label in range(25):
        want = [f for f in sorted(range(40), key=lambda f: (-shares[label, f], f))[:5] if shares[label, f] > 0]
        assert [f for f in support[label] if f >= 0] == want
        np.testing.assert_allclose(sums[label, :len(want)], shares[label, want], rtol=1e-5)


def test_a_feature_a_frequent_co_label_explains_goes_to_it():
    """Label 1 (one point, beside label 0 on it) sums f0 0.8 > f1 0.6 on its point, but label 0 puts f0 on all its
    five points: explained, label 1 keeps 0.235 of f0 and 0.429 of f1, so f1 comes first (hand-computed)."""
    x = sp.csr_matrix(np.array([[0.8, 0.6]] + [[1.0, 0.0]] * 4))
    y = sp.csr_matrix(np.array([[1.0, 1.0]] + [[1.0, 0.0]] * 4))
    assert label_supports(x, y, 1, 2, 2).tolist() == [[0, 1]]
    sums = np.zeros((1, 2), np.float32)
    assert label_supports(x, y, 1, 2, 2, sums, explained=explained_inputs(x, y)).tolist() == [[1, 0]]
    np.testing.assert_allclose(sums, [[0.6 * 0.6 / 0.84, 0.8 * 0.8 / 2.72]], rtol=1e-5)
    with pytest.raises(ValueError, match="non-negative"):
        explained_inputs(sp.csr_matrix(np.array([[0.5, -0.1]])), sp.csr_matrix(np.ones((1, 1))))


def test_centroid_start_scales_each_label_to_the_norm_and_scores_its_own_point():
    # label 0: sums (3, 4) -> norm 5; label 1: no training point -> stays 0
    start = centroid_weights(np.array([[3.0, 4.0], [0.0, 0.0]], np.float32), 10.0)
    np.testing.assert_allclose(start, [[6.0, 8.0], [0.0, 0.0]], rtol=1e-6)
    assert start.dtype == np.float32
    # built into the weights: a query equal to the label's one point scores scale x |x on the support|
    support = np.array([[1, 3], [-1, -1]], np.int32)
    rows = LexicalRows.build(support, 0, 2, 2, 5, 0, torch.device("cpu"), start)
    assert rows.values.weight.tolist() == [[6.0, 8.0], [0.0, 0.0]]
    ids, offsets, values = torch.tensor([1, 3]), torch.tensor([0]), torch.tensor([0.6, 0.8])
    scores = rows.query_scores({"feat_ids": ids, "feat_offsets": offsets, "feat_values": values}).toarray()
    np.testing.assert_allclose(scores, [[10.0, 0.0]], rtol=1e-6)


def _batch(gen, batch, num_features, per_row):
    ids = [torch.randperm(num_features, generator=gen)[:n] for n in per_row]
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(per_row)[:-1]]), dtype=torch.int64)
    flat = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    return flat, offsets, torch.rand(flat.numel(), generator=gen) + 0.1


@pytest.mark.parametrize("with_lookup", [False, True])
def test_step_scores_and_gradients_equal_dense_products(with_lookup):
    gen = torch.Generator().manual_seed(0)
    num_features, labels, width, batch = 40, 12, 5, 6
    flat, offsets, values = _batch(gen, batch, num_features, [7, 0, 3, 12, 1, 9])  # row 1 has no feature
    support = torch.randint(-1, num_features, (labels, width), generator=gen)
    weights = torch.randn(labels, width, generator=gen)
    x = torch.zeros(batch, num_features)
    rows = torch.repeat_interleave(torch.arange(batch), torch.tensor([7, 0, 3, 12, 1, 9]))
    x[rows, flat] = values
    w = torch.zeros(labels, num_features)  # the same weights as dense vectors (-1 pads carry nothing)
    for l in range(labels):
        for s in range(width):
            if support[l, s] >= 0:
                w[l, support[l, s]] += weights[l, s]
    lookup = torch.full((num_features + 1,), -1, dtype=torch.int64) if with_lookup else None
    feats = BatchFeatures(flat, offsets, values, batch, lookup)
    columns = feats.columns(support)
    if lookup is not None:
        assert (lookup == -1).all()  # reset for the next batch
    leaf = weights.clone().requires_grad_(True)
    inverse = torch.randint(0, labels, (batch, 4), generator=gen)
    picks = torch.tensor([3, 0, 11, 3])
    pair, shared = feats.pair_scores(columns, leaf, inverse), feats.shared_scores(columns, leaf, picks)
    full = x @ w.t()  # (B, L)
    torch.testing.assert_close(pair, full.gather(1, inverse))
    torch.testing.assert_close(shared, full[:, picks])
    (pair.sum() + 2 * shared.sum()).backward()
    dense_w = w.clone().requires_grad_(True)
    ((x @ dense_w.t()).gather(1, inverse).sum() + 2 * (x @ dense_w.t())[:, picks].sum()).backward()
    expected = torch.stack([torch.stack([dense_w.grad[l, f] if f >= 0 else torch.tensor(0.0) for f in support[l]])
                            for l in range(labels)])
    # a feature listed twice in a support gets each slot the same gradient
    torch.testing.assert_close(leaf.grad, expected)


def _model(gen, labels, dim, width, num_features, lo=0):
    shard = ClassifierShard(lo, lo + labels, lo + labels, dim, 1.0, 0, torch.device("cpu"))
    support = np.stack([np.sort(np.random.default_rng(l).choice(num_features, width, replace=False))
                        for l in range(labels)]).astype(np.int32)
    lexical = LexicalRows.build(support, lo, lo + labels, lo + labels, num_features, 0, torch.device("cpu"))
    lexical.values.weight.copy_(torch.randn(labels, width, generator=gen) * 3)
    return shard, lexical


@pytest.mark.parametrize("dense_k, bias", [(3, False), (6, False), (40, True)])
def test_rerank_is_the_exact_top_k_of_dense_plus_lexical(dense_k, bias):
    gen = torch.Generator().manual_seed(1)
    labels, dim, width, num_features, m, k, lo = 40, 8, 4, 30, 25, 3, 100
    shard, lexical = _model(gen, labels, dim, width, num_features, lo)
    if bias:
        shard.score_bias = torch.randn(labels, generator=gen)
    flat, offsets, values = _batch(gen, m, num_features, [int(n) for n in torch.randint(0, 8, (m,), generator=gen)])
    inputs = {"feat_ids": flat, "feat_offsets": offsets, "feat_values": values}
    emb = torch.randn(m, dim, generator=gen)
    dense = emb @ shard.weight.t() + (shard.score_bias if bias else 0.0)
    top, local = torch.topk(dense, dense_k)
    scores, ids, exact = lexical.rerank(inputs, emb, top, local + lo, k,
                                        lambda i, e: dense_scores_of(shard, i, e, shard.score_bias))
    if dense_k == 3:  # negative lexical weights take some queries' top k below the dense floor: not settled
        assert not exact.all()
    deeper = lexical_topk(lexical, shard, ExactSearcher(shard), lambda rows: _rows_of(inputs, rows), np.arange(m),
                          emb, top, local + lo, k, dense_k, DistContext())
    total = dense + torch.from_numpy(lexical.query_scores(inputs).toarray())
    want_scores, want_local = torch.topk(total, k)
    torch.testing.assert_close(scores[exact], want_scores[exact])  # every settled query exactly
    assert torch.equal(ids[exact], (want_local + lo)[exact])
    torch.testing.assert_close(deeper[0], want_scores)  # and every query once ranked deeper where needed
    assert torch.equal(deeper[1], want_local + lo)


def _rows_of(inputs, rows):
    """The encoder inputs of a subset of the batch's rows."""
    offsets = np.append(inputs["feat_offsets"].numpy(), inputs["feat_ids"].numel())
    parts = [np.arange(offsets[r], offsets[r + 1]) for r in rows]
    take = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))
    lengths = np.array([len(p) for p in parts], np.int64)
    return {"feat_ids": inputs["feat_ids"][take], "feat_offsets": torch.from_numpy(np.cumsum(lengths) - lengths),
            "feat_values": inputs["feat_values"][take]}


def test_rerank_pads_where_fewer_labels_than_k():
    gen = torch.Generator().manual_seed(2)
    shard, lexical = _model(gen, 2, 4, 2, 10)
    inputs = {"feat_ids": torch.tensor([0, 1]), "feat_offsets": torch.tensor([0]), "feat_values": torch.ones(2)}
    emb = torch.randn(1, 4, generator=gen)
    dense = emb @ shard.weight.t()
    top, ids = torch.topk(dense, 2)
    top = torch.cat([top, torch.tensor([[float("-inf")]])], 1)
    ids = torch.cat([ids, torch.tensor([[-1]])], 1)
    scores, out, exact = lexical.rerank(inputs, emb, top, ids, 3, lambda i, e: dense_scores_of(shard, i, e))
    assert exact.all()  # every label ranked
    assert sorted(out[0, :2].tolist()) == [0, 1] and out[0, 2] == -1 and scores[0, 2] == float("-inf")


def test_query_blocks_keep_each_block_within_the_budget():
    indptr = np.array([0, 2, 2, 5, 6, 8])  # query 1 has no feature
    bound = np.array([4, 99, 3, 5, 2])  # 99: what reduceat reads for an empty row, which bounds at 0
    assert query_blocks(bound, indptr, 7) == [3, 5]  # 4 + 0 + 3, then 5 + 2
    assert query_blocks(bound, indptr, 100) == [5]
    assert query_blocks(bound, indptr, 1) == [1, 3, 4, 5]  # a query over the budget still makes a block
    assert query_blocks(None, np.array([0, 0, 0]), 5) == [2]
    assert query_blocks(None, np.array([0]), 5) == []


def test_checkpoint_state_round_trips_and_refuses_another_support():
    gen = torch.Generator().manual_seed(3)
    _, lexical = _model(gen, 5, 4, 3, 20)
    _, other = _model(torch.Generator().manual_seed(4), 5, 4, 3, 20)
    other.load_state_dict(lexical.state_dict())
    assert torch.equal(other.support, lexical.support) and torch.equal(other.values.weight, lexical.values.weight)
    _, wider = _model(gen, 5, 4, 4, 20)
    with pytest.raises(ValueError, match="lexical support"):
        wider.load_state_dict(lexical.state_dict())


def test_rerank_in_small_blocks_ranks_as_in_one(monkeypatch):
    """More features than labels, the sparse scores held a few queries at a time: the same ranking."""
    gen = torch.Generator().manual_seed(5)
    labels, dim, m, k = 20, 6, 30, 4
    shard, lexical = _model(gen, labels, dim, 5, 200)
    flat, offsets, values = _batch(gen, m, 200, [int(n) for n in torch.randint(0, 40, (m,), generator=gen)])
    inputs = {"feat_ids": flat, "feat_offsets": offsets, "feat_values": values}
    emb = torch.randn(m, dim, generator=gen)
    top, local = torch.topk(emb @ shard.weight.t(), labels)
    whole = lexical.rerank(inputs, emb, top, local, k, lambda i, e: dense_scores_of(shard, i, e))
    monkeypatch.setattr("xc.models.lexical._SCORE_ENTRIES", 3)
    blocks = lexical.rerank(inputs, emb, top, local, k, lambda i, e: dense_scores_of(shard, i, e))
    assert torch.equal(whole[1], blocks[1]) and torch.equal(whole[0], blocks[0]) and blocks[2].all()


def test_rerank_each_ranks_every_ranking_as_rerank_alone(monkeypatch):
    """Several dense rankings of the same queries (the label prior's betas), their sparse scores computed once and
    held a few queries at a time: each ranked as `rerank` ranks it alone, settled or not."""
    gen = torch.Generator().manual_seed(7)
    labels, dim, m, k, depth = 30, 6, 24, 3, 5
    shard, lexical = _model(gen, labels, dim, 4, 50)
    flat, offsets, values = _batch(gen, m, 50, [int(n) for n in torch.randint(0, 10, (m,), generator=gen)])
    inputs = {"feat_ids": flat, "feat_offsets": offsets, "feat_values": values}
    emb = torch.randn(m, dim, generator=gen)
    biases = [torch.zeros(labels), torch.randn(labels, generator=gen), 3 * torch.randn(labels, generator=gen)]
    rankings = []
    for bias in biases:
        top, local = torch.topk(emb @ shard.weight.t() + bias, depth)
        rankings.append((top, local, lambda i, e, b=bias: dense_scores_of(shard, i, e, b)))
    alone = [lexical.rerank(inputs, emb, top, ids, k, of) for top, ids, of in rankings]
    monkeypatch.setattr("xc.models.lexical._SCORE_ENTRIES", 4)
    each = lexical.rerank_each(inputs, emb, rankings, k)
    assert len(each) == len(rankings)
    for (scores, ids, exact), (want_scores, want_ids, want_exact) in zip(each, alone):
        assert torch.equal(ids, want_ids) and torch.equal(scores, want_scores)
        np.testing.assert_array_equal(exact, want_exact)
    assert not all(exact.all() for _, _, exact in each)  # some query left unsettled at this depth: that case too
    assert not torch.equal(each[0][1], each[2][1])  # the biases rank differently


class _Table(torch.nn.Module):
    """An encoder whose embedding of dataset row r is row r of a fixed table."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, batch):
        return self.table[batch["row"]]


def test_every_beta_in_one_pass_ranks_as_predict_under_that_beta():
    from xc.eval.inference import predict
    from xc.fitting.label_prior import install, lexical_topk_per_beta

    gen = torch.Generator().manual_seed(6)
    labels, dim, m, k = 50, 6, 40, 5
    shard, lexical = _model(gen, labels, dim, 4, 60)
    shard.lexical = lexical
    per_row = [int(n) for n in torch.randint(0, 12, (m,), generator=gen)]
    flat, offsets, values = _batch(gen, m, 60, per_row)
    every = {"feat_ids": flat, "feat_offsets": offsets, "feat_values": values}
    table = torch.randn(m, dim, generator=gen)

    def inputs(rows):
        return {**_rows_of(every, rows), "row": torch.from_numpy(np.asarray(rows, np.int64))}

    rows = np.arange(m, dtype=np.int64)
    log_counts = torch.log1p(torch.randint(0, 30, (labels,), generator=gen).float())
    betas = [0.0, 1.0, -2.0]
    ranked = lexical_topk_per_beta(table, shard, inputs, rows, log_counts, betas, k, DistContext())
    assert shard.score_bias is None  # left as it was
    for b in betas:
        install(shard, b, log_counts)
        want = predict(_Table(table), shard, inputs, rows, k, 16, DistContext())[1]
        shard.score_bias = None
        np.testing.assert_array_equal(ranked[b][1], want)
