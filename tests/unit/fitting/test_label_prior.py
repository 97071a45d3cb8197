"""The label prior (xc/fitting/label_prior.py): counts, the biased exact search and fusion scores against brute force,
beta = 0 as the plain model bit for bit, the validation choice (ties to the smaller |beta|), bad configs."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from xc.config import build_config
from xc.data.sparse import SparseMatrix
from xc.distributed import DistContext
from xc.errors import ConfigError
from xc.eval.inference import ExactSearcher, sharded_topk
from xc.fitting.fusion import ModelScorer
from xc.fitting.label_prior import choose_beta, install, topk_per_beta, training_log_counts
from xc.models.classifier import ClassifierShard


def _labels(rows: list[list[int]], num_labels: int) -> SparseMatrix:
    indptr = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    indices = np.array([x for r in rows for x in r], dtype=np.int64)
    return SparseMatrix(indptr, indices, None, num_labels)


def test_training_log_counts_count_only_the_given_rows():
    labels = _labels([[0, 2], [2], [1, 2], [3]], 5)
    got = training_log_counts(labels, np.array([0, 1, 3]), 5)  # row 2 is the validation point
    np.testing.assert_allclose(got.numpy(), np.log1p([1, 0, 2, 1, 0]), rtol=1e-6)
    np.testing.assert_allclose(training_log_counts(labels, None, 5).numpy(), np.log1p([1, 1, 3, 1, 0]), rtol=1e-6)


def _shard(lo: int, hi: int, num_labels: int, dim: int = 8) -> ClassifierShard:
    return ClassifierShard(lo, hi, num_labels, dim, 1.0, seed=3, device=torch.device("cpu"))


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("lo,hi", [(0, 50), (16, 48)])
def test_biased_exact_search_and_fusion_scores_equal_brute_force(lo, hi, bf16, monkeypatch):
    """Either way of ranking (xc/ann/exact.py): plain float32 products, or a shortlist from a bfloat16 pass re-scored
    canonically (forced on wherever the test runs)."""
    import xc.ann.exact
    import xc.fitting.label_prior

    monkeypatch.setattr(xc.ann.exact, "bf16_products_pay", lambda device: bf16)
    for module in (xc.ann.exact, xc.fitting.label_prior):
        monkeypatch.setattr(module, "shortlist_pays", lambda k, n, dim: bf16)  # 50 rows of 8: too few to pay
    num_labels, ctx = 50, DistContext()
    shard = _shard(lo, hi, num_labels)
    counts = torch.from_numpy(np.random.default_rng(0).integers(0, 300, num_labels)).float()
    log_counts = torch.log1p(counts)
    emb = torch.randn(7, shard.dim, generator=torch.Generator().manual_seed(1))
    plain_scores, plain_ids = sharded_topk(emb, ExactSearcher(shard), 5, ctx)
    install(shard, 0.0, log_counts)
    assert shard.score_bias is None  # beta = 0 is the plain model, bit for bit
    for beta in (0.7, -1.5):
        install(shard, beta, log_counts)
        scores, ids = sharded_topk(emb, ExactSearcher(shard), 5, ctx)
        rows = shard.weight[:shard.num_real_rows]
        brute = emb @ rows.T + beta * log_counts[lo:lo + shard.num_real_rows]
        want_scores, want_local = torch.topk(brute, 5, dim=1)
        np.testing.assert_array_equal(ids.numpy(), (want_local + lo).numpy())
        np.testing.assert_allclose(scores.numpy(), want_scores.numpy(), rtol=1e-5, atol=1e-5)
        # the fusion's model side scores the same labels the same way (ids outside [lo, hi) score 0 here)
        scorer = ModelScorer(None, shard, ctx, 64, "softmax")
        np.testing.assert_allclose(scorer.scores_of(emb, ids.numpy()), scores.numpy(), rtol=1e-5, atol=1e-5)
    # the validation choice's one-pass ranking equals an exact search per beta
    install(shard, 0.0, log_counts)
    per_beta = topk_per_beta(emb, shard, log_counts, [0.0, 0.7, -1.5], 5, ctx)
    for beta, ids in per_beta.items():
        install(shard, beta, log_counts)
        np.testing.assert_array_equal(ids, sharded_topk(emb, ExactSearcher(shard), 5, ctx)[1].numpy())
    install(shard, 0.0, log_counts)
    again_scores, again_ids = sharded_topk(emb, ExactSearcher(shard), 5, ctx)
    assert torch.equal(again_ids, plain_ids) and torch.equal(again_scores, plain_scores)


class _QueryOfOnes(torch.nn.Module):
    def forward(self, batch: dict) -> torch.Tensor:
        return batch["x"]


def _components(num_points: int, num_labels: int, frequent: int, betas: list[float]):
    """A model whose scores ignore the query (all rows zero but a tie-breaking nudge towards label 0, the
    rarest), so the best beta is plainly the one that ranks the frequent label first."""
    rng = np.random.default_rng(0)
    rows = [[frequent] if rng.random() < 0.8 else [int(rng.integers(0, num_labels))] for _ in range(num_points)]
    labels = _labels(rows, num_labels)
    shard = _shard(0, num_labels, num_labels, dim=4)
    shard.weight.zero_()
    shard.weight[0, 0] = 0.01
    valid_ids = np.arange(num_points - 100, num_points)
    train = SimpleNamespace(valid_ids=valid_ids, train_ids=np.arange(num_points - 100),
                            split_inputs=lambda r: {"x": torch.ones(len(r), 4)})
    encoder = _QueryOfOnes()
    cfg = build_config({"eval": {"ks": [1], "label_prior": {"betas": betas}}})
    dataset = SimpleNamespace(train=SimpleNamespace(labels=labels), num_labels=num_labels)
    c = SimpleNamespace(train=train, shard=shard, encoder=encoder)
    return cfg, c, dataset, training_log_counts(labels, train.train_ids, num_labels)


def test_validation_picks_the_beta_that_ranks_best_and_ties_keep_the_smaller():
    cfg, c, dataset, log_counts = _components(600, 30, frequent=7, betas=[-1.0, 0.0, 0.5, 1.0])
    choice = choose_beta(cfg, c, dataset, DistContext(), log_counts)
    by_beta = {g["beta"]: g["value"] for g in choice.grid}
    assert by_beta[0.5] == by_beta[1.0] > by_beta[0.0]  # any beta > 0 ranks label 7 first
    assert choice.beta == 0.5, "a tie goes to the smaller |beta|"
    assert choice.valid_plain == by_beta[0.0] and choice.valid_chosen == by_beta[0.5]
    assert c.shard.score_bias is None, "choosing leaves the shard's scores plain"
    cfg, c, dataset, log_counts = _components(600, 30, frequent=7, betas=[-1.0, -0.5])
    choice = choose_beta(cfg, c, dataset, DistContext(), log_counts)
    assert choice.beta == 0.0 and {g["beta"] for g in choice.grid} == {-1.0, -0.5, 0.0}, "0 is always tried"


@pytest.mark.parametrize("bad", [{"betas": []}, {"betas": [0.0, float("nan")]}, {"beta": float("inf")}])
def test_bad_prior_config_names_the_field(bad):
    with pytest.raises(ConfigError, match="eval.label_prior"):
        build_config({"eval": {"label_prior": bad}})


def test_per_point_precision_averages_to_the_metric():
    from xc.eval.metrics import precision_at_k
    from xc.fitting.label_prior import per_point_precision

    rng = np.random.default_rng(5)
    truth = _labels([sorted(set(rng.integers(0, 12, rng.integers(1, 5)).tolist())) for _ in range(40)], 12)
    ids = np.stack([rng.permutation(12)[:5] for _ in range(40)])
    ids[3, 4] = -1
    indptr, indices = np.asarray(truth.indptr), np.asarray(truth.indices)
    want = np.mean(list(precision_at_k(ids, indptr, indices, (1, 3, 5)).values()))
    assert abs(per_point_precision(ids, indptr, indices, (1, 3, 5)).mean() - want) < 1e-12


def test_a_gain_within_one_standard_error_keeps_the_plain_model(monkeypatch):
    """100 validation points, every one's label is 1. beta 0.5 wins 3 points and loses 2 (+1, its standard error
    2.2): not taken; beta 1 wins 10 and loses none (+10, standard error 3): taken."""
    import xc.fitting.label_prior as lp

    cfg, c, dataset, log_counts = _components(600, 30, frequent=7, betas=[0.5])
    c.train.valid_ids = np.arange(100)
    dataset.train.labels = _labels([[1]] * 100, 30)
    plain = np.where(np.arange(100) < 50, 1, 2)[:, None]
    half = plain.copy()
    half[50:53], half[0:2] = 1, 2
    one = plain.copy()
    one[50:60] = 1
    monkeypatch.setattr(lp, "topk_per_beta", lambda emb, shard, counts, betas, k, ctx, with_scores:
                        {b: (torch.zeros(100, 1), torch.from_numpy({0.0: plain, 0.5: half, 1.0: one}[b]))
                         for b in betas})
    choice = lp.choose_beta(cfg, c, dataset, DistContext(), log_counts)
    assert choice.beta == 0.0 and choice.valid_chosen == choice.valid_plain == 50.0
    assert {g["beta"]: g["value"] for g in choice.grid}[0.5] == 51.0
    cfg = replace(cfg, eval=replace(cfg.eval, label_prior=replace(cfg.eval.label_prior, betas=[0.5, 1.0])))
    choice = lp.choose_beta(cfg, c, dataset, DistContext(), log_counts)
    assert choice.beta == 1.0 and choice.valid_chosen == 60.0


def test_an_ensemble_pools_its_members_folds_and_installs_one_beta(tmp_path):
    """Two members, disjoint 100-point folds: one choice on 200 pooled points, installed on both, recorded."""
    import json

    from xc.fitting.label_prior import choose_for_ensemble

    members = []
    for fold in (0, 1):
        cfg, c, dataset, _ = _components(600, 30, frequent=7, betas=[0.5, 1.0])
        c.train.valid_ids = np.arange(400 + 100 * fold, 500 + 100 * fold)
        c.train.train_ids = np.setdiff1d(np.arange(600), c.train.valid_ids)
        members.append(SimpleNamespace(cfg=cfg, components=c, ctx=DistContext(), shard=c.shard, prior_beta=None))
    cfg = replace(cfg, run_dir=str(tmp_path))
    choice = choose_for_ensemble(cfg, members, dataset)
    assert choice.valid_points == 200 and choice.beta == 0.5  # label 7 first: a tie between 0.5 and 1
    assert all(m.shard.score_bias is not None and m.prior_beta == 0.5 for m in members)
    assert json.loads((tmp_path / "prior.json").read_text())["beta"] == 0.5


@pytest.mark.parametrize("zero_share", [0.9, 0.2])
def test_the_row_block_ranking_per_beta_equals_an_exact_search_per_beta(zero_share, monkeypatch):
    """Past the point where a score block holds too few queries the betas are ranked walking the rows in blocks;
    rows without a training positive (log count 0) are ranked once for every beta where they are most rows. The
    labels are those of an exact search under each beta."""
    import xc.fitting.label_prior as lp

    num_labels, ctx = 3000, DistContext()
    shard = _shard(0, num_labels, num_labels)
    rng = np.random.default_rng(1)
    counts = rng.integers(1, 300, num_labels) * (rng.random(num_labels) > zero_share)
    log_counts = torch.log1p(torch.from_numpy(counts).float())
    emb = torch.randn(300, shard.dim, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(lp, "BLOCK_FLOATS", 16 * num_labels)  # a block would hold 16 queries: walk the rows
    walked = []
    real = lp.topk_in_row_blocks
    monkeypatch.setattr(lp, "topk_in_row_blocks",
                        lambda *a: walked.append((len(a[1]), a[1].data_ptr() == shard.weight.data_ptr())) or real(*a))
    per_beta = topk_per_beta(emb, shard, log_counts, [0.0, 0.7, -1.5], 5, ctx)
    counted = int((counts > 0).sum())
    # the uncounted rows are ranked in place (the counted masked), never copied out of the shard's rows
    assert walked == ([(num_labels, True), (counted, False)] if zero_share > 0.5 else [(num_labels, True)])
    monkeypatch.undo()
    for beta, ids in per_beta.items():
        install(shard, beta, log_counts)
        np.testing.assert_array_equal(ids, sharded_topk(emb, ExactSearcher(shard), 5, ctx)[1].numpy())
    install(shard, 0.0, log_counts)
