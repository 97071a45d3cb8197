"""Mean-centring for maximum-inner-product search over classifier vectors.

Classifier vectors trained with one-vs-all BCE share a large common component (every label is a
negative for most queries, so every w_l leans the same way): on a trained model the rows' mean had
norm 6.9 against row norms of about 7.5. Graph indexes then link rows by that shared direction, and
recall collapses (HNSW: 0.52, DiskANN: 0.43 recall@5 against exact search on real query embeddings).

Subtracting the mean mu changes every score of a query by the same constant q.mu, so the ranking is
exactly the same; the index sees only the discriminative part (recall 0.9995 on the same data). The
constant is added back, so `search` returns true inner products.
"""

from __future__ import annotations

import os

import numpy as np

from xc.ann.base import AnnIndex
from xc.ann.norm_head import NormHeadIndex
from xc.ann.registry import build_index


class CenteredIndex(AnnIndex):
    """Wraps any AnnIndex: indexes rows - mean(rows), returns scores + <query, mean>."""

    def __init__(self, inner: AnnIndex):
        super().__init__(inner.params)
        self.inner = inner
        self.name = f"centered({getattr(inner, 'name', type(inner).__name__)})"
        self.mean: np.ndarray | None = None

    def build(self, vectors: np.ndarray) -> None:
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        self.mean = vectors.mean(axis=0, dtype=np.float64).astype(np.float32)
        self.inner.build(vectors - self.mean)
        self._sync_inner()

    def build_and_save(self, vectors: np.ndarray, directory: str) -> None:
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        self.mean = vectors.mean(axis=0, dtype=np.float64).astype(np.float32)
        self.inner.build_and_save(vectors - self.mean, os.path.join(directory, "inner"))
        self._sync_inner()
        np.save(os.path.join(directory, "mean.npy"), self.mean)

    def save(self, directory: str) -> None:
        self.inner.save(os.path.join(directory, "inner"))
        np.save(os.path.join(directory, "mean.npy"), self.mean)

    def load(self, directory: str) -> None:
        self.inner.load(os.path.join(directory, "inner"))
        self.mean = np.load(os.path.join(directory, "mean.npy"))
        self._sync_inner()

    def _sync_inner(self) -> None:
        self.n, self.dim, self._built = self.inner.n, self.inner.dim, True
        self.build_seconds = getattr(self.inner, "build_seconds", 0.0)
        self.memory_bytes = getattr(self.inner, "memory_bytes", 0)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        scores, ids = self.inner.search(queries, k)
        shift = (queries @ self.mean)[:, None]
        return np.where(ids >= 0, scores + shift, scores).astype(np.float32), ids

    def search_excluding(self, queries: np.ndarray, k: int, exclude_indptr, exclude_indices) -> np.ndarray:
        return self.inner.search_excluding(np.ascontiguousarray(queries, dtype=np.float32), k,
                                           exclude_indptr, exclude_indices)


def build_for_mips(backend: str, params, center: bool) -> AnnIndex:
    """An unbuilt index for inner-product search over classifier rows: an approximate backend is mean-centred
    unless told not to, and its longest rows are searched exactly beside it (`params.exact_head`,
    xc/ann/norm_head.py). Exact search (the CPU, torch on a GPU, faiss_gpu's flat index) needs neither."""
    index = build_index(backend, params)
    if not is_graph_like(backend, params):
        return index
    index = CenteredIndex(index) if center else index
    return NormHeadIndex(index) if params.exact_head > 0 else index


def is_graph_like(backend: str, params) -> bool:
    """Whether `build_for_mips` wraps the backend (mean-centring, exact head): not for exact search, nor for the
    clustered backend, whose candidate bound already favours long rows (xc/ann/clustered.py)."""
    return not (backend in ("exact", "torch", "clustered") or (backend == "faiss_gpu" and params.gpu_index == "flat"))
