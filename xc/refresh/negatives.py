"""Hard-negative refresh, the negatives side: which mined generation the trainer uses, and how stale it is.

At an epoch boundary rank 0 decides (`_decide`): the generation mined for this epoch when the miner has
published it, verified against the run's label layout, else (late, failed, rejected) the one in use, per
`miner.late_policy`; every rank then switches together. With `miner.mode=sync` the trainer mines itself
(`_mine_sync`, through the miner's own `mine_table`). `staleness` measures how much of the stored negatives
are still in the current exact top-k. `NegativesIn` is one half of `xc.refresh.Refresher`.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from xc.distributed import all_gather_object, on_rank0
from xc.handoff import HandoffError, gen_name, list_generations, open_negatives, prune, read_manifest
from xc.train.host_threads import host_threads
from xc.eval.inference import encode_rows
from xc.miner.task import mine_table
from xc.refresh.rerank import rerank_candidates
from xc.sampling import HardNegativeSet
from xc.run.signals import stop_signal_received

log = logging.getLogger("xc.refresh")


def search_summary(stats: list[dict]) -> tuple[str, float | None]:
    """('clustered', 'graph/head_only', ... or '': the searches the shards' miners ran, the mean of their sampled
    recalls or None) from a generation's per-shard stats."""
    kinds = "/".join(sorted({s["search"] for s in stats if s.get("search")}))
    recalls = [s["recall"] for s in stats if s.get("recall") is not None]
    return kinds, float(np.mean(recalls)) if recalls else None


class NegativesIn:
    """Negatives for `Refresher` (which holds cfg, ctx, c (components), logger, root, k, mode and background)."""

    def _negatives_exist(self, generation: int) -> bool:
        return (self.root / "negatives" / gen_name(generation) / "manifest.json").exists()

    def _failed_marker(self, generation: int):
        """The file a miner leaves where it gave up on `generation`."""
        return self.root / "control" / f"failed-gen-{generation:06d}.json"

    # ------------------------------------------------------------------ sync mining
    def _mine_sync(self, epoch: int, step: int) -> HardNegativeSet:
        cfg, c = self.cfg, self.c
        start = time.perf_counter()
        queries = self._encode_all("encoding for mining").numpy()
        encode_s = time.perf_counter() - start
        indptr, indices = self.positives()
        tables, stats = {}, []
        vectors = self.label_vectors()
        # a GPU rank trains on a few torch threads; its synchronous search may take the rank's share of the cores
        threads = torch.get_num_threads() if self.ctx.device.type == "cpu" else host_threads(cfg, mining=False)[0]
        for shard in c.my_shards:
            lo, _ = c.layout.shard_range(shard)
            rows = vectors[shard]
            tables[shard], st = mine_table(rows, lo, queries, indptr, indices, self.k, cfg.miner.ann,
                                           threads, cfg.miner.recall_sample, seed=epoch)
            stats.append({"shard": shard, "build_seconds": st.build_seconds, "search_seconds": st.search_seconds,
                          "recall": st.recall, "search": st.search, "head_only": st.head_only,
                          "head_share": st.head_share, "clustered_probe": st.clustered_probe})
        stats = [s for part in all_gather_object(stats, self.ctx) for s in part]
        seconds = time.perf_counter() - start
        # the search that ran: a graph backend may keep its clustered trial or search its exact head alone
        kinds, recall = search_summary(stats)
        log.info("hard negatives: generation %d mined in-process (%s search%s) at epoch %d in %.1fs (encode %.1fs)",
                 epoch, kinds or cfg.miner.ann.backend, "" if recall is None else f", recall {recall:.3f}", epoch,
                 seconds, encode_s)
        self.logger.event("negatives", epoch=epoch, global_step=step, generation=epoch, mode="sync",
                          stall_seconds=seconds, encode_seconds=encode_s, shards=stats, age_steps=0)
        return HardNegativeSet(tables, epoch, epoch, step)

    def _switch(self, epoch: int, step: int, current: HardNegativeSet | None) -> HardNegativeSet | None:
        ctx = self.ctx
        # rank 0 decides; a dead miner's error reaches every rank, so none waits in the broadcast forever
        generation, stall, note = on_rank0(ctx, lambda: self._decide(epoch, current))
        if generation is None:
            return current
        tables, manifest = open_negatives(self.cfg.run_dir, generation, self.c.my_shards, checksum=False)
        made_step = self._snapshot_step(manifest, step)
        rerank = None
        if self.mine_k > self.k:
            tables, rerank = self._rerank(generation, tables, step)
            stall += rerank["seconds"]
        chosen = HardNegativeSet(tables, generation, manifest["snapshot_epoch"], made_step,
                                 step if rerank is not None else None)
        if generation >= self._published:
            self.follow_miner(mining=False)  # nothing newer handed to the miner: the trainer takes every core
        if ctx.is_main:
            stats = manifest.get("stats", [])
            kinds, recall = search_summary(stats)
            log.info("hard negatives: switching to generation %d (snapshot of step %d, %d steps old, stall %.2fs%s%s)",
                     generation, made_step, step - made_step, stall,
                     "" if recall is None else f", ANN recall {recall:.3f}", f", search {kinds}" if kinds else "")
            self.logger.event("negatives", epoch=epoch, global_step=step, generation=generation, mode=self.mode,
                              stall_seconds=stall, age_steps=step - made_step, note=note, shards=stats, recall=recall,
                              mine_seconds=manifest.get("seconds"), rerank=rerank)
            prune(self.root / "negatives", self.cfg.miner.keep_generations, protect={generation})
        return chosen

    def _rerank(self, generation: int, tables: dict, step: int) -> tuple[dict, dict]:
        """This rank's shards' (N, mine_k) candidates -> (N, k): the k scoring highest under the current
        encoder and rows (xc/refresh/rerank.py). Every rank encodes every query (as sync mining does)."""
        c = self.c
        start = time.perf_counter()
        queries = self._encode_all(f"re-ranking generation {generation}'s candidates", step)
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

    def _decide(self, epoch: int, current: HardNegativeSet | None) -> tuple[int | None, float, str]:
        """Rank 0: wait for generation `epoch` per the late policy; verify it; else keep `current`."""
        miner = self.cfg.miner
        start = time.perf_counter()
        failed_marker = self._failed_marker(epoch)
        wait = current is None or miner.late_policy == "wait"
        while True:
            background = getattr(self, "background", None)  # (absent on a Refresher built by a unit test)
            if background is not None:
                background.check()  # restarts a dead miner thread, or stops the run
            if self._negatives_exist(epoch):
                try:
                    tables, manifest = open_negatives(self.cfg.run_dir, epoch, range(self.c.layout.num_shards),
                                                      checksum=True)
                    self._check_fits(epoch, tables)
                    self._check_snapshot(epoch, manifest)
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
            ranked = None if current.ranked_at_step is None else step - current.ranked_at_step
            log.info("hard negatives in use: generation %d, %d steps old%s, %.1f%% still in the current top-%d",
                     current.generation, age, "" if ranked is None else f" (re-ranked {ranked} steps ago)",
                     100 * share, self.k)
            self.logger.event("staleness", epoch=epoch, global_step=step, generation=current.generation,
                              age_steps=age, ranked_age_steps=ranked, overlap_current_topk=share)
        return share
