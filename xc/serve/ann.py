"""Serving with ANN indexes over trained classifier shards (one index per label shard, top-k merged),
and those indexes kept as an artifact of the run, so a later `xc-eval`/`xc-predict` skips the build.

    from xc.serve.ann import AnnSearcher, SavedIndexes
    store = SavedIndexes(run_dir, "diskann", origin={"checkpoint": "step-00000120", "global_step": 120})
    searcher = AnnSearcher(shard, layout, shards, cfg.miner.ann, store=store, save=True)
    scores, ids = predict(encoder, shard, inputs, rows, k, batch, ctx, searcher=searcher)

Saved layout, `RUN_DIR/serving/<backend>/`:
    manifest.json      {"backend", "origin": {checkpoint, global_step}, "shards": {s: fingerprint}}
    shard{s}/          the backend's own files (xc.ann: `build_and_save` / `load`)
A shard's fingerprint is the checkpoint name and step, the sha256 of its classifier rows (float32) and
every ANN setting: an index is reused only when all of them match, and rebuilt otherwise, with a log
line saying which differs. A new artifact is built in `serving/.tmp-<backend>-*` and renamed into place
(the old one moved aside first), so a crash never leaves a half-written index under the final name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from xc.ann.breadth import BREADTH_FIELDS, PROBE_QUERIES, BreadthTuning, breadth_field, set_breadth, tune_breadth
from xc.ann.diskann_backend import graph_build_bytes
from xc.ann.exact import exact_topk
from xc.config import AnnConfig
from xc.errors import XCError
from xc.free_memory import host_memory
from xc.fsutil import fsync_dir, storage_failure, write_json_atomic
from xc.miner.params import build_ann
from xc.models.classifier import ClassifierShard
from xc.shards import ShardLayout

log = logging.getLogger(__name__)
# ANN settings that change how an index is built or searched on this machine, not what a saved one holds:
# left out of its fingerprint, so a saved index stays reusable across them
# (the search breadth included: it is tuned at search time, xc/ann/breadth.py)
RUNTIME_ONLY = ("num_threads", "diskann_tmp_dir", "exact_block_queries", "gpu_device", "torch_device", "serve_recall",
                "serve_neighbours",
                *BREADTH_FIELDS.values())


def index_build_bytes(backend: str, num_rows: int, dim: int, ann: AnnConfig) -> int:
    """What building `backend`'s index over num_rows x dim float32 rows holds beyond those rows: a graph's centred
    copy, its own vectors and edges (DiskANN: `graph_build_bytes`; HNSW: two copies and layer 0's 2M links a node),
    else the index's own copy of the vectors (IVF, exact, torch)."""
    if backend == "diskann":
        return graph_build_bytes(num_rows, dim, ann.diskann_graph_degree) - 4 * num_rows * dim
    if backend == "faiss_hnsw":
        return 8 * num_rows * dim + 8 * ann.hnsw_m * num_rows
    return 4 * num_rows * dim


def check_memory(need: int, what: str, backend: str) -> None:
    """Refuse in one line where `need` bytes exceed the memory free now (xc/free_memory.py): past it the kernel kills
    the process mid-build (a DiskANN index over 10^7 rows of 256 needs 32 GB), with no word of why."""
    free = host_memory()
    if need > free.bytes:
        raise XCError(f"--ann {backend}: {what} needs about {need / 2**30:.1f} GiB, {free.bytes / 2**30:.1f} GiB free "
                      f"({free.source}): serve without --ann (exact search), or on a host with more memory")


def rows_sha256(rows: np.ndarray) -> str:
    """sha256 of a (n, d) float32 matrix's bytes (C order): what the index was built on."""
    return hashlib.sha256(np.ascontiguousarray(rows, dtype=np.float32).data).hexdigest()


class SavedIndexes:
    """The saved indexes of one backend under `RUN_DIR/serving/<backend>/` and the checkpoint they serve.

    origin: {"checkpoint": directory name, "global_step": int} of the checkpoint whose rows are indexed."""

    def __init__(self, run_dir: str | Path, backend: str, origin: dict):
        self.root = Path(run_dir) / "serving"
        self.path = self.root / backend
        self.backend, self.origin = backend, dict(origin)

    def manifest(self) -> dict | None:
        try:
            return json.loads((self.path / "manifest.json").read_text())
        except (OSError, ValueError):
            return None

    def fingerprint(self, rows: np.ndarray, ann: AnnConfig, lo: int) -> dict:
        return {**self.origin, "label_lo": int(lo), "rows": int(rows.shape[0]), "dim": int(rows.shape[1]),
                "rows_sha256": rows_sha256(rows),
                "ann": {k: v for k, v in asdict(ann).items() if k not in RUNTIME_ONLY}}

    def stale_reason(self, shard: int, fingerprint: dict) -> str | None:
        """None when shard `shard`'s saved index matches `fingerprint`, else why it does not."""
        manifest = self.manifest()
        if manifest is None:
            return f"no saved {self.backend} index under {self.path}"
        saved = manifest.get("shards", {}).get(str(shard))
        if saved is None:
            return f"the saved index has no shard {shard}"
        if (saved.get("checkpoint"), saved.get("global_step")) != (fingerprint["checkpoint"], fingerprint["global_step"]):
            return (f"it was built for checkpoint {saved.get('checkpoint')} (step {saved.get('global_step')}), "
                    f"this is {fingerprint['checkpoint']} (step {fingerprint['global_step']})")
        for key in ("label_lo", "rows", "dim", "rows_sha256"):
            if saved.get(key) != fingerprint[key]:
                return f"its classifier rows differ ({key}: saved {saved.get(key)}, now {fingerprint[key]})"
        if saved.get("ann") != fingerprint["ann"]:
            changed = sorted(k for k in fingerprint["ann"] if saved.get("ann", {}).get(k) != fingerprint["ann"][k])
            return f"ANN settings differ ({', '.join(changed)})"
        return None

    def staging(self) -> Path:
        """A fresh private directory beside the artifact, to fill and then `publish`."""
        self.root.mkdir(parents=True, exist_ok=True)
        for dead in self.root.glob(f".tmp-{self.backend}-*"):  # left by a crash: never published
            if time.time() - dead.stat().st_mtime > 3600:
                shutil.rmtree(dead, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=f".tmp-{self.backend}-", dir=self.root))

    def publish(self, staged: Path, fingerprints: dict[int, dict]) -> None:
        """Write the manifest into `staged` (last, atomically) and swap the directory into place."""
        write_json_atomic(staged / "manifest.json", {"backend": self.backend, "origin": self.origin,
                                                     "shards": {str(s): f for s, f in fingerprints.items()}})
        fsync_dir(str(staged))
        old = None
        if self.path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".old-{self.backend}-", dir=self.root))
            os.replace(self.path, old / "d")
        try:
            os.replace(staged, self.path)
        except BaseException:
            if old is not None:  # the earlier index back under its name
                os.replace(old / "d", self.path)
                shutil.rmtree(old, ignore_errors=True)
            raise
        fsync_dir(str(self.root))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


class AnnSearcher:
    """ANN indexes over the label shards this rank holds; `search` merges their candidates.

    The first `search` tunes the indexes' search breadth on up to PROBE_QUERIES of its queries (recall@k against
    exact search reaching `ann.serve_recall`, xc/ann/breadth.py); `tuning` then says what was tried and chosen.

    With `store`, an index whose saved fingerprint matches is loaded instead of built (`reused` is then
    True); with `save` too, freshly built indexes are written there as a new artifact (one process only:
    every shard must be held here)."""

    def __init__(self, shard: ClassifierShard, layout: ShardLayout, shards: range, ann: AnnConfig, threads: int = 0,
                 store: SavedIndexes | None = None, save: bool = False):
        threads = threads or torch.get_num_threads()
        start = time.perf_counter()
        self.shard, self.ann = shard, ann
        self.tuning: BreadthTuning | None = None
        num_rows = sum(layout.real_count(s) for s in shards)
        check_memory(4 * num_rows * shard.dim, f"reading the {num_rows:,} x {shard.dim} rows as float32", ann.backend)
        parts = []
        for s in shards:
            lo, _ = layout.shard_range(s)
            n = layout.real_count(s)
            parts.append((s, lo, np.ascontiguousarray(shard.weight[lo - shard.lo:lo - shard.lo + n].float().cpu().numpy())))
        self._ranges = [(lo, rows.shape[0]) for _, lo, rows in parts]  # (first label, rows) of each shard searched
        fingerprints = {s: store.fingerprint(rows, ann, lo) for s, lo, rows in parts} if store else {}
        reasons = [r for s in fingerprints if (r := store.stale_reason(s, fingerprints[s]))] if store else ["no store"]
        self.indexes = []
        self.reused = store is not None and not reasons
        if self.reused:
            for s, lo, _ in parts:
                index = build_ann(ann, threads)
                index.load(str(store.path / f"shard{s}"))
                self.indexes.append((lo, index))
            log.info("reusing saved %s index %s (%s, step %s, %d shard(s)), build skipped", ann.backend, store.path,
                     store.origin.get("checkpoint"), store.origin.get("global_step"), len(parts))
        else:
            if store is not None:
                log.info("building %s index: saved index not reusable: %s", ann.backend, reasons[0])
            staged = None
            try:
                staged = store.staging() if store is not None and save else None
                self._build(parts, ann, threads, staged)
                if staged is not None:
                    store.publish(staged, fingerprints)
                    log.info("saved %s index to %s (%s, step %s)", ann.backend, store.path,
                             store.origin.get("checkpoint"), store.origin.get("global_step"))
            except BaseException as exc:
                if staged is not None:
                    shutil.rmtree(staged, ignore_errors=True)
                why = storage_failure(exc) if save and store is not None else None
                if why is None:
                    raise
                # a read-only export or run, a full disk: the index still serves, from memory, built once more where
                # the failure came before every shard was built
                log.warning("could not save the %s index under %s: %s; serving with the index built in memory "
                            "(not saved: the next --save-index builds it again)", ann.backend, store.root, why)
                if len(self.indexes) < len(parts):
                    self.indexes = []
                    self._build(parts, ann, threads, None)
        self.build_seconds = time.perf_counter() - start
        self.search_seconds = 0.0

    def _build(self, parts: list, ann: AnnConfig, threads: int, staged: Path | None) -> None:
        """An index per (shard, first label, rows) of `parts`, saved under `staged` where one is given."""
        need = sum(index_build_bytes(ann.backend, rows.shape[0], rows.shape[1], ann) for _, _, rows in parts)
        check_memory(need, f"an index over {sum(len(rows) for _, _, rows in parts):,} rows of {parts[0][2].shape[1]}"
                     if parts else "an empty index", ann.backend)
        for s, lo, rows in parts:
            index = build_ann(ann, threads)
            if staged is not None:
                index.build_and_save(rows, str(staged / f"shard{s}"))
            else:
                index.build(rows)
            self.indexes.append((lo, index))

    def search(self, embeddings: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k labels (global ids) of each query over this rank's shards: (scores (m, k'), ids (m, k'))."""
        queries = np.ascontiguousarray(embeddings.float().cpu().numpy())
        if self.tuning is None and self.ann.serve_recall > 0 and len(queries):
            self._tune(queries[:PROBE_QUERIES], k)
        start = time.perf_counter()
        return self._search(queries, k, start)

    def _tune(self, probe: np.ndarray, k: int) -> None:
        """Set the breadth every index searches at from recall@k against exact search on `probe` (m, d)."""
        name = breadth_field(self.ann.backend)
        if name is None:
            return
        clock, searched = time.perf_counter(), self.search_seconds
        truth = _best(*self._exact(probe, k), k)
        exact_seconds = time.perf_counter() - clock

        def search_ids(breadth: int) -> np.ndarray:
            for _, index in self.indexes:
                set_breadth(index, name, breadth)
            return _best(*self._search(probe, k, time.perf_counter()), k)

        self.tuning = tune_breadth(search_ids, truth, name, getattr(self.ann, name), self.ann.serve_recall)
        for _, index in self.indexes:
            set_breadth(index, name, self.tuning.chosen)
        # the probe's exact search and tries are the tuning's time, not serving's
        self.search_seconds, self.tuning.seconds = searched, time.perf_counter() - clock
        self.tuning.exact_query_seconds = exact_seconds / len(probe)
        if self.tuning.reached:
            log.info("ANN serving searches at %s", self.tuning.summary())
        else:  # the graph itself is too sparse for these rows: only a denser build helps (docs/serving.md)
            log.warning("ANN serving searches at %s; a denser index reaches further (e.g. miner.ann.diskann_graph_degree"
                        "=64 miner.ann.diskann_build_complexity=128: about 4x the build time)", self.tuning.summary())
        if self.tuning.exact_is_faster:  # advice only: which search serves stays the caller's choice, so the
            # answer never depends on this machine's timings
            log.warning("ANN serving: exact search (serving without --ann) was no slower a query than the %s index "
                        "on the probe, and is exact", self.ann.backend)

    def _exact(self, queries: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact top-k of every shard searched here, side by side: (scores (m, k * shards), global ids)."""
        found = [exact_topk(torch.from_numpy(queries), self.shard.weight[lo - self.shard.lo:lo - self.shard.lo + n], k)
                 for lo, n in self._ranges]
        return (torch.cat([s for s, _ in found], 1),
                torch.cat([torch.where(i >= 0, i + lo, -1) for (lo, _), (_, i) in zip(self._ranges, found)], 1))

    def _search(self, queries: np.ndarray, k: int, start: float) -> tuple[torch.Tensor, torch.Tensor]:
        all_scores, all_ids = [], []
        for lo, index in self.indexes:
            scores, ids = index.search(queries, k)
            all_scores.append(torch.from_numpy(np.where(ids >= 0, scores, -np.inf).astype(np.float32)))
            all_ids.append(torch.from_numpy(np.where(ids >= 0, ids + lo, -1).astype(np.int64)))
        self.search_seconds += time.perf_counter() - start
        return torch.cat(all_scores, 1), torch.cat(all_ids, 1)


def _best(scores: torch.Tensor, ids: torch.Tensor, k: int) -> np.ndarray:
    """The ids (m, k) of the k best of each row of shards' results side by side (scores, ids (m, k * shards))."""
    return torch.gather(ids, 1, torch.argsort(scores, dim=1, descending=True, stable=True)[:, :k]).numpy()
