"""xc/fitting/final_eval.py: the served scores the calibration is fitted on are the chosen grid entry of the held-out
rows (its vote, temperature, lambda and ranker weight) and the fused test candidates, with their hits."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from xc.data.sparse import SparseMatrix
from xc.fitting.final_eval import served_scores
from xc.fitting.fusion import Candidates, FusionChoice


def _labels(rows: list[list[int]], num_labels: int) -> SparseMatrix:
    indptr = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    indices = np.array([label for r in rows for label in r], np.int32)
    return SparseMatrix(indptr, indices, np.ones(len(indices), np.float32), num_labels)


def _cands(ids, scores, votes, ranked=None) -> Candidates:
    ids, scores = np.array(ids, np.int64), np.array(scores, np.float32)
    p = np.where(ids >= 0, 1.0 / (1.0 + np.exp(-scores)), 0.0).astype(np.float32)
    return Candidates(ids, p, np.array(votes, np.float32), (np.where(ids >= 0, scores, -np.inf),), "bce", ranked)


def test_the_held_out_rows_are_served_by_the_chosen_entry_and_the_test_rows_by_their_candidates():
    # training rows 0..3, rows 1 and 3 held out; two grid entries that rank them differently
    train = _labels([[0], [2], [1], [0, 3]], 4)
    test = _labels([[3], [1]], 4)
    chosen = _cands([[0, 1, 2], [3, 2, -1]], [[2.0, 1.0, 0.0], [1.0, 0.5, 0.0]], [[0.0, 0.0, 1.0], [0.5, 0.5, 0.0]])
    other = _cands([[1, 0, 2], [2, 3, -1]], [[2.0, 1.0, 0.0], [1.0, 0.5, 0.0]], [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    ranked = {("input", 5): np.array([[0.1, 0.9, 0.9], [0.5, 0.5, 0.0]], np.float32),
              ("input", 10): np.zeros((2, 3), np.float32)}
    test_cands = _cands([[3, 1, 0], [1, 0, -1]], [[0.5, 0.4, 0.0], [1.0, 0.0, 0.0]], [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]],
                        np.array([[0.9, 0.1, 0.5], [0.8, 0.2, 0.0]], np.float32))
    memory = SimpleNamespace(width=2, validation_grid=(np.array([1, 3]), {("input", 5): chosen, ("input", 10): other}),
                             validation_ranked=ranked, test_candidates=test_cands,
                             dataset=SimpleNamespace(train=SimpleNamespace(labels=train),
                                                     test=SimpleNamespace(labels=test)))
    choice = FusionChoice(lam=0.5, k=5, space="input", temperature=2.0, gamma=1.0)
    served = served_scores(memory, choice, np.array([0, 1]), 0.25)

    want = replace(chosen.at_temperature(2.0), ranked=ranked[("input", 5)]).fuse(0.5, 2, 1.0)
    assert np.allclose(served.valid_scores, want[0])
    # row 1's labels {2}, row 3's {0, 3}: the hits of the chosen entry's top 2, and every relevant label counted
    assert served.valid_hits.tolist() == [[label in truth for label in ids]
                                          for ids, truth in zip(want[1], ([2], [0, 3]))]
    assert served.valid_true == 3 and served.test_true == 2
    test_want = test_cands.fuse(0.5, 2, 1.0)
    assert np.allclose(served.test_scores, test_want[0])
    assert served.test_hits.tolist() == [[label in truth for label in ids] for ids, truth in zip(test_want[1], ([3], [1]))]
    assert served.width == 2 and served.prior_beta == 0.25


def test_a_fixed_choice_has_no_held_out_scores():
    memory = SimpleNamespace(width=20, validation_grid=None, validation_ranked=None, test_candidates=None)
    assert served_scores(memory, FusionChoice(0.5, 5, "input"), np.arange(3), 0.0) is None
