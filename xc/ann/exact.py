"""Exact maximum-inner-product top-k: blocked matrix products, with per-query exclusions.

Used for the synchronous hard-negative miner, exact sharded inference, and as the recall reference
for ANN backends. Memory stays at one (chunk, n) score block regardless of the number of queries.
"""

from __future__ import annotations

import numpy as np
import torch

# Score block budget in floats: chunk * n <= this (256 MiB of float32).
_BLOCK_FLOATS = 1 << 26


def exact_topk(queries: torch.Tensor, rows: torch.Tensor, k: int,
               exclude_indptr: np.ndarray | None = None, exclude_indices: np.ndarray | None = None,
               block_floats: int = _BLOCK_FLOATS, compute_dtype: torch.dtype = torch.float32,
               row_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k rows by inner product for every query.

    queries (N, d) on any device; rows (n, d) of any float dtype, on the device that computes: the products
    run in `compute_dtype` (float32, or bfloat16 for the torch backend's bf16 rows), the top-k on float32
    scores, plus `row_bias` (n,) where given (a per-row term added to every query's score: the label prior,
    xc/eval/label_prior.py). Exclusions as CSR over queries:
    exclude_indices holds row ids (0 <= id < n; others ignored) that query i may not return (its positives).
    Returns (scores (N, k') float32, ids (N, k') int64) on the CPU, k' = min(k, n); where fewer than k'
    rows are allowed for a query, the tail has id -1 and score -inf. One score block holds at most
    `block_floats` scores.
    """
    num_queries, n = queries.shape[0], rows.shape[0]
    k = min(k, n)
    out_scores = torch.empty(num_queries, k, dtype=torch.float32)
    out_ids = torch.empty(num_queries, k, dtype=torch.int64)
    chunk = max(1, min(num_queries, block_floats // max(1, n)))
    rows_t = rows.to(compute_dtype).t()
    bias = None if row_bias is None else row_bias.to(rows.device, torch.float32)
    for start in range(0, num_queries, chunk):
        stop = min(num_queries, start + chunk)
        scores = (queries[start:stop].to(rows.device, compute_dtype) @ rows_t).float()  # (c, n)
        if bias is not None:
            scores += bias
        if exclude_indptr is not None:
            lo_e, hi_e = int(exclude_indptr[start]), int(exclude_indptr[stop])
            cols = torch.from_numpy(np.asarray(exclude_indices[lo_e:hi_e], dtype=np.int64))
            counts = torch.from_numpy(np.diff(np.asarray(exclude_indptr[start:stop + 1], dtype=np.int64)))
            qrows = torch.repeat_interleave(torch.arange(stop - start), counts)
            inside = (cols >= 0) & (cols < n)
            scores[qrows[inside].to(scores.device), cols[inside].to(scores.device)] = float("-inf")
        top_scores, top_ids = torch.topk(scores, k, dim=1)
        top_ids = torch.where(torch.isinf(top_scores) & (top_scores < 0), -1, top_ids)
        out_scores[start:stop] = top_scores.cpu()
        out_ids[start:stop] = top_ids.cpu()
    return out_scores, out_ids
