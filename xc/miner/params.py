"""Typed config -> ANN backend parameters (the same field names; threads come from the miner settings)."""

from __future__ import annotations

import os
from dataclasses import asdict

from xc.ann.base import AnnParams
from xc.config import AnnConfig


def ann_params(cfg: AnnConfig, threads: int) -> AnnParams:
    """gpu_device -1 resolves to LOCAL_RANK: under torchrun each rank's sync miner and serving indexes use
    that rank's own GPU; pool workers inherit rank 0's, and a standalone xc-miner uses GPU 0."""
    fields = {k: v for k, v in asdict(cfg).items() if k != "center"}
    if fields["gpu_device"] < 0:
        fields["gpu_device"] = int(os.environ.get("LOCAL_RANK", "0"))
    return AnnParams.from_dict({**fields, "num_threads": max(1, threads)})


def build_ann(cfg: AnnConfig, threads: int):
    """An unbuilt index for inner-product search over classifier rows, per the config."""
    from xc.ann.centering import build_for_mips

    return build_for_mips(cfg.backend, ann_params(cfg, threads), cfg.center)
