"""A shard's memmapped label-embedding cache and its refresh policies (TargetCacheSources).

The cache of shard s is one (n, d) float32 memmap, n = the shard's real labels, at
`<run_dir>/label_cache/shard{s}.f32`. Three policies decide when rows are re-encoded by the label
tower g (every encoded label is counted in `encodings`):

- `lf_stale`      encode every row once, before the first step; never again;
- `lf_exhaustive` re-encode every row every w = cache_refresh_every steps (step 0 included);
- `lf_partial`    encode every row at step 0, then every w steps re-encode the ceil(frac * n) OLDEST rows
                  (a cyclic cursor, so rows are refreshed in order of age and every row is covered in
                  ceil(1 / frac) refreshes).

Mining is exact top-k of <f(x), cache_row> over the shard by chunked matmul: O(n d) per query, i.e.
O(L / G) per query and rank. It is the brute-force baseline the tree/ANN sources are measured against.
"""

from __future__ import annotations

import math
import os
from abc import abstractmethod

import numpy as np
import torch

from xc.sampling.cache_registry import CacheSpec, register_cache_source
from xc.sampling.target_cache import EncodeFn, TargetCacheSource

ENCODE_BLOCK = 2048  # labels per encode() call while (re)building


class LabelCache:
    """The (n, d) float32 memmap of one shard plus the step at which each row was last encoded."""

    def __init__(self, path: str, num_rows: int, dim: int):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path, self.num_rows, self.dim = path, num_rows, dim
        self.rows = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(num_rows, dim))
        self.encoded_at = np.full(num_rows, -1, dtype=np.int64)  # -1: never encoded
        self.generation = 0  # refreshes written so far

    def write(self, ids: np.ndarray, emb: torch.Tensor, step: int) -> None:
        self.rows[ids] = emb.detach().float().cpu().numpy()
        self.encoded_at[ids] = step

    def encode_into(self, ids: np.ndarray, encode: EncodeFn, step: int) -> int:
        """Encode rows `ids` (in blocks) into the cache; returns how many were encoded."""
        for start in range(0, len(ids), ENCODE_BLOCK):
            block = ids[start:start + ENCODE_BLOCK]
            self.write(block, encode(block), step)
        self.rows.flush()
        self.generation += 1
        return len(ids)

    def tensor(self) -> torch.Tensor:
        """(n, d) float32 view of the memmap (no copy)."""
        return torch.from_numpy(np.asarray(self.rows))

    def state_dict(self) -> dict:
        # The rows go into the checkpoint (the same O(L d) a classifier shard's rows cost), so a resume
        # mines from exactly the cache the interrupted run had, whatever happened to the memmap since.
        return {"rows": torch.from_numpy(np.array(self.rows)), "encoded_at": torch.from_numpy(self.encoded_at.copy()),
                "generation": self.generation}

    def load_state_dict(self, state: dict) -> None:
        self.rows[:] = state["rows"].numpy()
        self.rows.flush()
        self.encoded_at[:] = state["encoded_at"].numpy()
        self.generation = int(state["generation"])


def block_max_topk(scores: torch.Tensor, k: int, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(scores (B, n), min(k, n), dim=1), exactly, at a fraction of its cost for n >> k.

    The k largest entries of a row lie in the k blocks of `block` columns with the largest maxima: a block
    holding one of them has its maximum at or above the k-th largest value, and at most k blocks can. So
    one pass takes block maxima (a cheap reduction), and topk runs over (B, n / block) maxima, then over the
    k * block entries of the chosen blocks. torch.topk over all n columns was a quarter of the corrector's
    training step. Returns (values, column ids), both (B, min(k, n)), values descending."""
    batch, n = scores.shape
    k = min(k, n)
    full = n - n % block
    if full < k * block * 2:  # too few blocks for the pruning to pay
        return torch.topk(scores, k, dim=1)
    maxima = scores[:, :full].unflatten(1, (full // block, block)).amax(2)  # (B, n_blocks)
    if full < n:  # the ragged tail is one more block
        maxima = torch.cat([maxima, scores[:, full:].amax(1, keepdim=True)], 1)
    top_blocks = torch.topk(maxima, k, dim=1).indices  # (B, k)
    cols = (top_blocks * block).unsqueeze(2) + torch.arange(block, device=scores.device)  # (B, k, block)
    cols = cols.clamp_(max=n - 1).reshape(batch, k * block)  # the tail block repeats its last column ...
    vals = scores.gather(1, cols)
    if full < n:  # ... so mask those repeats, or one column could be picked twice
        repeats = torch.zeros((batch, 1), dtype=torch.bool, device=scores.device)
        vals = vals.masked_fill(torch.cat([cols[:, 1:] == cols[:, :-1], repeats], 1),
                                float("-inf"))
    best, pos = torch.topk(vals, k, dim=1)
    return best, cols.gather(1, pos)


def chunked_topk(query: torch.Tensor, table: torch.Tensor, k: int, chunk: int,
                 transform=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of query (B, d) @ transform(table[block]).T over the table (n, d) in row blocks.

    transform (optional) maps a block (c, d) to (c, d) (the corrector's h); returns (scores (B, k),
    ids (B, k) int64) on the table's device, k clipped to n. Memory O(B (chunk + k))."""
    k = min(k, table.shape[0])
    best_s = torch.full((query.shape[0], 0), float("-inf"), device=table.device)
    best_i = torch.zeros((query.shape[0], 0), dtype=torch.int64, device=table.device)
    for start in range(0, table.shape[0], chunk):
        block = table[start:start + chunk]
        if transform is not None:
            block = transform(block)
        s, i = block_max_topk(query @ block.t(), k)
        best_s, pick = torch.topk(torch.cat([best_s, s], 1), min(k, best_s.shape[1] + s.shape[1]), dim=1)
        best_i = torch.gather(torch.cat([best_i, i + start], 1), 1, pick)
    return best_s, best_i


class CacheSource(TargetCacheSource):
    """Exact mining over a LabelCache; subclasses decide which rows `refresh` re-encodes."""

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        self.num_rows = spec.num_rows
        self.cache = LabelCache(spec.cache_path, spec.num_rows, spec.dim)
        self.encodings = 0
        self.device = torch.device(spec.device)
        self._resident: torch.Tensor | None = None  # the cache's copy on a GPU, remade after each refresh

    def cache_rows(self) -> torch.Tensor:
        """The (n, d) cache on the source's device: the memmap itself on a CPU, a copy on a GPU, where mining a
        batch against it (B x n x d) takes a fraction of a millisecond instead of tens on the rank's host threads."""
        if self.device.type == "cpu":
            return self.cache.tensor()
        if self._resident is None:
            self._resident = self.cache.tensor().to(self.device)
        return self._resident

    @abstractmethod
    def due(self, step: int) -> np.ndarray:
        """Local ids to re-encode before mining at `step` (empty = nothing due): the refresh policy."""

    def refresh(self, step: int, encode: EncodeFn) -> int:
        ids = self.due(step)
        if not len(ids):
            return 0
        done = self.cache.encode_into(ids, encode, step)
        self.encodings += done
        self._resident = None
        return done

    @torch.no_grad()
    def mine(self, query_emb: torch.Tensor, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        if k == 0:
            return torch.zeros((query_emb.shape[0], 0), dtype=torch.int64), None
        _, ids = chunked_topk(query_emb.float().to(self.device), self.cache_rows(), k, self.spec.cfg.cache_mine_chunk)
        return ids.cpu(), None

    def memory_bytes(self) -> dict[str, int]:
        return {"cache": self.cache.rows.nbytes}

    def state_dict(self) -> dict:
        return {"encodings": self.encodings, "cache": self.cache.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.cache.load_state_dict(state["cache"])
        self._resident = None


class StaleCache(CacheSource):
    """Encode once before training, never again."""

    def due(self, step: int) -> np.ndarray:
        return np.arange(self.num_rows) if self.cache.generation == 0 else np.empty(0, dtype=np.int64)


class ExhaustiveCache(CacheSource):
    """Re-encode every row every w steps (and at step 0)."""

    def due(self, step: int) -> np.ndarray:
        stale = self.cache.generation == 0 or step % self.spec.cfg.cache_refresh_every == 0
        fresh_now = self.cache.generation > 0 and self.cache.encoded_at[0] == step  # already done this step
        return np.arange(self.num_rows) if stale and not fresh_now else np.empty(0, dtype=np.int64)


class PartialCache(CacheSource):
    """Full build at the start, then every w steps the ceil(frac * n) oldest rows (cyclic cursor)."""

    def __init__(self, spec: CacheSpec):
        super().__init__(spec)
        self.chunk = max(1, math.ceil(spec.cfg.cache_partial_fraction * spec.num_rows))
        self.cursor = 0
        self.last_step = -1

    def due(self, step: int) -> np.ndarray:
        if self.cache.generation == 0:
            self.last_step = step
            return np.arange(self.num_rows)
        if step % self.spec.cfg.cache_refresh_every or step == self.last_step:
            return np.empty(0, dtype=np.int64)
        ids = (self.cursor + np.arange(min(self.chunk, self.num_rows))) % self.num_rows
        self.cursor = int((self.cursor + len(ids)) % self.num_rows)
        self.last_step = step
        return ids

    def state_dict(self) -> dict:
        return {**super().state_dict(), "cursor": self.cursor, "last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.cursor, self.last_step = int(state["cursor"]), int(state["last_step"])


register_cache_source("lf_stale", StaleCache)
register_cache_source("lf_exhaustive", ExhaustiveCache)
register_cache_source("lf_partial", PartialCache)
