"""Hard-negative refresh on the trainer's side: snapshots out, negatives in, at epoch boundaries.

Schedule (ASTRA Sec. 3.2): negatives used from epoch t (t >= tau_s, (t - tau_s) % tau_r == 0) come from
a snapshot taken at the start of epoch t-1 and mined *during* epoch t-1, so training never waits
unless the miner is late, and then (miner.late_policy=bounded) only past miner.max_lag refreshes behind: a
generation that misses its boundary is taken at the next one. Generation g is always the epoch scheduled to use
it; a generation may mine a rotating slice of the queries (xc/refresh/slices.py). With miner.mode=sync the
trainer instead mines at the start of epoch t itself (waiting for it).

Rank 0 decides which generation is in use and broadcasts it, so every rank switches together.

`Refresher` decides when; it owns the two sides and delegates the work: `Snapshots` (snapshots out) and
`Negatives` (negatives in), which share one `RefreshState` (the generation last handed out, this boundary's report).

The refresh path, in reading order: this module (the schedule), `xc/refresh/snapshots.py` (snapshots out, and the
state both sides share), `xc/refresh/writer.py` (their files), `xc/handoff.py` (the contract: manifests, atomic
generations), `xc/miner/` (service, task: index builds and searches), `xc/ann/` (the backends), then
`xc/refresh/negatives.py` (negatives in: which generation is used, staleness).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from xc.config import XCConfig
from xc.distributed import DistContext, barrier
from xc.faults import NO_FAULTS, Faults
from xc.handoff import gen_name, handoff_root, sweep_stale, write_static_positives
from xc.miner.background import BackgroundMiner
from xc.refresh.negatives import Negatives
from xc.refresh.snapshots import RefreshState, Snapshots, fresh_boundary, negatives_published
from xc.sampling import HardNegativeSet

log = logging.getLogger("xc.refresh")


class Refresher:
    """The trainer's side of the hard-negative refresh: when each snapshot is taken and each generation switched
    to (see the module docstring), with the work done by `snapshots` (a `Snapshots`) and `negatives` (a
    `Negatives`). What the trainer calls is here."""

    def __init__(self, cfg: XCConfig, ctx: DistContext, components, logger, faults: Faults = NO_FAULTS,
                 planned_epochs: Callable[[], int] | None = None):
        self.cfg, self.ctx, self.c, self.logger = cfg, ctx, components, logger
        # the epochs the run trains as decided so far (xc/train/schedule.py: validation may end it before the cap)
        self.planned_epochs = planned_epochs or (lambda: cfg.train.epochs)
        self.mode = cfg.miner.mode
        self.k = components.layout.split_count(cfg.sampler.k_hard, "sampler.k_hard") if components.sampler else 0
        # what an asynchronous miner returns per query and shard: k, or the candidates the switch re-ranks
        candidates = cfg.miner.rerank_candidates or 0
        self.mine_k = self.k if self.mode == "sync" or candidates <= cfg.sampler.k_hard or not self.k else \
            components.layout.split_count(candidates, "miner.rerank_candidates")
        self.enabled = components.sampler is not None and components.sampler.wants_hard_negatives
        self.background = None
        self.root = handoff_root(cfg.run_dir)
        self.state = RefreshState()
        self._deferred: tuple[int, int] | None = None  # (generation, step): a first snapshot partway into an epoch
        self._order_of = None  # that epoch's row order, for the deferred snapshot's queries
        self.snapshots = Snapshots(cfg=cfg, ctx=ctx, components=components, logger=logger, root=self.root, k=self.k,
                                   mine_k=self.mine_k, state=self.state, faults=faults)
        if self.enabled and self.mode != "sync":
            if ctx.is_main:
                sweep_stale(self.root / "snapshots")  # stages of a trainer that died mid-write
                indptr, indices = self.snapshots.positives()
                write_static_positives(cfg.run_dir, indptr, indices)
                (self.root / "control").mkdir(parents=True, exist_ok=True)
                (self.root / "control" / "trainer-done").unlink(missing_ok=True)
            if self.mode in ("pool", "ray") and ctx.is_main:
                self.background = BackgroundMiner(cfg.run_dir, cfg.miner)
            barrier(ctx)
        self.negatives = Negatives(cfg=cfg, ctx=ctx, components=components, logger=logger, root=self.root, k=self.k,
                                   mine_k=self.mine_k, enabled=self.enabled, state=self.state,
                                   snapshots=self.snapshots, miner=self.background)

    def due(self, epoch: int) -> bool:
        """Is `epoch` a refresh epoch, the first to train with generation `epoch`?"""
        return self.negatives.due(epoch)

    def _next_due(self, epoch: int) -> bool:
        """Is a snapshot for epoch + 1 to be taken during `epoch` (a refresh epoch that the run reaches)?"""
        return self.due(epoch + 1) and epoch + 1 < self.planned_epochs()

    def wants_train_pass(self, epoch: int) -> bool:
        """Record this epoch's training embeddings? (A snapshot is published when the next epoch starts.)"""
        return (self.enabled and self.mode != "sync" and self.cfg.miner.query_source == "train_pass"
                and self.due(epoch + 2) and epoch + 2 < self.planned_epochs())

    def record(self, epoch: int, rows: np.ndarray, embeddings: torch.Tensor) -> None:
        """Keep this rank's embeddings (b, d) of dataset rows (b,) from a training forward pass."""
        self.snapshots.record(epoch, rows, embeddings)

    def staleness(self, current: HardNegativeSet | None, epoch: int, step: int) -> float | None:
        """Share of the stored hard negatives still in the current exact top-k, on a sample of queries."""
        return self.negatives.staleness(current, epoch, step)

    def finish_snapshot(self, step: int) -> None:
        """Publish a snapshot still being written (every rank at the same step)."""
        self.snapshots.finish_snapshot(step)

    # ------------------------------------------------------------------ the epoch boundary
    def at_epoch_start(self, epoch: int, step: int, current: HardNegativeSet | None,
                       order_of=None) -> HardNegativeSet | None:
        """The hard-negative set to train epoch `epoch` with; publishes the next snapshot if one is due.

        `order_of(e)` gives epoch e's row order (to find rows a training pass did not visit)."""
        if not self.enabled:
            return current
        snapshots = self.snapshots
        snapshots.epoch_started()  # the slice rule's budget (xc/refresh/slices.py)
        self.state.boundary = fresh_boundary()
        if self.mode == "sync":
            chosen = current
            if self.due(epoch):
                chosen = self.negatives.mine_sync(epoch, step)
            self._report_boundary(epoch, step, chosen)
            return chosen
        snapshots.finish_snapshot(step)  # one begun at the last boundary and not yet published (a short epoch)
        self._deferred = None  # a first snapshot whose step the last epoch never reached: published below if due
        chosen = current
        with snapshots.sharing(step):  # re-ranking this generation and snapshotting the next encode the queries once
            if self.due(epoch):
                ahead = (self.root / "snapshots" / gen_name(epoch)).exists() or negatives_published(self.root, epoch)
                if not ahead:
                    snapshots.publish_snapshot(epoch, step, order_of)  # nothing mined ahead (first use, a late start)
            if epoch >= self.cfg.sampler.start_epoch:
                # every hard epoch: a generation that arrived after its own boundary is taken at the next one
                chosen = self.negatives.switch(epoch, step, current)
            if self._next_due(epoch):
                if self._first_deferred(epoch + 1):
                    self._defer(epoch + 1, step, step, order_of)
                elif self.cfg.miner.async_snapshot:
                    snapshots.begin_snapshot(epoch + 1, step, order_of)  # published a few steps in (`poll`)
                else:
                    snapshots.publish_snapshot(epoch + 1, step, order_of)
        self._report_boundary(epoch, step, chosen)
        return chosen

    def _report_boundary(self, epoch: int, step: int, chosen: HardNegativeSet | None) -> None:
        """Rank 0, once per epoch: the seconds waited for negatives (and spent re-ranking them), the share of
        training queries whose negatives were refreshed at this boundary, their age in steps (mean, max) and the lag
        behind the schedule, and the miner's recall on its sample (the `refresh` event of log.jsonl, one log line)."""
        if not self.ctx.is_main:
            return
        b = self.state.boundary
        age_mean = age_max = None
        if chosen is not None and chosen.row_steps is None:
            age_mean = age_max = step - chosen.made_at_step
        elif chosen is not None and (chosen.row_steps >= 0).any():
            mined = chosen.row_steps[chosen.row_steps >= 0]
            age_mean, age_max = round(float(step - mined.mean()), 1), int(step - mined.min())
        lag = self.negatives.lag(epoch, None if chosen is None else chosen.generation)
        refreshed = b.get("refreshed_share", 1.0) if b["switched"] else 0.0
        fields = dict(epoch=epoch, global_step=step, mode=self.mode, waited_s=round(b["waited_s"], 3),
                      refreshed_share=refreshed, generation=None if chosen is None else chosen.generation,
                      covered_share=None if chosen is None or chosen.row_steps is None else
                      round(float((chosen.row_steps >= 0).mean()), 4),
                      age_mean_steps=age_mean, age_max_steps=age_max, lag=lag, lag_before=b.get("lag_before", lag),
                      recall=b.get("recall"), rerank_s=b.get("rerank_s"))
        self.logger.event("refresh", **fields)
        if epoch >= self.cfg.sampler.start_epoch:
            log.info("epoch %d negatives: %s, waited %.1fs, %.0f%% of the queries refreshed, %s, %d refresh(es) "
                     "behind the schedule%s", epoch,
                     "none yet (uniform draws)" if chosen is None else f"generation {chosen.generation}",
                     b["waited_s"], 100 * refreshed,
                     "age -" if age_mean is None else f"age {age_mean} steps (max {age_max})", lag,
                     "" if b.get("recall") is None else f", miner recall {b['recall']:.3f}")

    # ------------------------------------------------------------------ a first snapshot partway into an epoch
    def _first_deferred(self, generation: int) -> bool:
        """Is `generation` the first one, snapshotted miner.first_snapshot_at of the way into its epoch?"""
        return (self.cfg.miner.first_snapshot_at or 0) > 0 and generation == self.cfg.sampler.start_epoch

    def _defer(self, generation: int, epoch_start_step: int, step: int, order_of) -> None:
        """Take generation's snapshot at epoch_start_step + first_snapshot_at x steps_per_epoch (at once where
        `step`, a resume, is past that): the rows have trained that far, and the miner has the rest of the
        epoch. With start_epoch 1 this is what lets hard negatives start at epoch 1 from trained rows."""
        if (self.root / "snapshots" / gen_name(generation)).exists():
            return  # published before a resume
        offset = max(1, round(self.cfg.miner.first_snapshot_at * self.c.steps_per_epoch))
        self._deferred, self._order_of = (generation, max(step, epoch_start_step + offset)), order_of
        if self.ctx.is_main:
            log.info("snapshot generation %d deferred to step %d (miner.first_snapshot_at=%g)", generation,
                     self._deferred[1], self.cfg.miner.first_snapshot_at)

    def resume_mid_epoch(self, epoch: int, epoch_start_step: int, step: int, order_of) -> None:
        """A resume inside epoch `epoch`: re-arm the first snapshot if this epoch was to take it mid-way."""
        if (self.enabled and self.mode != "sync" and self._next_due(epoch)
                and self._first_deferred(epoch + 1)):
            self._defer(epoch + 1, epoch_start_step, step, order_of)

    def poll(self, step: int) -> None:
        """Once per optimizer step on every rank: begin a deferred first snapshot once its step is reached,
        then what `Snapshots.poll` does (publish a pending snapshot, take the pool's cores back)."""
        if self._deferred is not None and step >= self._deferred[1]:
            generation, _ = self._deferred
            self._deferred = None
            if self.cfg.miner.async_snapshot:
                self.snapshots.begin_snapshot(generation, step, self._order_of)
            else:
                self.snapshots.publish_snapshot(generation, step, self._order_of)
        self.snapshots.poll(step)

    def abandon(self) -> None:
        """A run stopping early (a signal, an error): the local miner pool stops at once, a task in flight killed.
        No trainer-done marker: an external miner keeps serving, for the run's resume."""
        if self.background is not None:
            self.background.close()
            self.background = None

    def close(self, step: int) -> None:
        """The run's end: the last snapshot published, the miner told the trainer is done, the local pool stopped."""
        self.snapshots.finish_snapshot(step)
        if self.ctx.is_main and self.enabled and self.mode != "sync":
            (self.root / "control").mkdir(parents=True, exist_ok=True)
            (self.root / "control" / "trainer-done").write_text("done")
        self.abandon()
