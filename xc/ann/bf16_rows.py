"""bfloat16 rows searched in float32 one block at a time: a shard's rows are never upcast whole.

Classifier rows trained in bfloat16 (model.classifier_dtype) reach the miner as bfloat16: a refresh snapshot
stores their 16-bit patterns (xc/handoff.py), and the exact and clustered searches score them here. Each row
block is converted to float32 just before its product, so the scores are float32 products of the rows' bfloat16
values, the same as a float32 search over the upcast rows, while the extra memory is one block
(`ROW_BLOCK` x d floats) instead of 4 n d bytes. Backends that must own float32 vectors (graph builds) take an
explicit `float32_copy`, which logs what it costs.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)

ROW_BLOCK = 1 << 16  # rows upcast at a time outside the score loop (finiteness, norms): 16 MiB at d 64
SCORE_FLOATS = 1 << 24  # scores per block: 64 MiB of float32
UPCAST_FLOATS = 1 << 22  # row elements upcast per block: 16 MiB of float32 (65,536 rows at d 64)
QUERY_CHUNK = 1024  # queries per pass over the row blocks: each row block is upcast once per chunk


def is_bf16(rows) -> bool:
    """Whether `rows` is a torch bfloat16 tensor (the form bfloat16 rows take in the search)."""
    return isinstance(rows, torch.Tensor) and rows.dtype == torch.bfloat16


def bf16_from_bits(bits: np.ndarray) -> torch.Tensor:
    """(n, d) bfloat16 tensor sharing memory with `bits` (n, d) uint16 (a snapshot's memmap): no copy."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise ValueError(f"bfloat16 bit patterns must be uint16, got {bits.dtype}")
    import warnings

    with warnings.catch_warnings():  # a snapshot's memmap is read-only; the search only reads it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def bits_of(rows: torch.Tensor) -> np.ndarray:
    """(n, d) uint16 bit patterns of bfloat16 `rows` (n, d) on the CPU, sharing their memory."""
    return rows.contiguous().view(torch.int16).numpy().view(np.uint16)


def check_finite(rows: torch.Tensor, name: str) -> None:
    """Refuse NaN or inf in bfloat16 `rows` (n, d), checked a block at a time."""
    for a in range(0, rows.shape[0], ROW_BLOCK):
        if not torch.isfinite(rows[a:a + ROW_BLOCK]).all():
            raise ValueError(f"{name}: vectors contain NaN or inf")


def row_norms(rows: torch.Tensor) -> torch.Tensor:
    """(n,) float32 Euclidean norms of `rows` (n, d), computed in float32 a block at a time."""
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
    for a in range(0, rows.shape[0], ROW_BLOCK):
        out[a:a + ROW_BLOCK] = rows[a:a + ROW_BLOCK].float().norm(dim=1)
    return out


def products(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(m, n) float32 q @ rows.T for float32 q (m, d) and bfloat16 rows (n, d), rows upcast `ROW_BLOCK` at a
    time (the caller bounds m n)."""
    n = rows.shape[0]
    out = torch.empty(q.shape[0], n, dtype=torch.float32, device=q.device)
    step = ROW_BLOCK
    for a in range(0, n, step):
        out[:, a:a + step] = q @ rows[a:a + step].float().T
    return out


def float32_copy(rows, why: str) -> np.ndarray:
    """(n, d) float32 copy of bfloat16 `rows` for a consumer that must own float32 vectors (`why` names it),
    logged with its size: 4 n d bytes on top of the 2 n d of the rows."""
    log.warning("%s needs float32 rows: converting %d x %d bfloat16 rows costs %.2f GB more memory", why,
                rows.shape[0], rows.shape[1], 4 * rows.shape[0] * rows.shape[1] / 1e9)
    return rows.float().numpy()


def topk_over_row_blocks(queries: torch.Tensor, rows: torch.Tensor, k: int, excluded_of, block_floats: int,
                         bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores (m, k) float32, ids (m, k) int64, -1 / -inf where fewer rows are allowed) of float32 queries
    (m, d) against bfloat16 rows (n, d), k <= n: per chunk of `QUERY_CHUNK` queries the rows are walked in
    blocks, each upcast once, scored in float32 and merged into a running top-k (a block: at most
    `block_floats` and `SCORE_FLOATS` scores, `UPCAST_FLOATS` row elements; the float32 held is a block's scores
    and rows, never the shard's). `excluded_of(start, stop)` gives a chunk's excluded (query, row) pairs
    (chunk-local, row ids) or None; `bias` (n,) float32 is added to every query's scores."""
    m, n = queries.shape[0], rows.shape[0]
    out_scores = torch.empty(m, k, dtype=torch.float32)
    out_ids = torch.empty(m, k, dtype=torch.int64)
    chunk = max(1, min(m, QUERY_CHUNK))
    step = max(k, min(min(block_floats, SCORE_FLOATS) // chunk, UPCAST_FLOATS // max(1, rows.shape[1])))
    for start in range(0, m, chunk):
        stop = min(m, start + chunk)
        q = queries[start:stop].to(rows.device, torch.float32)
        excluded = excluded_of(start, stop)
        best_s = torch.full((stop - start, 0), float("-inf"), device=rows.device)
        best_i = torch.zeros((stop - start, 0), dtype=torch.int64, device=rows.device)
        for a in range(0, n, step):
            b = min(n, a + step)
            scores = q @ rows[a:b].float().T  # (c, b - a)
            if bias is not None:
                scores += bias[a:b]
            if excluded is not None:
                inside = (excluded[1] >= a) & (excluded[1] < b)
                scores[excluded[0][inside], excluded[1][inside] - a] = float("-inf")
            top_s, top_i = torch.topk(scores, min(k, b - a), dim=1)
            merged_s, pick = torch.topk(torch.cat([best_s, top_s], dim=1), min(k, best_s.shape[1] + b - a), dim=1)
            best_i = torch.gather(torch.cat([best_i, top_i + a], dim=1), 1, pick)
            best_s = merged_s
            del scores, top_s, top_i  # before the next block's are made: one score block at a time
        best_i = torch.where(torch.isinf(best_s) & (best_s < 0), -1, best_i)
        out_scores[start:stop] = best_s.cpu()
        out_ids[start:stop] = best_i.cpu()
    return out_scores, out_ids
