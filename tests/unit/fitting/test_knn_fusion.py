"""kNN votes, neighbour search, fusion and the validation split against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from xc.data.inputs import split_validation
from xc.data.sparse import SparseMatrix
from xc.fitting.fusion import Candidates, FusionChoice, build_candidates, choose
from xc.fitting.knn import (LabelVotes, Neighbours, dense_neighbours, input_vectors, input_weights, labels_csr,
                            query_blocks, sparse_neighbours)


def _sparse(rows: list[list[tuple[int, float]]], num_cols: int) -> SparseMatrix:
    indptr = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    indices = np.array([c for r in rows for c, _ in r], np.int32)
    values = np.array([v for r in rows for _, v in r], np.float32)
    return SparseMatrix(indptr, indices, values, num_cols)


def test_label_votes_match_hand_computed_values():
    # memory point 0 has labels {1, 2}; point 1 has {2}; point 2 has {0}
    memory = sp.csr_matrix(np.array([[0, 1, 1], [0, 0, 1], [1, 0, 0]], np.float32))
    nbrs = Neighbours(sims=np.array([[0.6, 0.2, 0.0], [0.5, 0.5, 0.0]], np.float32),
                      ids=np.array([[0, 1, -1], [2, 0, -1]]))
    votes = LabelVotes(nbrs, memory, num_labels=3)
    # query 0: label 1 = 0.6/0.8, label 2 = (0.6+0.2)/0.8 = 1; query 1: label 0 = 0.5, 1 = 0.5, 2 = 0.5
    got = votes.lookup(np.array([[0, 1, 2], [0, 1, 2]]))
    np.testing.assert_allclose(got, [[0.0, 0.75, 1.0], [0.5, 0.5, 0.5]], rtol=1e-6)
    top_votes, top_ids = votes.top(2)
    np.testing.assert_array_equal(top_ids, [[2, 1], [0, 1]])  # ties ordered by label id
    np.testing.assert_allclose(top_votes, [[1.0, 0.75], [0.5, 0.5]], rtol=1e-6)
    assert votes.lookup(np.array([[-1, 0], [2, -1]])).tolist() == [[0.0, 0.0], [0.5, 0.0]]


def test_sparse_neighbours_equal_brute_force_cosine():
    rng = np.random.default_rng(0)
    dense_mem = (rng.random((60, 30)) < 0.2) * rng.random((60, 30))
    dense_q = (rng.random((25, 30)) < 0.2) * rng.random((25, 30))
    mem = input_vectors(SparseMatrix.from_scipy(sp.csr_matrix(dense_mem.astype(np.float32))), None)
    q = input_vectors(SparseMatrix.from_scipy(sp.csr_matrix(dense_q.astype(np.float32))), None)
    got = sparse_neighbours(q, mem, 7)
    sims = q.toarray() @ mem.toarray().T
    for i in range(25):
        positive = np.nonzero(sims[i] > 0)[0]
        want = positive[np.lexsort((positive, -sims[i, positive]))][:7]
        assert got.ids[i, :len(want)].tolist() == want.tolist()
        np.testing.assert_allclose(got.sims[i, :len(want)], sims[i, want], rtol=1e-5)
        assert (got.ids[i, len(want):] == -1).all()
    dense = dense_neighbours(torch.from_numpy(q.toarray()), torch.from_numpy(mem.toarray()), 7)
    agree = np.mean([len(set(a[a >= 0]) & set(b[b >= 0])) / max(1, (b >= 0).sum()) for a, b in zip(dense.ids, got.ids)])
    assert agree > 0.99


def test_query_blocks_bound_the_product_and_leave_the_neighbours_unchanged():
    rng = np.random.default_rng(1)
    dense_mem = (rng.random((80, 40)) < 0.15) * rng.random((80, 40))
    dense_mem[:, 0] = 1.0  # a background feature every memory point holds: each query pairs with all of them
    dense_q = (rng.random((30, 40)) < 0.15) * rng.random((30, 40))
    dense_q[::3, 0] = 0.5
    dense_q[7] = 0.0  # a query without features
    mem = input_vectors(SparseMatrix.from_scipy(sp.csr_matrix(dense_mem.astype(np.float32))), None)
    q = input_vectors(SparseMatrix.from_scipy(sp.csr_matrix(dense_q.astype(np.float32))), None)
    memory_t = mem.T.tocsr()
    pairs = ((dense_q > 0).astype(np.int64) @ (dense_mem > 0).astype(np.int64).T).sum(1)  # per query, by hand
    for max_pairs in (1, 60, 200, 10**9):
        blocks = query_blocks(q, memory_t, max_pairs)
        assert blocks[0][0] == 0 and blocks[-1][1] == 30
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))  # consecutive, covering every query
        for start, stop in blocks:
            assert stop - start == 1 or pairs[start:stop].sum() <= max_pairs
            product = q[start:stop] @ memory_t
            assert product.nnz <= max(max_pairs, pairs[start:stop].sum())
    assert len(query_blocks(q, memory_t, 10**9)) == 1 and len(query_blocks(q, memory_t, 1)) == 30
    one = sparse_neighbours(q, mem, 5, max_pairs=10**9)
    for max_pairs in (1, 200):
        got = sparse_neighbours(q, mem, 5, max_pairs=max_pairs)
        np.testing.assert_array_equal(got.ids, one.ids)
        np.testing.assert_array_equal(got.sims, one.sims)


@pytest.mark.parametrize("empty_rows", [[4], [0, 4], [1, 2], [0, 1, 2, 3, 4]])
def test_queries_without_features_anywhere_get_no_neighbours(empty_rows):
    """A query row with no features (an empty input line, or only zero values), first, last or in between, pairs
    with nothing: np.add.reduceat gave such a last row an IndexError, an inner one its neighbour's count."""
    rng = np.random.default_rng(2)
    dense_mem = (rng.random((20, 12)) < 0.3) * rng.random((20, 12))
    dense_q = (rng.random((5, 12)) < 0.4) * rng.random((5, 12)) + (rng.random((5, 12)) < 0.1)
    dense_q[empty_rows] = 0.0
    mem = input_vectors(SparseMatrix.from_scipy(sp.csr_matrix(dense_mem.astype(np.float32))), None)
    q = input_vectors(SparseMatrix.from_scipy(sp.csr_matrix(dense_q.astype(np.float32))), None)
    memory_t = mem.T.tocsr()
    pairs = ((dense_q > 0).astype(np.int64) @ (dense_mem > 0).astype(np.int64).T).sum(1)
    for max_pairs in (1, 10**9):
        blocks = query_blocks(q, memory_t, max_pairs)
        assert blocks[0][0] == 0 and blocks[-1][1] == 5
        assert all(stop - start == 1 or pairs[start:stop].sum() <= max_pairs for start, stop in blocks)
    got = sparse_neighbours(q, mem, 3)
    assert (got.ids[empty_rows] == -1).all() and (got.sims[empty_rows] == 0).all()


def test_input_weights_rule():
    binary = _sparse([[(0, 1.0), (1, 1.0)], [(1, 1.0)], [(2, 1.0)], [(1, 1.0)]], 40)
    w = input_weights(binary, text_features=False)
    np.testing.assert_allclose(w[:3], np.log(5.0 / np.array([2.0, 4.0, 2.0])) + 1.0, rtol=1e-6)
    assert input_weights(binary, text_features=True) is None  # tf-idf made at convert time is used as is
    dense = SparseMatrix.from_scipy(sp.csr_matrix(np.ones((4, 3), np.float32)))
    assert input_weights(dense, text_features=False) is None


class _FixedScorer:
    """A model whose score for label l is table[query, l]."""

    loss = "bce"

    def __init__(self, table):
        self.table = table

    def scores_of(self, emb, ids):
        out = np.take_along_axis(self.table, np.maximum(ids, 0), 1).astype(np.float32)
        return np.where(ids >= 0, out, -np.inf)

    def probabilities(self, scores):
        return 1.0 / (1.0 + np.exp(-np.clip(scores, -50, 50)))


def _candidates():
    table = np.array([[3.0, 1.0, 0.0, -1.0, -2.0], [0.0, 2.0, 1.0, -3.0, 0.5]])
    model_ids = np.argsort(-table, 1)[:, :2]
    model_scores = np.take_along_axis(table, model_ids, 1)
    memory = sp.csr_matrix(np.array([[0, 0, 0, 1, 0], [0, 0, 0, 1, 1], [1, 0, 0, 0, 0]], np.float32))
    nbrs = Neighbours(np.array([[0.9, 0.8], [0.7, 0.1]], np.float32), np.array([[0, 1], [1, 2]]))
    votes = LabelVotes(nbrs, memory, 5)
    return build_candidates(_FixedScorer(table), None, model_scores, model_ids, votes, 2), model_ids


def test_fusion_with_lambda_zero_is_the_plain_model_and_one_is_the_vote():
    cands, model_ids = _candidates()
    _, ids0 = cands.fuse(0.0, 2)
    np.testing.assert_array_equal(ids0, model_ids)
    _, ids1 = cands.fuse(1.0, 1)
    assert ids1[:, 0].tolist() == [3, 3]  # label 3 carries both neighbours' votes in both queries
    # candidates hold every label once
    for row in cands.ids:
        real = row[row >= 0]
        assert len(real) == len(set(real.tolist()))


def test_fused_score_is_the_stated_mixture():
    cands, _ = _candidates()
    scores, ids = cands.fuse(0.3, 4)
    table = np.array([[3.0, 1.0, 0.0, -1.0, -2.0], [0.0, 2.0, 1.0, -3.0, 0.5]])
    vote = {(0, 3): 1.0, (0, 4): 0.8 / 1.7, (1, 3): 0.7 / 0.8, (1, 4): 0.7 / 0.8, (1, 0): 0.1 / 0.8}
    for q in range(2):
        for s, l in zip(scores[q], ids[q]):
            if l < 0:
                continue
            p = 1.0 / (1.0 + np.exp(-table[q, l]))
            assert s == pytest.approx(0.7 * p + 0.3 * vote.get((q, int(l)), 0.0), rel=1e-5)


def test_choose_prefers_the_best_then_the_smaller_lambda():
    ids = np.array([[1, 2], [3, 4]])
    flat = Candidates(ids, np.array([[0.9, 0.1], [0.9, 0.1]], np.float32), np.zeros((2, 2), np.float32))
    choice, tried = choose({("input", 5): flat}, [1.0, 0.5, 0.0], 1, lambda pred: 1.0)
    assert choice == FusionChoice(0.0, 5, "input") and len(tried) == 3  # all equal: no memory
    helps = Candidates(ids, np.array([[0.9, 0.1], [0.9, 0.1]], np.float32), np.array([[0, 1], [0, 1]], np.float32))
    choice, _ = choose({("input", 5): flat, ("embedding", 10): helps}, [0.0, 0.2, 0.8, 1.0], 1,
                       lambda pred: float((pred[:, 0] == ids[:, 1]).mean()))
    assert choice == FusionChoice(0.8, 10, "embedding")  # smallest lambda that flips to the voted label


def test_validation_split_is_disjoint_seeded_and_capped():
    train, valid = split_validation(1000, 0.1, 0, seed=3)
    assert len(valid) == 100 and len(train) == 900
    assert not set(train.tolist()) & set(valid.tolist())
    again = split_validation(1000, 0.1, 0, seed=3)
    assert np.array_equal(again[1], valid) and not np.array_equal(split_validation(1000, 0.1, 0, seed=4)[1], valid)
    assert len(split_validation(1000, 0.1, 30, seed=3)[1]) == 30
    train, valid = split_validation(1000, 0.0, 0, seed=3)
    assert len(valid) == 0 and np.array_equal(train, np.arange(1000))


def test_labels_csr_rows():
    labels = SparseMatrix(np.array([0, 2, 2, 3], np.int64), np.array([1, 4, 0], np.int32), None, 5)
    m = labels_csr(labels, np.array([2, 0]))
    assert m.toarray().tolist() == [[1, 0, 0, 0, 0], [0, 1, 0, 0, 1]]


def test_mixed_votes_average_the_spaces():
    from xc.fitting.knn import MixedVotes

    memory = sp.csr_matrix(np.array([[0, 1, 1], [0, 0, 1], [1, 0, 0]], np.float32))
    a = LabelVotes(Neighbours(np.array([[0.6, 0.2]], np.float32), np.array([[0, 1]])), memory, 3)  # 1: .75, 2: 1
    b = LabelVotes(Neighbours(np.array([[0.5, 0.5]], np.float32), np.array([[2, 1]])), memory, 3)  # 0: .5, 2: .5
    mixed = MixedVotes([a, b])
    np.testing.assert_allclose(mixed.lookup(np.array([[0, 1, 2]])), [[0.25, 0.375, 0.75]], rtol=1e-6)
    votes, ids = mixed.top(3)
    assert ids.tolist() == [[2, 1, 0]]
    np.testing.assert_allclose(votes, [[0.75, 0.375, 0.25]], rtol=1e-6)


def test_tempered_probabilities_are_the_stated_softmax_and_sigmoid():
    scores = np.array([[2.0, 0.0, -np.inf], [1.0, 1.0, 3.0]])
    ids = np.array([[4, 7, -1], [1, 2, 3]])
    soft = Candidates(ids, np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32), (scores,), "softmax")
    p = soft.at_temperature(2.0).p_model
    e = np.exp(np.array([1.0, 0.0]))
    np.testing.assert_allclose(p[0], [e[0] / e.sum(), e[1] / e.sum(), 0.0], rtol=1e-6)
    np.testing.assert_allclose(p[1], np.exp([0.5, 0.5, 1.5]) / np.exp([0.5, 0.5, 1.5]).sum(), rtol=1e-6)
    bce = Candidates(ids, np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32), (scores,), "bce")
    np.testing.assert_allclose(bce.at_temperature(4.0).p_model[1], 1 / (1 + np.exp(-np.array([0.25, 0.25, 0.75]))),
                               rtol=1e-6)
    # two averaged models: the mean of their tempered probabilities
    both = Candidates(ids, np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32), (scores, 2 * scores), "bce")
    sig = lambda z: np.where(ids >= 0, 1 / (1 + np.exp(-np.clip(z, -50, 50))), 0.0)  # noqa: E731
    np.testing.assert_allclose(both.at_temperature(2.0).p_model, (sig(scores / 2) + sig(scores)) / 2, rtol=1e-6)
    assert soft.at_temperature(1.0) is soft


def test_temperature_keeps_lambda_zero_the_plain_model_and_changes_the_mixture():
    cands, model_ids = _candidates()  # BCE scorer: p = sigmoid(score / T)
    for t in (0.5, 2.0, 8.0):
        np.testing.assert_array_equal(cands.at_temperature(t).fuse(0.0, 2)[1], model_ids)
    scores, ids = cands.at_temperature(2.0).fuse(0.3, 4)
    table = np.array([[3.0, 1.0, 0.0, -1.0, -2.0], [0.0, 2.0, 1.0, -3.0, 0.5]])
    vote = {(0, 3): 1.0, (0, 4): 0.8 / 1.7, (1, 3): 0.7 / 0.8, (1, 4): 0.7 / 0.8, (1, 0): 0.1 / 0.8}
    for q in range(2):
        for s, l in zip(scores[q], ids[q]):
            if l >= 0:
                p = 1.0 / (1.0 + np.exp(-table[q, l] / 2.0))
                assert s == pytest.approx(0.7 * p + 0.3 * vote.get((q, int(l)), 0.0), rel=1e-5)


def test_choose_picks_a_temperature_only_when_it_is_better():
    # query 0: the model prefers label 1 (scores 2 vs 0), the vote label 2; a softer model lets lambda 0.5 flip it
    ids = np.array([[1, 2]])
    scores = np.array([[2.0, 0.0]])
    p1 = np.exp(scores) / np.exp(scores).sum()
    cands = Candidates(ids, p1.astype(np.float32), np.array([[0.0, 0.6]], np.float32), (scores,), "softmax")
    wants_vote = lambda pred: float(pred[0, 0] == 2)  # noqa: E731
    choice, tried = choose({("input", 5): cands}, [0.0, 0.5], 1, wants_vote, [1.0, 4.0])
    # T = 1: 0.5 * 0.88 > 0.5 * (0.12 + 0.6), the model wins; T = 4: p = (0.62, 0.38), the vote wins
    assert choice == FusionChoice(0.5, 5, "input", 4.0) and len(tried) == 4
    choice, _ = choose({("input", 5): cands}, [0.0, 0.5], 1, lambda pred: 1.0, [4.0, 1.0])
    assert choice == FusionChoice(0.0, 5, "input", 1.0)  # a tie keeps the plain model
    assert FusionChoice(0.5, 5, "input", 4.0).as_dict()["temperature"] == 4.0


def test_input_vectors_are_weighted_unit_rows_and_leave_the_matrix_alone(monkeypatch):
    import xc.fitting.knn as knn

    monkeypatch.setattr(knn, "_NORM_BLOCK_ROWS", 2)  # rows in blocks: a block boundary inside the matrix
    matrix = _sparse([[(0, 3.0), (2, 4.0)], [], [(1, 1.0)], [(0, 1.0), (1, 1.0), (2, 2.0)]], 3)
    kept = matrix.values.copy()
    weights = np.array([2.0, 1.0, 0.5], np.float32)
    # row 0: (6, 2) / sqrt(40); row 1 stays empty; row 2: (0, 1, 0); row 3: (2, 1, 1) / sqrt(6)
    expected = np.array([[6, 0, 2] / np.sqrt(40), [0, 0, 0], [0, 1, 0], [2, 1, 1] / np.sqrt(6)], np.float32)
    for rows in (None, np.arange(4), np.array([3, 0])):
        out = input_vectors(matrix, weights, rows)
        assert out.dtype == np.float32
        np.testing.assert_allclose(out.toarray(), expected if rows is None else expected[rows], rtol=1e-6)
        assert not np.shares_memory(out.data, matrix.values) and not np.shares_memory(out.indices, matrix.indices)
    np.testing.assert_array_equal(matrix.values, kept)
    unweighted = input_vectors(matrix, None)
    np.testing.assert_allclose(unweighted.toarray()[0], [0.6, 0.0, 0.8], rtol=1e-6)
