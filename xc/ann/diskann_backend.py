"""DiskANN backend: Microsoft's Rust DiskANN (`diskannpy-rust` 0.49.1, imported as `diskannpy`),
in-memory Vamana graph with the native inner-product metric.

What the 0.49.1 Python API needs, and what this wrapper does about it:

* Building goes through files: `diskannpy.build_async_index(data, "innerproduct", dir, ...)` writes a
  copy of the vectors (`ann_vectors.bin`), the graph (`ann`), the graph's vector store (`ann.data`)
  and metadata into an existing directory (and refuses to reuse one). `AsyncDiskIndex(dir, ...)`
  then loads graph and vectors fully into memory. `build` works in a private temporary directory
  (`ann.diskann_tmp_dir`, default the system temp dir) deleted as soon as the index is loaded;
  `build_and_save` writes the files into the serving artifact's directory and keeps them, and `load`
  reopens them (xc/serve/ann.py).
* `build_async_index` has no defaults for `num_start_pts`, `graph_slack_factor`,
  `max_fp_vecs_per_prune`, `num_tasks`, `pq_seed` and `insert_minibatch_size`; we pass 1, 1.3, 750,
  num_threads, 0 and 1 (bigger insert minibatches built slower for no recall gain).
* Results: `batch_search(...)` returns int64 row ids and *distances* = -<q, w> for "innerproduct";
  we return scores = -distances. One frozen start point is stored after the data (id n); it is
  never a valid result and is masked if it ever comes back.
* When it finds fewer than k rows (k near n, or rows unreachable in the graph) it pads with id 0
  and distance 0.0, indistinguishable from a real hit on row 0. We drop an id-0 entry unless it is
  the row's first and its distance equals -<q, w_0> (we keep w_0 to check).
* Native inner product works for MIPS (recall@16 0.95 at 10^6 rows, tools/bench/bench_ann.py); the
  classic MIPS-to-L2 augmentation (append sqrt(M^2 - |w|^2), L2 metric) was far worse here
  (recall@16 0.45 vs 0.99 at 10^5 rows, same R/L), so no transform is applied. With an IP graph
  some low-norm rows are unreachable (the build logs "points reachable"), which only affects rows
  that are rarely anyone's top-k.
* Its Rust logging (`tracing`) writes INFO lines to stdout and reads RUST_LOG once, at import:
  we default RUST_LOG to "warn" when diskannpy has not been imported yet. Two plain `println!`
  lines per build ("Batch insert completed", "Index build completed successfully") remain.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from xc.ann.base import AnnIndex, AnnParams, pad_result

log = logging.getLogger(__name__)

GRAPH_SLACK_FACTOR = 1.3
MAX_OCCLUSION = 750  # max_fp_vecs_per_prune: candidates considered when pruning a node's edges


def graph_build_bytes(num_rows: int, dim: int, graph_degree: int) -> int:
    """What building a graph index over `num_rows` rows of `dim` holds beyond the rows as stored: the rows read as
    float32, their mean-centred copy (xc/ann/centering.py) and the index's own float32 vectors, 12 B a row element,
    and ceil(R x slack) + 1 u32 edges a node (the loaded layout, `_layout_bytes`). At 10^6 rows of 1024: 12.5 GB."""
    return num_rows * (12 * dim + 4 * (math.ceil(graph_degree * GRAPH_SLACK_FACTOR) + 1))


def _diskannpy():
    if "diskannpy" not in sys.modules:
        os.environ.setdefault("RUST_LOG", "warn")
    try:
        import diskannpy
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("the diskann backend needs diskannpy-rust==0.49.1 (imported as `diskannpy`)") from exc
    return diskannpy


class DiskannIndex(AnnIndex):
    name = "diskann"

    def __init__(self, params: AnnParams | None = None):
        super().__init__(params)
        self._dap = _diskannpy()
        self._index = None
        self._row0 = None
        self._files: str | None = None  # directory holding the index files
        # build()'s files live here until the next build or until the index is dropped, so save() can copy them
        self._scratch: tempfile.TemporaryDirectory | None = None

    def build(self, vectors: np.ndarray) -> None:
        p = self.params
        start = time.perf_counter()
        vectors = self._check_vectors(vectors)
        if self._scratch is not None:
            self._scratch.cleanup()
        self._scratch = tempfile.TemporaryDirectory(prefix="xc-diskann-", dir=p.diskann_tmp_dir or None)
        self._build_in(vectors, os.path.join(self._scratch.name, "graph"))
        self._files = os.path.join(self._scratch.name, "graph")
        self.build_seconds = time.perf_counter() - start

    def build_and_save(self, vectors: np.ndarray, directory: str) -> None:
        """Build with the index files written into `directory/graph` and kept there (no copy)."""
        start = time.perf_counter()
        vectors = self._check_vectors(vectors)
        os.makedirs(directory, exist_ok=True)
        self._build_in(vectors, os.path.join(directory, "graph"))
        self._files = os.path.join(directory, "graph")
        self._save_extras(directory)
        self.build_seconds = time.perf_counter() - start

    def save(self, directory: str) -> None:
        if self.n and self._files is not None and os.path.abspath(self._files) != os.path.abspath(os.path.join(directory, "graph")):
            shutil.copytree(self._files, os.path.join(directory, "graph"))
        self._save_extras(directory)

    def load(self, directory: str) -> None:
        info = self._read_info(directory)
        p = self.params
        self._index, self._row0 = None, None
        if self.n:
            # The graph's own build parameters (R, L, alpha) come from the saved index, not this run's config.
            self._index = self._dap.AsyncDiskIndex(
                os.path.join(directory, "graph"), num_threads=p.threads(), r=int(info["graph_degree"]),
                l=int(info["build_complexity"]), alpha=float(info["alpha"]), graph_slack_factor=GRAPH_SLACK_FACTOR)
            self._row0 = np.load(os.path.join(directory, "row0.npy"))
        self._files = os.path.join(directory, "graph")
        self.memory_bytes = self._layout_bytes(int(info["graph_degree"]))
        self._built = True

    def _save_extras(self, directory: str) -> None:
        p = self.params
        self._write_info(directory, graph_degree=p.diskann_graph_degree, build_complexity=p.diskann_build_complexity,
                         alpha=p.diskann_alpha)
        if self.n:
            np.save(os.path.join(directory, "row0.npy"), self._row0)

    def _layout_bytes(self, graph_degree: int) -> int:
        # Loaded layout: the vectors plus the frozen start point, and a fixed-width adjacency
        # list of ceil(R * slack) + 1 u32 per node (matches the measured RSS growth within ~10%).
        slots = math.ceil(graph_degree * GRAPH_SLACK_FACTOR) + 1
        return int((self.n + 1) * (4 * self.dim + 4 * slots)) if self.n else 0

    def _build_in(self, vectors: np.ndarray, graph_dir: str) -> None:
        """Build the Vamana graph into the new directory `graph_dir` and load it into memory."""
        dap, p = self._dap, self.params
        self.n, self.dim = vectors.shape
        self._index = None
        threads = p.threads()
        if self.n:
            os.makedirs(graph_dir)  # build_async_index refuses a directory that holds an index already
            dap.build_async_index(
                data=vectors, distance_metric="innerproduct", index_directory=graph_dir,
                complexity=p.diskann_build_complexity, graph_degree=p.diskann_graph_degree,
                alpha=p.diskann_alpha, num_start_pts=1, num_threads=threads,
                graph_slack_factor=GRAPH_SLACK_FACTOR, max_fp_vecs_per_prune=MAX_OCCLUSION,
                num_tasks=threads, pq_seed=0, insert_minibatch_size=1,
            )
            self._index = dap.AsyncDiskIndex(
                graph_dir, num_threads=threads, r=p.diskann_graph_degree, l=p.diskann_build_complexity,
                alpha=p.diskann_alpha, graph_slack_factor=GRAPH_SLACK_FACTOR,
            )
            self._row0 = vectors[0].copy()
        self.memory_bytes = self._layout_bytes(p.diskann_graph_degree)
        self._built = True

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        queries = self._check_queries(queries, k)
        m = queries.shape[0]
        if self.n == 0 or m == 0:
            return self._empty_result(m, k)
        kk = min(k, self.n)
        p = self.params
        res = self._index.batch_search(queries, k_value=kk, l_value=max(p.diskann_search_complexity, kk),
                                       num_threads=p.threads())
        ids = np.asarray(res.identifiers, dtype=np.int64).reshape(m, kk)
        scores = -np.asarray(res.distances, dtype=np.float32).reshape(m, kk)
        bad = (ids < 0) | (ids >= self.n)  # the frozen start point (id n) or garbage
        # Padding is (id 0, distance 0.0): keep an id-0 entry only if it is the row's first and its
        # score matches <q, w_0>.
        is0 = ids == 0
        if is0.any():
            true0 = queries @ self._row0
            tol = 1e-4 * (np.linalg.norm(queries, axis=1) * float(np.linalg.norm(self._row0))) + 1e-6
            first0 = is0 & (np.cumsum(is0, axis=1) == 1)
            genuine = first0 & (np.abs(scores - true0[:, None]) <= tol[:, None])
            bad |= is0 & ~genuine
        if bad.any():
            ids = np.where(bad, -1, ids)
            scores = np.where(bad, np.float32(-np.inf), scores)
            # Keep the contract "best first, padding last" even if a bad entry sat mid-row.
            order = np.argsort(bad, axis=1, kind="stable")
            ids = np.take_along_axis(ids, order, axis=1)
            scores = np.take_along_axis(scores, order, axis=1)
        return pad_result(scores, ids, k)
