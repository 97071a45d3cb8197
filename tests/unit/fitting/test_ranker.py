"""The lexical ranker (xc/fitting/ranker.py): its pairs, its solve, its rank split and its place in the fusion."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.optimize import minimize

from xc.config import RankerConfig
from xc.fitting.fusion import Candidates, FusionChoice
from xc.fitting.knn import _l2_rows
from xc.fitting.ranker import (NO_EVIDENCE, LexicalRanker, RankerParams, RankerSize, fit_ranker, largest_row_features,
                               neighbour_negatives, pair_features, sigmoid, solve_block, training_pairs)


def _binary(rows: list[list[int]], num_cols: int) -> sp.csr_matrix:
    indptr = np.cumsum([0] + [len(r) for r in rows])
    indices = np.array([c for r in rows for c in r], np.int32)
    return sp.csr_matrix((np.ones(len(indices)), indices, indptr), shape=(len(rows), num_cols))


def _topic_data(num_points: int, num_labels: int = 12, num_features: int = 60, seed: int = 0):
    """Each label owns 4 features; a point of label l carries 2 of them and 3 of the features past 4 L that every
    label shares (the words a lexical model must learn to discount): (x (n, F) L2-normalised, labels (n, L))."""
    rng = np.random.default_rng(seed)
    rows, label_rows = [], []
    shared = np.arange(4 * num_labels, num_features)
    for _ in range(num_points):
        label = int(rng.integers(num_labels))
        own = rng.choice(4, 2, replace=False) + 4 * label
        rows.append(sorted(own.tolist() + rng.choice(shared, 3, replace=False).tolist()))
        label_rows.append([label])
    x = _l2_rows(_binary(rows, num_features).astype(np.float32))
    return x, _binary(label_rows, num_labels)


def test_pair_features_list_every_feature_of_every_pair_under_its_label_key():
    x = sp.csr_matrix(np.array([[0.0, 0.6, 0.8], [1.0, 0.0, 0.0]], np.float32))
    pair, key, value = pair_features(x, np.array([1, 0, 0]), np.array([2, 0, 5]), num_features=3)
    assert pair.tolist() == [0, 1, 1, 2, 2]
    assert key.tolist() == [2 * 3 + 0, 0 * 3 + 1, 0 * 3 + 2, 5 * 3 + 1, 5 * 3 + 2]
    np.testing.assert_allclose(value, [1.0, 0.6, 0.8, 0.6, 0.8])


def test_training_pairs_are_positives_and_negatives_once_each_sorted_by_label():
    labels = _binary([[1], [0, 2]], 4)
    negatives = np.array([[1, 3, -1], [2, 1, 3]])  # point 0's positive 1 and point 1's positive 2 appear again
    rows, ids, y = training_pairs(labels, negatives)
    assert list(zip(ids.tolist(), rows.tolist(), y.tolist())) == [
        (0, 1, 1.0), (1, 0, 1.0), (1, 1, 0.0), (2, 1, 1.0), (3, 0, 0.0), (3, 1, 0.0)]


def test_a_point_never_votes_for_its_own_labels():
    # points 0 and 1 are near twins; point 0 alone carries label 3, point 1 alone label 4
    x = _l2_rows(sp.csr_matrix(np.array([[1, 1, 0], [1, 1, 0.1], [0, 0, 1]], np.float32)))
    labels = _binary([[0, 3], [0, 4], [1]], 5)
    negatives = neighbour_negatives(x, labels, neighbours=2, width=5)
    assert 3 not in negatives[0] and 4 in negatives[0]
    assert 4 not in negatives[1] and 3 in negatives[1]
    assert set(negatives[2][negatives[2] >= 0].tolist()) <= {0, 3, 4}  # its neighbours' labels, not its own 1


def test_solve_block_reaches_the_stated_objectives_minimum():
    """The preconditioned solve against a plain L-BFGS on the same objective written out densely."""
    x, labels = _topic_data(80, num_labels=3, num_features=16)
    negatives = np.tile(np.arange(3), (80, 1))
    rows, ids, y = training_pairs(labels, negatives)
    reg = 0.1
    keys, weights, bias = solve_block(x, rows, ids, y, 0, 3, reg, iterations=500)
    dense = x.toarray().astype(np.float64)
    sign = 2 * y - 1

    def objective(theta):
        u, b = theta[:48].reshape(3, 16), theta[48:]
        margin = sign * ((dense[rows] * u[ids]).sum(1) + b[ids])
        return np.logaddexp(0, -margin).sum() + 0.5 * reg * (u * u).sum()

    reference = minimize(objective, np.zeros(51), method="L-BFGS-B", options={"maxiter": 5000}).x
    ours = np.zeros(51)
    ours[keys] = weights  # key = label * 16 + feature: the dense layout's index
    ours[48:] = bias
    assert objective(ours) <= objective(reference) + 1e-3
    np.testing.assert_allclose(ours, reference, atol=0.02)


def test_scoring_in_row_chunks_gives_the_one_pass_scores(monkeypatch):
    import xc.fitting.ranker as ranker_module

    x, labels = _topic_data(300)
    ranker = fit_ranker(x, labels, RankerParams(neighbours=10, negatives=12))
    ids = np.tile(np.arange(-1, 12), (300, 1))
    whole = ranker.score_part(x, ids)
    monkeypatch.setattr(ranker_module, "SCORE_ENTRIES", 50)  # 5 features x 13 labels a row: one row a chunk
    np.testing.assert_array_equal(ranker.score_part(x, ids), whole)
    monkeypatch.setattr(ranker_module, "SCORE_ENTRIES", 700)  # about ten rows a chunk
    np.testing.assert_array_equal(ranker.score_part(x, ids), whole)


def test_the_ranker_learns_which_features_name_a_label_and_discounts_shared_ones():
    x, labels = _topic_data(600)
    test_x, test_labels = _topic_data(200, seed=1)
    ranker = fit_ranker(x, labels, RankerParams(neighbours=10, negatives=12))
    every = np.tile(np.arange(12), (200, 1))
    top = every[np.arange(200), ranker.score(test_x, every).argmax(1)]
    assert np.mean(top == test_labels.indices) > 0.95
    # label 0's own features push its score up; the shared ones, seen with every label, count for less
    w = dict(zip(ranker.keys.tolist(), ranker.weights.tolist()))
    own = [w[f] for f in range(4)]
    assert min(own) > 0
    assert np.mean([w.get(f, 0.0) for f in range(48, 60)]) < 0.5 * min(own)


def test_two_ranks_solve_the_one_rank_problems_and_their_saved_parts_load_as_one(tmp_path):
    x, labels = _topic_data(300)
    params = RankerParams(neighbours=10, negatives=12, block_labels=5)  # blocks [0, 5), [5, 10), [10, 12)
    whole = fit_ranker(x, labels, params)
    parts = [fit_ranker(x, labels, params, rank, 2) for rank in (0, 1)]
    assert parts[0].owned[:5].all() and not parts[0].owned[5:10].any() and parts[0].owned[10:].all()
    ids = np.array([[0, 6, 11, -1], [7, 3, 2, 9]])
    queries = x[:2]
    summed = parts[0].score_part(queries, ids) + parts[1].score_part(queries, ids)
    np.testing.assert_array_equal(np.where(ids >= 0, summed, -np.inf).astype(np.float32), whole.score(queries, ids))
    for rank, part in enumerate(parts):
        part.save(tmp_path, rank, 2)
    whole.save(tmp_path, 0, 1)  # a 1-rank run's part in the same folder is never mixed in
    loaded = LexicalRanker.load(tmp_path, 2)
    np.testing.assert_array_equal(loaded.score(queries, ids), whole.score(queries, ids))
    assert not list(tmp_path.glob("ranker/.*"))  # no temporary left behind


def test_blocks_solved_on_several_threads_give_the_one_thread_ranker_bit_for_bit():
    x, labels = _topic_data(300)
    params = RankerParams(neighbours=10, negatives=12, block_labels=3)  # 4 blocks over 12 labels
    one = fit_ranker(x, labels, params, threads=1)
    three = fit_ranker(x, labels, params, threads=3)
    assert len(one.keys) and np.all(np.diff(one.keys) > 0)
    for field in ("keys", "weights", "bias", "owned"):
        np.testing.assert_array_equal(getattr(three, field), getattr(one, field))
    mine = fit_ranker(x, labels, params, 1, 2, threads=2)  # a rank's own blocks, 1 and 3, on two threads
    assert mine.owned[3:6].all() and mine.owned[9:].all() and not mine.owned[:3].any()
    np.testing.assert_array_equal(mine.bias[3:6], one.bias[3:6])


def test_a_label_no_training_point_carries_scores_no_evidence():
    x, labels = _topic_data(200)
    labels = sp.csr_matrix((labels.data, labels.indices, labels.indptr), shape=(200, 14))  # labels 12, 13: none
    ranker = fit_ranker(x, labels, RankerParams(neighbours=10, negatives=12))
    assert ranker.bias[12] == ranker.bias[13] == NO_EVIDENCE
    assert sigmoid(ranker.score(x[:1], np.array([[12]])))[0, 0] < 1e-8


def test_fusion_with_gamma_is_the_stated_product_and_zero_gamma_leaves_it_unchanged():
    ids = np.array([[4, 7, 9]])
    cands = Candidates(ids, np.array([[0.6, 0.3, 0.1]], np.float32), np.array([[0.0, 0.5, 0.5]], np.float32),
                       ranked=np.array([[0.1, 0.2, 0.9]], np.float32))
    scores, order = cands.fuse(0.2, 3, gamma=0.5)
    # (0.8 p + 0.2 v) * r ** 0.5: 0.48 * 0.316 = 0.152, 0.34 * 0.447 = 0.152, 0.18 * 0.949 = 0.171
    by_hand = [(0.8 * [0.6, 0.3, 0.1][i] + 0.2 * [0, .5, .5][i]) * [.1, .2, .9][i] ** 0.5 for i in range(3)]
    np.testing.assert_allclose(scores[0], sorted(by_hand, reverse=True), rtol=1e-6)
    assert order[0].tolist() == [9, 7, 4]
    assert cands.fuse(0.2, 3, gamma=2.0)[1][0].tolist() == [9, 7, 4]  # 0.146, 0.0136, 0.0048
    assert cands.fuse(0.0, 3, gamma=0.1)[1][0].tolist() == [4, 7, 9]  # a weak exponent keeps the model's order
    plain = Candidates(ids, cands.p_model, cands.votes)
    np.testing.assert_array_equal(cands.fuse(0.2, 3, gamma=0.0)[1], plain.fuse(0.2, 3)[1])


def test_a_choice_with_gamma_round_trips_through_fusion_json_and_the_additive_form_is_refused(tmp_path):
    import json

    from xc.errors import CheckpointError

    choice = FusionChoice(0.2, 20, "embedding", 4.0, gamma=0.75, ranker_parts=2)
    (tmp_path / "fusion.json").write_text(json.dumps(choice.as_dict()))
    assert FusionChoice.read(tmp_path) == choice
    plain = FusionChoice(0.2, 20, "embedding", 4.0)
    assert "gamma" not in plain.as_dict()  # runs without the ranker write what they wrote before
    (tmp_path / "fusion.json").write_text(json.dumps(dict(plain.as_dict(), mu=0.3, ranker_parts=1)))
    with pytest.raises(CheckpointError, match="mu"):
        FusionChoice.read(tmp_path)


def test_the_ranker_rule_takes_sparse_features_within_its_size():
    from dataclasses import replace
    from types import SimpleNamespace

    from xc.data.sparse import SparseMatrix
    from xc.fitting.memory import FusionEvaluator

    def evaluator(features: np.ndarray, models: int = 1, hard: bool = False, **rc) -> FusionEvaluator:
        csr = sp.csr_matrix(features)
        matrix = SparseMatrix(csr.indptr.astype(np.int64), csr.indices.astype(np.int32), csr.data.astype(np.float32),
                              csr.shape[1])
        labels = SparseMatrix(np.arange(len(features) + 1, dtype=np.int64), np.zeros(len(features), np.int32), None, 3)
        ev = object.__new__(FusionEvaluator)  # the rule reads the config, the models' tables and the data only
        ev.rc = replace(RankerConfig(), **rc)
        ev.models = [SimpleNamespace(hard_negatives=np.zeros((len(features), 16), np.int64) if hard else None)
                     for _ in range(models)]
        ev.dataset = SimpleNamespace(train=SimpleNamespace(features=matrix, labels=labels), meta={})
        return ev

    sparse = np.eye(40, 100)
    assert evaluator(sparse).ranker_size() == RankerSize(100)
    assert evaluator(np.ones((40, 100))).ranker_size() == RankerSize(100)  # dense: 40 x 101 x 100 = 404,000 entries
    assert evaluator(sparse, models=3).ranker_size() == RankerSize(100)  # an ensemble: each fold its member's ranker
    assert evaluator(sparse, enabled=False).ranker_size() is None
    # 40 points x (100 negatives + 1 positive) x 1 non-zero = 4,040 estimated entries: within 4,100 all 100 pair
    assert evaluator(sparse, max_pair_features=4100).ranker_size() == RankerSize(100)
    assert evaluator(sparse, max_pair_features=0).ranker_size() == RankerSize(100)  # 0: no cap
    # over the cap, as many as fit: 4,000 / (40 x 1) - 1 positive = 99; 400 / 40 - 1 = 9
    assert evaluator(sparse, max_pair_features=4000).ranker_size() == RankerSize(99)
    assert evaluator(sparse, max_pair_features=400).ranker_size() == RankerSize(9)
    assert evaluator(np.ones((40, 100)), max_pair_features=400_000).ranker_size() == RankerSize(99)
    # the positives alone (40 x 1 x 1 = 40 entries) over the cap and no hard negatives to pair: no ranker
    assert evaluator(sparse, max_pair_features=79).ranker_size() is None
    # with the model's 16 hard negatives: no neighbours' labels, rows cut to cap / (40 x (1 + 16)) features;
    # dense rows of 100: one neighbour label needs 40 x 2 x 100 = 8,000 entries; within 6,800 none pairs, and rows
    # are cut to 6,800 / (40 x 17) = 10 features
    assert evaluator(np.ones((40, 100)), max_pair_features=6_800).ranker_size() is None
    assert evaluator(np.ones((40, 100)), hard=True, max_pair_features=6_800).ranker_size() == RankerSize(0, 10)
    assert evaluator(np.ones((40, 100)), hard=True, max_pair_features=680).ranker_size() == RankerSize(0, 1)
    assert evaluator(np.ones((40, 100)), hard=True, max_pair_features=679).ranker_size() is None  # not one fits


def test_cut_rows_keep_their_largest_values():
    x = sp.csr_matrix(np.array([[0.1, 0.5, 0.0, 0.3, 0.5],
                                [0.0, 0.0, 0.0, 0.0, 0.0],
                                [0.9, 0.0, 0.2, 0.0, 0.0]]))
    cut = largest_row_features(x, 2)
    # row 0: 0.5 (feature 1) and 0.5 (feature 4) tie above 0.3: both kept; row 2 has only two
    np.testing.assert_array_equal(cut.toarray(), [[0, 0.5, 0, 0, 0.5], [0, 0, 0, 0, 0], [0.9, 0, 0.2, 0, 0]])
    np.testing.assert_array_equal(largest_row_features(x, 1).toarray(),
                                  [[0, 0.5, 0, 0, 0], [0, 0, 0, 0, 0], [0.9, 0, 0, 0, 0]])  # tie: the lower id
    assert largest_row_features(x, 0) is x and largest_row_features(x, 3).nnz == 3 + 2


def test_a_ranker_on_hard_negatives_and_cut_rows_trains_only_on_those_features():
    x, labels = _topic_data(120)
    hard = np.random.default_rng(3).integers(0, labels.shape[1], size=(x.shape[0], 4))
    ranker = fit_ranker(x, labels, RankerParams(negatives=0, row_features=2), hard_negatives=hard)
    cut = largest_row_features(x, 2)
    kept = set()
    for r, l in zip(*training_pairs(labels, hard)[:2]):
        kept.update(int(l) * x.shape[1] + int(f) for f in cut.indices[cut.indptr[r]:cut.indptr[r + 1]])
    assert set(ranker.keys.tolist()) <= kept and len(ranker.keys) > 0
    # a query scores through the weights its cut features carry, the rest of its row adding nothing
    assert np.isfinite(ranker.score(x[:5], np.zeros((5, 1), np.int64))).all()


def test_the_neighbour_search_leaves_out_the_most_frequent_features_beyond_its_budget():
    from xc.fitting.ranker import search_features

    # feature 0 in every one of 10 rows (df 10: 100 products), feature 1 in rows 0-4 (25), features 2-11 once each (10)
    rows = [[0, 1, 2 + i] if i < 5 else [0, 2 + i] for i in range(10)]
    x = sp.csr_matrix((np.ones(25), np.concatenate(rows), np.r_[0, np.cumsum([len(r) for r in rows])]), shape=(10, 12))
    assert search_features(x, 0) is x and search_features(x, 135) is x  # 135 products in all
    kept = search_features(x, 134)  # 35 <= 134 < 135: feature 0 goes, the rarer ones stay
    assert set(kept.indices.tolist()) == set(range(1, 12)) and kept.shape == x.shape
    np.testing.assert_array_equal(kept.data, 1.0)  # values as they were: rows are not re-normalised
    assert set(search_features(x, 34).indices.tolist()) == set(range(2, 12))  # 10 <= 34 < 35: only the singletons
    # a point whose every shared feature is left out finds no neighbours, so it pairs with no neighbour's labels
    labels = sp.csr_matrix((np.ones(10), np.arange(10), np.arange(11)), shape=(10, 10))
    assert (neighbour_negatives(x, labels, neighbours=3, width=4, max_products=34) == -1).all()
    assert (neighbour_negatives(x, labels, neighbours=3, width=4) >= 0).any()
    # equally frequent features: none is a background word, and at least half of the non-zeros stay
    even = sp.csr_matrix(np.kron(np.eye(4), np.ones((5, 3))))  # 4 groups of 5 rows, each on its own 3 features (df 5)
    assert search_features(even, 1).nnz >= even.nnz / 2


def test_dense_rows_find_the_neighbours_the_sparse_search_finds():
    from xc.fitting.knn import sparse_neighbours

    rng = np.random.default_rng(0)
    x = _l2_rows(sp.csr_matrix(rng.random((60, 6)) + 0.01))  # every entry non-zero: the dense product
    labels = sp.csr_matrix((np.ones(60), rng.integers(0, 9, 60), np.arange(61)), shape=(60, 9))
    dense = neighbour_negatives(x, labels, neighbours=4, width=3)
    found = sparse_neighbours(x, x, 5)  # the sparse search's answer, built as neighbour_negatives builds it
    others = np.array([[j for j in row if j != i][:4] for i, row in enumerate(found.ids)])
    sims = np.take_along_axis(np.asarray(x @ x.T.toarray()), others, 1).astype(np.float32)
    from xc.fitting.knn import LabelVotes, Neighbours

    np.testing.assert_array_equal(dense, LabelVotes(Neighbours(sims, others), labels, 9).top(3)[1])


def test_stacked_folds_are_each_scored_by_their_own_ranker():
    """Cross-fitted ensembles: the rows of fold f (stacked in order) take ranker f's probabilities, 0 at pads."""
    from types import SimpleNamespace

    from xc.fitting.fusion import Candidates
    from xc.fitting.memory import FusionEvaluator

    def constant(bias: float) -> LexicalRanker:  # no weights: r(x, l) = bias for each of 4 labels
        return LexicalRanker(np.zeros(0, np.int64), np.zeros(0, np.float32), np.full(4, bias, np.float32),
                             np.ones(4, bool), 5)

    ev = object.__new__(FusionEvaluator)
    ev.ctx, ev.ranker, ev.dataset = SimpleNamespace(active=False), None, SimpleNamespace(num_labels=4)
    ids = np.array([[0, 1], [2, -1], [3, 0]])
    cands = Candidates(ids, np.full(ids.shape, 0.5, np.float32), np.zeros(ids.shape, np.float32), (), "softmax")
    x = sp.csr_matrix(np.ones((3, 5), np.float32))
    out = ev.ranked_over_grid({"one": cands}, [(x[:2], constant(0.0)), (x[2:], constant(np.log(3.0)))])["one"]
    np.testing.assert_allclose(out, [[0.5, 0.5], [0.5, 0.0], [0.75, 0.75]], rtol=1e-6)


def test_a_grid_of_candidate_sets_is_scored_pair_by_pair_as_each_set_alone():
    """The ranker's choice scores every distinct (row, label) of the grid's entries once; each entry's probabilities
    are bit for bit those of a grid of that entry alone, with each fold's rows scored by its own ranker, 0 at pads."""
    from types import SimpleNamespace

    from xc.fitting.fusion import Candidates
    from xc.fitting.memory import FusionEvaluator

    x, labels = _topic_data(120)
    params = RankerParams(neighbours=10, negatives=12)
    first, second = fit_ranker(x[:60], labels[:60], params), fit_ranker(x[60:], labels[60:], params)
    ev = object.__new__(FusionEvaluator)
    ev.ctx, ev.ranker = SimpleNamespace(active=False), None
    ev.dataset = SimpleNamespace(num_labels=labels.shape[1])
    rng = np.random.default_rng(0)

    def entry(width: int) -> Candidates:
        ids = rng.integers(-1, labels.shape[1], size=(120, width))
        ids[5] = -1  # a row with no candidates in this entry
        return Candidates(ids, np.zeros(ids.shape, np.float32), np.zeros(ids.shape, np.float32), (), "softmax")

    grid = {("input", 5): entry(6), ("embedding", 10): entry(9), ("both", 5): entry(4)}
    parts = [(x[:70], first), (x[70:], second)]
    scored = ev.ranked_over_grid(grid, parts)
    for key, cands in grid.items():
        alone = ev.ranked_over_grid({key: cands}, parts)[key]
        assert alone.max() > 0 and np.array_equal(scored[key], alone), key
        assert (scored[key][cands.ids < 0] == 0).all()


def test_the_models_hard_negatives_become_pairs_beside_the_neighbours_labels():
    x, labels = _topic_data(300)
    params = RankerParams(neighbours=10, negatives=2)  # few voted labels: most hard negatives are new pairs
    plain = fit_ranker(x, labels, params)
    hard = np.full((300, 3), -1, np.int64)
    hard[:, 0] = (labels.indices + 6) % 12  # a label the neighbours rarely vote for: a confusion of the model's
    hard[5, 1] = labels.indices[5]  # a positive among them counts once, as a positive
    with_hard = fit_ranker(x, labels, params, hard_negatives=hard)
    rows, ids, y = training_pairs(labels, np.concatenate([neighbour_negatives(x, labels, 10, 2), hard], axis=1))
    assert len(np.unique(rows * 12 + ids)) == len(rows) and y[(rows == 5) & (ids == labels.indices[5])].tolist() == [1]
    paired = lambda r: set((r.keys // x.shape[1]).tolist())  # noqa: E731 -- the labels that got weights
    assert paired(with_hard) == set(range(12)) and len(with_hard.keys) > len(plain.keys)
    # each added pair is a negative: the model's confusion of point 0 scores lower for point 0 than before
    confusion = np.array([[hard[0, 0]]])
    assert with_hard.score(x[:1], confusion)[0, 0] < plain.score(x[:1], confusion)[0, 0]
    with pytest.raises(ValueError, match="300 training rows"):
        fit_ranker(x, labels, params, hard_negatives=hard[:10])


def test_hard_negatives_by_point_take_each_shards_best_and_leave_validation_points_out():
    from xc.fitting.model_memory import hard_negatives_by_point

    shard0 = np.array([[1, 2], [0, 3], [4, 2], [1, 0]], np.int32)  # rows: points 3, 0, 4, then a label-text row
    shard1 = np.array([[7, 5], [6, 9], [8, 5], [9, 9]], np.int32)
    train_ids = np.array([3, 0, 4])
    out = hard_negatives_by_point({1: shard1, 0: shard0}, train_ids, 6, width=2)  # one column of each shard
    np.testing.assert_array_equal(out, [[0, 6], [-1, -1], [-1, -1], [1, 7], [4, 8], [-1, -1]])
    assert hard_negatives_by_point({0: shard0}, train_ids, 6, width=0) is None
    assert hard_negatives_by_point({0: shard0}, train_ids, 6, width=5).shape == (6, 2)  # no more than it has


def test_a_fold_ranker_pairs_its_own_members_negatives_and_the_ranker_fused_at_test_every_members(monkeypatch):
    """Cross-fitted members: fold m's ranker learns from member m's points with member m's hard negatives only
    (another member's model has seen fold m's validation points); the ranker trained on every point takes each
    member's negatives of the points it trained on."""
    from types import SimpleNamespace

    import xc.fitting.memory as memory
    from xc.data.sparse import SparseMatrix

    seen = []
    monkeypatch.setattr(memory, "fit_ranker", lambda x, y, params, rank, world, threads, hard_negatives, progress:
                        seen.append((x.shape[0], hard_negatives)))
    features = SparseMatrix(np.arange(5, dtype=np.int64), np.zeros(4, np.int32), np.ones(4, np.float32), 2)
    labels = SparseMatrix(np.arange(5, dtype=np.int64), np.array([0, 1, 0, 1], np.int32), np.ones(4, np.float32), 2)
    dataset = SimpleNamespace(train=SimpleNamespace(features=features, labels=labels, num_points=4))
    hard = [np.array([[1], [0], [-1], [-1]]), np.array([[-1], [-1], [1], [0]])]  # member m trained on its 2 points
    members = [SimpleNamespace(train=SimpleNamespace(train_ids=np.array([0, 1]) + 2 * m), hard_negatives=hard[m],
                               trained_ranker=None) for m in (0, 1)]
    ev = object.__new__(memory.FusionEvaluator)
    ev.models, ev.dataset, ev.weights = members, dataset, None
    ev.rc = RankerConfig(reg=0.2, iterations=1, neighbours=1, negatives=1, block_labels=2)
    ev.ctx = SimpleNamespace(rank=0, world_size=1)
    ev.fit_ranker(members[1].train.train_ids, [members[1]])
    ev.fit_ranker(np.arange(4), members)
    ev.fit_ranker()  # one model: the first's
    np.testing.assert_array_equal(seen[0][1], [[1], [0]])
    np.testing.assert_array_equal(seen[1][1], [[1, -1], [0, -1], [-1, 1], [-1, 0]])
    np.testing.assert_array_equal(seen[2][1], [[1], [0]])


def test_a_fold_reuses_the_ranker_its_members_own_run_trained_and_the_all_points_ranker_is_fitted(monkeypatch):
    from types import SimpleNamespace

    import xc.fitting.memory as memory

    fitted = []
    monkeypatch.setattr(memory, "fit_ranker", lambda x, y, *a, **k: fitted.append(x.shape[0]) or "fitted")
    monkeypatch.setattr(memory, "input_vectors", lambda features, weights, rows: sp.csr_matrix((len(rows), 2)))
    monkeypatch.setattr(memory, "labels_csr", lambda labels, rows: sp.csr_matrix((len(rows), 2)))
    own = SimpleNamespace(train=SimpleNamespace(train_ids=np.array([0, 1])), hard_negatives=None,
                          trained_ranker=lambda: "the member's own")
    other = SimpleNamespace(train=SimpleNamespace(train_ids=np.array([2, 3])), hard_negatives=None, trained_ranker=None)
    ev = object.__new__(memory.FusionEvaluator)
    ev.models, ev.weights = [own, other], None
    ev.dataset = SimpleNamespace(train=SimpleNamespace(features=None, labels=None, num_points=4))
    ev.rc = RankerConfig(reg=0.2, iterations=1, neighbours=1, negatives=1, block_labels=2)
    ev.ctx = SimpleNamespace(rank=0, world_size=1)
    assert ev.fit_ranker(own.train.train_ids, [own]) == "the member's own" and fitted == []
    assert ev.fit_ranker(other.train.train_ids, [other]) == "fitted"  # its run kept no ranker: fitted here
    assert ev.fit_ranker(np.arange(4), [own, other]) == "fitted"  # every point: a new problem
    ev.ctx = SimpleNamespace(rank=0, world_size=2)  # a rank holds only its blocks: the whole ranker is not its part
    assert ev.fit_ranker(own.train.train_ids, [own]) == "fitted" and fitted == [2, 4, 2]
