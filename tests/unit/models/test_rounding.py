"""Stochastic rounding to bfloat16 (xc/models/rounding.py): unbiased, only ever to one of the two neighbours,
keyed by (seed, label, column, step) alone, where rounding to nearest stalls a row under small updates."""

from __future__ import annotations

import pytest
import torch

from xc.models import ClassifierShard
from xc.models.rounding import round_rows, rounding_bits, stochastic_round_bf16


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(towards zero, away from zero): the two bfloat16 values around each float32 in x, as float32."""
    pattern = x.view(torch.int32) & -(1 << 16)
    return pattern.view(torch.float32), (pattern + (1 << 16)).view(torch.float32)


def test_mean_of_many_roundings_is_the_value_and_each_is_a_neighbour():
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(1, 64, generator=gen) * 4 - 2)  # (1, 64) values in [-2, 2), almost none a bfloat16
    down, up = _neighbours(x)
    draws = 4000
    rounded = torch.cat([round_rows(x, torch.bfloat16, True, 7, torch.tensor([3]), step).float()
                         for step in range(draws)])  # (draws, 64), a new step counter each time
    assert torch.all((rounded == down) | (rounded == up))
    # the share rounded up is a Bernoulli mean with p = (x - down) / ulp: its standard error is at most 0.5 / sqrt(N)
    p = (x - down) / (up - down)
    share_up = (rounded == up).float().mean(0, keepdim=True)
    assert torch.all((share_up - p).abs() <= 5 * 0.5 / draws ** 0.5)
    stderr = (up - down).abs() * 0.5 / draws ** 0.5
    assert torch.all((rounded.mean(0, keepdim=True) - x).abs() <= 5 * stderr)
    # and over the 64 columns the errors are not one-sided: the mean signed error is within noise of zero
    assert abs(float(((rounded.mean(0) - x[0]) / (up - down)[0].abs()).mean())) < 5 * 0.5 / (draws * 64) ** 0.5


def test_representable_values_and_non_finite_ones_pass_unchanged():
    exact = torch.tensor([[1.0, -2.5, 0.0, -0.0, 2.0 ** 127, float("inf"), -float("inf"), float("nan")]])
    for step in range(50):
        out = round_rows(exact, torch.bfloat16, True, 0, torch.tensor([1]), step).float()
        assert torch.equal(out[:, :5], exact[:, :5]) and torch.equal(out[:, 5:7], exact[:, 5:7])
        assert torch.isnan(out[0, 7])
    assert torch.signbit(round_rows(exact, torch.bfloat16, True, 0, torch.tensor([1]), 0).float()[0, 3])


def test_negative_values_round_in_magnitude_as_positive_ones_do():
    x = torch.full((1, 32), 1.0 + 2 ** -10)
    bits = rounding_bits(3, torch.tensor([9]), 11, 32)
    assert torch.equal(stochastic_round_bf16(-x, bits.clone()), -stochastic_round_bf16(x, bits))


def test_the_bits_are_a_function_of_seed_label_column_and_step():
    ids = torch.arange(100, 110)
    a = rounding_bits(5, ids, 42, 16)
    assert a.dtype == torch.int32 and a.shape == (10, 16) and int(a.min()) >= 0 and int(a.max()) < 1 << 16
    assert torch.equal(a, rounding_bits(5, ids, 42, 16))
    assert torch.equal(a[3:5], rounding_bits(5, ids[3:5], 42, 16))  # a row's bits do not depend on its neighbours
    assert torch.equal(a[:, :8], rounding_bits(5, ids, 42, 8))  # nor on the other columns
    for other in (rounding_bits(6, ids, 42, 16), rounding_bits(5, ids, 43, 16), rounding_bits(5, ids + 1, 42, 16)):
        assert (other != a).float().mean() > 0.99
    assert (a[:, 1:] != a[:, :-1]).float().mean() > 0.99  # columns are not copies of each other


def test_small_updates_stall_under_nearest_rounding_and_survive_stochastic_rounding():
    """1000 updates of +1e-4 to rows at 1.0 (a bfloat16 ulp there is 2^-7): to nearest, x + 1e-4 == x every time;
    stochastically, each update moves the row by an ulp with probability 1e-4 / ulp, so the rows reach 1.1 in
    expectation (std of the sum of 1000 roundings <= sqrt(1000) x ulp / 2 = 0.12 for one element, 0.015 for the mean
    of 64)."""
    ids = torch.arange(2)
    nearest = ClassifierShard(0, 2, 2, 64, 0.0, 0, torch.device("cpu"), torch.bfloat16, False, "nearest")
    stochastic = ClassifierShard(0, 2, 2, 64, 0.0, 0, torch.device("cpu"), torch.bfloat16, False, "stochastic")
    for shard in (nearest, stochastic):
        shard.write_rows(ids, torch.ones(2, 64), 0)
        for step in range(1, 1001):
            shard.write_rows(ids, shard.exact_rows(ids) + 1e-4, step)
    assert torch.all(nearest.weight.float() == 1.0)
    assert abs(float(stochastic.weight.float().mean()) - 1.1) < 0.02


def test_stochastic_rows_refuse_a_write_without_the_step_that_keys_it():
    shard = ClassifierShard(0, 2, 2, 4, 0.0, 0, torch.device("cpu"), torch.bfloat16, False, "stochastic")
    with pytest.raises(ValueError, match="global step"):
        shard.write_rows(torch.arange(2), torch.ones(2, 4))
    with pytest.raises(ValueError, match="without fp32 masters"):
        ClassifierShard(0, 2, 2, 4, 0.0, 0, torch.device("cpu"), torch.float16, False, "stochastic")
