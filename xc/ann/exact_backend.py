"""The exact backend: `xc.ann.exact.exact_topk` (blocked torch matrix products) behind `AnnIndex`.

build takes float32 rows (n, d) or a bfloat16 tensor (n, d) (a bfloat16 snapshot's rows), searched in float32
without a float32 copy (xc/ann/bf16_rows.py). Recall 1 by construction; the reference for the approximate
backends and the right choice for small shards. Exclusions are applied inside the score blocks (no over-fetching).
"""

from __future__ import annotations

import os
import time

import numpy as np

from xc.ann.base import AnnIndex, AnnParams, _check_exclusions
from xc.ann.bf16_rows import check_finite, is_bf16
from xc.ann.exact import exact_topk


class ExactIndex(AnnIndex):
    name = "exact"

    def __init__(self, params: AnnParams | None = None):
        super().__init__(params)
        self._rows = None

    def build(self, vectors: np.ndarray) -> None:
        import torch

        start = time.perf_counter()
        if is_bf16(vectors):  # a bfloat16 snapshot's rows: kept as they are, scored in float32 block by block
            check_finite(vectors, self.name)
            self._rows = vectors
        else:
            self._rows = torch.from_numpy(self._check_vectors(vectors))  # shares the caller's float32 array
        self.n, self.dim = self._rows.shape
        self.memory_bytes = int(self._rows.numel() * self._rows.element_size())
        self._built = True
        self.build_seconds = time.perf_counter() - start

    def save(self, directory: str) -> None:
        self._write_info(directory)
        np.save(os.path.join(directory, "rows.npy"), self._rows.float().cpu().numpy())

    def load(self, directory: str) -> None:
        import torch

        self._read_info(directory)
        self._rows = torch.from_numpy(np.load(os.path.join(directory, "rows.npy")))
        self.memory_bytes = int(self._rows.numel() * 4)
        self._built = True

    def _blocks(self, m: int):
        step = self.params.exact_block_queries
        return ((s, min(m, s + step)) for s in range(0, m, step))

    def _topk_options(self) -> dict:
        """Extra keywords of `exact_topk` (the torch backend: its block size and compute dtype)."""
        return {}

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self._search(queries, k, None, None)

    def search_excluding(self, queries, k, exclude_indptr, exclude_indices) -> np.ndarray:
        return self._search(queries, k, exclude_indptr, exclude_indices)[1]

    def _search(self, queries, k, exclude_indptr, exclude_indices):
        import torch

        queries = self._check_queries(queries, k)
        m = queries.shape[0]
        scores, ids = self._empty_result(m, k)
        if self.n == 0 or m == 0:
            return scores, ids
        indptr = indices = None
        if exclude_indptr is not None:
            indptr, indices = _check_exclusions(m, exclude_indptr, exclude_indices)
        q, options = torch.from_numpy(queries), self._topk_options()
        for lo, hi in self._blocks(m):
            excluded = (None, None) if indptr is None else (indptr[lo:hi + 1] - indptr[lo], indices[indptr[lo]:indptr[hi]])
            s, i = exact_topk(q[lo:hi], self._rows, k, *excluded, **options)
            width = s.shape[1]
            scores[lo:hi, :width] = s.numpy()
            ids[lo:hi, :width] = i.numpy()
        return scores, ids
