"""Negative samplers behind one interface (see base.Sampler); `registry.build_sampler` picks one."""

from xc.sampling.base import (
    POSITIVE_STREAM, HardNegativeSet, NegativeDraw, Positives, SampleBatch, Sampler, ShardRows, StepKey,
    draw_positives, mix_seed,
)
from xc.sampling.registry import build_sampler
from xc.sampling.samplers import AstraSampler, CurriculumSampler, HardSampler, UniformSampler, uniform_excluding

__all__ = [
    "POSITIVE_STREAM", "HardNegativeSet", "NegativeDraw", "Positives", "SampleBatch", "Sampler", "ShardRows",
    "StepKey", "draw_positives", "mix_seed", "AstraSampler", "CurriculumSampler", "HardSampler", "UniformSampler",
    "build_sampler", "uniform_excluding",
]
