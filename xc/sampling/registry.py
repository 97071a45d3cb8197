"""`sampler=<name>`: the one place that maps a config name to a sampler."""

from __future__ import annotations

import numpy as np

from xc.config import SamplerConfig
from xc.errors import ConfigError
from xc.sampling.adaptive import LshSampler, MidxSampler, SnmSampler
from xc.sampling.base import Sampler
from xc.sampling.samplers import AstraSampler, CurriculumSampler, HardSampler, UniformSampler
from xc.sampling.static import InBatchSampler, PopularitySampler
from xc.shards import ShardLayout


def build_sampler(cfg: SamplerConfig, layout: ShardLayout, seed: int = 0,
                  label_counts: np.ndarray | None = None) -> Sampler | None:
    """The sampler the config names; None for `full` (every label scored, no sampling).

    label_counts (L,) training frequency per label, needed by popularity and in-batch (and by astra / curriculum
    with `sampler.random_proposal=popularity`).
    """
    name = cfg.name
    if name == "full":
        return None
    if name == "uniform":
        return UniformSampler(layout, cfg)
    if name in ("hard", "ehard"):
        return HardSampler(layout, cfg)
    if name == "astra":
        return AstraSampler(layout, cfg, label_counts)
    if name == "curriculum":
        return CurriculumSampler(layout, cfg, label_counts)
    if name in ("popularity", "inbatch"):
        if label_counts is None:
            raise ConfigError("sampler.name", f"{name} needs the training label frequencies")
        return (PopularitySampler if name == "popularity" else InBatchSampler)(layout, cfg, label_counts)
    if name == "snm":
        return SnmSampler(layout, cfg)
    if name in ("midx_pq", "midx_rq"):
        return MidxSampler(layout, cfg, name[-2:], seed)
    if name in ("lsh_embedding", "lsh_label"):
        return LshSampler(layout, cfg, name[4:], seed)
    raise ConfigError("sampler.name", f"unknown sampler {name!r}")
