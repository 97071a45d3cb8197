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
