"""Shared uniform negatives (dual mode, `sampler.shared_uniform`): one draw per batch, still unbiased."""

from __future__ import annotations

import torch

from xc.dual_step import shared_uniform


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
