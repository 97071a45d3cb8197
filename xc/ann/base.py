"""The ANN-backend contract: `AnnParams` (every backend's knobs), the `AnnIndex` interface, and the
backend-independent helpers `search_excluding` and `recall_at_k`.

Everything here works on numpy arrays and imports neither torch nor any ANN library, so the
hard-negative miner (a separate process, no model, no torch.distributed) can use it directly.

Metric everywhere: maximum inner product. `search` returns *scores* = <w_l, q> (larger is better),
never distances, and *local* row ids 0 <= id < n of the indexed matrix; -1 (score -inf) pads a row
when fewer than k rows come back.
"""

from __future__ import annotations

import dataclasses
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from xc.arrays import find_sorted, unique_ints
from xc.errors import ConfigError

BACKENDS = ("diskann", "faiss_hnsw", "faiss_ivf", "faiss_gpu", "exact", "torch", "clustered")
# `--ann neighbours` (xc/serve/neighbours.py): no index over the rows but the query's nearest training points; a
# serving choice only (the miner has no use for it), with nothing to save
NEIGHBOURS = "neighbours"
SERVE_BACKENDS = (*BACKENDS, NEIGHBOURS)
NEIGHBOURS_SAVE_REFUSED = ("--ann neighbours builds no index to save (it encodes the training points when it starts): "
                           "drop --save-index")
# The synchronous miner's default: the trainer picks exact or diskann from the label count (xc/defaults/)
# before any index is built; build_index refuses it.
AUTO_BACKEND = "auto"
TORCH_DEVICES, TORCH_DTYPES = ("auto", "cpu", "cuda"), ("float32", "bfloat16")
GPU_INDEX_KINDS = ("flat", "ivf")


@dataclass(frozen=True)
class AnnParams:
    """Build and search knobs of every backend; a backend reads only its own (prefixed) fields.

    The one ANN settings schema: the run config's `miner.ann` group is this class (`xc.config.AnnConfig` is
    another name for it), so the miner, serving and benchmarks share its fields and defaults. Errors name
    the key as `ann.<field>`. Defaults were tuned on 10^6 synthetic classifier vectors, d = 64, k = 16
    (tools/bench/bench_ann.py): both graph backends reach recall@16 >= 0.9 against exact MIPS there.
    """

    backend: str = "exact"  # one of BACKENDS; `build_index(params.backend, params)`
    center: bool = True  # the miner indexes rows minus their mean: same ranking, far better recall (centering.py)
    # approximate backends over classifier rows: this many longest rows (at most n / 8) are searched exactly and
    # merged with the index's results over the rest (xc/ann/norm_head.py); 0 = the index alone
    exact_head: int = 1024
    # the miner skips the index when the exact head alone holds this share of a probe sample's exact top-k
    # (head sizes exact_head x 1, 2, 4, 8, at most n / 8; xc/ann/norm_head.py `head_only_rows`); 0 = never.
    # 0.97: what head + index measured at best (10^5: 0.971; 10^6: 0.950), so skipping never costs recall
    head_only_recall: float = 0.97
    # graph backends (diskann, faiss_hnsw, faiss_ivf) in the miner: first try the query-clustered search
    # (xc/ann/clustered.py) on a probe block of queries, and use it instead of building the graph where its recall
    # against exact search there reaches this (xc/miner/task.py `shard_index`); 0 = never
    clustered_recall: float = 0.9
    # serving (xc/serve/ann.py): the search breadth (diskann_search_complexity, hnsw_ef_search, ivf_nprobe) doubles
    # from its setting until recall@k against exact search on a probe of the served queries reaches this
    # (xc/ann/breadth.py); 0 = the setting as is. The miner measures its own recall and does not use it
    serve_recall: float = 0.97
    # serving with --ann neighbours (xc/serve/neighbours.py): the nearest training points whose labels are a query's
    # candidates, beside the exact_head longest rows; doubled from here while recall@k is under serve_recall (64: from
    # 32 the six doublings stopped at 2048 on the 10^7-label model, at 96.2% of a 97% target)
    serve_neighbours: int = 64
    # build and search threads for diskann / faiss; 0 = the miner's threads (miner.threads_per_worker), or all
    # CPUs of this process where an index is built directly
    num_threads: int = 0
    diskann_graph_degree: int = 32  # diskann (in-memory Vamana graph, inner product): R, the max out-degree
    diskann_build_complexity: int = 40  # diskann: L_build, the candidate list size while building
    diskann_alpha: float = 1.2  # diskann: pruning slack, in [1, 4]; larger keeps longer edges
    diskann_search_complexity: int = 64  # diskann: L_search (raised to k when k is larger)
    diskann_tmp_dir: str = ""  # diskann: where the index files are built (deleted once loaded); "" = system temp
    hnsw_m: int = 16  # faiss_hnsw (IndexHNSWFlat, inner product): M, links per node per layer (2M on layer 0), >= 2
    hnsw_ef_construction: int = 64  # faiss_hnsw: efConstruction, the candidate list size while building
    hnsw_ef_search: int = 128  # faiss_hnsw: efSearch, the candidate list size per query (raised to k when k is larger)
    # faiss_ivf, and faiss_gpu with gpu_index = "ivf" (IVF-Flat): inverted lists; 0 = auto: about 4 * sqrt(n), at
    # least 1, at most n / 39
    ivf_nlist: int = 0
    ivf_nprobe: int = 32  # faiss_ivf / faiss_gpu ivf: lists scanned per query (clamped to nlist)
    gpu_index: str = "flat"  # faiss_gpu: "flat" (exact IP on the GPU) or "ivf"
    gpu_device: int = -1  # faiss_gpu: CUDA ordinal; -1 = this process's LOCAL_RANK (0 outside torchrun)
    exact_block_queries: int = 4096  # exact backend (blocked matrix products, xc.ann.exact): queries per score block
    # torch backend (exact products on a GPU, xc.ann.torch_backend) and the clustered one: where the rows live;
    # auto: this rank's GPU (gpu_device, -1 = LOCAL_RANK) if CUDA is there, else the CPU
    torch_device: str = "auto"
    torch_dtype: str = "float32"  # torch backend: the rows' precision, float32 or bfloat16 (half the memory; clustered: float32)
    # clustered backend (xc/ann/clustered.py: queries grouped by k-means share candidates scored exactly; rows on
    # torch_device): queries per k-means cluster of a search block
    cluster_size: int = 1024
    cluster_candidates: int = 8192  # clustered: candidate rows scored exactly per cluster
    cluster_slack: float = 1.5  # clustered: z in the candidate bound c.w + z r |w| / sqrt(d), >= 0
    # clustered: leave out the rows too short to reach a query's top-k (xc/ann/norm_floor.py; exact, by |q.w| <= |q||w|)
    cluster_norm_floor: bool = True

    def validate(self) -> AnnParams:
        """Raise `ConfigError("ann.<field>")` for any out-of-range or wrongly typed value; returns self."""
        hints = {f.name: f.type for f in dataclasses.fields(self)}
        for name, tp in hints.items():
            value = getattr(self, name)
            tp = tp if isinstance(tp, str) else tp.__name__
            if tp == "int" and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise ConfigError(f"ann.{name}", f"expected an integer, got {value!r}")
            if tp == "float" and (isinstance(value, bool) or not isinstance(value, (int, float, np.number))
                                  or not np.isfinite(value)):
                raise ConfigError(f"ann.{name}", f"expected a finite number, got {value!r}")
            if tp == "bool" and not isinstance(value, (bool, np.bool_)):
                raise ConfigError(f"ann.{name}", f"expected true or false, got {value!r}")
            if tp == "str" and not isinstance(value, str):
                raise ConfigError(f"ann.{name}", f"expected a string, got {value!r}")
        if self.backend not in BACKENDS and self.backend != AUTO_BACKEND:
            raise ConfigError("ann.backend", f"{self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.torch_device not in TORCH_DEVICES:
            raise ConfigError("ann.torch_device", f"{self.torch_device!r} is not one of {', '.join(TORCH_DEVICES)}")
        if self.torch_dtype not in TORCH_DTYPES:
            raise ConfigError("ann.torch_dtype", f"{self.torch_dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
        if self.gpu_index not in GPU_INDEX_KINDS:
            raise ConfigError("ann.gpu_index", f"{self.gpu_index!r} is not one of {', '.join(GPU_INDEX_KINDS)}")
        for name in ("diskann_graph_degree", "diskann_build_complexity", "diskann_search_complexity",
                     "hnsw_m", "hnsw_ef_construction", "hnsw_ef_search", "ivf_nprobe", "exact_block_queries",
                     "cluster_size", "cluster_candidates", "serve_neighbours"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ann.{name}", f"must be >= 1, got {getattr(self, name)}")
        for name in ("num_threads", "ivf_nlist", "exact_head"):
            if getattr(self, name) < 0:
                raise ConfigError(f"ann.{name}", f"must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.head_only_recall <= 1.0:
            raise ConfigError("ann.head_only_recall", f"must be in [0, 1] (0 = never), got {self.head_only_recall}")
        if not 0.0 <= self.serve_recall <= 1.0:
            raise ConfigError("ann.serve_recall", f"must be in [0, 1] (0 = the breadth as set), got {self.serve_recall}")
        if not 0.0 <= self.clustered_recall <= 1.0:
            raise ConfigError("ann.clustered_recall", f"must be in [0, 1] (0 = never), got {self.clustered_recall}")
        if self.cluster_slack < 0:
            raise ConfigError("ann.cluster_slack", f"must be >= 0, got {self.cluster_slack}")
        if self.gpu_device < -1:
            raise ConfigError("ann.gpu_device", f"must be >= -1 (-1 = LOCAL_RANK), got {self.gpu_device}")
        if self.hnsw_m < 2:
            raise ConfigError("ann.hnsw_m", f"must be >= 2, got {self.hnsw_m}")
        if not 1.0 <= self.diskann_alpha <= 4.0:
            raise ConfigError("ann.diskann_alpha", f"must be in [1, 4], got {self.diskann_alpha}")
        return self

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> AnnParams:
        """Build from a plain mapping (e.g. the `ann` section of a config); unknown keys raise ConfigError."""
        raw = dict(raw or {})
        names = {f.name for f in dataclasses.fields(cls)}
        for key in raw:
            if key not in names:
                raise ConfigError(f"ann.{key}", "unknown key")
        return cls(**raw).validate()

    def device_ordinal(self) -> int:
        """`gpu_device` with -1 resolved to LOCAL_RANK: under torchrun each rank's sync miner and serving
        indexes use that rank's own GPU; pool workers inherit rank 0's; a standalone xc-miner uses GPU 0."""
        return self.gpu_device if self.gpu_device >= 0 else int(os.environ.get("LOCAL_RANK", "0"))

    def threads(self) -> int:
        """`num_threads` with 0 resolved to the CPUs this process may run on."""
        if self.num_threads > 0:
            return int(self.num_threads)
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            return max(1, os.cpu_count() or 1)


class AnnIndex(ABC):
    """A maximum-inner-product index over the rows of one matrix (one label shard).

    Lifecycle: `index = build_index(backend, params); index.build(W_r); scores, ids = index.search(Q, k)`.
    After `build`: `n`, `dim`, `build_seconds` (wall) and `memory_bytes` (the index's resident size,
    measured from the library where it can tell, else estimated from its layout) are set.
    """

    name: str = "abstract"

    def __init__(self, params: AnnParams | None = None):
        self.params = (params or AnnParams()).validate()
        self.n = 0
        self.dim = 0
        self.build_seconds = 0.0
        self.memory_bytes = 0
        self._built = False

    # -- the interface -------------------------------------------------------------------------
    @abstractmethod
    def build(self, vectors: np.ndarray) -> None:
        """Index `vectors` (n, d) float32; replaces any previous contents."""

    @abstractmethod
    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k rows by inner product: (scores (m, k) float32, ids (m, k) int64), best first;
        ids are local row ids, -1 (score -inf) where fewer than k rows came back."""

    def search_excluding(self, queries: np.ndarray, k: int, exclude_indptr: np.ndarray,
                         exclude_indices: np.ndarray) -> np.ndarray:
        """Ids of the top-k rows per query other than its excluded rows; see `search_excluding`."""
        return _search_excluding_generic(self, queries, k, exclude_indptr, exclude_indices)

    # -- persistence (serving indexes kept as artifacts, xc/serve/ann.py) -----------------------------
    @abstractmethod
    def save(self, directory: str) -> None:
        """Write the built index into `directory` (created if missing) so that `load` restores it."""

    @abstractmethod
    def load(self, directory: str) -> None:
        """Restore an index written by `save` (or `build_and_save`) of the same backend; replaces any contents."""

    def build_and_save(self, vectors: np.ndarray, directory: str) -> None:
        """`build(vectors)` and `save(directory)`; backends that build through files (DiskANN) write
        them straight into `directory` instead of copying."""
        self.build(vectors)
        self.save(directory)

    def _write_info(self, directory: str, backend: str | None = None, **extra: Any) -> None:
        import json

        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "index.json"), "w") as f:
            json.dump({"backend": backend or self.name, "n": int(self.n), "dim": int(self.dim), **extra}, f)

    def _read_info(self, directory: str, backend: str | None = None, shown: str | None = None) -> dict:
        """index.json of a saved index, checked to be of `backend` (default: this one's name; a refusal names
        `shown` as what was expected); sets n and dim."""
        import json

        path = os.path.join(directory, "index.json")
        try:
            with open(path) as f:
                info = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: unreadable saved-index description ({exc})") from exc
        if info.get("backend") != (backend or self.name):
            raise ValueError(f"{path}: an index of backend {info.get('backend')!r}, not {shown or repr(self.name)}")
        self.n, self.dim = int(info["n"]), int(info["dim"])
        return info

    # -- shared checks -------------------------------------------------------------------------
    def _check_vectors(self, vectors: np.ndarray) -> np.ndarray:
        vectors = np.asarray(vectors)
        if vectors.ndim != 2 or vectors.shape[1] < 1:
            raise ValueError(f"{self.name}: vectors must be a 2-D (n, d) array with d >= 1, got shape {vectors.shape}")
        if vectors.dtype != np.float32:
            if not np.issubdtype(vectors.dtype, np.floating):
                raise ValueError(f"{self.name}: vectors must be float32, got {vectors.dtype}")
            vectors = vectors.astype(np.float32)
        vectors = np.ascontiguousarray(vectors)
        if not np.isfinite(vectors).all():
            raise ValueError(f"{self.name}: vectors contain NaN or inf")
        return vectors

    def _check_queries(self, queries: np.ndarray, k: int) -> np.ndarray:
        if not self._built:
            raise RuntimeError(f"{self.name}: search() before build()")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"{self.name}: k must be a positive integer, got {k!r}")
        queries = np.asarray(queries)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"{self.name}: queries must be (m, {self.dim}), got shape {queries.shape}")
        if queries.dtype != np.float32:
            queries = queries.astype(np.float32)
        return np.ascontiguousarray(queries)

    def _empty_result(self, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        return np.full((m, k), -np.inf, dtype=np.float32), np.full((m, k), -1, dtype=np.int64)

    def __repr__(self) -> str:
        state = f"n={self.n}, d={self.dim}" if self._built else "unbuilt"
        return f"<{type(self).__name__} {self.name} {state}>"


def pad_result(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Normalise a library's (scores, ids) to the contract: width k, float32 / int64, -1 and -inf padding."""
    scores = np.asarray(scores, dtype=np.float32)
    ids = np.asarray(ids, dtype=np.int64)
    scores = np.where(ids < 0, np.float32(-np.inf), scores)
    if ids.shape[1] < k:
        extra = k - ids.shape[1]
        ids = np.concatenate([ids, np.full((ids.shape[0], extra), -1, np.int64)], axis=1)
        scores = np.concatenate([scores, np.full((scores.shape[0], extra), -np.inf, np.float32)], axis=1)
    return np.ascontiguousarray(scores[:, :k]), np.ascontiguousarray(ids[:, :k])


# ---------------------------------------------------------------------------------------------
# Search with per-query exclusions (the queries' positive labels)
# ---------------------------------------------------------------------------------------------

def search_excluding(index: AnnIndex, queries: np.ndarray, k: int, exclude_indptr: np.ndarray | None,
                     exclude_indices: np.ndarray | None) -> np.ndarray:
    """Top-k ids per query that are not among the query's excluded rows.

    exclusions: CSR over queries (exclude_indptr (m + 1,), exclude_indices local row ids; ids outside
    [0, n) are ignored, as in `exact_topk`). Returns ids (m, k) int64, best first, -1 padded where
    fewer than k admissible rows were found.

    Backends without native exclusion support search k + e rows, with e the 99th percentile of the
    per-query exclusion counts, drop the excluded ids and keep the first k; the few queries left
    short (more exclusions than e, or a library returning fewer rows than asked) are searched again
    with k + their own count, then with doubled widths, at most a few rounds.
    """
    if exclude_indptr is None:
        return index.search(queries, k)[1]
    return index.search_excluding(queries, k, exclude_indptr, exclude_indices)


def _check_exclusions(m: int, exclude_indptr, exclude_indices) -> tuple[np.ndarray, np.ndarray]:
    indptr = np.asarray(exclude_indptr, dtype=np.int64)
    indices = np.asarray(exclude_indices if exclude_indices is not None else [], dtype=np.int64)
    if indptr.ndim != 1 or indptr.shape[0] != m + 1:
        raise ValueError(f"exclude_indptr must have m + 1 = {m + 1} entries, got shape {indptr.shape}")
    if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] > indices.shape[0]:
        raise ValueError("exclude_indptr must start at 0, be non-decreasing and end within exclude_indices")
    return indptr, indices


def _search_excluding_generic(index: AnnIndex, queries: np.ndarray, k: int, exclude_indptr,
                              exclude_indices, max_rounds: int = 4) -> np.ndarray:
    queries = index._check_queries(queries, k)
    m, n = queries.shape[0], index.n
    indptr, indices = _check_exclusions(m, exclude_indptr, exclude_indices)
    out = np.full((m, k), -1, dtype=np.int64)
    if m == 0 or n == 0:
        return out
    # Exclusion set as sorted keys query * n + row, rows outside [0, n) dropped.
    qrow = np.repeat(np.arange(m, dtype=np.int64), np.diff(indptr))
    cols = indices[: indptr[-1]]
    inside = (cols >= 0) & (cols < n)
    keys = unique_ints(qrow[inside] * n + cols[inside])
    counts = np.bincount(keys // n, minlength=m) if keys.size else np.zeros(m, np.int64)
    # Rows a query can still return: at most n - counts; that is all it can ever get.
    wanted = np.minimum(k, n - counts)

    first_extra = int(np.ceil(np.quantile(counts, 0.99))) if m else 0
    pending = np.arange(m)
    width = np.full(m, min(n, k + first_extra), dtype=np.int64)
    for round_ in range(max_rounds):
        if pending.size == 0:
            break
        # One library call per distinct width (a handful: the first round has a single width).
        for w in np.unique(width[pending]):
            sel = pending[width[pending] == w]
            _, ids = index.search(queries[sel], int(w))
            ids = np.where((ids >= 0) & (ids < n), ids, -1)
            _, excluded = find_sorted(keys, sel[:, None] * n + np.maximum(ids, 0))
            keep = (ids >= 0) & ~excluded
            # Duplicates (a library quirk) count once: mask later copies of an id within a row.
            order = np.argsort(ids, axis=1, kind="stable")
            sorted_ids = np.take_along_axis(ids, order, axis=1)
            dup_sorted = np.zeros_like(keep)
            dup_sorted[:, 1:] = (sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)
            dup = np.zeros_like(keep)
            np.put_along_axis(dup, order, dup_sorted, axis=1)
            keep &= ~dup
            # Stable compaction of the kept ids to the front, first k of them.
            front = np.argsort(~keep, axis=1, kind="stable")[:, :k]
            got = np.take_along_axis(ids, front, axis=1)
            got = np.where(np.take_along_axis(keep, front, axis=1), got, -1)
            if got.shape[1] < k:
                got = np.concatenate([got, np.full((got.shape[0], k - got.shape[1]), -1, np.int64)], axis=1)
            out[sel] = got
        have = (out[pending] >= 0).sum(axis=1)
        short = pending[(have < wanted[pending]) & (width[pending] < n)]
        if short.size == 0:
            break
        # Next width: first the query's own need, then doubling (bucketed to powers of two).
        need = k + counts[short]
        nxt = np.where(width[short] < need, need, 2 * width[short])
        nxt = np.minimum(n, 1 << np.ceil(np.log2(np.maximum(nxt, 1))).astype(np.int64))
        width[short] = np.maximum(nxt, width[short] + 1).clip(max=n)
        pending = short
    return out


# ---------------------------------------------------------------------------------------------
# Recall
# ---------------------------------------------------------------------------------------------

def recall_at_k(approx_ids: np.ndarray, exact_ids: np.ndarray, block: int = 8192) -> float:
    """Mean over queries of |approx ∩ exact| / |exact|, with -1 entries ignored on both sides.

    `exact_ids` (m, k) is the reference top-k; `approx_ids` (m, k') may be wider or narrower.
    Queries whose reference row is all -1 are skipped; returns nan when every row is.
    """
    approx_ids = np.asarray(approx_ids, dtype=np.int64)
    exact_ids = np.asarray(exact_ids, dtype=np.int64)
    if approx_ids.ndim != 2 or exact_ids.ndim != 2 or approx_ids.shape[0] != exact_ids.shape[0]:
        raise ValueError(f"recall_at_k: need two (m, k) arrays with equal m, got {approx_ids.shape} and {exact_ids.shape}")
    total, rows = 0.0, 0
    for start in range(0, exact_ids.shape[0], block):
        a = approx_ids[start:start + block]
        e = exact_ids[start:start + block]
        # Each reference id counts once: sort + dedupe the reference row by masking repeats.
        e = np.sort(e, axis=1)
        valid = e >= 0
        valid[:, 1:] &= e[:, 1:] != e[:, :-1]
        hit = (e[:, :, None] == a[:, None, :]).any(axis=2) & valid
        denom = valid.sum(axis=1)
        ok = denom > 0
        total += float((hit.sum(axis=1)[ok] / denom[ok]).sum())
        rows += int(ok.sum())
    return total / rows if rows else float("nan")
