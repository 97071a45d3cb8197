"""Torch intra-op threads per rank, and a local miner pool's share of the cores handed back while it is idle.

A miner pool beside rank 0 (miner.mode=pool, or ray on a local instance) uses its cores only while it mines a
generation: from the snapshot's publication to the switch to its negatives, a stretch of each refresh. Keeping
those cores from the trainer for the whole run halves a 2-core machine's training speed for nothing while the
pool waits (at 10^6 labels, the whole first epoch: docs/miner_quality.md). So the trainer runs on every core while the
pool is idle and leaves the pool its cores while it mines (`xc.refresh.snapshots.Snapshots.follow_miner` switches
at those two events, on every rank at the same step). $XC_THREADS fixes the count for the whole run.
"""

from __future__ import annotations

import os

from xc.config import XCConfig
from xc.errors import ConfigError


# Torch intra-op threads of a rank that trains on a GPU: its host work is launching kernels and small gathers,
# and more threads only spin between them (an H100 rank with torch's default 16 burned 17.5 CPU seconds per wall
# second, docs/gpu_path.md). The miner's indexes take their own thread counts (miner.ann.num_threads).
GPU_RANK_THREADS = 2


def host_threads(cfg: XCConfig, mining: bool = True, device_type: str = "cpu") -> tuple[int, str]:
    """(threads, why) for this rank: $XC_THREADS when set (an empty value counts as unset); else the cores this
    process may run on, less those of a local miner pool (workers x threads_per_worker) while it `mining`,
    shared among the ranks on this host (torchrun's LOCAL_WORLD_SIZE), at least 1, and at most GPU_RANK_THREADS
    where the rank trains on a GPU (`device_type` "cuda"). Torch's own default takes every core in every rank, so
    8 ranks on a node would each spin up all its cores and starve each other and the miner."""
    raw = os.environ.get("XC_THREADS", "").strip()
    if raw:
        try:
            threads = int(raw)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ConfigError("XC_THREADS", f"expected a positive integer number of threads, got {raw!r}")
        return threads, "XC_THREADS"
    cores, ranks = host_cores(), local_ranks()
    miner = miner_cores(cfg) if mining else 0
    threads = max(1, (cores - miner) // ranks)
    why = f"{cores} cores - {miner} for the miner pool, / {ranks} local rank(s)"
    if device_type == "cuda" and threads > GPU_RANK_THREADS:
        return GPU_RANK_THREADS, why + f", at most {GPU_RANK_THREADS} for a GPU rank"
    return threads, why


def final_phase_threads(cfg: XCConfig, device_type: str) -> tuple[int, str] | None:
    """(threads, why) for a GPU rank once training is over, else None (a CPU rank already has its share).

    What follows the last step is host work: the label prior, the lexical ranker's fit (sparse products and
    L-BFGS), the kNN vote's searches and the fusion's choices. A GPU rank kept to GPU_RANK_THREADS ran them on 2 of
    an H100 host's 16 cores (80 s of a 3-minute debian-deps run, docs/accuracy.md) while the idle miner pool left
    the rest unused; it now takes its share of every core. $XC_THREADS, when set, still decides."""
    if device_type != "cuda":
        return None
    threads, why = host_threads(cfg, mining=False, device_type="cpu")
    return threads, (why if why == "XC_THREADS" else why + ", the final evaluation on the host")


def host_cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def local_ranks() -> int:
    """Ranks on this host (torchrun's LOCAL_WORLD_SIZE; 1 without torchrun)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def miner_cores(cfg: XCConfig) -> int:
    """Cores a miner pool on this host takes while it mines (0 for sync, external and remote ray miners)."""
    local_pool = cfg.miner.mode == "pool" or (cfg.miner.mode == "ray" and not cfg.miner.ray_address)
    return cfg.miner.workers * cfg.miner.threads_per_worker if local_pool else 0
