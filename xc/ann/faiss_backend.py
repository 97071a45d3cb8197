"""faiss backends, inner-product metric throughout: HNSW (CPU), IVF-Flat (CPU) and a GPU index
(flat or IVF) that falls back to the CPU equivalent, with a warning, when faiss sees no GPU.

faiss is imported inside the classes. faiss' OpenMP thread count is process-global: every build and
search sets it to `params.num_threads` and restores the previous value afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time

import numpy as np

from xc.ann.base import AnnIndex, AnnParams, pad_result
from xc.errors import ConfigError

log = logging.getLogger(__name__)

# faiss GPU kernels (flat and IVF) return at most this many neighbours per query.
GPU_MAX_K = 2048


def _faiss():
    try:
        import faiss
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("faiss backends need faiss: pip install 'xc[cpu]' (faiss-cpu) or 'xc[gpu]' (faiss-gpu)") from exc
    return faiss


@contextlib.contextmanager
def _omp_threads(faiss, n: int):
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(int(n))
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


def gpu_status() -> tuple[int, str]:
    """(GPUs visible to faiss, why none are when there are none)."""
    try:
        faiss = _faiss()
    except ImportError:
        return 0, "faiss is not installed"
    get = getattr(faiss, "get_num_gpus", None)
    if get is None or not hasattr(faiss, "StandardGpuResources"):
        return 0, f"the installed faiss {getattr(faiss, '__version__', '?')} is a CPU-only build (faiss-cpu)"
    try:
        count = int(get())
    except Exception as exc:  # a broken CUDA runtime reads as "no GPU"
        return 0, f"faiss-gpu cannot query CUDA ({type(exc).__name__}: {exc})"
    return count, "" if count else "faiss-gpu is installed but sees no CUDA device"


def num_gpus() -> int:
    """GPUs visible to faiss (0 for faiss-cpu or without CUDA devices)."""
    return gpu_status()[0]


def auto_nlist(n: int, requested: int = 0) -> int:
    """IVF list count: `requested`, or about 4 * sqrt(n); kept within [1, n // 39] so k-means has
    the ~39 training points per centroid that faiss asks for."""
    cap = max(1, n // 39)
    nlist = requested if requested > 0 else int(round(4 * math.sqrt(max(n, 1))))
    if requested > cap:
        log.warning("ann.ivf_nlist=%d is too large for %d rows; using %d lists", requested, n, cap)
    return max(1, min(nlist, cap))


class _FaissIndex(AnnIndex):
    def __init__(self, params: AnnParams | None = None):
        super().__init__(params)
        self._faiss = _faiss()
        self._index = None

    def _add(self, index, vectors: np.ndarray) -> None:
        index.add(vectors)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        queries = self._check_queries(queries, k)
        m = queries.shape[0]
        if self.n == 0 or m == 0:
            return self._empty_result(m, k)
        kk = min(k, self.n)
        with _omp_threads(self._faiss, self.params.threads()):
            scores, ids = self._search(queries, kk)
        # faiss pads with id -1 and score -FLT_MAX: normalise to -inf and width k.
        return pad_result(scores, ids, k)

    def _search(self, queries: np.ndarray, k: int):
        return self._index.search(queries, k)

    def save(self, directory: str) -> None:
        """faiss's own file format (`write_index`); a GPU index is written as its CPU copy."""
        index = self._index
        if getattr(self, "on_gpu", False):
            index = self._faiss.index_gpu_to_cpu(index)
        self._write_info(directory, nlist=int(getattr(self, "nlist", 0)), memory_bytes=int(self.memory_bytes))
        self._faiss.write_index(index, os.path.join(directory, "index.faiss"))

    def load(self, directory: str) -> None:
        info = self._read_info(directory)
        index = self._faiss.read_index(os.path.join(directory, "index.faiss"))
        self.nlist = int(info.get("nlist", 0))
        if getattr(self, "on_gpu", False):
            self._res = self._faiss.StandardGpuResources()
            index = self._faiss.index_cpu_to_gpu(self._res, self.params.device_ordinal(), index)
            self._cpu_copy = None
        if self.nlist and self.n and hasattr(index, "nprobe"):
            index.nprobe = min(self.params.ivf_nprobe, self.nlist, GPU_MAX_K)
        self._index = index
        self.memory_bytes = int(info.get("memory_bytes", 0))
        self._built = True


class FaissHNSWIndex(_FaissIndex):
    """faiss `IndexHNSWFlat(d, M, METRIC_INNER_PRODUCT)`: graph search directly on inner products."""

    name = "faiss_hnsw"

    def build(self, vectors: np.ndarray) -> None:
        faiss, p = self._faiss, self.params
        start = time.perf_counter()
        vectors = self._check_vectors(vectors)
        self.n, self.dim = vectors.shape
        index = faiss.IndexHNSWFlat(self.dim, p.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = p.hnsw_ef_construction
        with _omp_threads(faiss, p.threads()):
            index.add(vectors)
        self._index = index
        hnsw = index.hnsw
        # Resident size: full-precision storage + neighbour lists (int32) + per-node level/offset tables.
        self.memory_bytes = int(vectors.nbytes + 4 * hnsw.neighbors.size() + 4 * hnsw.levels.size()
                                + 8 * hnsw.offsets.size())
        self._built = True
        self.build_seconds = time.perf_counter() - start

    def _search(self, queries, k):
        sp = self._faiss.SearchParametersHNSW()
        sp.efSearch = max(self.params.hnsw_ef_search, k)
        return self._index.search(queries, k, params=sp)


def _build_ivf_cpu(faiss, vectors: np.ndarray, nlist: int, seed: int = 0):
    n, d = vectors.shape
    quantizer = faiss.IndexFlatIP(d)
    index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
    # (faiss' Python wrapper keeps `quantizer` alive as long as `index`.)
    index.train(_training_sample(vectors, nlist, seed))
    return index


def _training_sample(vectors: np.ndarray, nlist: int, seed: int = 0) -> np.ndarray:
    n = vectors.shape[0]
    cap = 256 * nlist  # faiss' own k-means cap per centroid
    if n <= cap:
        return vectors
    pick = np.sort(np.random.default_rng(seed).choice(n, cap, replace=False))
    return np.ascontiguousarray(vectors[pick])


class FaissIVFIndex(_FaissIndex):
    """faiss `IndexIVFFlat` with an inner-product coarse quantizer; scans `ivf_nprobe` lists."""

    name = "faiss_ivf"

    def build(self, vectors: np.ndarray) -> None:
        faiss, p = self._faiss, self.params
        start = time.perf_counter()
        vectors = self._check_vectors(vectors)
        self.n, self.dim = vectors.shape
        self.nlist = auto_nlist(self.n, p.ivf_nlist)
        with _omp_threads(faiss, p.threads()):
            if self.n > 0:
                index = _build_ivf_cpu(faiss, vectors, self.nlist)
                index.add(vectors)
            else:
                index = faiss.IndexFlatIP(self.dim)
        self._index = index
        self.memory_bytes = int(vectors.nbytes + 8 * self.n + 4 * self.nlist * self.dim)
        self._built = True
        self.build_seconds = time.perf_counter() - start

    def _search(self, queries, k):
        if not isinstance(self._index, self._faiss.IndexIVF):
            return self._index.search(queries, k)
        sp = self._faiss.SearchParametersIVF()
        sp.nprobe = min(self.params.ivf_nprobe, self.nlist)
        return self._index.search(queries, k, params=sp)


class FaissGpuIndex(_FaissIndex):
    """faiss on a GPU: `GpuIndexFlatIP` (gpu_index="flat", exact) or `GpuIndexIVFFlat` (gpu_index="ivf").

    Without a GPU visible to faiss (faiss-cpu, no CUDA device) it logs a warning and runs the same
    index kind on the CPU (`IndexFlatIP` / `IndexIVFFlat`); results keep the same contract.
    `on_gpu` tells which one is in use.
    """

    name = "faiss_gpu"

    def __init__(self, params: AnnParams | None = None):
        super().__init__(params)
        p = self.params
        gpus = num_gpus()
        self.on_gpu = gpus > 0
        self._cpu_copy = None
        if self.on_gpu and p.device_ordinal() >= gpus:
            raise ConfigError("ann.gpu_device", f"device {p.device_ordinal()} requested but faiss sees {gpus} GPU(s)")
        if not self.on_gpu:
            why = gpu_status()[1] or "faiss sees no GPU"
            kind = "IndexFlatIP, exact: the same results as GpuIndexFlatIP" if p.gpu_index == "flat" else \
                f"IndexIVFFlat, nprobe={p.ivf_nprobe}"
            log.warning("ann backend faiss_gpu: %s; falling back to faiss CPU (%s) with %d threads. To search on a "
                        "GPU, install faiss-gpu on a CUDA machine (bash tools/setup.sh --gpu)", why, kind, p.threads())

    def build(self, vectors: np.ndarray) -> None:
        faiss, p = self._faiss, self.params
        start = time.perf_counter()
        vectors = self._check_vectors(vectors)
        self.n, self.dim = vectors.shape
        self.nlist = auto_nlist(self.n, p.ivf_nlist) if p.gpu_index == "ivf" else 0
        self._cpu_copy = None
        with _omp_threads(faiss, p.threads()):
            if self.on_gpu:
                self._res = faiss.StandardGpuResources()
                if p.gpu_index == "flat" or self.n == 0:
                    cfg = faiss.GpuIndexFlatConfig()
                    cfg.device = p.device_ordinal()
                    index = faiss.GpuIndexFlatIP(self._res, self.dim, cfg)
                else:
                    cfg = faiss.GpuIndexIVFFlatConfig()
                    cfg.device = p.device_ordinal()
                    index = faiss.GpuIndexIVFFlat(self._res, self.dim, self.nlist, faiss.METRIC_INNER_PRODUCT, cfg)
                    index.train(_training_sample(vectors, self.nlist))
            else:
                if p.gpu_index == "flat" or self.n == 0:
                    index = faiss.IndexFlatIP(self.dim)
                else:
                    index = _build_ivf_cpu(faiss, vectors, self.nlist)
            if self.n:
                index.add(vectors)
            if self.nlist and self.n:
                # IndexIVF (CPU) and GpuIndexIVF both carry nprobe; GPU kernels cap it at 2048.
                index.nprobe = min(p.ivf_nprobe, self.nlist, GPU_MAX_K)
        self._index = index
        self.memory_bytes = int(vectors.nbytes + (8 * self.n + 4 * self.nlist * self.dim if self.nlist else 0))
        self._built = True
        self.build_seconds = time.perf_counter() - start

    def _search(self, queries, k):
        faiss, index = self._faiss, self._index
        if self.on_gpu and k > GPU_MAX_K:
            # GPU kernels stop at k = 2048: serve the rare wider search from a CPU copy.
            if self._cpu_copy is None:
                log.warning("faiss_gpu: k=%d exceeds the GPU limit %d; searching a CPU copy", k, GPU_MAX_K)
                self._cpu_copy = faiss.index_gpu_to_cpu(index)
            index = self._cpu_copy
        return index.search(queries, k)
