"""Shared uniform negatives (dual mode, `sampler.shared_uniform`): one draw per batch, still unbiased."""

from __future__ import annotations

import torch

from xc.train.modes.dual.step import shared_uniform


def test_one_draw_for_the_batch_and_an_unbiased_sum_outside_each_querys_hard_ids():
    num_real, lo, k = 40, 100, 8
    hard = torch.tensor([[100, 105, 139], [110, 111, -1]])  # global ids; -1 = empty slot
    f = torch.linspace(0.5, 2.0, num_real, dtype=torch.float64)  # any per-label quantity
    gen = torch.Generator().manual_seed(0)
    total = torch.zeros(2, dtype=torch.float64)
    trials = 20000
    for _ in range(trials):
        draw = shared_uniform(hard, num_real, lo, k, gen, exclude_hard=True)
        assert torch.equal(draw.ids[0], draw.ids[1])  # shared by every query
        assert ((draw.ids >= lo) & (draw.ids < lo + num_real)).all()
        total += (draw.weight.double() * f[draw.ids - lo]).sum(1)
    for q in range(2):
        outside = torch.ones(num_real, dtype=torch.bool)
        outside[hard[q][hard[q] >= 0] - lo] = False
        want = f[outside].sum()
        assert abs(total[q] / trials - want) / want < 0.01, (q, total[q] / trials, want)
    # without exclusion every draw weighs num_real / k: the sum over the whole shard
    plain = shared_uniform(hard, num_real, lo, k, gen, exclude_hard=False)
    assert torch.all(plain.weight == num_real / k)


class _TopK:
    """A deterministic top-k source over a fixed score table (what a label cache's `mine` returns)."""

    def __init__(self, scores: torch.Tensor):
        self.scores = scores  # (B, n)

    def mine(self, emb, k, gen):
        return torch.topk(self.scores, k, dim=1).indices, None


class _Sampling:
    """A sampling source: k draws per query from a fixed distribution q, with their log q."""

    def __init__(self, q: torch.Tensor):
        self.q = q  # (n,)

    def mine(self, emb, k, gen):
        ids = torch.multinomial(self.q.expand(emb.shape[0], -1), k, replacement=True, generator=gen)
        return ids, torch.log(self.q[ids])


def test_inbatch_negatives_keep_every_source_unbiased():
    """hard + in-batch positives + uniform draws, weighted as xc/train/modes/dual/step.py says, estimate the sum over
    the whole shard, for top-k and sampling sources, shared and per-query uniform draws; an in-batch id that is
    also a hard id counts once."""
    from xc.train.modes.dual.step import shard_draw

    num_real, lo, batch, k_hard, k_random = 30, 60, 3, 4, 6
    f = torch.linspace(0.5, 2.0, num_real, dtype=torch.float64)
    scores = torch.randn(batch, num_real, generator=torch.Generator().manual_seed(1))
    inbatch = torch.tensor([60, 61, 75, int(lo + torch.topk(scores[0], 1).indices[0])]).unique()  # one is a hard id
    q = torch.softmax(torch.randn(num_real, generator=torch.Generator().manual_seed(2)), 0).double()
    emb = torch.zeros(batch, 2)
    want = f.sum()
    for source in (_TopK(scores), _Sampling(q)):
        for shared in (False, True):
            gen = torch.Generator().manual_seed(0)
            total, trials = torch.zeros(batch, dtype=torch.float64), 6000
            for _ in range(trials):
                draw = shard_draw(source, emb, lo, num_real, k_hard, k_random, gen, shared, inbatch)
                ok = draw.ids >= 0
                assert ((draw.ids[ok] >= lo) & (draw.ids[ok] < lo + num_real)).all()
                total += (draw.weight.double() * f[draw.ids.clamp_min(lo) - lo] * ok).sum(1)
            err = (total / trials - want).abs() / want
            assert (err < 0.02).all(), (type(source).__name__, shared, total / trials, want)


def test_without_inbatch_ids_the_draw_is_unchanged():
    from xc.train.modes.dual.step import shard_draw

    scores = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))
    for shared in (False, True):
        a = shard_draw(_TopK(scores), torch.zeros(2, 2), 0, 20, 3, 5, torch.Generator().manual_seed(4), shared)
        b = shard_draw(_TopK(scores), torch.zeros(2, 2), 0, 20, 3, 5, torch.Generator().manual_seed(4), shared,
                       torch.zeros(0, dtype=torch.int64))
        assert torch.equal(a.ids, b.ids) and torch.equal(a.weight, b.weight)
        assert a.ids.shape == (2, 8)
