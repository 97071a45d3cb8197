"""`miner=ray`: hard-negative mining as Ray tasks on a Ray cluster, published through the same hand-off.

    xc-train miner=ray                                   # a local Ray instance, started for this run
    ray start --head --num-cpus 16                       # or a cluster: head here, `ray start --address
    xc-train miner=ray miner.ray_address=auto            #   HEAD:6379` on each miner node
    xc-miner --run-dir runs/big --ray-address HEAD:6379  # offline: xc-miner as the Ray driver (miner=external)

The driver (rank 0's miner thread, or `xc-miner`) reads each published snapshot from the run directory and
puts the shard rows, the queries and the positives into Ray's object store: miner nodes need the Python
environment (tools/setup.sh) but no filesystem shared with the trainer. Per label shard one *build* task
indexes the rows and returns the saved index (the backend's own files, `AnnIndex.save`) as an object;
`miner.ray_query_blocks` *search* tasks then each load it and search one block of the queries, so one
shard's search spreads over nodes. Every task asks Ray for `miner.threads_per_worker` CPUs, and Ray
schedules them by CPU. A task lost with its worker or node is re-run elsewhere, up to `miner.max_retries`
times (Ray's own retry of system failures; an object lost with a node is rebuilt from its lineage). The
driver assembles each shard's (N, k) table, writes it into the generation's stage and publishes the
generation exactly as the process pool does (manifest with sizes and digests, atomic rename), so nothing
half-mined is ever visible, and the trainer cannot tell the two apart: for the exact backend the tables are
the pool's, value for value. Telemetry per shard: build and search seconds, recall against exact search
on `miner.recall_sample` queries, and the hosts that ran it.

Only this module imports ray, and only when `miner=ray` is chosen.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from xc.ann.bf16_rows import bf16_from_bits, float32_copy
from xc.config import AnnConfig, MinerConfig
from xc.errors import XCError, require_extra
from xc.faults import Faults
from xc.handoff import BF16, HandoffStorageError, Stage, positives_of_rows, read_static_positives
from xc.miner.lease import MinerLease
from xc.miner.params import build_ann
from xc.miner.service import MinerHalted, MinerService, ShardsFailed, init_worker_threads
from xc.miner.task import (
    judged_depth, probe_sample, sampled_hits, search_block, shard_index, trial_params, trial_table, wants_probe,
)

log = logging.getLogger("xc.miner")


class RayUnavailableError(XCError):
    """Ray does not import or cannot be reached, or the cluster has too few CPUs for one task (not installed at all:
    xc.errors.MissingExtraError)."""


def connect(cfg: MinerConfig) -> None:
    """Join the Ray cluster at `miner.ray_address` ("auto": the one `ray start` runs here, or RAY_ADDRESS), or
    start a local instance of `workers * threads_per_worker` CPUs when it is empty; idempotent."""
    require_extra("ray", "Ray", "ray", "miner=ray")
    try:
        import ray
    except ImportError as exc:  # installed, but broken (e.g. one of its own dependencies is missing)
        raise RayUnavailableError(f"miner=ray: Ray is installed but does not import: {exc}") from exc
    if ray.is_initialized():
        return
    kwargs = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
                  ignore_reinit_error=True)
    try:
        if cfg.ray_address:
            ray.init(address=cfg.ray_address, **kwargs)
        else:
            # "local": a new instance even where RAY_ADDRESS names a cluster (e.g. a parent process's)
            ray.init(address="local", num_cpus=cfg.workers * cfg.threads_per_worker,
                     object_store_memory=cfg.ray_object_store_mb * 2**20, **kwargs)
    except Exception as exc:  # ConnectionError, RuntimeError, ValueError: all mean "no cluster here"
        where = f"the Ray cluster at {cfg.ray_address!r}" if cfg.ray_address else "a local Ray instance"
        raise RayUnavailableError(f"miner=ray: cannot start or reach {where}: {type(exc).__name__}: {exc}") from exc
    cpus = ray.cluster_resources().get("CPU", 0)
    log.info("miner=ray: %s, %g CPUs on %d node(s); %d CPU(s) per task", cfg.ray_address or "local Ray instance",
             cpus, len([n for n in ray.nodes() if n.get("Alive")]), cfg.threads_per_worker)


# ---------------------------------------------------------------------------------------------- tasks
def _writable(a: np.ndarray) -> np.ndarray:
    """Objects come out of Ray's store read-only; torch wants arrays it may write."""
    return a if a.flags.writeable else np.array(a)


def _index_files(index) -> dict[str, bytes] | None:
    if index is None:
        return None
    with tempfile.TemporaryDirectory(prefix="xc-ray-index-") as d:
        index.save(d)
        return {str(p.relative_to(d)): p.read_bytes() for p in Path(d).rglob("*") if p.is_file()}


def _load_index(files: dict[str, bytes] | None, ann: AnnConfig, threads: int, directory: str):
    if files is None:
        return None
    for name, data in files.items():
        path = Path(directory) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    index = build_ann(ann, threads)
    index.load(directory)
    return index


def build_task(rows: np.ndarray, ann_fields: dict, threads: int, probe=None, k: int = 0, recall_k: int = 0,
               lo: int = 0, num_queries: int = -1) -> dict:
    """One shard's index, saved to bytes: {"files": {name: bytes} (None: exact), "build_seconds", "head_only"
    (rows of an exact head searched alone, 0 = an index; `probe` as `xc.miner.task.probe_sample`), "table"
    (the (num_queries, k) table where the clustered trial already searched every query, else None), "host"}."""
    init_worker_threads(max(1, threads))
    index, seconds = shard_index(_writable(rows), AnnConfig(**ann_fields), threads, probe, k, recall_k)
    # the search tasks then slice this table instead of searching every query a second time
    table = trial_table(index, num_queries, lo, k)  # None for exact search, a graph, or a partial probe block
    return {"files": _index_files(index), "build_seconds": seconds, "table": table,
            "head_only": getattr(index, "head_only_size", 0), "head_share": getattr(index, "head_probe_share", None),
            "search": getattr(index, "search_kind", "exact"),
            "clustered_probe": getattr(index, "clustered_probe", None),
            "host": socket.gethostname()}


def search_task(built: dict, rows: np.ndarray, lo: int, queries: np.ndarray, positives: tuple, k: int,
                start: int, stop: int, ann_fields: dict, threads: int, recall_sample: int, seed: int,
                recall_k: int = 0) -> dict:
    """Queries [start, stop) against one shard: {"table" (stop - start, k) int32, "search_seconds", "hits",
    "total" (recall of the exact top-recall_k (0 = k) on a sample), "host"}. A Ray worker's entry: the tests'
    fault injection comes from the environment its node started with (`_fault_hooks`)."""
    init_worker_threads(max(1, threads))
    # from the worker's environment, not the driver's: a test sets these on the nodes it starts
    _fault_hooks(Faults.from_env(os.environ))
    rows = _writable(rows)
    pos_indptr, pos_indices = positives
    if built.get("table") is not None:  # the build's clustered trial searched every query: nothing left to search
        table, seconds, indexed = built["table"][start:stop], 0.0, True
    else:
        with tempfile.TemporaryDirectory(prefix="xc-ray-search-") as d:
            ann = AnnConfig(**ann_fields)
            if built.get("search") == "clustered":  # the build task kept the clustered search (shard_index)
                ann = trial_params(ann)
            index = _load_index(built["files"], ann, threads, d)
            began = time.perf_counter()
            table = search_block(index, rows, lo, queries, pos_indptr, pos_indices, k, start, stop)
            seconds, indexed = time.perf_counter() - began, index is not None
    hits = total = 0
    if indexed and recall_sample > 0:  # exact search (no index) has nothing to measure
        hits, total = sampled_hits(table, rows, lo, queries, pos_indptr, pos_indices, judged_depth(k, recall_k),
                                   recall_sample, seed, start)
    return {"table": table, "search_seconds": seconds, "hits": hits, "total": total, "host": socket.gethostname()}


def _fault_hooks(faults: Faults) -> None:
    """Tests only: `faults.ray_mark_dir` gets a file per running search task named after its node (so a test
    can kill that node mid-task), `faults.ray_task_delay_s` keeps the task running that long."""
    if faults.ray_mark_dir:
        import ray

        node = ray.get_runtime_context().get_node_id()
        Path(faults.ray_mark_dir, f"{node}.{os.getpid()}").touch()
    if faults.ray_task_delay_s:
        time.sleep(faults.ray_task_delay_s)


@functools.cache
def _remotes():
    import ray

    return ray.remote(build_task), ray.remote(search_task)


# ---------------------------------------------------------------------------------------------- driver
class RayMinerService(MinerService):
    """MinerService whose shards are mined by Ray tasks (the module docstring); serve/mine/publish unchanged."""

    def __init__(self, run_dir: str | Path, cfg: MinerConfig, lease: MinerLease | None = None):
        super().__init__(run_dir, cfg, lease)
        self._inflight: list = []  # the object refs of the generation being mined (cancelled by `halt`)
        connect(cfg)

    def halt(self) -> None:
        """Stop now, from another thread: the generation's tasks are cancelled with their workers killed (force),
        as the process pool's workers are, and the generation is abandoned (`MinerHalted`). Without it a closing
        trainer or a stopped xc-miner left its search tasks running on the cluster for minutes, for nobody."""
        import ray

        self._halted.set()
        for ref in list(self._inflight):
            try:
                ray.cancel(ref, force=True)
            except Exception as exc:  # noqa: BLE001 - a finished or lost task: nothing left to stop
                log.debug("ray.cancel(%s): %s", ref, exc)

    def _blocks(self, num_queries: int) -> list[tuple[int, int]]:
        count = max(1, min(self.cfg.ray_query_blocks, num_queries))
        size = math.ceil(num_queries / count)
        return [(a, min(num_queries, a + size)) for a in range(0, num_queries, size)] or [(0, 0)]

    def _mine_shards(self, generation: int, snapshot, stage: Stage) -> dict[int, dict]:
        import ray
        from ray.exceptions import RayError, RayTaskError

        build, search = _remotes()
        cfg, manifest = self.cfg, snapshot.manifest
        threads, k, recall_k = cfg.threads_per_worker, manifest["k_per_shard"], manifest.get("k_keep", 0)
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < threads:
            raise ShardsFailed(f"the Ray cluster has {cpus:g} CPUs, fewer than one task asks for "
                               f"(miner.threads_per_worker={threads}): add nodes or lower it")
        # SPREAD: shards' builds go to different nodes even when the driver's node has CPUs free (Ray's default
        # packs tasks onto the local node first, which left a loaded cluster's other nodes idle)
        options = dict(num_cpus=threads, max_retries=cfg.max_retries, scheduling_strategy="SPREAD")
        ann = asdict(cfg.ann)
        queries = np.ascontiguousarray(snapshot.queries(), dtype=np.float32)
        queries_ref = ray.put(queries)
        positives = positives_of_rows(*read_static_positives(self.run_dir), snapshot.query_rows())
        positives_ref = ray.put(positives)
        blocks = self._blocks(len(queries))
        pending = {}
        for entry in manifest["shards"]:
            shard = entry["shard"]
            rows = snapshot.shard_rows(shard)
            if snapshot.shard_dtype(shard) == BF16:  # Ray ships numpy arrays to its workers: a float32 copy
                rows = float32_copy(bf16_from_bits(rows), f"the Ray miner (shard {shard})")
            rows = np.ascontiguousarray(rows, dtype=np.float32)
            rows_ref = ray.put(rows)
            probing, block = wants_probe(cfg.ann, cfg.recall_sample)
            probe = probe_sample(queries, *positives, entry["lo"], len(rows), cfg.recall_sample, generation,
                                 block) if probing else None
            built = build.options(**options).remote(rows_ref, ann, threads, probe, k, recall_k, entry["lo"], len(queries))
            searches = []
            for b, (start, stop) in enumerate(blocks):
                # the pool samples recall with seed = generation over all N queries: one block does the same
                share = cfg.recall_sample if len(blocks) == 1 else math.ceil(cfg.recall_sample * (stop - start) / len(queries))
                seed = generation if len(blocks) == 1 else generation * 1_000_003 + b
                searches.append(search.options(**options).remote(
                    built, rows_ref, entry["lo"], queries_ref, positives_ref, k, start, stop, ann, threads, share, seed,
                    recall_k))
            pending[shard] = (built, searches)
        self._inflight = [ref for built, searches in pending.values() for ref in (built, *searches)]
        results = {}
        try:
            if self._halted.is_set():  # halted while the tasks were being submitted
                self.halt()
                raise MinerHalted()
            for shard, (built, searches) in pending.items():
                made = ray.get(built)
                parts = ray.get(searches)
                table = np.concatenate([p["table"] for p in parts]) if parts else np.zeros((0, k), np.int32)
                entry = stage.write_array(f"neg.shard{shard}.int32", table, raw=True)  # fsynced, hashed, described
                total = sum(p["total"] for p in parts)
                results[shard] = {
                    "entry": dict(entry, shard=shard),
                    "build_seconds": made["build_seconds"],
                    "search_seconds": sum(p["search_seconds"] for p in parts),
                    "recall": (sum(p["hits"] for p in parts) / total if total else 1.0) if made["files"] else None,
                    "head_only": made.get("head_only", 0), "head_share": made.get("head_share"),
                    "search": made.get("search"), "clustered_probe": made.get("clustered_probe"),
                    "hosts": sorted({made["host"], *(p["host"] for p in parts)})}
        except (RayError, OSError, HandoffStorageError) as exc:
            if self._halted.is_set():  # our own cancellation (`halt`), not a failure: no marker, no retry
                raise MinerHalted() from None
            for built, searches in pending.values():  # a failed generation leaves no work running
                for ref in (built, *searches):
                    ray.cancel(ref, force=False)
            if isinstance(exc, HandoffStorageError):  # the driver's write: one line, the miner stops (service.mine)
                raise
            if isinstance(exc, RayTaskError):  # the task itself raised: report it, do not retry
                raise ShardsFailed(f"a Ray mining task failed: {exc.cause!r}") from exc
            if isinstance(exc, RayError):  # retries exhausted: workers or nodes kept dying
                raise ShardsFailed(f"Ray lost a mining task after {cfg.max_retries} retries: "
                                   f"{type(exc).__name__}: {exc}") from exc
            raise ShardsFailed(f"cannot write negatives ({exc}); check free space in {self.run_dir}") from exc
        finally:
            self._inflight = []
        return results
