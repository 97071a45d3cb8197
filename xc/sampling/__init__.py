"""Negative samplers behind one interface (see base.Sampler)."""

from xc.sampling.base import (
    POSITIVE_STREAM, HardNegativeSet, NegativeDraw, Positives, Sampler, StepKey, draw_positives, mix_seed,
)
from xc.sampling.samplers import AstraSampler, HardSampler, UniformSampler, build_sampler, uniform_excluding

__all__ = [
    "POSITIVE_STREAM", "HardNegativeSet", "NegativeDraw", "Positives", "Sampler", "StepKey", "draw_positives",
    "mix_seed", "AstraSampler", "HardSampler", "UniformSampler", "build_sampler", "uniform_excluding",
]
