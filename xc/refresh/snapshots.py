"""Hard-negative refresh, the snapshot side: what the trainer hands the miner at an epoch boundary.

A snapshot generation g holds, per label shard, the rows an index is built on (the classifier rows, or the
label texts' embeddings for E-hard) and the query embeddings of every training row (a dedicated encoding
pass, or the previous epoch's training forward passes topped up), written by `xc.refresh.writer` on a
background thread and published through the hand-off contract (`xc.handoff`) a few steps later, the same
step on every rank. `Snapshots` is this side of `xc.refresh.schedule.Refresher`, `xc.refresh.negatives` the
other, which reads this one (the boundary's query encoding, the label rows, the generation handed out) and never
the other way round.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from xc.distributed import all_gather_no_grad, all_gather_object, barrier, broadcast_object
from xc.errors import XCError
from xc.faults import NO_FAULTS, Faults
from xc.handoff import HandoffError, Stage, gen_name, list_generations, prune, read_manifest, window_rows
from xc.distributed.host_threads import host_threads
from xc.eval.inference import encode_rows
from xc.refresh.slices import EPOCH_SHARE, MinerRate, next_window, slice_count
from xc.refresh.writer import ShardRows, SnapshotWrite

log = logging.getLogger("xc.refresh")

# While a local pool mines, every this many optimizer steps rank 0 looks for its output (two stat calls) and
# broadcasts the answer, so every rank takes its cores back at the same step.
RECLAIM_CHECK_STEPS = 20


def negatives_published(root: Path, generation: int) -> bool:
    """Has the miner published `generation`'s negatives under the hand-off root `root`?"""
    return (root / "negatives" / gen_name(generation) / "manifest.json").exists()


def failed_marker(root: Path, generation: int) -> Path:
    """The file a miner leaves where it gave up on `generation`."""
    return root / "control" / f"failed-gen-{generation:06d}.json"


def fresh_boundary() -> dict:
    """An epoch boundary's refresh before anything happened at it: no wait, no switch."""
    return {"waited_s": 0.0, "switched": False}


@dataclass
class RefreshState:
    """What a `Refresher` and both of its sides read and write: the newest generation handed to the miner
    (the snapshot side sets it; the negatives side gives the pool's cores back only once nothing newer is out)
    and the current epoch boundary's refresh (the negatives side fills it; the Refresher reports it once)."""

    published: int = 0
    boundary: dict = field(default_factory=fresh_boundary)


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
    shared_queries: bool = False  # its query embeddings were the boundary's re-ranking encoding (`sharing`)
    window: dict | None = None  # the slice of training rows it mines (xc/refresh/slices.py); None = every row


class Snapshots:
    """The trainer's snapshots out to the miner: the training rows' positives (once), the query embeddings (the
    training pass's, or the current encoder's, encoded once per epoch boundary and shared with the negatives side),
    each generation's files written in the background and published, the query window each mines, and the host's
    cores handed between the trainer and a local miner pool while it mines."""

    def __init__(self, *, cfg, ctx, components, logger, root: Path, k: int, mine_k: int, state: RefreshState,
                 faults: Faults = NO_FAULTS):
        self.cfg, self.ctx, self.c, self.logger = cfg, ctx, components, logger
        self.root, self.k, self.mine_k, self.state = root, k, mine_k, state
        self.faults = faults  # the tests' fault injection (xc/faults.py), for the snapshot writer
        self._positives = None
        self._recorded: list[tuple[np.ndarray, torch.Tensor]] = []
        self._recorded_epoch: int | None = None
        self._pending: _Pending | None = None  # a snapshot being written in the background
        self._pool_mining = False  # a local pool holds cores for the newest snapshot (reclaimed when it is mined)
        self._boundary_step: int | None = None  # the step whose query encoding is shared (`sharing`)
        self._boundary_encoding: tuple[int, torch.Tensor] | None = None
        self._shared_hit = False  # the last `encode_queries` returned the shared encoding
        self._epoch_began: float | None = None  # when the current epoch's boundary was reached (perf_counter)
        self._epoch_seconds: float | None = None  # rank 0: the last whole epoch's wall time (the slice rule's budget)

    def positives(self) -> tuple[np.ndarray, np.ndarray]:
        """Every training row's positives as CSR of global label ids (built once)."""
        if self._positives is None:
            self._positives = self.c.train.labels(np.arange(self.c.train.num_rows, dtype=np.int64))
        return self._positives

    def epoch_started(self) -> None:
        """An epoch boundary is reached now: the epoch just ended is the budget of the next query window."""
        now = time.perf_counter()
        if self._epoch_began is not None:
            self._epoch_seconds = now - self._epoch_began
        self._epoch_began = now

    def label_vectors(self) -> dict[int, np.ndarray | torch.Tensor]:
        """What the index is built on, per shard of this rank, (n_real, d) float32 (numpy), or a bfloat16 CPU
        tensor where the rows are bfloat16 (on a CPU a view of them: no float32 copy): the classifier rows
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
                rows = c.shard.weight[lo - c.shard.lo:lo - c.shard.lo + n].detach()
                out[shard] = rows.cpu() if rows.dtype == torch.bfloat16 else rows.float().cpu().numpy()
        return out

    def encode_queries(self, desc: str, step: int | None = None) -> torch.Tensor:
        """Q (N, d): every training row through the current encoder. Inside an epoch boundary (`sharing`) the
        encoding of that step is kept and reused: re-ranking one generation and snapshotting the next both
        encode every query with the same model (about 20 s each at 2M queries on 2 cores)."""
        from tqdm import tqdm

        shared = self._boundary_encoding
        if step is not None and shared is not None and shared[0] == step:
            self._shared_hit = True
            return shared[1]
        rows = np.arange(self.c.train.num_rows, dtype=np.int64)
        show = self.ctx.is_main and self.cfg.logger.progress
        with tqdm(total=len(rows), desc=desc, disable=not show, leave=False, mininterval=2.0) as bar:
            queries = encode_rows(self.c.encoder, self.c.train.inputs, rows, self.cfg.sampler.mining_batch_size,
                                  self.ctx, bar)
        if step is not None and self._boundary_step == step:
            self._boundary_encoding = (step, queries)
        return queries

    @contextmanager
    def sharing(self, step: int):
        """The encodings of `step` are shared for the duration (an epoch boundary), then released (N x d floats)."""
        self._boundary_step, self._boundary_encoding = step, None
        try:
            yield
        finally:
            self._boundary_step, self._boundary_encoding = None, None

    # ------------------------------------------------------------------ train-pass query embeddings
    def record(self, epoch: int, rows: np.ndarray, embeddings: torch.Tensor) -> None:
        """Keep this rank's embeddings (b, d) of dataset rows (b,) from a training forward pass."""
        if self._recorded_epoch != epoch:
            self._recorded, self._recorded_epoch = [], epoch
        self._recorded.append((rows, embeddings.detach().float().cpu()))

    def _snapshot_queries(self, generation: int, order_of, step: int | None = None) -> torch.Tensor:
        """Q (N, d): embeddings saved during the previous epoch's training when configured and complete,
        topped up by encoding the rows that epoch did not visit; otherwise a dedicated encoding pass."""
        previous = generation - 2
        recorded = self._recorded if self._recorded_epoch == previous else []
        have = broadcast_object(len(recorded), self.ctx)
        if self.cfg.miner.query_source != "train_pass" or not have or have != len(recorded):
            if self.cfg.miner.query_source == "train_pass" and self.ctx.is_main:
                log.info("snapshot %d: no training embeddings of epoch %d (first snapshot or a resume); encoding",
                         generation, previous)
            return self.encode_queries("snapshot: encoding queries", step)
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
        self._shared_hit = False
        queries = self._snapshot_queries(generation, order_of, step)
        window, stage_path = broadcast_object(
            (self._query_window(generation, int(queries.shape[0])), str(Stage(parent, gen_name(generation)).path))
            if ctx.is_main else None, ctx)
        rows = window_rows(window)
        stage = Stage(parent, gen_name(generation), path=Path(stage_path))
        vectors = self.label_vectors()
        shards = []
        for shard in c.my_shards:
            lo, _ = c.layout.shard_range(shard)
            shards.append(ShardRows(shard, lo, c.layout.real_count(shard), vectors[shard]))
        q = None
        if ctx.is_main:
            q = queries.numpy().astype(np.float32) if rows is None else queries.numpy()[rows].astype(np.float32)
        # In the background the writer copies the rows first: on CPU they are views of the live weights.
        writer = SnapshotWrite(stage, shards, q, background, faults=self.faults)
        self._pending = _Pending(generation, step, stage, writer, int(queries.shape[0]), int(queries.shape[1]),
                                 start, time.perf_counter() - start, self._shared_hit, window)

    def _query_window(self, generation: int, num_rows: int) -> dict | None:
        """Rank 0: the training rows `generation` mines (xc/refresh/slices.py), after the newest earlier snapshot's
        window, sized by miner.refresh_share or from the newest generation's measured mining time and the
        last epoch's wall time; None = every row."""
        miner = self.cfg.miner
        previous = [g for g in list_generations(self.root / "snapshots") if g < generation]
        window = None
        if previous:
            try:
                window = read_manifest(self.root / "snapshots" / gen_name(previous[-1])).get("query_rows")
            except HandoffError:
                window = None
        # under late_policy=wait no measured second may size what is mined (xc/refresh/slices.py)
        timed = miner.late_policy != "wait"
        count = slice_count(num_rows, miner.refresh_share, miner.max_rotation, self._epoch_seconds,
                            self._miner_rate(), timed)
        chosen = next_window(window, count, num_rows)
        if chosen is not None:
            log.info("snapshot %d mines training rows %d.. (%d of %d, %.0f%%, rotating%s)", generation,
                     chosen["start"], count, num_rows, 100 * count / num_rows,
                     "" if miner.refresh_share is not None else
                     f": what the miner's measured rate searches in {EPOCH_SHARE:g} of a {self._epoch_seconds:.0f} s "
                     f"epoch, at least 1/{miner.max_rotation}")
        return chosen

    def _miner_rate(self) -> MinerRate | None:
        """The newest published generation's measured mining time (None before one was mined)."""
        published = list_generations(self.root / "negatives")
        if not published:
            return None
        try:
            manifest = read_manifest(self.root / "negatives" / gen_name(published[-1]))
        except HandoffError:
            return None
        stats = manifest.get("stats") or []
        if not stats:
            return None
        window = manifest.get("query_rows")
        queries = int(window["count"]) if window else int(self.c.train.num_rows)
        return MinerRate.of(stats, queries, self.cfg.miner.workers)

    def follow_miner(self, mining: bool) -> None:
        """Every rank, at the same step: this rank's torch threads for a local miner pool that mines or is idle
        (xc/distributed/host_threads.py); a no-op with XC_THREADS set or no pool on this host."""
        threads, why = host_threads(self.cfg, mining, self.ctx.device.type)
        if not mining:
            self._pool_mining = False
        if threads == torch.get_num_threads():
            return
        torch.set_num_threads(threads)
        if self.ctx.is_main:
            log.info("host threads per rank: %d while the miner pool %s (%s)", threads,
                     "mines" if mining else "is idle", why)
            self.logger.event("threads", threads=threads, miner_mining=mining)

    def poll(self, step: int) -> None:
        """Once per optimizer step, on every rank (same `step` everywhere): publish a pending snapshot once
        snapshot_finish_steps steps have passed since its epoch boundary; take the pool's cores back once it
        has mined the newest generation (`reclaim_cores`)."""
        p = self._pending
        if p is not None and step >= p.step + self.cfg.miner.snapshot_finish_steps:
            self.finish_snapshot(step)
        if self._pool_mining and step % RECLAIM_CHECK_STEPS == 0:
            self.reclaim_cores(step)

    def reclaim_cores(self, step: int) -> None:
        """Every rank at the same step: when the miner has published (or given up on) the newest snapshot's
        generation, the pool is idle until the next snapshot, so the trainer takes every core back now rather
        than at the epoch boundary that switches to the negatives. At 10^6 labels on 2 cores the pool mined in
        376 s of a 731 s epoch; before, the remaining 4,400 steps ran on one thread (docs/miner_quality.md)."""
        generation = self.state.published
        answered = None
        if self.ctx.is_main:
            answered = negatives_published(self.root, generation) or failed_marker(self.root, generation).exists()
        done = broadcast_object(answered, self.ctx)
        if done:
            self.follow_miner(mining=False)  # also ends the watch
            if self.ctx.is_main:
                self.logger.event("pool_idle", generation=generation, global_step=step)

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
            # a fresh id per snapshot: the miner copies it into its negatives, which the trainer accepts only
            # for its own snapshot of that generation (never a generation copied from another run)
            p.stage.publish({"kind": "snapshot", "snapshot_id": uuid.uuid4().hex, "generation": p.generation,
                             "epoch": p.generation - 1,
                             "global_step": p.step, "num_rows": p.num_rows, "dim": p.dim,
                             "k_per_shard": self.mine_k, "k_keep": self.k, "layout": vars(self.c.layout), "shards": entries,
                             **({"query_rows": p.window} if p.window is not None else {}),
                             "queries": q_entry, "query_source": self.cfg.miner.query_source, "created": time.time()})
            prune(self.root / "snapshots", self.cfg.miner.keep_generations)
        barrier(ctx)
        self.state.published = max(self.state.published, p.generation)
        self.follow_miner(mining=True)  # a local pool mines it now: leave it its cores
        # watch for the pool's end only where its cores make a difference (not with XC_THREADS, nor remote
        # miners); rank 0's answer, so that every rank polls at the same steps
        self._pool_mining = bool(broadcast_object(
            host_threads(self.cfg, True, ctx.device.type)[0] != host_threads(self.cfg, False, ctx.device.type)[0] if ctx.is_main else None, ctx))
        seconds = time.perf_counter() - p.start
        log.info("snapshot generation %d of step %d published at step %d in %.1fs (training stalled %.1fs; "
                 "mined during epoch %d, used from epoch %d)", p.generation, p.step, step, seconds, stall,
                 p.generation - 1, p.generation)
        self.logger.event("snapshot", generation=p.generation, global_step=p.step, finish_step=step,
                          seconds=seconds, stall_seconds=stall, write_seconds=p.writer.write_seconds,
                          bytes=p.writer.bytes, background=p.writer.background, shared_queries=p.shared_queries)
