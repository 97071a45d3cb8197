"""The encoders' dropout (xc/models/encoders.py Dropout): nn.Dropout's law from a mask of 16-bit random slices."""

from __future__ import annotations

import math

import pytest
import torch

from xc.models.encoders import Dropout


@pytest.mark.parametrize("p", [0.1, 0.5, 0.3])
def test_each_element_is_dropped_with_probability_p_and_the_rest_scaled(p):
    torch.manual_seed(0)
    n = 400_000
    out = Dropout(p).train()(torch.ones(n))
    dropped = out == 0
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(dropped.float().mean().item() - p) < 4 * sd
    # each of a word's four 16-bit slices on its own: no slice position is biased
    for slot in range(4):
        assert abs(dropped[slot::4].float().mean().item() - p) < 4 * 2 * sd
    assert torch.allclose(out[~dropped], torch.full((int((~dropped).sum()),), 1 / (1 - p)))


def test_neighbouring_elements_are_dropped_independently():
    """P(both of two neighbours dropped) = p^2, within sampling error, for neighbours in one word and across words."""
    torch.manual_seed(1)
    p, n = 0.5, 800_000
    dropped = Dropout(p).train()(torch.ones(n)) == 0
    for gap in (1, 3, 4):
        both = (dropped[:-gap] & dropped[gap:]).float().mean().item()
        assert abs(both - p * p) < 4 * math.sqrt(p * p * (1 - p * p) / n)


def test_the_gradient_is_the_mask_times_the_scale_and_eval_is_the_identity():
    torch.manual_seed(2)
    x = torch.randn(64, 32, requires_grad=True)
    layer = Dropout(0.25).train()
    out = layer(x)
    out.sum().backward()
    mask = (out != 0).float()
    assert torch.allclose(x.grad, mask / 0.75)
    assert torch.allclose(out, x.detach() * mask / 0.75)
    layer.eval()
    assert layer(x) is x
    assert Dropout(0.0).train()(x) is x


def test_the_mask_follows_torchs_default_generator():
    x = torch.ones(1000)
    torch.manual_seed(7)
    first = Dropout(0.5).train()(x)
    torch.manual_seed(7)
    assert torch.equal(Dropout(0.5).train()(x), first)


@pytest.mark.parametrize("p", [-0.1, 1.0])
def test_a_probability_outside_zero_one_is_refused(p):
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(p)
