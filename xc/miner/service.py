"""The miner service: watches a run directory for snapshots and publishes hard-negative generations.

One task per label shard runs in a pool of worker processes. A worker that dies (OOM kill, SIGKILL)
breaks the pool: the service starts a new one and retries the unfinished shards, up to
`max_retries` times. A generation is published only when every shard succeeded; otherwise its staging
directory is removed and a `failed-gen-*.json` marker tells the trainer to keep the previous one.
The same class serves the trainer's in-process pool (a thread of rank 0, `xc.miner.background`) and the
offline `xc-miner`.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict
from pathlib import Path

from xc.config import MinerConfig
from xc.errors import XCError
from xc.handoff import (
    HandoffError, HandoffStorageError, Stage, gen_name, handoff_root, list_generations, open_snapshot, prune,
    stop_requested, sweep_stale,
)
from xc.miner.lease import MinerLease
from xc.miner.task import run_shard_task

log = logging.getLogger("xc.miner")
STAT_KEYS = ("build_seconds", "search_seconds", "recall", "search", "head_only", "head_share", "clustered_probe",
             "rows_scanned", "hosts")  # per shard, logged


def init_worker_threads(threads: int) -> None:
    """A mining worker's torch and faiss threads (process pool initialiser; Ray tasks call it too)."""
    import torch

    torch.set_num_threads(threads)
    try:
        import faiss

        faiss.omp_set_num_threads(threads)
    except ImportError:
        pass


def init_pool_worker(threads: int, parent_pid: int) -> None:
    """A process-pool worker: its threads, and a watch that ends it once the process that started the pool is
    gone. A trainer or xc-miner killed outright (SIGKILL, OOM, a scheduler's kill) cannot shut its pool down,
    and a spawned worker would otherwise keep building an index for nobody, holding cores and memory."""
    init_worker_threads(threads)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)  # orphaned: nothing of ours is written outside the stage, which the next miner sweeps

    threading.Thread(target=watch, name="xc-parent-watch", daemon=True).start()


class ShardsFailed(Exception):
    """Mining a generation gave up (the reason is the message): its stage is abandoned, a failure marked."""


class MinerHalted(Exception):
    """`MinerService.halt` was called (the trainer is closing): the generation in flight is abandoned, neither
    published nor marked failed."""


class MinerLostLeaseError(XCError):
    """Another miner took this miner's lease (it was presumed dead): this one stops before publishing twice."""


class MinerService:
    """Mines `run_dir`'s snapshots. `lease`: the run's miner lease, taken by the caller (xc-miner, or the
    trainer's BackgroundMiner); checked before every generation, so a miner presumed dead and replaced
    stops instead of racing its successor."""

    def __init__(self, run_dir: str | Path, cfg: MinerConfig, lease: MinerLease | None = None):
        self.run_dir, self.cfg, self.lease = Path(run_dir), cfg, lease
        self.snapshots = handoff_root(run_dir) / "snapshots"
        self.negatives = handoff_root(run_dir) / "negatives"
        self.control = handoff_root(run_dir) / "control"
        self._executor: ProcessPoolExecutor | None = None
        self._halted = threading.Event()
        self.published: list[int] = []

    # ------------------------------------------------------------------ state on disk
    def failed(self) -> set[int]:
        if not self.control.is_dir():
            return set()
        return {int(p.stem.split("-")[-1]) for p in self.control.glob("failed-gen-*.json")}

    def pending(self) -> list[int]:
        """Snapshot generations that have neither negatives nor a failure marker."""
        done = set(list_generations(self.negatives)) | self.failed()
        return [g for g in list_generations(self.snapshots) if g not in done]

    # ------------------------------------------------------------------ mining
    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=self.cfg.workers, mp_context=mp.get_context("spawn"),
                initializer=init_pool_worker, initargs=(self.cfg.threads_per_worker, os.getpid()))
        return self._executor

    def _reset_pool(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def halt(self) -> None:
        """Stop now, from another thread: the workers are killed mid-task and the generation in flight is
        abandoned (its stage is swept by the next miner). Why: a shard task runs for minutes at 10^6 labels,
        and a pool shut down without it kept the trainer's process alive after its final (or SIGTERM)
        checkpoint until the task ended: the interpreter's exit joins a process pool's running work."""
        self._halted.set()
        executor = self._executor
        if executor is None:
            return
        workers = list((getattr(executor, "_processes", None) or {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            if worker.is_alive():
                worker.kill()

    def _check_lease(self) -> None:
        if self.lease is not None and not self.lease.held():
            raise MinerLostLeaseError(f"{self.lease.path}: another miner took this run's miner lease (this one was "
                                      "presumed dead); stopping so that one miner publishes each generation")

    def mine(self, generation: int) -> Path | None:
        """Mine one snapshot generation; returns the published directory, or None if it failed."""
        self._check_lease()
        started = time.time()
        try:
            snapshot = open_snapshot(self.run_dir, generation)
        except HandoffError as exc:
            return self._fail(generation, None, f"snapshot rejected: {exc}")
        manifest = snapshot.manifest
        stage = None
        try:
            stage = Stage(self.negatives, gen_name(generation))
            results = self._mine_shards(generation, snapshot, stage)
            shards = [results[s] for s in sorted(results)]
            self._check_lease()
            final = self._publish(generation, stage, manifest, results, started)
        except ShardsFailed as exc:
            return self._fail(generation, stage, str(exc))
        except MinerHalted:
            stage.abandon()
            log.info("miner halted while mining generation %d; nothing published", generation)
            return None
        except HandoffStorageError as exc:  # disk full, read-only, permission, quota: marked, then the miner stops
            self._fail(generation, stage, str(exc))
            raise
        except MinerLostLeaseError:
            stage.abandon()
            raise
        self.published.append(generation)
        log.info("miner published negatives generation %d (%s, %d shards) in %.1fs", generation,
                 self.cfg.ann.backend, len(shards), time.time() - started)
        prune(self.negatives, self.cfg.keep_generations + 1)
        return final

    def _publish(self, generation: int, stage: Stage, manifest: dict, results: dict[int, dict],
                 started: float) -> Path:
        """Publish the negatives of every shard (`results`) mined from the snapshot `manifest`."""
        shards = [results[s] for s in sorted(results)]
        return stage.publish({
            "kind": "negatives", "generation": generation, "snapshot_generation": generation,
            "snapshot_id": manifest.get("snapshot_id"),
            "snapshot_epoch": manifest["epoch"], "snapshot_step": manifest["global_step"],
            "query_rows": manifest.get("query_rows"),  # the slice of training rows mined (None: every row)
            "k_per_shard": manifest["k_per_shard"], "k_keep": manifest.get("k_keep"), "backend": self.cfg.ann.backend, "ann": asdict(self.cfg.ann),
            "shards": [r["entry"] for r in shards],
            "stats": [{k: r[k] for k in STAT_KEYS if k in r} | {"shard": s}
                      for s, r in zip(sorted(results), shards)],
            "seconds": time.time() - started, "created": time.time(),
        })

    def _mine_shards(self, generation: int, snapshot, stage: Stage) -> dict[int, dict]:
        """{shard: run_shard_task's result} with every shard's table written into `stage`, or ShardsFailed.
        The process pool's way; `miner=ray` (xc/miner/ray_pool.py) overrides it."""
        manifest = snapshot.manifest
        base = {"run_dir": str(self.run_dir), "generation": generation, "k": manifest["k_per_shard"],
                "recall_k": manifest.get("k_keep", 0),
                "ann": asdict(self.cfg.ann), "threads": self.cfg.threads_per_worker,
                "recall_sample": self.cfg.recall_sample, "stage": str(stage.path)}
        todo = {e["shard"]: 0 for e in manifest["shards"]}
        results: dict[int, dict] = {}
        while todo:
            if self._halted.is_set():
                raise MinerHalted()
            try:
                # Inside the try: a worker that died while the pool was idle (an OOM kill between two
                # generations) breaks the pool, and it is `submit` that raises BrokenProcessPool then.
                pool = self._pool()
                futures = {pool.submit(run_shard_task, dict(base, shard=s)): s for s in todo}
                for future in as_completed(futures):
                    shard = futures[future]
                    results[shard] = future.result()
                    del todo[shard]
            except BrokenProcessPool:
                self._reset_pool()
                if self._halted.is_set():  # our own kill, not a crash: no retry
                    raise MinerHalted() from None
                for shard in list(todo):
                    todo[shard] += 1
                    if todo[shard] > self.cfg.max_retries:
                        raise ShardsFailed(f"shard {shard}: worker died {todo[shard]} times")
                log.warning("miner worker died while mining generation %d; retrying shards %s", generation, sorted(todo))
            except HandoffStorageError:  # a worker's write (xc/miner/task.py): one line, the miner stops
                self._reset_pool()
                raise
            except Exception as exc:
                self._reset_pool()
                # halted while a pool was being (re)built: "cannot schedule new futures after shutdown" is our own
                # stop, and a failure marker would make a resumed run skip this generation (the soak found it)
                if self._halted.is_set():
                    raise MinerHalted() from None
                if isinstance(exc, OSError):
                    raise ShardsFailed(f"cannot write negatives ({exc}); check free space in {self.run_dir}")
                raise ShardsFailed(f"{type(exc).__name__}: {exc}")  # a task error other than a crash: no loop
        return results

    def supersede(self, generation: int, newer: int) -> None:
        """Skip `generation`: a newer snapshot is waiting, and a miner that falls behind catches up by mining the
        newest one (the trainer takes the newest generation that has arrived). Marked as given up, so a trainer
        that waits for it (late_policy=wait) stops waiting."""
        self.control.mkdir(parents=True, exist_ok=True)
        (self.control / f"failed-gen-{generation:06d}.json").write_text(json.dumps(
            {"reason": f"superseded by generation {newer}, whose snapshot arrived before this one was mined",
             "superseded_by": newer, "time": time.time()}))
        log.info("miner: generation %d skipped, superseded by the newer snapshot of generation %d", generation, newer)

    def _fail(self, generation: int, stage: Stage | None, reason: str) -> None:
        """Abandon the generation's stage and mark it failed, for the trainer to keep the negatives it has. The marker
        is best effort: the storage failure that failed the generation may refuse it too (the trainer then finds no
        generation and waits as for a late miner)."""
        if stage is not None:
            stage.abandon()
        try:
            self.control.mkdir(parents=True, exist_ok=True)
            (self.control / f"failed-gen-{generation:06d}.json").write_text(
                json.dumps({"reason": reason, "time": time.time()}))
        except OSError as exc:
            log.error("miner: could not mark generation %d failed (%s)", generation, exc)
        log.error("miner gave up on generation %d: %s", generation, reason)
        return None

    # ------------------------------------------------------------------ loop
    def serve(self, stop: threading.Event | None = None, exit_when_done: bool = True) -> None:
        """Mine snapshots as they appear until asked to stop (event, control/stop) or, with
        `exit_when_done`, until the trainer has finished and nothing is pending.

        A stop request, or Ctrl-C, halts a generation in flight (`halt`): a shard task runs for minutes at 10^6
        labels, and `xc-miner` used to finish it before looking at control/stop."""
        served = threading.Event()
        watch = threading.Thread(target=self._watch_stop, args=(stop, served), daemon=True, name="xc-miner-stop")
        watch.start()
        try:
            while True:
                self._check_lease()
                # the lease holder is the only writer of negatives/: any staging but ours is a dead miner's
                sweep_stale(self.negatives, sole_writer=self.lease is not None)
                pending = self.pending()
                if pending:
                    if (stop is not None and stop.is_set()) or stop_requested(self.run_dir):
                        return
                    for older in pending[:-1]:
                        self.supersede(older, pending[-1])
                    self.mine(pending[-1])
                if (stop is not None and stop.is_set()) or stop_requested(self.run_dir):
                    return
                if exit_when_done and (self.control / "trainer-done").exists() and not self.pending():
                    return
                time.sleep(self.cfg.poll_seconds)
        except KeyboardInterrupt:
            self.halt()  # the workers share the terminal's Ctrl-C, but not a `kill -INT` of this process
            raise
        finally:
            served.set()
            self._reset_pool()

    def _watch_stop(self, stop: threading.Event | None, served: threading.Event) -> None:
        """Beside `serve`: halt as soon as a stop is requested, even in the middle of a generation."""
        while not served.wait(self.cfg.poll_seconds):
            if (stop is not None and stop.is_set()) or stop_requested(self.run_dir):
                log.info("miner: stop requested; halting the generation in flight, if any")
                self.halt()
                return
