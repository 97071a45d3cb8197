"""Classifier rows started at their labels' training points (xc/train/row_init.py), against hand-computed rows."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from xc.config import XCConfig
from xc.config_checks import validate
from xc.errors import ConfigError
from xc.models import ClassifierShard
from xc.train.components import candidates_per_query
from xc.distributed import DistContext
from xc.eval.inference import encode_rows
from xc.train.row_init import CENTROID_BELOW_POSITIVES, centroid_rows, centroid_scale, rows_start_at_centroids


class _Lin(torch.nn.Module):
    """A linear encoder of dense inputs, with dropout so that eval mode matters."""

    def __init__(self, x: np.ndarray, dim: int, seed: int = 0, bias_column: bool = False):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.from_numpy(x)
        self.proj = torch.randn(x.shape[1], dim, generator=gen)
        self.drop = torch.nn.Dropout(0.9)
        self.bias_column = bias_column
        self.out_dim = dim + int(bias_column)

    def forward(self, batch):
        emb = self.drop(self.x[batch["rows"]] @ self.proj)
        return torch.cat([emb, torch.ones(emb.shape[0], 1)], 1) if self.bias_column else emb


class _View:
    """A TrainingView's two methods over hand-made labels: row r carries labels[r]."""

    def __init__(self, labels: list[list[int]]):
        self.num_rows = len(labels)
        self.rows_labels = labels

    def inputs(self, rows):
        return {"rows": torch.from_numpy(np.asarray(rows))}

    def labels(self, rows):
        lists = [self.rows_labels[r] for r in rows]
        indptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int64)
        return indptr, np.array([l for x in lists for l in x], dtype=np.int64)


_LABELS = [[0, 2], [2], [0, 5], [], [5, 2], [7]]
_CTX = DistContext(device=torch.device("cpu"))


def _setup(bias_column=False):
    x = np.random.default_rng(0).standard_normal((len(_LABELS), 5)).astype(np.float32)
    encoder = _Lin(x, 4, bias_column=bias_column)
    encoder.train()
    return x, encoder, _View(_LABELS)


def _expected(x, encoder, scale, width=4):
    emb = (torch.from_numpy(x) @ encoder.proj).numpy()
    mean_norm = np.linalg.norm(emb, axis=1).mean()
    out = {}
    for label in {l for row in _LABELS for l in row}:
        total = sum(emb[r] for r, row in enumerate(_LABELS) if label in row)
        out[label] = total / np.linalg.norm(total) * scale / mean_norm
    return out


def test_rows_with_training_points_start_at_their_scaled_mean_embedding_the_others_at_random():
    x, encoder, view = _setup()
    shard = ClassifierShard(0, 10, 9, 4, 0.01, seed=3, device=torch.device("cpu"))
    random_rows = shard.weight.clone()
    assert centroid_rows(encoder, view, shard, scale=6.0, ctx=_CTX) == 4  # labels 0, 2, 5, 7
    for label, row in _expected(x, encoder, 6.0).items():
        np.testing.assert_allclose(shard.weight[label].numpy(), row, rtol=1e-5, atol=1e-6)
    untouched = [1, 3, 4, 6, 8, 9]  # no training row (9 is padding)
    assert torch.equal(shard.weight[untouched], random_rows[untouched])
    assert encoder.training  # the encoder's mode is restored


def test_eval_mode_embeddings_are_the_encoders_without_dropout():
    x, encoder, view = _setup()
    emb = encode_rows(encoder, view.inputs, np.arange(view.num_rows), 4, _CTX).numpy()  # two blocks, as the start reads
    np.testing.assert_allclose(emb, (torch.from_numpy(x) @ encoder.proj).numpy(), rtol=1e-5)


def test_shards_set_the_same_rows_as_one_process():
    x, encoder, view = _setup()
    whole = ClassifierShard(0, 10, 9, 4, 0.01, seed=3, device=torch.device("cpu"))
    centroid_rows(encoder, view, whole, scale=8.0, ctx=_CTX)
    parts = [ClassifierShard(lo, hi, 9, 4, 0.01, seed=3, device=torch.device("cpu")) for lo, hi in ((0, 3), (3, 10))]
    for part in parts:
        centroid_rows(encoder, view, part, scale=8.0, ctx=_CTX)
    assert torch.equal(torch.cat([p.weight for p in parts]), whole.weight)


def test_bfloat16_rows_with_masters_hold_the_exact_values_and_their_rounding():
    x, encoder, view = _setup()
    shard = ClassifierShard(0, 10, 9, 4, 0.01, seed=3, device=torch.device("cpu"), dtype=torch.bfloat16,
                            master_fp32=True)
    centroid_rows(encoder, view, shard, scale=6.0, ctx=_CTX)
    exact = _expected(x, encoder, 6.0)[2]
    np.testing.assert_allclose(shard.master[2].numpy(), exact, rtol=1e-5)
    assert torch.equal(shard.weight[2], torch.from_numpy(exact).to(torch.bfloat16))


def test_the_label_bias_column_starts_at_zero_and_the_direction_is_the_rest():
    x, encoder, view = _setup(bias_column=True)
    shard = ClassifierShard(0, 10, 9, 5, 0.01, seed=3, device=torch.device("cpu"))
    centroid_rows(encoder, view, shard, scale=6.0, ctx=_CTX, label_bias=True)
    assert float(shard.weight[0, 4]) == 0.0
    np.testing.assert_allclose(shard.weight[0, :4].numpy(), _expected(x, encoder, 6.0)[0], rtol=1e-5, atol=1e-6)


def test_no_training_row_leaves_every_row_random():
    encoder = _Lin(np.zeros((0, 5), np.float32), 4)
    shard = ClassifierShard(0, 4, 4, 4, 0.01, seed=3, device=torch.device("cpu"))
    before = shard.weight.clone()
    assert centroid_rows(encoder, _View([]), shard, scale=6.0, ctx=_CTX) == 0
    assert torch.equal(shard.weight, before)


def test_the_scale_gives_a_half_point_cosine_margin_half_the_softmax_mass():
    for candidates in (10, 88, 10_000):
        s = centroid_scale(candidates)
        assert s == pytest.approx(2 * math.log(candidates))
        share = math.exp(s * 0.5) / (math.exp(s * 0.5) + candidates - 1)  # the positive vs C - 1 at cosine 0
        assert share == pytest.approx(candidates / (2 * candidates - 1))  # about a half, at least a half


class _Sampler:
    def __init__(self, hard: bool):
        self.wants_hard_negatives = hard


def test_candidates_count_the_negatives_the_sampler_draws():
    cfg = XCConfig()
    s = cfg.sampler
    assert candidates_per_query(cfg, _Sampler(True), 10**6) == s.k_pos + s.k_hard + s.k_random
    assert candidates_per_query(cfg, _Sampler(False), 10**6) == s.k_pos + s.k_random
    assert candidates_per_query(cfg, None, 159) == 159  # the full loss scores every label
    assert candidates_per_query(cfg, _Sampler(True), 20) == 20


def test_an_unknown_initialisation_is_a_config_error_naming_the_key():
    cfg = XCConfig()
    with pytest.raises(ConfigError) as info:
        validate(replace(cfg, model=replace(cfg.model, classifier_init="zeros")))
    assert info.value.key == "model.classifier_init" and "random" in str(info.value)


@pytest.mark.parametrize("scale, needle", [(0.0, "must be > 0"), (-1.0, "must be > 0"), (float("nan"), "must be > 0"),
                                           (float("inf"), "finite")])
def test_a_scale_that_is_not_a_positive_number_is_a_config_error(scale, needle):
    cfg = XCConfig()
    with pytest.raises(ConfigError) as info:
        validate(replace(cfg, model=replace(cfg.model, classifier_init_scale=scale)))
    assert info.value.key == "model.classifier_init_scale" and needle in str(info.value)


def test_auto_starts_at_centroids_under_one_positive_a_label_on_average(caplog):
    assert CENTROID_BELOW_POSITIVES == 1.0
    sparse = np.array([3, 0, 0, 0, 1, 0, 0, 0], np.int64)  # 0.5 a label: the 10^5-10^7 benchmarks' regime
    dense = np.array([70, 12, 5, 1], np.int64)  # Bibtex-like: tens a label
    with caplog.at_level("INFO", logger="xc.train.row_init"):
        assert rows_start_at_centroids("auto", sparse)
    assert "centroid (0.5 positives a label" in caplog.text
    assert not rows_start_at_centroids("auto", dense)
    assert not rows_start_at_centroids("auto", np.ones(4, np.int64))  # exactly one: random
    assert rows_start_at_centroids("centroid", dense) and not rows_start_at_centroids("random", sparse)
    assert not rows_start_at_centroids("auto", np.zeros(0, np.int64))  # no label: nothing to start


def test_the_rows_do_not_depend_on_how_many_training_rows_are_encoded_at_a_time():
    """The run encodes at sampler.mining_batch_size (a transformer pads a batch to its longest text): any batch size
    gives the same rows."""
    x, encoder, view = _setup()
    rows = {}
    for batch_size in (2, 8192):
        shard = ClassifierShard(0, 10, 9, 4, 0.01, seed=3, device=torch.device("cpu"))
        centroid_rows(encoder, view, shard, scale=6.0, ctx=_CTX, batch_size=batch_size)
        rows[batch_size] = shard.weight.clone()
    torch.testing.assert_close(rows[2], rows[8192])
