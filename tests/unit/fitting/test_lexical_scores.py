"""The fusion's model side with lexical weights (model.lexical_features): its top k is predict's, the scores of
given labels are dense + lexical, and a lexical model scored without its queries' inputs is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.models.test_lexical import _Table, _batch, _model, _rows_of
from xc.distributed import DistContext
from xc.eval.inference import predict
from xc.fitting.fusion import ModelScorer


def _setup():
    gen = torch.Generator().manual_seed(7)
    labels, dim, m = 30, 6, 25
    shard, lexical = _model(gen, labels, dim, 4, 50)
    shard.lexical = lexical
    flat, offsets, values = _batch(gen, m, 50, [int(n) for n in torch.randint(0, 10, (m,), generator=gen)])
    every = {"feat_ids": flat, "feat_offsets": offsets, "feat_values": values}
    table = torch.randn(m, dim, generator=gen)

    def inputs(rows):
        return {**_rows_of(every, rows), "row": torch.from_numpy(np.asarray(rows, np.int64))}

    return shard, lexical, inputs, table, np.arange(m, dtype=np.int64)


def test_top_and_scores_of_add_the_lexical_weights():
    shard, lexical, inputs, table, rows = _setup()
    scorer = ModelScorer(_Table(table), shard, DistContext(), 16, "bce")
    scores, ids = scorer.top(table, 5, (inputs, rows))
    np.testing.assert_array_equal(ids, predict(_Table(table), shard, inputs, rows, 5, 16, DistContext())[1])
    full = (table @ shard.weight.t()).numpy() + lexical.query_scores(inputs(rows)).toarray()
    np.testing.assert_allclose(scores, np.take_along_axis(full, ids, 1), rtol=1e-5, atol=1e-5)
    given = np.array([[0, 29, -1], [3, 3, 7]] * (len(rows) // 2) + [[1, 2, 3]])
    got = scorer.scores_of(table, given, block=4, queries=(inputs, rows))
    want = np.where(given >= 0, np.take_along_axis(full, np.maximum(given, 0), 1), -np.inf)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_lexical_model_is_not_scored_without_its_inputs():
    shard, _, _, table, _ = _setup()
    scorer = ModelScorer(_Table(table), shard, DistContext(), 16, "bce")
    with pytest.raises(ValueError, match="queries="):
        scorer.top(table, 5)
    with pytest.raises(ValueError, match="queries="):
        scorer.scores_of(table, np.zeros((len(table), 2), np.int64))
