"""Hard-negative refresh, the negatives side: which mined generation the trainer uses, and how stale it is.

At an epoch boundary rank 0 decides (`_decide`): the newest scheduled generation the miner has published,
verified against the run's label layout; it waits only where what would be in use trails the schedule by more
refreshes than `miner.late_policy` allows (`bounded`: miner.max_lag; `wait`: none; `reuse`: never waits); every
rank then switches together. A generation that mined a slice of the queries is merged into the table in use
(`merge_slice`). With `miner.mode=sync` the trainer mines itself (`mine_sync`, through the miner's own
`mine_table`). `staleness` measures how much of the stored negatives are still in the current exact top-k.
`Negatives` is this side of `xc.refresh.schedule.Refresher`; it reads the snapshot side (`xc.refresh.snapshots`)
for the boundary's query encoding, the label rows and the generation last handed to the miner.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from xc.ann.exact import exact_topk
from xc.distributed import all_gather_object, on_rank0
from xc.handoff import (
    HandoffError, gen_name, list_generations, open_negatives, prune, read_manifest, window_rows,
)
from xc.distributed.host_threads import host_threads
from xc.eval.inference import encode_rows
from xc.miner.task import mine_table
from xc.refresh.rerank import rerank_candidates
from xc.refresh.snapshots import RefreshState, Snapshots, failed_marker, negatives_published
from xc.sampling import HardNegativeSet
from xc.run.signals import stop_signal_received

log = logging.getLogger("xc.refresh")


def search_summary(stats: list[dict]) -> tuple[str, float | None]:
    """('clustered', 'graph/head_only', ... or '': the searches the shards' miners ran, the mean of their sampled
    recalls or None) from a generation's per-shard stats."""
    kinds = "/".join(sorted({s["search"] for s in stats if s.get("search")}))
    recalls = [s["recall"] for s in stats if s.get("recall") is not None]
    return kinds, float(np.mean(recalls)) if recalls else None


def merge_slice(current: HardNegativeSet | None, tables: dict[int, np.ndarray], query_rows: np.ndarray | None,
                made_step: int, num_rows: int) -> tuple[dict[int, np.ndarray], np.ndarray | None]:
    """A generation's tables over the whole training set, and each row's snapshot step (N,) (None: every row
    is `made_step`'s). A generation that mined a slice (`query_rows` (n,), its tables (n, k)) replaces those
    rows of the tables in use; the other rows keep theirs (-1, and step -1, where none was mined yet)."""
    if query_rows is None:
        return tables, None
    merged = {}
    for shard, table in tables.items():
        base = None if current is None else current.tables.get(shard)
        if base is None or base.shape != (num_rows, table.shape[1]):
            out = np.full((num_rows, table.shape[1]), -1, dtype=np.int32)
        else:
            out = np.array(base, dtype=np.int32, copy=True)
        out[query_rows] = table
        merged[shard] = out
    if current is None:
        steps = np.full(num_rows, -1, dtype=np.int64)
    elif current.row_steps is None:
        steps = np.full(num_rows, current.made_at_step, dtype=np.int64)
    else:
        steps = current.row_steps.copy()
    steps[query_rows] = made_step
    return merged, steps


class Negatives:
    """The trainer's negatives in: which generation is scheduled for an epoch, which arrived one is taken (or
    mined in-process with miner.mode=sync), its candidates re-ranked and merged into the tables in use, and how
    stale the negatives in use are. `miner` is the local background miner (None: none, or not rank 0), checked
    while rank 0 waits for a generation."""

    def __init__(self, *, cfg, ctx, components, logger, root, k: int, mine_k: int, enabled: bool,
                 state: RefreshState, snapshots: Snapshots, miner=None):
        self.cfg, self.ctx, self.c, self.logger = cfg, ctx, components, logger
        self.root, self.k, self.mine_k, self.enabled = root, k, mine_k, enabled
        self.state, self.snapshots, self.miner = state, snapshots, miner
        self._lag_before = 0  # refreshes behind the schedule at the last boundary, before any wait (rank 0)

    # ------------------------------------------------------------------ sync mining
    def mine_sync(self, epoch: int, step: int) -> HardNegativeSet:
        """miner.mode=sync, every rank: generation `epoch` mined in-process now over this rank's shards (training
        waits for it)."""
        cfg, c = self.cfg, self.c
        start = time.perf_counter()
        queries = self.snapshots.encode_queries("encoding for mining").numpy()
        encode_s = time.perf_counter() - start
        indptr, indices = self.snapshots.positives()
        tables, stats = {}, []
        vectors = self.snapshots.label_vectors()
        # a GPU rank trains on a few torch threads; its synchronous search may take the rank's share of the cores
        threads = torch.get_num_threads() if self.ctx.device.type == "cpu" else host_threads(cfg, mining=False)[0]
        for shard in c.my_shards:
            lo, _ = c.layout.shard_range(shard)
            rows = vectors[shard]
            tables[shard], st = mine_table(rows, lo, queries, indptr, indices, self.k, cfg.miner.ann,
                                           threads, cfg.miner.recall_sample, seed=epoch)
            stats.append({"shard": shard, "build_seconds": st.build_seconds, "search_seconds": st.search_seconds,
                          "recall": st.recall, "search": st.search, "head_only": st.head_only,
                          "head_share": st.head_share, "clustered_probe": st.clustered_probe,
                          "rows_scanned": st.rows_scanned})
        stats = [s for part in all_gather_object(stats, self.ctx) for s in part]
        seconds = time.perf_counter() - start
        # the search that ran: a graph backend may keep its clustered trial or search its exact head alone
        kinds, recall = search_summary(stats)
        log.info("hard negatives: generation %d mined in-process (%s search%s) at epoch %d in %.1fs (encode %.1fs)",
                 epoch, kinds or cfg.miner.ann.backend, "" if recall is None else f", recall {recall:.3f}", epoch,
                 seconds, encode_s)
        self.logger.event("negatives", epoch=epoch, global_step=step, generation=epoch, mode="sync",
                          stall_seconds=seconds, encode_seconds=encode_s, shards=stats, age_steps=0)
        self.state.boundary.update(waited_s=seconds, switched=True, recall=recall)
        return HardNegativeSet(tables, epoch, epoch, step)

    def switch(self, epoch: int, step: int, current: HardNegativeSet | None) -> HardNegativeSet | None:
        """Every rank: the set to train epoch `epoch` with: the generation rank 0 decides on (`_decide`), its
        candidates re-ranked where the miner returned more than k, merged over the rows it mined; else `current`."""
        ctx = self.ctx
        # rank 0 decides; a dead miner's error reaches every rank, so none waits in the broadcast forever
        generation, stall, note, lag_before = on_rank0(ctx, lambda: (*self._decide(epoch, current), self._lag_before))
        self.state.boundary.update(waited_s=stall, lag_before=lag_before, note=note)
        if generation is None:
            return current
        tables, manifest = open_negatives(self.cfg.run_dir, generation, self.c.my_shards, checksum=False)
        made_step = self._snapshot_step(manifest, step)
        query_rows = window_rows(manifest.get("query_rows"))
        rerank = None
        if self.mine_k > self.k:
            tables, rerank = self._rerank(generation, tables, step, query_rows)
            stall += rerank["seconds"]
        tables, row_steps = merge_slice(current, tables, query_rows, made_step, self.c.train.num_rows)
        chosen = HardNegativeSet(tables, generation, manifest["snapshot_epoch"], made_step,
                                 step if rerank is not None else None, row_steps)
        stats = manifest.get("stats", [])
        refreshed = 1.0 if query_rows is None else len(query_rows) / self.c.train.num_rows
        self.state.boundary.update(switched=True, refreshed_share=refreshed, recall=search_summary(stats)[1],
                             rerank_s=None if rerank is None else rerank["seconds"])
        if generation >= self.state.published:
            self.snapshots.follow_miner(mining=False)  # nothing newer handed to the miner: the trainer takes every core
        if ctx.is_main:
            kinds, recall = search_summary(stats)
            scanned = [s["rows_scanned"] for s in stats if s.get("rows_scanned") is not None]
            log.info("hard negatives: switching to generation %d (snapshot of step %d, %d steps old, "
                     "stall %.2fs%s%s%s)",
                     generation, made_step, step - made_step, stall,
                     "" if recall is None else f", ANN recall {recall:.3f}", f", search {kinds}" if kinds else "",
                     f", {sum(scanned):,} of {self.c.layout.num_labels:,} rows scanned"
                     if scanned and len(scanned) == len(stats) else "")
            self.logger.event("negatives", epoch=epoch, global_step=step, generation=generation,
                              mode=self.cfg.miner.mode, stall_seconds=stall, age_steps=step - made_step, note=note,
                              shards=stats, recall=recall, mine_seconds=manifest.get("seconds"), rerank=rerank)
            prune(self.root / "negatives", self.cfg.miner.keep_generations, protect={generation})
        return chosen

    def _rerank(self, generation: int, tables: dict, step: int,
                query_rows: np.ndarray | None = None) -> tuple[dict, dict]:
        """This rank's shards' (n, mine_k) candidates -> (n, k): the k scoring highest under the current
        encoder and rows (xc/refresh/rerank.py), for the generation's training rows `query_rows` (n,) (None:
        all N). Every rank encodes every query (as sync mining does; the next snapshot shares the encoding)."""
        c = self.c
        start = time.perf_counter()
        queries = self.snapshots.encode_queries(f"re-ranking generation {generation}'s candidates", step)
        if query_rows is not None:
            queries = queries[torch.from_numpy(query_rows)]
        kept, unchanged = {}, []
        for shard, table in tables.items():
            lo, _ = c.layout.shard_range(shard)
            rows = c.shard.weight[lo - c.shard.lo:lo - c.shard.lo + c.layout.real_count(shard)].detach()
            kept[shard], share = rerank_candidates(table, rows, lo, queries, self.k)
            unchanged.append(share)
        unchanged = [u for part in all_gather_object(unchanged, self.ctx) for u in part]
        info = {"candidates": self.mine_k, "kept": self.k, "seconds": time.perf_counter() - start,
                "unchanged_share": float(np.mean(unchanged)) if unchanged else None}
        log.info("hard negatives: generation %d re-ranked, %d candidates -> %d per query and shard with the current "
                 "rows in %.1fs (%.0f%% of the kept were in the miner's own top-%d)", generation, self.mine_k,
                 self.k, info["seconds"], 100 * (info["unchanged_share"] or 0), self.k)
        return kept, info

    @staticmethod
    def _snapshot_step(manifest: dict, fallback: int) -> int:
        value = manifest.get("snapshot_step")
        return int(value) if value is not None else fallback

    # ------------------------------------------------------------------ which generation, and whether to wait
    def due(self, epoch: int) -> bool:
        """Is `epoch` a refresh epoch, the first to use a new generation (generation `epoch`)?"""
        s = self.cfg.sampler
        return self.enabled and epoch >= s.start_epoch and (epoch - s.start_epoch) % s.refresh_every == 0

    def scheduled_generation(self, epoch: int) -> int | None:
        """The newest generation the schedule has due by `epoch` (None before the first hard epoch)."""
        s = self.cfg.sampler
        if not self.enabled or epoch < s.start_epoch:
            return None
        return epoch - (epoch - s.start_epoch) % s.refresh_every

    def lag(self, epoch: int, generation: int | None) -> int:
        """Refreshes by which `generation` (None: nothing mined yet) trails the schedule at `epoch`."""
        target = self.scheduled_generation(epoch)
        if target is None:
            return 0
        s = self.cfg.sampler
        in_use = s.start_epoch - s.refresh_every if generation is None else generation
        return max(0, (target - in_use) // s.refresh_every)

    def _wait_bound(self) -> int | None:
        """Refreshes the negatives in use may trail the schedule before rank 0 waits (None: never wait)."""
        policy = self.cfg.miner.late_policy
        return 0 if policy == "wait" else self.cfg.miner.max_lag if policy == "bounded" else None

    def _newest_arrived(self, target: int, current: HardNegativeSet | None,
                        checked: dict[int, str | None]) -> int | None:
        """Rank 0: the newest scheduled generation in (the one in use, target] whose negatives are published and
        fit this run. Each is verified once (`checked`: None where it fits, else why it was rejected)."""
        floor = -1 if current is None else current.generation
        for generation in range(target, floor, -1):
            if generation not in checked:
                if not self.due(generation) or not negatives_published(self.root, generation):
                    continue
                try:
                    tables, manifest = open_negatives(self.cfg.run_dir, generation, range(self.c.layout.num_shards),
                                                      checksum=True)
                    self._check_fits(generation, tables, manifest)
                    self._check_snapshot(generation, manifest)
                    checked[generation] = None
                except HandoffError as exc:
                    checked[generation] = f"generation {generation} rejected: {exc}"
                    log.warning("%s", checked[generation])
            if checked[generation] is None:
                return generation
        return None

    def _decide(self, epoch: int, current: HardNegativeSet | None) -> tuple[int | None, float, str]:
        """Rank 0: the generation to train epoch `epoch` with (None: keep `current`), the seconds waited, a note.

        The newest generation that has arrived is taken at once. Rank 0 waits (up to wait_timeout_s) only at a
        scheduled refresh, and only while what would be in use trails the schedule by more than the policy's
        bound: 0 refreshes for `wait`, miner.max_lag for `bounded`, never for `reuse`."""
        miner = self.cfg.miner
        start = time.perf_counter()
        target = self.scheduled_generation(epoch)
        bound = self._wait_bound()
        in_use = None if current is None else current.generation
        self._lag_before = self.lag(epoch, in_use)
        checked: dict[int, str | None] = {}
        announced = False
        while True:
            if self.miner is not None:
                self.miner.check()  # restarts a dead miner thread, or stops the run
            newest = self._newest_arrived(target, current, checked)
            have = newest if newest is not None else in_use
            lag = self.lag(epoch, have)
            waited = time.perf_counter() - start
            if bound is None or lag <= bound or not self.due(epoch):
                if newest is not None:
                    note = "fresh" if newest == target else f"newest arrived ({lag} refresh(es) behind, no wait)"
                    return newest, waited, note
                if lag == 0:
                    return None, waited, "nothing newer"
                why = self._why_missing(target, checked)
                if why is not None:
                    return self._keep(current, start, why)
                bound_text = "" if bound is None else f", within the bound of {bound}"
                return self._keep(current, start, f"generation {target} not mined yet; {lag} refresh(es) behind"
                                                  f"{bound_text} (miner.late_policy={miner.late_policy}): no wait",
                                  warn=False)
            if not announced:
                log.info("waiting for the miner: the negatives in use (%s) would trail generation %d by %d "
                         "refresh(es), over the bound of %d (miner.late_policy=%s%s)",
                         "none yet" if have is None else f"generation {have}", target, lag, bound, miner.late_policy,
                         f", miner.max_lag={miner.max_lag}" if miner.late_policy == "bounded" else "")
                announced = True
            why = self._why_missing(target, checked)
            if why is not None:  # the generation waited for will not come
                return (newest, waited, why) if newest is not None else self._keep(current, start, why)
            if waited > miner.wait_timeout_s or stop_signal_received():  # SIGTERM: stop waiting
                why = f"miner late for generation {target} after {waited:.1f}s (late_policy={miner.late_policy})"
                return (newest, waited, why) if newest is not None else self._keep(current, start, why)
            time.sleep(min(miner.poll_seconds, 0.2))

    def _why_missing(self, generation: int, checked: dict[int, str | None]) -> str | None:
        """Why `generation` will never be trained with (rejected, or the miner gave up on it), or None."""
        if checked.get(generation) is not None:
            return checked[generation]
        marker = failed_marker(self.root, generation)
        return f"miner failed generation {generation}: {marker.read_text()}" if marker.exists() else None

    def _check_fits(self, generation: int, tables: dict[int, np.ndarray], manifest: dict | None = None) -> None:
        """Reject a generation that does not fit this run's layout (mined before a resume that re-split the
        label shards, say): shape (n, k per shard) with n the rows of its query window (N without one), every id
        -1 or a real label of its own shard."""
        layout, rows = self.c.layout, self.c.train.num_rows
        window = (manifest or {}).get("query_rows")
        if window is not None:
            if int(window.get("num_rows", -1)) != rows:
                raise HandoffError(f"generation {generation}: mined a window of {window.get('num_rows')} training rows, "
                                   f"this run has {rows}")
            rows = len(window_rows(window))
        for shard, table in tables.items():
            if table.shape != (rows, self.mine_k):
                raise HandoffError(f"generation {generation} shard {shard}: table {table.shape}, this run needs "
                                   f"({rows}, {self.mine_k}) (mined for another label layout, data or "
                                   f"miner.rerank_candidates?)")
            lo, _ = layout.shard_range(shard)
            t = np.asarray(table)
            if not ((t == -1) | ((t >= lo) & (t < lo + layout.real_count(shard)))).all():
                raise HandoffError(f"generation {generation} shard {shard}: label ids outside the shard's range "
                                   f"[{lo}, {lo + layout.real_count(shard)}) (mined for another label layout?)")

    def _check_snapshot(self, generation: int, manifest: dict) -> None:
        """Reject negatives not mined from this run's snapshot of `generation` (a generation copied from another
        run, or mined from a snapshot since replaced): the snapshot's id must be the one the miner recorded."""
        try:
            snapshot = read_manifest(self.root / "snapshots" / gen_name(generation))
        except HandoffError:
            return  # the snapshot is pruned already: nothing to compare with
        expected, got = snapshot.get("snapshot_id"), manifest.get("snapshot_id")
        if expected is not None and got != expected:
            raise HandoffError(f"generation {generation} was mined from snapshot {got or '(none recorded)'}, not from "
                               f"this run's snapshot {expected} of that generation (copied from another run?)")

    def _keep(self, current: HardNegativeSet | None, start: float, why: str,
              warn: bool = True) -> tuple[int | None, float, str]:
        stall = time.perf_counter() - start
        say = log.warning if warn else log.info
        if current is not None:
            say("%s; keeping generation %d", why, current.generation)
        else:
            fallback = [g for g in list_generations(self.root / "negatives")]
            say("%s; no earlier generation in use%s", why, f" (latest on disk: {fallback[-1]})" if fallback else "")
        self.logger.event("negatives_late", reason=why, stall_seconds=stall,
                          kept=None if current is None else current.generation)
        return (None, stall, why)

    # ------------------------------------------------------------------ telemetry and shutdown
    def staleness(self, current: HardNegativeSet | None, epoch: int, step: int) -> float | None:
        """Share of the stored hard negatives still in the current exact top-k, on a sample of queries."""
        if current is None or not self.cfg.miner.staleness_sample:
            return None
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
            # bfloat16 rows stay bfloat16: exact_topk scores them in float32 a block at a time
            weight = c.shard.weight[lo - c.shard.lo:lo - c.shard.lo + n].detach().cpu()
            weight = weight if weight.dtype == torch.bfloat16 else weight.float()
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
            ranked = None if current.ranked_at_step is None else step - current.ranked_at_step
            log.info("hard negatives in use: generation %d, %d steps old%s, %.1f%% still in the current top-%d",
                     current.generation, age, "" if ranked is None else f" (re-ranked {ranked} steps ago)",
                     100 * share, self.k)
            self.logger.event("staleness", epoch=epoch, global_step=step, generation=current.generation,
                              age_steps=age, ranked_age_steps=ranked, overlap_current_topk=share)
        return share
