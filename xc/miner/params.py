"""The run's ANN settings (`miner.ann`, an AnnParams) for one index: the miner's threads unless set."""

from __future__ import annotations

from dataclasses import replace

from xc.ann.base import AnnParams
from xc.ann.centering import build_for_mips


def ann_params(cfg: AnnParams, threads: int) -> AnnParams:
    """`cfg` with num_threads 0 resolved to the miner's `threads` (at least 1), checked."""
    return replace(cfg, num_threads=cfg.num_threads or max(1, threads)).validate()


def build_ann(cfg: AnnParams, threads: int):
    """An unbuilt index for inner-product search over classifier rows, per the config."""
    return build_for_mips(cfg.backend, ann_params(cfg, threads), cfg.center)
