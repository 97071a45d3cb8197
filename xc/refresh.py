"""Hard-negative refresh on the trainer's side: snapshots out, negatives in, at epoch boundaries.

Schedule (ASTRA Sec. 3.2): negatives used from epoch t (t >= tau_s, (t - tau_s) % tau_r == 0) come from
a snapshot taken at the start of epoch t-1 and mined *during* epoch t-1, so training never waits
unless the miner is late. Generation g is always the epoch that uses it. With miner.mode=sync the
trainer instead mines at the start of epoch t itself (waiting for it).

Rank 0 decides which generation is in use and broadcasts it, so every rank switches together.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from xc.config import XCConfig
from xc.distributed import DistContext, all_gather_no_grad, all_gather_object, barrier, broadcast_object, on_rank0
from xc.errors import XCError
from xc.handoff import (
    HandoffError, Stage, gen_name, handoff_root, list_generations, open_negatives, prune, sweep_stale,
    write_static_positives,
)
from xc.inference import encode_rows
from xc.miner.task import mine_table
from xc.sampling import HardNegativeSet
from xc.signals import stop_signal_received
from xc.snapshot_writer import ShardRows, SnapshotWrite

log = logging.getLogger("xc.refresh")


@dataclass
class _Pending:
    """A snapshot begun at an epoch boundary (global step `step`) whose files are still being written."""

    generation: int
    step: int
    stage: Stage
    writer: SnapshotWrite
    num_rows: int
    dim: int
    start: float
    begin_seconds: float  # the main thread's share at the boundary: queries, host copy, thread start


class Refresher:
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
        if self.enabled and self.mode != "sync":
            if ctx.is_main:
                sweep_stale(self.root / "snapshots")  # stages of a trainer that died mid-write
                indptr, indices = self.positives()
                write_static_positives(cfg.run_dir, indptr, indices)
                (self.root / "control").mkdir(parents=True, exist_ok=True)
                (self.root / "control" / "trainer-done").unlink(missing_ok=True)
            if self.mode == "pool" and ctx.is_main:
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

    def _negatives_exist(self, generation: int) -> bool:
        return (self.root / "negatives" / gen_name(generation) / "manifest.json").exists()

    # ------------------------------------------------------------------ sync mining
    def _mine_sync(self, epoch: int, step: int) -> HardNegativeSet:
        cfg, c = self.cfg, self.c
        start = time.perf_counter()
        queries = self._encode_all("encoding for mining").numpy()
        encode_s = time.perf_counter() - start
        indptr, indices = self.positives()
        tables, stats = {}, []
        vectors = self.label_vectors()
        for shard in c.my_shards:
            lo, _ = c.layout.shard_range(shard)
            rows = vectors[shard]
            tables[shard], st = mine_table(rows, lo, queries, indptr, indices, self.k, cfg.miner.ann,
                                           torch.get_num_threads(), cfg.miner.recall_sample, seed=epoch)
            stats.append({"shard": shard, "build_seconds": st.build_seconds, "search_seconds": st.search_seconds,
                          "recall": st.recall})
        stats = [s for part in all_gather_object(stats, self.ctx) for s in part]
        seconds = time.perf_counter() - start
        log.info("hard negatives: generation %d mined in-process (%s) at epoch %d in %.1fs (encode %.1fs)",
                 epoch, cfg.miner.ann.backend, epoch, seconds, encode_s)
        self.logger.event("negatives", epoch=epoch, global_step=step, generation=epoch, mode="sync",
                          stall_seconds=seconds, encode_seconds=encode_s, shards=stats, age_steps=0)
        return HardNegativeSet(tables, epoch, epoch, step)

    def label_vectors(self) -> dict[int, np.ndarray]:
        """What the index is built on, per shard of this rank, (n_real, d) float32: the classifier rows
        (w-hard, ASTRA) or, with sampler.hard_source=label_text, the encoder's embeddings of the label
        texts (E-hard, ASTRA Table 5), re-encoded at every refresh (O(L) encoder passes)."""
        c = self.c
        if self.cfg.sampler.hard_source == "label_text":
            from tqdm import tqdm

            labels = np.arange(c.layout.num_labels, dtype=np.int64)
            show = self.ctx.is_main and self.cfg.logger.progress
            with tqdm(total=len(labels), desc="encoding label texts", disable=not show, leave=False) as bar:
                emb = encode_rows(c.encoder, c.label_inputs, labels, self.cfg.sampler.mining_batch_size, self.ctx, bar)
        out = {}
        for shard in c.my_shards:
            lo, _ = c.layout.shard_range(shard)
            n = c.layout.real_count(shard)
            if self.cfg.sampler.hard_source == "label_text":
                out[shard] = emb[lo:lo + n].numpy()
            else:
                out[shard] = c.shard.weight[lo - c.shard.lo:lo - c.shard.lo + n].float().cpu().numpy()
        return out

    def _encode_all(self, desc: str) -> torch.Tensor:
        from tqdm import tqdm

        rows = np.arange(self.c.train.num_rows, dtype=np.int64)
        show = self.ctx.is_main and self.cfg.logger.progress
        with tqdm(total=len(rows), desc=desc, disable=not show, leave=False, mininterval=2.0) as bar:
            return encode_rows(self.c.encoder, self.c.train.inputs, rows, self.cfg.sampler.mining_batch_size,
                               self.ctx, bar)

    # ------------------------------------------------------------------ train-pass query embeddings
    def wants_train_pass(self, epoch: int) -> bool:
        """Record this epoch's training embeddings? (A snapshot is published when the next epoch starts.)"""
        return (self.enabled and self.mode != "sync" and self.cfg.miner.query_source == "train_pass"
                and self.due(epoch + 2) and epoch + 2 < self.cfg.train.epochs)

    def record(self, epoch: int, rows: np.ndarray, embeddings: torch.Tensor) -> None:
        """Keep this rank's embeddings (b, d) of dataset rows (b,) from a training forward pass."""
        if self._recorded_epoch != epoch:
            self._recorded, self._recorded_epoch = [], epoch
        self._recorded.append((rows, embeddings.detach().float().cpu()))

    def _snapshot_queries(self, generation: int, order_of) -> torch.Tensor:
        """Q (N, d): embeddings saved during the previous epoch's training when configured and complete,
        topped up by encoding the rows that epoch did not visit; otherwise a dedicated encoding pass."""
        previous = generation - 2
        recorded = self._recorded if self._recorded_epoch == previous else []
        have = broadcast_object(len(recorded), self.ctx)
        if self.cfg.miner.query_source != "train_pass" or not have or have != len(recorded):
            if self.cfg.miner.query_source == "train_pass" and self.ctx.is_main:
                log.info("snapshot %d: no training embeddings of epoch %d (first snapshot or a resume); encoding",
                         generation, previous)
            return self._encode_all("snapshot: encoding queries")
        rows = torch.from_numpy(np.concatenate([r for r, _ in recorded]).astype(np.int64))
        emb = torch.cat([e for _, e in recorded])
        all_rows = all_gather_no_grad(rows.to(self.ctx.device), self.ctx).cpu().numpy()
        all_emb = all_gather_no_grad(emb.to(self.ctx.device), self.ctx).cpu()
        queries = torch.empty(self.c.train.num_rows, emb.shape[1])
        queries[torch.from_numpy(all_rows)] = all_emb
        unseen = np.sort(order_of(previous)[len(all_rows):])  # the epoch's dropped tail
        if len(unseen):
            queries[torch.from_numpy(unseen)] = encode_rows(self.c.encoder, self.c.train.inputs, unseen,
                                                            self.cfg.sampler.mining_batch_size, self.ctx)
        self._recorded, self._recorded_epoch = [], None
        return queries

    # ------------------------------------------------------------------ async: snapshots out
    def publish_snapshot(self, generation: int, step: int, order_of=None) -> None:
        """Every rank writes its shards' rows, rank 0 the query embeddings; rank 0 publishes. Synchronous:
        training waits until the generation is published."""
        self.finish_snapshot(step)
        self.begin_snapshot(generation, step, order_of, background=False)
        self.finish_snapshot(step)

    def begin_snapshot(self, generation: int, step: int, order_of=None, background: bool = True) -> None:
        """Main thread, at the epoch boundary: the collective parts (query embeddings, the stage path), a
        host copy of this rank's rows as of now, then the files written on a background thread.
        `finish_snapshot` publishes; `poll` calls it snapshot_finish_steps optimizer steps later."""
        c, ctx = self.c, self.ctx
        parent = self.root / "snapshots"
        if (parent / gen_name(generation)).exists():
            return  # already published by an earlier incarnation of this run (resume)
        start = time.perf_counter()
        queries = self._snapshot_queries(generation, order_of)
        stage_path = broadcast_object(str(Stage(parent, gen_name(generation)).path) if ctx.is_main else None, ctx)
        stage = Stage(parent, gen_name(generation), path=Path(stage_path))
        vectors = self.label_vectors()
        shards = []
        for shard in c.my_shards:
            lo, _ = c.layout.shard_range(shard)
            shards.append(ShardRows(shard, lo, c.layout.real_count(shard), vectors[shard]))
        q = queries.numpy().astype(np.float32) if ctx.is_main else None
        # In the background the writer copies the rows first: on CPU they are views of the live weights.
        writer = SnapshotWrite(stage, shards, q, background)
        self._pending = _Pending(generation, step, stage, writer, int(queries.shape[0]), int(queries.shape[1]),
                                 start, time.perf_counter() - start)

    def poll(self, step: int) -> None:
        """Once per optimizer step, on every rank (same `step` everywhere): publish a pending snapshot once
        snapshot_finish_steps steps have passed since its epoch boundary."""
        p = self._pending
        if p is not None and step >= p.step + self.cfg.miner.snapshot_finish_steps:
            self.finish_snapshot(step)

    def finish_snapshot(self, step: int) -> None:
        """Main thread, every rank at the same step: join the writer, gather the entries, rank 0 publishes.
        A writer failure on any rank abandons the stage (nothing published) and stops training on every rank:
        the failing rank re-raises its own exception, the others an XCError naming it."""
        p, ctx = self._pending, self.ctx
        if p is None:
            return
        self._pending = None
        wait = time.perf_counter()
        error = None
        try:
            entries, q_entry = p.writer.join()
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it before anyone raises
            entries, q_entry, error = [], None, exc
        stall = p.begin_seconds + time.perf_counter() - wait
        parts = all_gather_object((step, entries, q_entry, None if error is None else repr(error)), ctx)
        failed = [(r, why) for r, (_, _, _, why) in enumerate(parts) if why is not None]
        if failed:
            if ctx.is_main:
                p.stage.abandon()
            barrier(ctx)
            self.logger.event("snapshot_failed", generation=p.generation, global_step=step, errors=failed)
            if error is not None:
                raise error
            raise XCError(f"snapshot generation {p.generation}: writing failed on rank(s) "
                          f"{', '.join(f'{r} ({why})' for r, why in failed)}; nothing was published")
        if len({s for s, _, _, _ in parts}) != 1:  # a caller bug: ranks would pair unrelated collectives
            raise XCError(f"snapshot generation {p.generation} finished at different steps per rank: "
                          f"{[s for s, _, _, _ in parts]}")
        entries = [e for _, part, _, _ in parts for e in part]
        if ctx.is_main:
            p.stage.publish({"kind": "snapshot", "generation": p.generation, "epoch": p.generation - 1,
                             "global_step": p.step, "num_rows": p.num_rows, "dim": p.dim,
                             "k_per_shard": self.k, "layout": vars(self.c.layout), "shards": entries,
                             "queries": q_entry, "query_source": self.cfg.miner.query_source, "created": time.time()})
            prune(self.root / "snapshots", self.cfg.miner.keep_generations)
        barrier(ctx)
        seconds = time.perf_counter() - p.start
        log.info("snapshot generation %d of step %d published at step %d in %.1fs (training stalled %.1fs; "
                 "mined during epoch %d, used from epoch %d)", p.generation, p.step, step, seconds, stall,
                 p.generation - 1, p.generation)
        self.logger.event("snapshot", generation=p.generation, global_step=p.step, finish_step=step,
                          seconds=seconds, stall_seconds=stall, write_seconds=p.writer.write_seconds,
                          bytes=p.writer.bytes, background=p.writer.background)

    # ------------------------------------------------------------------ async: negatives in
    def _switch(self, epoch: int, step: int, current: HardNegativeSet | None) -> HardNegativeSet | None:
        ctx = self.ctx
        # rank 0 decides; a dead miner's error reaches every rank, so none waits in the broadcast forever
        generation, stall, note = on_rank0(ctx, lambda: self._decide(epoch, current))
        if generation is None:
            return current
        tables, manifest = open_negatives(self.cfg.run_dir, generation, self.c.my_shards, checksum=False)
        made_step = self._snapshot_step(manifest, step)
        chosen = HardNegativeSet(tables, generation, manifest["snapshot_epoch"], made_step)
        if ctx.is_main:
            stats = manifest.get("stats", [])
            recalls = [s["recall"] for s in stats if s.get("recall") is not None]
            log.info("hard negatives: switching to generation %d (snapshot of step %d, %d steps old, stall %.2fs%s)",
                     generation, made_step, step - made_step, stall,
                     f", ANN recall {np.mean(recalls):.3f}" if recalls else "")
            self.logger.event("negatives", epoch=epoch, global_step=step, generation=generation, mode=self.mode,
                              stall_seconds=stall, age_steps=step - made_step, note=note, shards=stats,
                              recall=float(np.mean(recalls)) if recalls else None,
                              mine_seconds=manifest.get("seconds"))
            prune(self.root / "negatives", self.cfg.miner.keep_generations, protect={generation})
        return chosen

    @staticmethod
    def _snapshot_step(manifest: dict, fallback: int) -> int:
        value = manifest.get("snapshot_step")
        return int(value) if value is not None else fallback

    def _decide(self, epoch: int, current: HardNegativeSet | None) -> tuple[int | None, float, str]:
        """Rank 0: wait for generation `epoch` per the late policy; verify it; else keep `current`."""
        miner = self.cfg.miner
        start = time.perf_counter()
        failed_marker = self.root / "control" / f"failed-gen-{epoch:06d}.json"
        wait = current is None or miner.late_policy == "wait"
        while True:
            background = getattr(self, "background", None)  # (absent on a Refresher built by a unit test)
            if background is not None:
                background.check()  # restarts a dead miner thread, or stops the run
            if self._negatives_exist(epoch):
                try:
                    tables, _ = open_negatives(self.cfg.run_dir, epoch, range(self.c.layout.num_shards), checksum=True)
                    self._check_fits(epoch, tables)
                    return epoch, time.perf_counter() - start, "fresh"
                except HandoffError as exc:
                    return self._keep(current, start, f"generation {epoch} rejected: {exc}")
            if failed_marker.exists():
                return self._keep(current, start, f"miner failed generation {epoch}: {failed_marker.read_text()}")
            waited = time.perf_counter() - start
            if not wait or waited > miner.wait_timeout_s or stop_signal_received():  # SIGTERM: stop waiting
                return self._keep(current, start, f"miner late for generation {epoch} after {waited:.1f}s "
                                                  f"(late_policy={miner.late_policy})")
            time.sleep(min(miner.poll_seconds, 0.2))

    def _check_fits(self, generation: int, tables: dict[int, np.ndarray]) -> None:
        """Reject a generation that does not fit this run's layout (mined before a resume that re-split the
        label shards, say): shape (N, k per shard), every id -1 or a real label of its own shard."""
        layout, rows = self.c.layout, self.c.train.num_rows
        for shard, table in tables.items():
            if table.shape != (rows, self.k):
                raise HandoffError(f"generation {generation} shard {shard}: table {table.shape}, this run needs "
                                   f"({rows}, {self.k}) (mined for another label layout or data?)")
            lo, _ = layout.shard_range(shard)
            t = np.asarray(table)
            if not ((t == -1) | ((t >= lo) & (t < lo + layout.real_count(shard)))).all():
                raise HandoffError(f"generation {generation} shard {shard}: label ids outside the shard's range "
                                   f"[{lo}, {lo + layout.real_count(shard)}) (mined for another label layout?)")

    def _keep(self, current: HardNegativeSet | None, start: float, why: str) -> tuple[int | None, float, str]:
        stall = time.perf_counter() - start
        if current is not None:
            log.warning("%s; keeping generation %d", why, current.generation)
        else:
            fallback = [g for g in list_generations(self.root / "negatives")]
            log.warning("%s; no earlier generation in use%s", why, f" (latest on disk: {fallback[-1]})" if fallback else "")
        self.logger.event("negatives_late", reason=why, stall_seconds=stall,
                          kept=None if current is None else current.generation)
        return (None, stall, why)

    # ------------------------------------------------------------------ telemetry and shutdown
    def staleness(self, current: HardNegativeSet | None, epoch: int, step: int) -> float | None:
        """Share of the stored hard negatives still in the current exact top-k, on a sample of queries."""
        if current is None or not self.cfg.miner.staleness_sample:
            return None
        from xc.ann.exact import exact_topk

        c = self.c
        rows = np.random.default_rng(0).permutation(c.train.num_rows)[:self.cfg.miner.staleness_sample]
        rows.sort()
        emb = encode_rows(c.encoder, c.train.inputs, rows, self.cfg.eval.batch_size, self.ctx)
        indptr, indices = c.train.labels(rows)
        hits = total = 0
        for shard in c.my_shards:
            lo, _ = c.layout.shard_range(shard)
            n = c.layout.real_count(shard)
            local = indices - lo
            weight = c.shard.weight[lo - c.shard.lo:lo - c.shard.lo + n].float().cpu()
            _, ids = exact_topk(emb, weight, self.k, indptr, local)
            stored = current.tables[shard][rows]
            for q in range(len(rows)):
                now = set((ids[q][ids[q] >= 0] + lo).tolist())
                hits += len(now & set(stored[q][stored[q] >= 0].tolist()))
                total += len(now)
        hits, total = (sum(x) for x in zip(*all_gather_object((hits, total), self.ctx)))
        share = hits / total if total else None
        if share is not None and self.ctx.is_main:
            age = step - current.made_at_step
            log.info("hard negatives in use: generation %d, %d steps old, %.1f%% still in the current top-%d",
                     current.generation, age, 100 * share, self.k)
            self.logger.event("staleness", epoch=epoch, global_step=step, generation=current.generation,
                              age_steps=age, overlap_current_topk=share)
        return share

    def close(self, step: int) -> None:
        self.finish_snapshot(step)
        if self.ctx.is_main and self.enabled and self.mode != "sync":
            (self.root / "control").mkdir(parents=True, exist_ok=True)
            (self.root / "control" / "trainer-done").write_text("done")
        if self.background is not None:
            self.background.close()
            self.background = None
