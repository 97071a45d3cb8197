"""Where lexical weights (model.lexical_features) cannot train, one line names the key."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import scipy.sparse as sp
import pytest
import torch

from xc.config import XCConfig
from xc.distributed import DistContext
from xc.errors import ConfigError
from xc.train.components import lexical_start, lexical_supported

_SAMPLER = object()  # any sampled-negative sampler


def _cfg(**model) -> XCConfig:
    cfg = XCConfig()
    return replace(cfg, model=replace(cfg.model, lexical_features=16, **model))


@pytest.mark.parametrize("cfg, ctx, sampler, needle", [
    (_cfg(encoder="dense"), DistContext(), _SAMPLER, "model.encoder=dense"),
    (_cfg(mode="dual"), DistContext(), _SAMPLER, "model.mode=dual"),
    (_cfg(), DistContext(rank=0, world_size=2), _SAMPLER, "this run has 2"),
    (_cfg(), DistContext(), None, "sampler.name=full"),
])
def test_lexical_weights_refuse_what_they_cannot_train(cfg, ctx, sampler, needle):
    with pytest.raises(ConfigError) as info:
        lexical_supported(cfg, ctx, sampler)
    assert info.value.key == "model.lexical_features" and needle in str(info.value)


def test_lexical_weights_train_on_one_rank_of_a_sampled_bow_classifier():
    lexical_supported(_cfg(), DistContext(device=torch.device("cpu")), _SAMPLER)  # no error


class _Points:
    """Two training points over 4 features: point 0 carries labels {0, 1}, point 1 label {0}; label 2 none."""
    num_points = 2
    x = torch.tensor([[0.6, 0.0, 0.8, 0.0], [0.0, 0.0, 0.6, 0.8]])

    def inputs(self, rows):
        ids, values, offsets = [], [], []
        for r in rows:
            offsets.append(len(ids))
            nz = torch.nonzero(self.x[r]).ravel()
            ids += nz.tolist()
            values += self.x[r, nz].tolist()
        return {"feat_ids": torch.tensor(ids), "feat_offsets": torch.tensor(offsets),
                "feat_values": torch.tensor(values)}

    def labels(self, rows):
        indptr, indices = [0, 2, 3], [0, 1, 0]
        return np.array(indptr)[: len(rows) + 1], np.array(indices[: indptr[len(rows)]])


def test_the_centroid_start_sets_each_label_to_its_summed_inputs_at_the_norm_asked():
    from xc.train.components import build_lexical

    start = build_lexical(2, _Points(), 0, 3, 3, 3, 4, 0, torch.device("cpu"), start_scale=10.0)
    # label 0 sums f2 1.4, f3 0.8, f0 0.6 -> support (2, 3), values (1.4, 0.8) scaled to norm 10
    assert start.support.tolist() == [[2, 3], [2, 0], [-1, -1]]
    norm = float(np.hypot(1.4, 0.8))
    np.testing.assert_allclose(start.values.weight[0].numpy(), [14 / norm, 8 / norm], rtol=1e-5)
    np.testing.assert_allclose(start.values.weight[1].numpy(), [8.0, 6.0], rtol=1e-5)  # (0.8, 0.6) x 10
    assert start.values.weight[2].tolist() == [0.0, 0.0]  # no training point
    zero = build_lexical(2, _Points(), 0, 3, 3, 3, 4, 0, torch.device("cpu"))
    assert zero.support.tolist() == start.support.tolist() and not zero.values.weight.any()


def test_the_explained_start_takes_each_label_s_share_and_refuses_negative_inputs_in_one_line():
    from xc.models.lexical import centroid_weights, csr_of_inputs, explained_inputs, label_supports
    from xc.train.components import build_lexical

    points = _Points()
    start = build_lexical(2, points, 0, 3, 3, 3, 4, 0, torch.device("cpu"), start_scale=10.0, explained=True)
    x = csr_of_inputs([(points.inputs([0, 1]), 4)])
    y = sp.csr_matrix((np.ones(3, np.float32), [0, 1, 0], [0, 2, 3]), shape=(2, 3))
    sums = np.zeros((3, 2), np.float32)
    assert start.support.tolist() == label_supports(x, y, 0, 3, 2, sums, explained_inputs(x, y)).tolist()
    np.testing.assert_allclose(start.values.weight.numpy(), centroid_weights(sums, 10.0), rtol=1e-5)
    assert start.values.weight[0].tolist() != build_lexical(2, points, 0, 3, 3, 3, 4, 0, torch.device("cpu"),
                                                            start_scale=10.0).values.weight[0].tolist()
    points.x = points.x.clone()
    points.x[0, 0] = -0.6
    with pytest.raises(ConfigError, match="model.lexical_init.*non-negative"):
        build_lexical(2, points, 0, 3, 3, 3, 4, 0, torch.device("cpu"), start_scale=10.0, explained=True)
    build_lexical(2, points, 0, 3, 3, 3, 4, 0, torch.device("cpu"), explained=True)  # loading a run: not needed
    # auto asked for it: negative inputs start at the plain centroids instead, as model.lexical_init=centroid does
    auto = build_lexical(2, points, 0, 3, 3, 3, 4, 0, torch.device("cpu"), start_scale=10.0, explained=True,
                         explained_required=False)
    plain = build_lexical(2, points, 0, 3, 3, 3, 4, 0, torch.device("cpu"), start_scale=10.0)
    assert torch.equal(auto.support, plain.support) and torch.equal(auto.values.weight, plain.values.weight)


@pytest.mark.parametrize("choice, rows_at_centroids, expected", [
    ("zero", True, "zero"), ("zero", False, "zero"), ("centroid", False, "centroid"), ("centroid", True, "centroid"),
    ("auto", True, "explained"), ("auto", False, "zero"), ("explained", False, "explained"),
])
def test_auto_starts_the_weights_at_their_shares_where_the_rows_start_at_centroids(choice, rows_at_centroids,
                                                                                   expected):
    assert lexical_start(choice, rows_at_centroids) == expected
