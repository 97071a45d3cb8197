"""Where lexical weights (model.lexical_features) cannot train, one line names the key."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from xc.config import XCConfig
from xc.distributed import DistContext
from xc.errors import ConfigError
from xc.train.components import lexical_supported

_SAMPLER = object()  # any sampled-negative sampler


def _cfg(**model) -> XCConfig:
    cfg = XCConfig()
    return replace(cfg, model=replace(cfg.model, lexical_features=16, **model))


@pytest.mark.parametrize("cfg, ctx, sampler, needle", [
    (_cfg(encoder="dense"), DistContext(), _SAMPLER, "model.encoder=dense"),
    (_cfg(mode="dual"), DistContext(), _SAMPLER, "model.mode=dual"),
    (_cfg(), DistContext(rank=0, world_size=2), _SAMPLER, "this run has 2"),
    (_cfg(), DistContext(), None, "sampler.name=full"),
])
def test_lexical_weights_refuse_what_they_cannot_train(cfg, ctx, sampler, needle):
    with pytest.raises(ConfigError) as info:
        lexical_supported(cfg, ctx, sampler)
    assert info.value.key == "model.lexical_features" and needle in str(info.value)


def test_lexical_weights_train_on_one_rank_of_a_sampled_bow_classifier():
    lexical_supported(_cfg(), DistContext(device=torch.device("cpu")), _SAMPLER)  # no error
