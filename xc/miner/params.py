"""Typed config -> ANN backend parameters (the same field names; threads come from the miner settings)."""

from __future__ import annotations

from dataclasses import asdict

from xc.ann.base import AnnParams
from xc.config import AnnConfig


def ann_params(cfg: AnnConfig, threads: int) -> AnnParams:
    return AnnParams.from_dict({**asdict(cfg), "num_threads": max(1, threads)})
