"""Every sampler draws what it states: empirical frequencies against Sampler.distribution, the
returned log_q against the same, MIDX's decompositions against the softmax, sampled softmax
against its exact version."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from xc.config import SamplerConfig
from xc.train.loss import assemble_candidates, full_softmax, sampled_softmax
from xc.sampling import NegativeDraw, SampleBatch, StepKey, build_sampler, draw_positives
from xc.sampling.lsh import HashFamily, inclusion_probability
from xc.sampling.midx import build_index, exact_decomposition
from xc.shards import ShardLayout

N, D = 48, 8


def _problem(num_shards=1, seed=0, clustered=True):
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(6, D, generator=gen) * 1.5
    rows = centers[torch.randint(6, (N,), generator=gen)] + 0.4 * torch.randn(N, D, generator=gen)
    if not clustered:
        rows = torch.randn(N, D, generator=gen)
    layout = ShardLayout.build(N, num_shards, multiple=1)
    z = torch.randn(2, D, generator=gen)
    indptr = np.array([0, 2, 9])
    indices = np.array([1, 30, 3, 10, 44, 25, 40, 12, 7])
    positives = draw_positives(indptr, indices, 4, layout.padded_labels, torch.Generator().manual_seed(1))
    counts = np.bincount(np.random.default_rng(seed).zipf(1.5, 400) % N, minlength=N)
    return layout, rows, z, positives, counts


def _shard_rows(layout, rows):
    out = {}
    for s in range(layout.num_shards):
        lo, _ = layout.shard_range(s)
        out[s] = rows[lo:lo + layout.real_count(s)]
    return out


def _make(name, layout, rows, counts, **overrides):
    cfg = SamplerConfig(name=name, k_hard=0, k_random=64 * layout.num_shards, **overrides)
    sampler = build_sampler(cfg, layout, seed=3, label_counts=counts)
    sampler.update(0, None, _shard_rows(layout, rows), 0)
    return sampler


def _chi_square_pvalue(counts: np.ndarray, prob: np.ndarray) -> float:
    """Pearson chi-square with cells of expected count < 5 pooled (so rare labels do not dominate)."""
    expected = prob * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    if obs[~keep].sum() > 0:
        return 0.0  # drawn where the stated probability is zero
    if keep.sum() < 2:
        return 1.0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


IID = ["uniform", "popularity", "inbatch", "midx_pq", "midx_rq"]


@pytest.mark.parametrize("name", IID)
@pytest.mark.parametrize("num_shards", [1, 2])
def test_iid_samplers_match_their_stated_distribution(name, num_shards):
    layout, rows, z, positives, counts = _problem(num_shards)
    sampler = _make(name, layout, rows, counts, midx_codewords=4)
    batch = SampleBatch(torch.arange(2), positives, z)
    for shard in range(num_shards):
        lo, _ = layout.shard_range(shard)
        n = layout.real_count(shard)
        stated = sampler.distribution(shard, batch).numpy()
        assert stated.shape == (2, n) and np.allclose(stated.sum(1), 1.0)
        hits = np.zeros((2, n))
        for step in range(60):
            draw = sampler.sample(StepKey(0, 0, step), shard, batch)
            local = (draw.ids - lo).numpy()
            for q in range(2):
                hits[q] += np.bincount(local[q], minlength=n)
            # the log_q it returns is the stated probability of each drawn id
            expect = np.log(np.take_along_axis(stated, local, 1))
            assert np.allclose(draw.log_q.numpy(), expect, atol=1e-4)
            if name != "inbatch":  # in-batch weights use the marginal frequency (docstring)
                assert np.allclose(draw.weight.numpy(), 1.0 / (draw.ids.shape[1] * np.exp(expect)), rtol=1e-3)
        for q in range(2):
            assert _chi_square_pvalue(hits[q], stated[q]) > 1e-4
            if name != "uniform":  # the same test rejects a wrong q (here: uniform)
                assert _chi_square_pvalue(hits[q], np.full(n, 1.0 / n)) < 1e-4


def test_midx_exact_decomposition_equals_the_softmax():
    layout, rows, z, *_ = _problem()
    for quantizer in ("pq", "rq"):
        index = build_index(rows, 5, quantizer, 20, torch.Generator().manual_seed(0))
        exact = exact_decomposition(index, rows, z)
        full = torch.softmax(z.double() @ rows.double().t(), 1)
        torch.testing.assert_close(exact, full, rtol=1e-6, atol=1e-12)
        # Theorem 2: the fast proposal is the softmax over the reconstructed rows
        offsets = torch.arange(N).unsqueeze(0).expand(2, -1)
        fast = torch.exp(index.log_prob(z, offsets).double())
        torch.testing.assert_close(fast, torch.softmax(z.double() @ index.reconstruct().double().t(), 1),
                                   rtol=1e-5, atol=1e-9)


def _kl(q: torch.Tensor, p: torch.Tensor) -> float:
    return float((q * (q.log() - p.log())).sum(1).mean())


def test_midx_is_closer_to_the_softmax_than_uniform_and_improves_with_k():
    layout, rows, z, *_ = _problem()
    target = torch.softmax(z.double() @ rows.double().t(), 1)
    uniform = torch.full_like(target, 1.0 / N)
    kl = {}
    for k in (2, 4, 8):
        index = build_index(rows, k, "rq", 30, torch.Generator().manual_seed(0))
        kl[k] = _kl(torch.softmax(z.double() @ index.reconstruct().double().t(), 1), target)
    assert kl[8] < kl[4] < kl[2] < _kl(uniform, target)


def _inclusion_trials(sampler, layout, rows, batch, trials):
    n = layout.real_count(0)
    hits, stated = np.zeros((batch.size, n)), np.zeros((batch.size, n))
    for t in range(trials):
        sampler.update(t, None, _shard_rows(layout, rows), 0)  # LSH: fresh hash functions each time
        draw = sampler.sample(StepKey(0, t, 0), 0, batch)
        for q in range(batch.size):
            ids = draw.ids[q][draw.ids[q] >= 0].unique().numpy()
            hits[q, ids] += 1
        stated += sampler.distribution(0, batch).numpy()
    return hits / trials, stated / trials


def test_snm_inclusion_matches_its_formula():
    layout, rows, z, positives, counts = _problem()
    cfg = SamplerConfig(name="snm", k_hard=0, k_random=6, snm_pool=20)
    sampler = build_sampler(cfg, layout, 0, counts)
    batch = SampleBatch(torch.arange(2), positives, z)
    freq, stated = _inclusion_trials(sampler, layout, rows, batch, 3000)
    assert ((stated.sum(1) > 4) & (stated.sum(1) <= 6)).all()  # k slots, fewer distinct labels (repeats)
    sd = np.sqrt(stated * (1 - stated) / 3000) + 1e-3
    assert np.abs(freq - stated).max() < 5 * sd.max()
    assert np.abs(freq - stated).sum(1).max() / 6 < 0.08
    # a wrong formula (top-k of the whole shard, no sampling) is far off
    assert np.abs(freq - (stated > 0.5)).sum(1).max() / 6 > 0.3


@pytest.mark.parametrize("family", ["simhash", "dwta"])
def test_lsh_inclusion_matches_one_minus_one_minus_alpha_k_to_the_l(family):
    """Over fresh hash functions (one family per epoch), a label is in the probed union with
    probability 1 - (1 - alpha^K)^L (Theorems 1-2); budget and window do not truncate here."""
    layout, rows, z, positives, counts = _problem(clustered=False)
    bits, tables, trials = 3, 3, 1500
    cfg = SamplerConfig(name="lsh_embedding", k_hard=0, k_random=N, lsh_family=family, lsh_bits=bits,
                        lsh_tables=tables, lsh_window=N, lsh_dwta_bin=4, lsh_rebuild_every=0)
    sampler = build_sampler(cfg, layout, 0, counts)
    batch = SampleBatch(torch.arange(2), positives, z)
    hits, alpha_sum, stated_sum = np.zeros((2, N)), np.zeros((2, N)), np.zeros((2, N))
    every = torch.arange(N).unsqueeze(0).expand(2, -1)
    for t in range(trials):
        sampler.update(t, None, _shard_rows(layout, rows), 0)
        union = sampler.probe_union(0, batch, torch.Generator().manual_seed(t))
        for q in range(2):
            hits[q, union[q][union[q] >= 0].numpy()] += 1
        fam, tab = sampler.families[0], sampler.tables[0]
        if family == "simhash":
            beta = fam.table_collision_probability(z, rows[every])
        else:
            beta = fam.table_collision_probability(z, None, tab.codes[every], fam.codes(z))
        alpha_sum += beta.numpy()
        stated_sum += sampler.distribution(0, batch).numpy()
    freq = hits / trials
    truth = inclusion_probability(torch.from_numpy(alpha_sum / trials), tables).numpy()
    if family == "simhash":  # the stated probability is the exact closed form
        assert np.allclose(stated_sum / trials, truth, atol=1e-6)
    sd = np.sqrt(truth * (1 - truth) / trials) + 1e-3
    assert np.abs(freq - truth).max() < 5 * sd.max()
    assert np.abs(freq - truth).mean() < 0.02
    wrong = inclusion_probability(torch.from_numpy(alpha_sum / trials), tables - 1).numpy()
    assert np.abs(freq - wrong).max() > 5 * sd.max()  # a wrong L is rejected


def test_simhash_collision_probability_is_one_minus_angle_over_pi():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, D, generator=gen), torch.randn(1, 1, D, generator=gen)
    family = HashFamily.draw("simhash", D, 1, 4000, gen)
    agree = (family.hashes(a) == family.hashes(b[0])).float().mean()
    alpha = family.table_collision_probability(a, b)  # K = 1: per-hash
    assert abs(float(agree) - float(alpha)) < 0.03
    assert float(inclusion_probability(torch.tensor(0.25), 3)) == pytest.approx(1 - 0.75 ** 3)


def test_sampled_softmax_with_every_label_equals_full_softmax():
    layout, rows, z, positives, _ = _problem()
    scores_all = z @ rows.t()
    n = layout.real_count(0)
    # "sample" every label once with weight 1 (q = 1/n, c = n): the estimate is exact
    draw = NegativeDraw(torch.arange(n).unsqueeze(0).expand(2, -1).clone(), torch.ones(2, n))
    cand = assemble_candidates(positives, [draw], 0, layout.padded_labels)
    scores = scores_all.gather(1, cand.local_ids)
    sampled = sampled_softmax(scores, cand, positives, normalizer=2.0)
    exact = full_softmax(scores_all, positives, 0, n, normalizer=2.0)
    torch.testing.assert_close(sampled, exact)
    # by hand: each kept positive p of a query (weight |P|/k_pos when subsampled) against all
    # labels that are not positives of that query
    by_hand = 0.0
    for q, labels in ((0, [1, 30]), (1, [3, 10, 44, 25, 40, 12, 7])):
        s = scores_all[q].double()
        neg = torch.ones(N, dtype=torch.bool)
        neg[labels] = False
        z_neg = torch.exp(s[neg]).sum()
        for slot, p in enumerate(positives.ids[q].tolist()):
            if p >= 0:
                w = float(positives.weight[q, slot])
                by_hand += w * float(torch.log(torch.exp(s[p]) + z_neg) - s[p])
    assert float(exact) == pytest.approx(by_hand / 2.0, rel=1e-5)


@pytest.mark.parametrize("name", ["uniform", "popularity", "midx_rq"])
def test_importance_weights_estimate_the_partition_function_without_bias(name):
    """E[sum_j w_j exp(o_j)] over draws = sum over labels of exp(o): the logQ-corrected denominator."""
    layout, rows, z, positives, counts = _problem()
    z = z * 0.3  # keep exp(o) / q light-tailed so 400 x 64 draws show the mean (IS variance)
    sampler = _make(name, layout, rows, counts, midx_codewords=4)  # coarse cells: q far from exact
    batch = SampleBatch(torch.arange(2), positives, z)
    exact = torch.exp(z.double() @ rows.double().t()).sum(1)
    estimates = []
    for step in range(400):
        draw = sampler.sample(StepKey(1, 0, step), 0, batch)
        o = (rows[draw.ids].double() @ z.double().unsqueeze(2)).squeeze(2)
        estimates.append((draw.weight.double() * torch.exp(o)).sum(1))
    est = torch.stack(estimates)
    zscore = (est.mean(0) - exact) / (est.std(0) / math.sqrt(len(est)) + 1e-6 * exact)
    assert bool((zscore.abs() < 4).all()), zscore


def test_curriculum_ramps_the_hard_share_with_an_equal_budget():
    layout = ShardLayout.build(100, 1, multiple=1)
    cfg = SamplerConfig(name="curriculum", k_hard=8, k_random=24, start_epoch=1, curriculum_epochs=4)
    sampler = build_sampler(cfg, layout)
    from xc.sampling import HardNegativeSet

    table = np.tile(np.arange(8, dtype=np.int32), (3, 1))
    used = []
    for epoch in range(1, 7):
        sampler.update(epoch, HardNegativeSet({0: table}, epoch, epoch - 1, 0))
        draw = sampler.sample(StepKey(0, epoch, 0), 0, torch.arange(3))
        assert draw.ids.shape[1] == 32  # k_hard + k_random whatever the stage
        used.append(int((draw.weight[0] == 1.0).sum()))
    assert used[:4] == [2, 4, 6, 8] and used[4:] == [8, 8]


def test_lsh_rebuilds_on_schedule_and_on_drift():
    layout, rows, z, positives, counts = _problem()
    rows = rows.clone()
    sampler = _make("lsh_embedding", layout, rows, counts, lsh_rebuild_every=5, lsh_drift_threshold=0.5)
    start = sampler.rebuilds
    for step in range(1, 5):
        sampler.after_step(step, _shard_rows(layout, rows))
    assert sampler.rebuilds == start  # no schedule hit, no drift
    sampler.after_step(5, _shard_rows(layout, rows))
    assert sampler.rebuilds == start + 1
    rows.mul_(-3.0)  # drift far past the threshold
    sampler.after_step(6, _shard_rows(layout, rows))
    assert sampler.rebuilds == start + 2


def test_learned_codewords_bring_the_proposal_closer_to_the_softmax():
    layout, rows, z, *_ = _problem(seed=4)
    from xc.sampling.midx import learn_codewords

    gen = torch.Generator().manual_seed(0)
    queries = torch.randn(256, D, generator=gen)
    target = torch.softmax(queries.double() @ rows.double().t(), 1)

    def renyi2(index):
        q = torch.softmax(queries.double() @ index.reconstruct().double().t(), 1)
        return float(torch.log((target ** 2 / q).sum(1)).mean())

    for quantizer in ("pq", "rq"):
        index = build_index(rows, 3, quantizer, 30, torch.Generator().manual_seed(0))
        learned = learn_codewords(index, rows, queries, steps=200, lr=0.05, gen=gen)
        assert learned.counts.sum() == N and learned.indptr[-1] == N  # every row still in one cell
        assert renyi2(learned) < renyi2(index)


def test_hard_samplers_return_the_stored_table_and_warm_up_uniformly():
    """w-hard / E-hard: deterministic negatives (inclusion 1, weight 1) once a table exists."""
    from xc.sampling import HardNegativeSet

    layout = ShardLayout.build(60, 2, multiple=1)
    sampler = build_sampler(SamplerConfig(name="hard", k_hard=8, k_random=0), layout)
    rows = torch.tensor([0, 2])
    sampler.update(0, None)
    warm = sampler.sample(StepKey(0, 0, 0), 1, rows)  # before the first table: uniform over the shard
    assert warm.ids.shape == (2, 4) and bool(((warm.ids >= 30) & (warm.ids < 60)).all())
    tables = {s: np.arange(12, dtype=np.int32).reshape(3, 4) + 30 * s for s in range(2)}
    sampler.update(1, HardNegativeSet(tables, 1, 0, 0))
    draw = sampler.sample(StepKey(0, 1, 0), 1, rows)
    assert draw.ids.tolist() == [[30, 31, 32, 33], [38, 39, 40, 41]]
    assert bool((draw.weight == 1).all())


@pytest.mark.parametrize("name, proposal", [("astra", "uniform"), ("curriculum", "uniform"), ("hard", "uniform"),
                                            ("astra", "popularity"), ("curriculum", "popularity")])
def test_hard_mixture_inclusion_matches_its_stated_distribution(name, proposal):
    """Stored hard ids are always in; each other label is in with 1 - (1 - 1/(n - |H|))^k_uniform, or with
    1 - (1 - q(l))^k_random when the random part draws from the popularity proposal."""
    from xc.sampling import HardNegativeSet

    layout = ShardLayout.build(N, 1, multiple=1)
    cfg = SamplerConfig(name=name, k_hard=4, k_random=12, start_epoch=1, curriculum_epochs=2,
                        random_proposal=proposal)
    counts = np.bincount(np.random.default_rng(0).zipf(1.5, 400) % N, minlength=N)
    sampler = build_sampler(cfg, layout, label_counts=counts)
    table = np.array([[5, 9, 20, 33], [1, 2, 3, -1]], dtype=np.int32)
    sampler.update(1, HardNegativeSet({0: table}, 1, 0, 0))  # curriculum: 2 of the 4 hard slots
    batch = SampleBatch(torch.arange(2))
    stated = sampler.distribution(0, batch).numpy()
    trials = 3000
    hits = np.zeros((2, N))
    for t in range(trials):
        ids = sampler.sample(StepKey(0, 1, t), 0, batch).ids
        for q in range(2):
            hits[q, ids[q][ids[q] >= 0].unique().numpy()] += 1
    freq = hits / trials
    sd = np.sqrt(stated * (1 - stated) / trials) + 1e-3
    assert np.abs(freq - stated).max() < 5 * sd.max()
    assert ((stated == 1.0) == (freq == 1.0)).all()  # exactly the hard ids in use are certain
    if name != "hard":  # a wrong law (k_uniform draws from all n labels) is rejected
        k = 16 - (2 if name == "curriculum" else 4)
        wrong = np.where(stated == 1.0, 1.0, 1 - (1 - 1 / N) ** k)
        assert np.abs(freq - wrong).sum() > (2 if proposal == "popularity" else 1) * np.abs(freq - stated).sum()


@pytest.mark.parametrize("name, proposal", [("astra", "uniform"), ("curriculum", "uniform"), ("uniform", "uniform"),
                                            ("astra", "popularity"), ("curriculum", "popularity")])
def test_shared_pool_inclusion_matches_its_stated_distribution(name, proposal):
    """sampler.shared_pool: one pool for the batch, the same for every query: the batch's hard union surely
    (its uniform hits weigh 0), each other label with 1 - (1 - 1/n)^k, k uniform draws from the whole shard
    (1 - (1 - q(l))^k from the popularity proposal)."""
    from xc.sampling import HardNegativeSet

    layout = ShardLayout.build(N, 1, multiple=1)
    cfg = SamplerConfig(name=name, k_hard=4, k_random=12, start_epoch=1, curriculum_epochs=2, shared_pool=6,
                        random_proposal=proposal)
    counts = np.bincount(np.random.default_rng(0).zipf(1.5, 400) % N, minlength=N)
    sampler = build_sampler(cfg, layout, label_counts=counts)
    table = np.array([[5, 9, 20, 33], [1, 2, 3, -1]], dtype=np.int32)
    if name != "uniform":
        sampler.update(1, HardNegativeSet({0: table}, 1, 0, 0))  # curriculum: 2 of the 4 hard slots
    batch = SampleBatch(torch.arange(2))
    stated = sampler.distribution(0, batch).numpy()
    assert (stated[0] == stated[1]).all()
    trials = 3000
    hits = np.zeros(N)
    for t in range(trials):
        draw = sampler.sample(StepKey(0, 1, t), 0, batch)
        assert draw.shared and draw.ids.shape[0] == 1
        hits[draw.ids[0][draw.weight[0] > 0].unique().numpy()] += 1
    freq = hits / trials
    sd = np.sqrt(stated[0] * (1 - stated[0]) / trials) + 1e-3
    assert np.abs(freq - stated[0]).max() < 5 * sd.max()
    assert ((stated[0] == 1.0) == (freq == 1.0)).all()  # exactly the batch's hard union in use is certain
    union = {"astra": {5, 9, 20, 33, 1, 2, 3}, "curriculum": {5, 9, 1, 2}, "uniform": set()}[name]
    assert set(np.flatnonzero(stated[0] == 1.0).tolist()) == union
    if proposal == "popularity":  # the uniform law with the same number of draws is rejected
        k = sampler.pool.uniform(2, 4 if name == "astra" else 2)
        wrong = np.where(stated[0] == 1.0, 1.0, 1 - (1 - 1 / N) ** k)
        assert np.abs(freq - wrong).sum() > 2 * np.abs(freq - stated[0]).sum()
