"""Exact maximum-inner-product top-k: blocked matrix products, with per-query exclusions.

Used for the synchronous hard-negative miner, exact sharded inference, and as the recall reference
for ANN backends. Memory stays at one (chunk, n) score block regardless of the number of queries.

Where a shortlist pays (`xc.ann.shortlist.shortlist_pays`: debian-deps' rankings, not Bibtex's), a block is
scored in a first pass and each query's best rows are scored again canonically (xc/ann/shortlist.py): the answer
is the same whether the first pass ran in bfloat16 (where the device multiplies it faster: `bf16_products_pay`, a
CPU with AVX512-BF16 or AMX, 2.3x on a 2-core EPYC with AVX512-BF16) or in float32 (an AVX2-only CPU emulates
bfloat16), so a timing probe never decides what a ranking returns. Elsewhere the ranking is the plain float32
product.
"""

from __future__ import annotations

import functools
import os
import time

import numpy as np
import torch

from xc.ann.bf16_rows import topk_over_row_blocks
from xc.ann.row_blocks import excluded_pairs, row_blocks_pay, topk_in_row_blocks
from xc.ann.shortlist import ShortlistScores, shortlist_pays, shortlist_width

# Score block budget in floats: chunk * n <= this (256 MiB of float32).
BLOCK_FLOATS = 1 << 26
# bfloat16 score block: ~16 MiB, which stays in a CPU's last-level cache for the top-k (3x slower from memory)
BF16_BLOCK_FLOATS = 1 << 23
# "on" / "off" pins the speed probe's answer (an A/B of the two first passes, which return the same rankings)
_BF16_ENV = "XC_BF16_PRODUCTS"


def first_pass_dtype(device: str) -> torch.dtype:
    """The dtype of a shortlisted ranking's first pass on `device`: bfloat16 where `bf16_products_pay`."""
    return torch.bfloat16 if bf16_products_pay(device) else torch.float32


@functools.lru_cache(maxsize=None)
def bf16_products_pay(device: str) -> bool:
    """Whether `device` ("cpu", "cuda:0") multiplies bfloat16 matrices at least 1.5x faster than float32, timed
    once per process on the rankings' layout (queries times transposed rows), a (64, 1024) x (1024, 256) product
    first and, only where bfloat16 keeps up on that, a (512, 1024) x (1024, 2048) one; XC_BF16_PRODUCTS=on|off
    pins the answer. CPUs without bfloat16 instructions emulate them, and some products then run far slower than
    float32 (a (512, 1024) x (1024, 2048) product with untransposed rows: 5.8 s against 0.03 s on a 2-core AVX2
    EPYC), so the small product settles them in milliseconds. CUDA keeps float32, whose cuBLAS may reduce bfloat16
    products in bfloat16 (the bound of xc/ann/shortlist.py assumes float32 sums). The answer chooses only the
    speed of a ranking, never its result (xc/ann/shortlist.py)."""
    pinned = os.environ.get(_BF16_ENV, "auto")
    if pinned not in ("auto", "on", "off"):
        raise ValueError(f"{_BF16_ENV}={pinned!r}: expected on, off or auto")
    if not device.startswith("cpu"):
        return False
    if pinned != "auto":
        return pinned == "on"
    for queries, rows, repeats in ((64, 256, 5), (512, 2048, 3)):
        seconds = {dtype: _product_seconds(queries, rows, 1024, dtype, repeats)
                   for dtype in (torch.float32, torch.bfloat16)}
        if seconds[torch.bfloat16] * 1.5 > seconds[torch.float32]:
            return False
    return True


def _product_seconds(queries: int, rows: int, dim: int, dtype: torch.dtype, repeats: int) -> float:
    """Seconds of `repeats` (queries, dim) x (rows, dim)^T products in `dtype`, after one warm-up (kernel choice,
    first touch of the output). The operands come from a private generator: drawn from torch's global one, they
    would shift the training's random stream by whether (and when) a process first ranked something."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(queries, dim, generator=gen).to(dtype), torch.randn(rows, dim, generator=gen).to(dtype)
    x @ y.T
    start = time.perf_counter()
    for _ in range(repeats):
        x @ y.T
    return time.perf_counter() - start


def exact_topk(queries: torch.Tensor, rows: torch.Tensor, k: int,
               exclude_indptr: np.ndarray | None = None, exclude_indices: np.ndarray | None = None,
               block_floats: int = BLOCK_FLOATS, compute_dtype: torch.dtype = torch.float32,
               row_bias: torch.Tensor | None = None,
               bf16_first: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k rows by inner product for every query.

    queries (N, d) on any device; rows (n, d) of any float dtype, on the device that computes: the products
    run in `compute_dtype` (float32, or bfloat16 for the torch backend's bf16 rows), the top-k on float32
    scores, plus `row_bias` (n,) where given (a per-row term added to every query's score: the label prior,
    xc/fitting/label_prior.py). Exclusions as CSR over queries:
    exclude_indices holds row ids (0 <= id < n; others ignored) that query i may not return (its positives).
    Returns (scores (N, k') float32, ids (N, k') int64) on the CPU, k' = min(k, n); where fewer than k'
    rows are allowed for a query, the tail has id -1 and score -inf. One score block holds at most
    `block_floats` scores; where that holds fewer than a matrix product's worth of queries the rows are walked in
    blocks instead (xc/ann/row_blocks.py: the same answer). `bf16_first`: the canonical top-k (xc/ann/shortlist.py) through a first pass in
    bfloat16 (True) or float32 (False) wherever the shortlist is shorter than the rows, the same answer either way;
    None: where `shortlist_pays`, with the first pass `bf16_products_pay` chooses, else the plain float32 product.
    bfloat16 rows with a float32 `compute_dtype` (a bfloat16 snapshot's or model's rows) are never copied whole:
    where a shortlist pays they take the canonical top-k of their values through the row blocks, the first pass
    multiplying them as stored; elsewhere they are upcast a row block at a time (xc/ann/bf16_rows.py), the float32
    ranking of their values.
    """
    num_queries, n = queries.shape[0], rows.shape[0]
    k = min(k, n)
    first_pass = None
    if bf16_first is not None:
        first_pass = torch.bfloat16 if bf16_first else torch.float32
    elif shortlist_pays(k, n, rows.shape[1]):
        first_pass = first_pass_dtype(str(rows.device))
    bias = None if row_bias is None else row_bias.to(rows.device, torch.float32)
    exclude = None if exclude_indptr is None else (exclude_indptr, exclude_indices)
    if rows.dtype == torch.bfloat16 and compute_dtype == torch.float32:
        if num_queries == 0 or k == 0:
            return torch.empty(num_queries, k), torch.empty(num_queries, k, dtype=torch.int64)
        if first_pass is not None:
            # the canonical top-k through the rows as stored: a bfloat16 first pass multiplies them without an
            # upcast (1.5x faster over 10^6 rows of 256 on the 2-core EPYC), a float32 one upcasts a block at a time
            # (the small block bounds that copy); the same answer either way
            (scores, ids), = topk_in_row_blocks(queries, rows, k, [bias], min(block_floats, BF16_BLOCK_FLOATS),
                                                first_pass, exclude)
            return scores, ids
        return topk_over_row_blocks(queries, rows, k, functools.partial(_excluded_pairs, exclude_indptr,
                                                                        exclude_indices, n, rows.device),
                                    block_floats, bias)
    out_scores = torch.empty(num_queries, k, dtype=torch.float32)
    out_ids = torch.empty(num_queries, k, dtype=torch.int64)
    refine = (first_pass is not None and compute_dtype == torch.float32 and rows.dtype == torch.float32
              and shortlist_width(k) < n)  # a shortlist of every row has nothing to save
    if refine and first_pass == torch.bfloat16:
        block_floats = min(block_floats, BF16_BLOCK_FLOATS)
    if (compute_dtype == torch.float32 and rows.dtype == torch.float32 and k > 0
            and row_blocks_pay(num_queries, n, block_floats)):
        (scores, ids), = topk_in_row_blocks(queries, rows, k, [bias], block_floats,
                                            first_pass if refine else None, exclude)
        return scores, ids
    if refine:
        refined = ShortlistScores(rows, first_pass)
    else:
        refined, rows_t = None, rows.to(compute_dtype).t()
    chunk = max(1, min(num_queries, block_floats // max(1, n)))
    for start in range(0, num_queries, chunk):
        stop = min(num_queries, start + chunk)
        excluded = _excluded_pairs(exclude_indptr, exclude_indices, n, rows.device, start, stop)
        if refined is not None:
            q = queries[start:stop].to(rows.device, torch.float32)
            top_scores, top_ids = refined.topk(q, refined.products(q), k, bias, excluded)
        else:
            scores = (queries[start:stop].to(rows.device, compute_dtype) @ rows_t).float()  # (c, n)
            if bias is not None:
                scores += bias
            if excluded is not None:
                scores[excluded] = float("-inf")
            top_scores, top_ids = torch.topk(scores, k, dim=1)
            top_ids = torch.where(torch.isinf(top_scores) & (top_scores < 0), -1, top_ids)
        out_scores[start:stop] = top_scores.cpu()
        out_ids[start:stop] = top_ids.cpu()
    return out_scores, out_ids


def _excluded_pairs(exclude_indptr, exclude_indices, n: int, device, start: int, stop: int):
    """(chunk-local query positions, row ids) of the excluded pairs of queries [start, stop), rows outside
    [0, n) dropped; None without exclusions."""
    exclude = None if exclude_indptr is None else (exclude_indptr, exclude_indices)
    return excluded_pairs(exclude, start, stop, n, device)
