"""The check before every checkpoint (xc/train/lifecycle.py): a non-finite tensor in any named part stops the run
with one line naming the part, in either mode's terms; a finite state (or an empty part) passes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from xc.distributed import DistContext
from xc.errors import XCError
from xc.train.lifecycle import check_finite_state


def _trainer():
    return SimpleNamespace(ctx=DistContext(), epoch=2, global_step=17, cfg=SimpleNamespace(run_dir="/runs/r"))


def test_a_non_finite_part_is_named_and_stops_the_checkpoint():
    towers = [torch.ones(3, 2), torch.tensor([1.0, float("nan")])]
    with pytest.raises(XCError, match=r"non-finite values in the towers at epoch 2 global step 17; refusing"):
        check_finite_state(_trainer(), {"towers": towers, "free vectors": [torch.zeros(4, 2)]})
    with pytest.raises(XCError, match=r"in the encoder parameters and classifier rows at"):
        check_finite_state(_trainer(), {"encoder parameters": [torch.tensor([float("inf")])],
                                        "classifier rows": [torch.tensor([[float("-inf"), 1.0]])]})


def test_a_finite_state_and_an_empty_part_pass():
    check_finite_state(_trainer(), {"towers": [torch.ones(3, 2)], "free vectors": []})


def test_the_finiteness_sum_walks_large_tensors_in_blocks(monkeypatch):
    """`blocked_sum` gives the float64 sum a whole-tensor `sum(dtype=float64)` gives, without that call's float64
    copy of the tensor (20 GB for 10^7 bfloat16 rows of 256: a checkpoint's check killed such a run), and a NaN or
    inf anywhere still makes it non-finite."""
    import torch

    from xc.train import lifecycle

    monkeypatch.setattr(lifecycle, "SUM_BLOCK", 1000)  # 7 rows of 128 a block
    rows = torch.randn(100, 128).bfloat16()
    assert torch.allclose(lifecycle.blocked_sum(rows), rows.sum(dtype=torch.float64), rtol=1e-12)
    assert lifecycle.blocked_sum(torch.tensor(2.5)) == 2.5 and lifecycle.blocked_sum(torch.ones(10)) == 10
    for bad in (float("nan"), float("inf")):
        poisoned = rows.clone()
        poisoned[97, 3] = bad
        assert not torch.isfinite(lifecycle.blocked_sum(poisoned))
    calls = []
    real_sum = torch.Tensor.sum
    monkeypatch.setattr(torch.Tensor, "sum", lambda t, *a, **k: calls.append(t.numel()) or real_sum(t, *a, **k))
    lifecycle.blocked_sum(rows)
    assert max(calls) <= 1000 and sum(calls) == rows.numel()
