"""Hard-negative refresh on the trainer's side: snapshots out, negatives in, at epoch boundaries.

Schedule (ASTRA Sec. 3.2): negatives used from epoch t (t >= tau_s, (t - tau_s) % tau_r == 0) come from
a snapshot taken at the start of epoch t-1 and mined *during* epoch t-1, so training never waits
unless the miner is late. Generation g is always the epoch that uses it. With miner.mode=sync the
trainer instead mines at the start of epoch t itself (waiting for it).

Rank 0 decides which generation is in use and broadcasts it, so every rank switches together.

The refresh path, in reading order: this module (the schedule), `xc/refresh_snapshots.py` (snapshots out),
`xc/snapshot_writer.py` (their files), `xc/handoff.py` (the contract: manifests, atomic generations),
`xc/miner/` (service, task: index builds and searches), `xc/ann/` (the backends), then
`xc/refresh_negatives.py` (negatives in: which generation is used, staleness).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from xc.config import XCConfig
from xc.distributed import DistContext, barrier
from xc.handoff import gen_name, handoff_root, sweep_stale, write_static_positives
from xc.refresh_negatives import NegativesIn
from xc.refresh_snapshots import SnapshotsOut, _Pending
from xc.sampling import HardNegativeSet

log = logging.getLogger("xc.refresh")


class Refresher(SnapshotsOut, NegativesIn):
    """The trainer's side of the hard-negative refresh (see the module docstring)."""

    def __init__(self, cfg: XCConfig, ctx: DistContext, components, logger):
        self.cfg, self.ctx, self.c, self.logger = cfg, ctx, components, logger
        self.mode = cfg.miner.mode
        self.k = components.layout.split_count(cfg.sampler.k_hard, "sampler.k_hard") if components.sampler else 0
        self.enabled = components.sampler is not None and components.sampler.wants_hard_negatives
        self.background = None
        self.root = handoff_root(cfg.run_dir)
        self._positives = None
        self._recorded: list[tuple[np.ndarray, torch.Tensor]] = []
        self._recorded_epoch: int | None = None
        self._pending: _Pending | None = None  # a snapshot being written in the background
        self._published = 0  # newest generation handed to the miner (its pool's cores are given back until used)
        self._pool_mining = False  # a local pool holds cores for the newest snapshot (reclaimed when it is mined)
        if self.enabled and self.mode != "sync":
            if ctx.is_main:
                sweep_stale(self.root / "snapshots")  # stages of a trainer that died mid-write
                indptr, indices = self.positives()
                write_static_positives(cfg.run_dir, indptr, indices)
                (self.root / "control").mkdir(parents=True, exist_ok=True)
                (self.root / "control" / "trainer-done").unlink(missing_ok=True)
            if self.mode in ("pool", "ray") and ctx.is_main:
                from xc.miner.service import BackgroundMiner

                self.background = BackgroundMiner(cfg.run_dir, cfg.miner)
            barrier(ctx)

    def positives(self) -> tuple[np.ndarray, np.ndarray]:
        """Every training row's positives as CSR of global label ids (built once)."""
        if self._positives is None:
            self._positives = self.c.train.labels(np.arange(self.c.train.num_rows, dtype=np.int64))
        return self._positives

    def due(self, epoch: int) -> bool:
        s = self.cfg.sampler
        return self.enabled and epoch >= s.start_epoch and (epoch - s.start_epoch) % s.refresh_every == 0

    # ------------------------------------------------------------------ the epoch boundary
    def at_epoch_start(self, epoch: int, step: int, current: HardNegativeSet | None,
                       order_of=None) -> HardNegativeSet | None:
        """The hard-negative set to train epoch `epoch` with; publishes the next snapshot if one is due.

        `order_of(e)` gives epoch e's row order (to find rows a training pass did not visit)."""
        if not self.enabled:
            return current
        if self.mode == "sync":
            return self._mine_sync(epoch, step) if self.due(epoch) else current
        self.finish_snapshot(step)  # one begun at the last boundary and not yet published (a short epoch)
        chosen = current
        if self.due(epoch):
            if not (self.root / "snapshots" / gen_name(epoch)).exists() and not self._negatives_exist(epoch):
                self.publish_snapshot(epoch, step, order_of)  # nothing was mined ahead (first use, or a late start)
            chosen = self._switch(epoch, step, current)
        if self.due(epoch + 1) and epoch + 1 < self.cfg.train.epochs:
            if self.cfg.miner.async_snapshot:
                self.begin_snapshot(epoch + 1, step, order_of)  # published a few steps into the epoch (poll)
            else:
                self.publish_snapshot(epoch + 1, step, order_of)
        return chosen

    def close(self, step: int) -> None:
        self.finish_snapshot(step)
        if self.ctx.is_main and self.enabled and self.mode != "sync":
            (self.root / "control").mkdir(parents=True, exist_ok=True)
            (self.root / "control" / "trainer-done").write_text("done")
        if self.background is not None:
            self.background.close()
            self.background = None
