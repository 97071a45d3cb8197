"""`--ann neighbours` (xc/serve/neighbours.py): a query's candidates are the labels of its nearest training points and
the longest rows, scored exactly; the number of points is tuned until recall@k against exact search reaches the
target; its bad inputs are one-line errors."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from xc.config import AnnConfig
from xc.data.sparse import SparseMatrix
from xc.errors import XCError
from xc.models.classifier import ClassifierShard
from xc.serve import neighbours as serve_neighbours
from xc.serve.neighbours import NeighbourSearcher, neighbour_searcher

L, D, N = 300, 16, 400


def _problem(seed: int = 0):
    """Rows, training points that each carry their 3 best labels under the rows, and a label matrix."""
    rng = np.random.default_rng(seed)
    shard = ClassifierShard(0, L, L, D, 0.0, 0, torch.device("cpu"))
    shard.weight[:L] = torch.from_numpy(rng.standard_normal((L, D)).astype(np.float32))
    points = torch.from_numpy(rng.standard_normal((N, D)).astype(np.float32))
    best = (points @ shard.weight[:L].T).topk(3, dim=1).indices.numpy()
    labels = sp.csr_matrix((np.ones(best.size, np.float32), best.ravel(), np.arange(0, best.size + 1, 3)), shape=(N, L))
    return shard, points, labels


def _exact(shard, queries, k):
    return (queries @ shard.weight[:L].T).topk(k, dim=1)


def test_with_every_training_point_and_label_as_candidates_it_is_exact():
    shard, points, labels = _problem()
    every = sp.csr_matrix(np.ones((N, L), np.float32))  # each point carries every label
    searcher = NeighbourSearcher(shard, points, every, neighbours=1, head=0, target=0.0)
    queries = torch.randn(50, D, generator=torch.Generator().manual_seed(1))
    scores, ids = searcher.search(queries, 5)
    want_scores, want_ids = _exact(shard, queries, 5)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(scores, want_scores, atol=1e-5)


def test_candidates_are_the_nearest_points_labels_and_the_head_only():
    shard, points, labels = _problem()
    searcher = NeighbourSearcher(shard, points, labels, neighbours=1, head=4, target=0.0)
    head = set(shard.weight[:L].norm(dim=1).topk(4).indices.tolist())
    assert set(searcher.head.tolist()) == head
    query = points[7:8] * 3.0  # its nearest training point by cosine is point 7
    _, ids = searcher.search(query, 10)
    found = set(ids[0][ids[0] >= 0].tolist())
    assert found == set(labels[7].indices.tolist()) | head  # 3 + 4 candidates, the rest -1 pads
    assert (ids[0] == -1).sum() == 10 - len(found)


def test_scores_are_the_plain_models_whatever_prior_is_installed():
    """As every `--ann` search: no label prior (shard.score_bias), no fusion."""
    shard, points, labels = _problem()
    every = sp.csr_matrix(np.ones((N, L), np.float32))
    bias = torch.zeros(L)
    bias[123] = 100.0  # a prior that would put this label first for every query
    shard.score_bias = bias
    searcher = NeighbourSearcher(shard, points, every, neighbours=2, head=8, target=0.5)
    queries = torch.randn(20, D, generator=torch.Generator().manual_seed(2))
    scores, ids = searcher.search(queries, 3)
    want_scores, want_ids = _exact(shard, queries, 3)
    assert torch.equal(ids, want_ids) and torch.allclose(scores, want_scores, atol=1e-4)


def test_the_breadth_doubles_until_the_recall_target_and_is_logged(caplog):
    shard, points, labels = _problem()
    queries = points[:100] + 0.1 * torch.randn(100, D, generator=torch.Generator().manual_seed(3))
    searcher = NeighbourSearcher(shard, points, labels, neighbours=1, head=0, target=0.95)
    with caplog.at_level(logging.INFO, logger=serve_neighbours.__name__):
        _, ids = searcher.search(queries, 3)
    tuning = searcher.tuning
    assert tuning is not None and tuning.reached and tuning.chosen > 1  # one point's 3 labels were not enough
    assert list(tuning.tried) == [1 << i for i in range(len(tuning.tried))]
    assert searcher.neighbours == tuning.chosen
    exact = _exact(shard, queries, 3)[1].numpy()
    hits = np.mean([len(set(a.tolist()) & set(b.tolist())) / 3 for a, b in zip(ids.numpy(), exact)])
    assert hits >= 0.95
    assert any("ann.serve_neighbours=" in r.getMessage() for r in caplog.records)


def test_a_sharded_rank_returns_only_its_own_labels():
    _, points, labels = _problem()
    rng = np.random.default_rng(0)
    rows = torch.from_numpy(rng.standard_normal((L, D)).astype(np.float32))
    shard = ClassifierShard(100, 200, L, D, 0.0, 0, torch.device("cpu"))  # this rank holds labels [100, 200)
    shard.weight[:100] = rows[100:200]
    every = sp.csr_matrix(np.ones((N, L), np.float32))
    searcher = NeighbourSearcher(shard, points, every, neighbours=4, head=2, target=0.0)
    queries = torch.randn(10, D, generator=torch.Generator().manual_seed(4))
    _, ids = searcher.search(queries, 5)
    assert ((ids >= 100) & (ids < 200)).all()
    assert torch.equal(ids, (queries @ rows[100:200].T).topk(5, dim=1).indices + 100)


def _labels_matrix(labels: sp.csr_matrix) -> SparseMatrix:
    return SparseMatrix(labels.indptr.astype(np.int64), labels.indices.astype(np.int32), None, labels.shape[1])


@pytest.mark.parametrize("case, match", [
    ("save", "builds no index to save"),
    ("no_points", "needs the training points"),
    ("empty", "no training points"),
])
def test_bad_requests_are_one_line_errors(case, match):
    shard, points, labels = _problem()
    matrix = _labels_matrix(labels)
    embeddings, encoded = points, []

    def encode_points():
        encoded.append(True)
        return embeddings

    args = dict(ann=AnnConfig(), shard=shard, train_labels=matrix, encode_points=encode_points)
    if case == "save":
        args["save_index"] = True
    elif case == "no_points":
        embeddings = None
    else:
        embeddings = points[:0]
        args["train_labels"] = SparseMatrix(np.zeros(1, np.int64), np.zeros(0, np.int32), None, L)
    with pytest.raises(XCError, match=match) as info:
        neighbour_searcher(**args)
    assert "\n" not in str(info.value)
    assert encoded == ([] if case == "save" else [True])  # a refused save encodes nothing


def test_the_factory_cuts_the_head_as_the_norm_head_does_and_times_the_encoding():
    shard, points, labels = _problem()
    searcher = neighbour_searcher(AnnConfig(exact_head=1024), shard, _labels_matrix(labels), lambda: points)
    assert len(searcher.head) == L // 8  # exact_head, at most an eighth of the rows (xc/ann/norm_head.py head_rows)
    assert searcher.build_seconds > 0


def test_the_serving_breadth_is_validated():
    from xc.errors import ConfigError

    with pytest.raises(ConfigError, match="ann.serve_neighbours"):
        AnnConfig(serve_neighbours=0).validate()
