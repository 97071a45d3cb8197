"""Samplers draw what they say they draw, and ASTRA's weighted loss is unbiased for full BCE."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from xc.config import SamplerConfig
from xc.errors import ConfigError
from xc.train.loss import assemble_candidates, full_bce, weighted_bce
from xc.sampling import AstraSampler, HardNegativeSet, StepKey, UniformSampler, draw_positives, uniform_excluding
from xc.shards import ShardLayout


@pytest.mark.parametrize("rounds, excluded", [
    (8, [[103, 100, 139, -1], [-1, -1, -1, -1]]),  # by rejection
    (0, [[103, 100, 139, -1], [-1, -1, -1, -1]]),  # every excluded draw left to the exact mapping
    (1, [[103, 100, 139, -1], [101, 102, 104, 105]]),
    (8, [list(range(100, 124)), [-1] * 24]),  # more than half a row excluded: the exact mapping
])
def test_uniform_excluding_is_uniform_over_allowed_labels(monkeypatch, rounds, excluded):
    import xc.sampling.samplers as samplers

    monkeypatch.setattr(samplers, "REJECTION_ROUNDS", rounds)
    lo, n, k = 100, 40, 5000
    excluded = torch.tensor(excluded)
    draw = uniform_excluding(excluded, n, lo, k, torch.Generator().manual_seed(0))
    for row in (0, 1):
        banned = {i for i in excluded[row].tolist() if i >= 0}
        ids = draw.ids[row].numpy()
        assert not banned & set(ids.tolist())
        assert ids.min() >= lo and ids.max() < lo + n
        allowed = [i for i in range(lo, lo + n) if i not in banned]
        counts = np.array([(ids == i).sum() for i in allowed])
        assert counts.sum() == k  # nothing outside the allowed set
        assert stats.chisquare(counts).pvalue > 1e-3
        # the stated weight is 1 / (inclusion probability * k) = (n - |H|) / k
        assert torch.allclose(draw.weight[row], torch.full((k,), len(allowed) / k))


def test_uniform_excluding_fails_a_wrong_distribution():
    """The chi-square check above detects a sampler that is off by one label's worth of mass."""
    rng = np.random.default_rng(0)
    biased = np.concatenate([rng.integers(0, 37, 5000), np.zeros(300, dtype=int)])
    counts = np.bincount(biased, minlength=37)
    assert stats.chisquare(counts).pvalue < 1e-3


def test_positives_subsampled_uniformly_with_unbiased_weight():
    indptr = np.array([0, 10, 12])
    indices = np.concatenate([np.arange(10), [3, 7]])
    hits = np.zeros(10)
    trials = 4000
    for t in range(trials):
        pos = draw_positives(indptr, indices, 4, 16, torch.Generator().manual_seed(t))
        row0 = pos.ids[0].numpy()
        assert len(set(row0.tolist())) == 4
        hits[row0] += 1
        assert torch.allclose(pos.weight[0], torch.full((4,), 10 / 4))
        # a query with fewer positives than k_pos keeps all, weight 1, empty slots weight 0
        assert sorted(pos.ids[1].tolist()) == [-1, -1, 3, 7]
        assert pos.weight[1].tolist().count(1.0) == 2 and pos.weight[1].tolist().count(0.0) == 2
    assert stats.chisquare(hits).pvalue > 1e-3  # each positive kept with prob 4/10
    assert abs(hits.sum() / trials - 4) < 1e-9
    assert pos.is_positive(torch.tensor([[9, 11], [7, 9]])).tolist() == [[True, False], [True, False]]


def test_accidental_positive_lookup_by_table_equals_binary_search(monkeypatch):
    """Every way of finding a negative among the query's positives (the host's hashed filter; on a device the
    per-query table under TABLE_MAX_POSITIVES positives, the binary search over sorted keys above it) agrees
    with brute force."""
    from xc.sampling.base import TABLE_MAX_POSITIVES

    rng = np.random.default_rng(0)
    for most in (3, TABLE_MAX_POSITIVES, TABLE_MAX_POSITIVES + 5):
        counts = rng.integers(0, most + 1, 20)
        counts[0] = most
        rows = [rng.choice(200, c, replace=False) for c in counts]
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        indices = np.concatenate(rows).astype(np.int64)
        pos = draw_positives(indptr, indices, 4, 256, torch.Generator().manual_seed(1))
        assert (pos.table is not None) == (most <= TABLE_MAX_POSITIVES)
        neg = torch.from_numpy(rng.integers(-1, 200, (20, 50)))
        want = torch.tensor([[int(n) >= 0 and int(n) in set(r.tolist()) for n in row] for row, r in zip(neg, rows)])
        assert torch.equal(pos.is_positive(neg), want)  # on the host: the hashed filter
        with monkeypatch.context() as m:  # a filter of 16 entries: most keys collide, the search must sort them out
            m.setattr("xc.sampling.base.POSITIVE_FILTER_BITS", 16)
            assert torch.equal(pos.is_positive(neg), want)
        assert torch.equal(pos.by_search(neg), want)
        if pos.table is not None:
            assert torch.equal(pos.by_table(neg), want)


def _fixed_problem(seed=0, batch=6, num_labels=50, d=8):
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(batch, d, generator=gen)
    weight = torch.randn(num_labels, d, generator=gen) * 0.5
    indptr = np.array([0, 2, 3, 5, 5, 8, 9])
    indices = np.array([1, 7, 3, 10, 44, 2, 30, 31, 49])
    return emb, weight, indptr, indices


def _candidate_scores(w: torch.Tensor, e: torch.Tensor, cand) -> torch.Tensor:
    """(B, C + c) scores of the per-query candidates, then of the batch-shared pool if any."""
    scores = (w[cand.local_ids] * e.unsqueeze(1)).sum(-1)
    return scores if cand.pool_ids is None else torch.cat([scores, e @ w[cand.pool_ids].t()], 1)


@pytest.mark.parametrize("num_shards, shared_pool, proposal", [
    (1, 0, "uniform"), (2, 0, "uniform"), (1, 8, "uniform"), (2, 8, "uniform"),
    (1, 0, "popularity"), (2, 0, "popularity"), (2, 8, "popularity")])
def test_astra_loss_and_gradient_are_unbiased_for_full_bce(num_shards, shared_pool, proposal):
    """Per-query draws and the batch-shared pool (`sampler.shared_pool`: the batch's hard union + uniform
    draws from the whole shard, hits on the union weighted 0) both estimate the full BCE without bias; so do
    both with the random part drawn from the popularity proposal (`sampler.random_proposal`)."""
    emb, weight, indptr, indices = _fixed_problem()
    layout = ShardLayout.build(50, num_shards, multiple=1)
    cfg = SamplerConfig(k_pos=8, k_hard=4, k_random=8, shared_pool=shared_pool, random_proposal=proposal)
    counts = np.bincount(np.random.default_rng(2).zipf(1.3, 300) % 50, minlength=50)
    sampler = AstraSampler(layout, cfg, counts)
    rows = torch.arange(6)
    # fixed stale "hard" negatives per shard (any fixed set keeps the estimator unbiased)
    tables = {}
    for s in range(num_shards):
        lo, _ = layout.shard_range(s)
        tables[s] = (lo + (np.arange(6)[:, None] * 3 + np.arange(4 // num_shards)) % layout.real_count(s)).astype(np.int32)
    sampler.update(1, HardNegativeSet(tables, 1, 0, 0))

    def full():
        w = weight.clone().requires_grad_(True)
        e = emb.clone().requires_grad_(True)
        pos = draw_positives(indptr, indices, 8, layout.padded_labels, torch.Generator().manual_seed(0))
        loss = full_bce(e @ w.t(), pos, 0, 50, normalizer=6.0)
        loss.backward()
        return loss.item(), e.grad, w.grad

    exact_loss, exact_egrad, exact_wgrad = full()
    trials = 2000
    losses, egrads, wgrads = [], [], []
    for t in range(trials):
        key = StepKey(seed=1, epoch=0, step=t)
        pos = draw_positives(indptr, indices, 8, layout.padded_labels, key.generator(-1))
        draws = [sampler.sample(key, s, rows) for s in range(num_shards)]
        cand = assemble_candidates(pos, draws, 0, layout.padded_labels)
        assert (cand.pool_ids is not None) == bool(shared_pool)
        w = weight.clone().requires_grad_(True)
        e = emb.clone().requires_grad_(True)
        loss = weighted_bce(_candidate_scores(w, e, cand), cand, normalizer=6.0)
        loss.backward()
        losses.append(loss.detach())
        egrads.append(e.grad)
        wgrads.append(w.grad)
    # z-scores of the Monte-Carlo means against the exact values: a biased estimator (see the test
    # below) gives |z| in the tens; an unbiased one stays within a few standard errors.
    for samples, exact in ((torch.stack(losses), torch.tensor(exact_loss)), (torch.stack(egrads), exact_egrad),
                           (torch.stack(wgrads), exact_wgrad)):
        mean, se = samples.double().mean(0), samples.double().std(0) / trials ** 0.5
        # + 1e-6: components summed exactly every trial (the pool's hard rows) have se 0 and float32 rounding
        z = (mean - exact.double()).abs() / (se + 1e-6)
        assert float(z.max()) < 5.0, float(z.max())


def test_unweighted_uniform_loss_is_biased():
    """Guard that the unbiasedness test can fail: dropping the (n - |H|)/k weight is caught."""
    emb, weight, indptr, indices = _fixed_problem()
    layout = ShardLayout.build(50, 1, multiple=1)
    sampler = UniformSampler(layout, SamplerConfig(k_hard=0, k_random=8))
    pos0 = draw_positives(indptr, indices, 8, 50, torch.Generator().manual_seed(0))
    exact = full_bce(emb @ weight.t(), pos0, 0, 50, 6.0).item()
    losses = []
    for t in range(500):
        key = StepKey(1, 0, t)
        draw = sampler.sample(key, 0, torch.arange(6))
        draw.weight = torch.ones_like(draw.weight)  # the bug
        cand = assemble_candidates(pos0, [draw], 0, 50)
        losses.append(weighted_bce((weight[cand.local_ids] * emb.unsqueeze(1)).sum(-1), cand, 6.0).item())
    losses = torch.tensor(losses, dtype=torch.float64)
    z = (losses.mean() - exact).abs() / (losses.std() / 500 ** 0.5)
    assert z > 20


def test_shard_draws_do_not_depend_on_which_rank_holds_the_shard():
    layout = ShardLayout.build(1000, 4, multiple=16)
    sampler = UniformSampler(layout, SamplerConfig(k_hard=8, k_random=32))
    key = StepKey(3, 2, 17)
    a = sampler.sample(key, 2, torch.arange(5))
    b = UniformSampler(layout, SamplerConfig(k_hard=8, k_random=32)).sample(key, 2, torch.arange(5))
    assert torch.equal(a.ids, b.ids)
    lo, hi = layout.shard_range(2)
    assert a.ids.min() >= lo and a.ids.max() < hi
    assert not torch.equal(a.ids, sampler.sample(StepKey(3, 2, 18), 2, torch.arange(5)).ids)


def test_astra_never_draws_padding_or_stored_hard_negatives():
    layout = ShardLayout.build(37, 2, multiple=16)  # shards of 32 rows; shard 1 holds labels 32..36
    sampler = AstraSampler(layout, SamplerConfig(k_hard=4, k_random=64))
    tables = {0: np.tile(np.array([[0, 5]], dtype=np.int32), (3, 1)),
              1: np.tile(np.array([[33, -1]], dtype=np.int32), (3, 1))}
    sampler.update(1, HardNegativeSet(tables, 1, 0, 0))
    draw = sampler.sample(StepKey(0, 1, 0), 1, torch.arange(3))
    uniform = draw.ids[:, 2:]
    assert uniform.min() >= 32 and uniform.max() <= 36 and not (uniform == 33).any()
    assert torch.allclose(draw.weight[:, 2:], torch.full_like(draw.weight[:, 2:], 4 / 32))  # (5 - 1) / 32
    assert draw.weight[:, :2].tolist() == [[1.0, 0.0]] * 3


def test_counts_must_split_over_shards():
    layout = ShardLayout.build(100, 3, multiple=1)
    with pytest.raises(ConfigError, match="sampler.k_random"):
        AstraSampler(layout, SamplerConfig(k_hard=3, k_random=10))


@pytest.mark.parametrize("seed", range(5))
def test_compact_pool_writes_out_to_the_dense_masked_weights(seed):
    """The shared pool travels as (c,) weights plus the (query, column) hits of each query's own positives;
    written out it is exactly the dense (B, c) weight that masks every query's positives, duplicates and empty
    slots included, with an all-zero target."""
    from xc.train.loss import Candidates
    from xc.sampling.base import NegativeDraw

    gen = torch.Generator().manual_seed(seed)
    num_labels, batch = 40, 7
    counts = torch.randint(0, 6, (batch,), generator=gen)
    indptr = np.concatenate([[0], np.cumsum(counts.numpy())])
    indices = np.concatenate([np.sort(torch.randperm(num_labels, generator=gen)[:n].numpy()) for n in counts.tolist()])
    pos = draw_positives(indptr, indices.astype(np.int64), 3, num_labels, gen)
    pool = torch.randint(-1, num_labels, (1, 60), generator=gen)  # repeats and empty slots
    weight = torch.rand(1, 60, generator=gen) + 0.5
    cand = assemble_candidates(pos, [NegativeDraw(pool, weight, shared=True)], 0, num_labels)
    assert cand.weight.shape == (batch, 3) and cand.pool_weight.shape == (60,)
    dense = cand.dense()
    hit = torch.zeros(batch, 60, dtype=torch.bool)
    for q in range(batch):
        mine = set(indices[indptr[q]:indptr[q + 1]].tolist())
        hit[q] = torch.tensor([int(i) in mine for i in pool[0]])
    expected = weight * ~hit
    assert torch.equal(dense.weight[:, 3:], expected)
    assert torch.equal(dense.target[:, 3:], torch.zeros(batch, 60))
    assert torch.equal(dense.weight[:, :3], cand.weight) and torch.equal(dense.target[:, :3], cand.target)
    rows, columns = pos.pool_hits(pool[0])
    listed = torch.zeros_like(hit)
    listed[rows, columns] = True
    assert torch.equal(listed, hit & (pool[0] >= 0)) and rows.numel() == int(listed.sum())  # each hit once
    assert isinstance(dense, Candidates) and dense.dense() is dense
