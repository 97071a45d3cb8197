"""Typed config -> ANN backend parameters (the same field names; threads come from the miner settings)."""

from __future__ import annotations

from dataclasses import asdict

from xc.ann.base import AnnParams
from xc.config import AnnConfig


def ann_params(cfg: AnnConfig, threads: int) -> AnnParams:
    fields = {k: v for k, v in asdict(cfg).items() if k != "center"}
    return AnnParams.from_dict({**fields, "num_threads": max(1, threads)})


def build_ann(cfg: AnnConfig, threads: int):
    """An unbuilt index for inner-product search over classifier rows, per the config."""
    from xc.ann.centering import build_for_mips

    return build_for_mips(cfg.backend, ann_params(cfg, threads), cfg.center)
