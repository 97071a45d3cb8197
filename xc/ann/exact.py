"""Exact maximum-inner-product top-k: blocked matrix products, with per-query exclusions.

Used for the synchronous hard-negative miner, exact sharded inference, and as the recall reference
for ANN backends. Memory stays at one (chunk, n) score block regardless of the number of queries.

Where the device multiplies bfloat16 faster than float32 (`bf16_products_pay`: a CPU with AVX512-BF16 or AMX,
2.3x on a 2-core EPYC with AVX512-BF16; an AVX2-only CPU emulates bfloat16 and keeps float32), a block is scored
in bfloat16 first and only each query's best rows are scored again in float32 (`refine_topk`). The answer is the
float32 one, not an approximation of it: a bfloat16 product of q and w is within `bf16_error(d) |q| |w|` of the
float32 one, so a row the bfloat16 pass ranked below the shortlist cannot beat the shortlist's k-th float32 score
when that score clears the shortlist's last bfloat16 score by more than this bound. A query for which it does not
(1 in 100 at k 5 on a trained model, 1 in 20 at k 50) gets a shortlist eight times as long, then, if still
unsettled, every row in float32.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import numpy as np
import torch

# Score block budget in floats: chunk * n <= this (256 MiB of float32).
BLOCK_FLOATS = 1 << 26
# Rows per query scored again in float32: SHORTLIST_FACTOR * k + SHORTLIST_EXTRA. On a trained debian-deps model
# (11k test queries, 38k rows, d 1024) the bound settled 99.2% of queries at k 5, 97.5% at k 20, 95% at k 50.
SHORTLIST_FACTOR, SHORTLIST_EXTRA = 2, 16
RESCORE_MULTIPLY_ADDS = 1 << 18  # `shortlist_pays`
# gathered rows per re-scoring block (8 MiB of float32): larger blocks leave the heap (a fresh mapping, zeroed page
# by page) and the cache; 4.5k queries x 26 rows took 0.26 s in 64 MiB blocks, 0.15 s in 8 MiB ones
_RESCORE_FLOATS = 1 << 21
# bfloat16 score block: ~16 MiB, which stays in a CPU's last-level cache for the top-k (3x slower from memory)
BF16_BLOCK_FLOATS = 1 << 23


def bf16_error(dim: int) -> float:
    """The bound e with |bf16 product - float32 product| <= e |q| |w| for vectors of `dim` floats: both rounded to
    bfloat16 (relative 2^-8 each: 2 2^-8 on a product, which float32 holds exactly), summed in float32 (at most
    dim 2^-24 of sum |q_i w_i| <= |q| |w| for either sum), the result rounded to bfloat16 (2^-8 more); a quarter
    of 2^-8 on top for the second-order terms."""
    return 3.25 * 2.0 ** -8 + 2.0 * dim * 2.0 ** -24


@functools.lru_cache(maxsize=None)
def bf16_products_pay(device: str) -> bool:
    """Whether `device` ("cpu", "cuda:0") multiplies bfloat16 matrices at least 1.5x faster than float32, timed
    once per process on the rankings' layout (queries times transposed rows), a (64, 1024) x (1024, 256) product
    first and, only where bfloat16 keeps up on that, a (512, 1024) x (1024, 2048) one. CPUs without bfloat16
    instructions emulate them, and some products then run far slower than float32 (a (512, 1024) x (1024, 2048)
    product with untransposed rows: 5.8 s against 0.03 s on a 2-core AVX2 EPYC), so the small product settles
    them in milliseconds. CUDA keeps float32, whose cuBLAS may reduce bfloat16 products in bfloat16 (the bound
    above assumes float32 sums) and whose float32 products are rarely what an evaluation waits for."""
    if not device.startswith("cpu"):
        return False
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


def shortlist_width(k: int) -> int:
    """Rows per query the first shortlist re-scores in float32."""
    return SHORTLIST_FACTOR * k + SHORTLIST_EXTRA


def shortlist_pays(k: int, n: int, dim: int) -> bool:
    """Whether a top-k over n rows of `dim` floats saves more in its bfloat16 pass than its shortlist costs: a row
    re-scored in float32 (gathered: about 1.2 us at d 1,024 on the test machine) costs what bfloat16 saves on about
    2^17 multiply-adds there (float32 140, bfloat16 329 GFLOP/s), so the pass is taken where the n d multiply-adds
    per query reach RESCORE_MULTIPLY_ADDS (2^18, twice that) per shortlisted row. debian-deps' rankings (38k rows,
    d 1,024, shortlists of 26-116) take it; Bibtex's and Delicious' (159 and 983 labels), where the float32 product
    costs less than the re-scores, do not (Delicious' exact miner: 8.9 s against 0.8 s in float32)."""
    return shortlist_width(k) * RESCORE_MULTIPLY_ADDS <= n * dim


def refine_topk(approx: torch.Tensor, k: int, slack: torch.Tensor,
                rescore: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                full: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 top-k of a block from its bfloat16 scores.

    approx (c, n) bfloat16 scores (-inf: excluded rows); slack (c,) each query's bound on |approx - exact| over
    every row; rescore(queries (b,), ids (b, w)) -> those queries' exact scores of ids (b, w); full(queries (b,))
    -> their exact scores of every row (b, n), excluded rows -inf. The shortlist is SHORTLIST_FACTOR k +
    SHORTLIST_EXTRA rows, 8x that for the queries it cannot settle, every row for the few left.
    Returns (scores (c, k), ids (c, k)), -1 ids at -inf."""
    c, n = approx.shape
    top = torch.empty(c, k, dtype=torch.float32, device=approx.device)
    ids = torch.empty(c, k, dtype=torch.int64, device=approx.device)
    todo = torch.arange(c, device=approx.device)
    first = shortlist_width(k)
    for width in (first, 8 * first, n):
        if not len(todo):
            break
        if width >= n:  # every row
            top[todo], ids[todo] = torch.topk(full(todo), k, dim=1)
            break
        short_scores, short_ids = torch.topk(approx if len(todo) == c else approx[todo], width, dim=1)
        short_scores = short_scores.float()
        exact = torch.where(torch.isneginf(short_scores), float("-inf"), rescore(todo, short_ids))
        best, pick = torch.topk(exact, k, dim=1)
        top[todo], ids[todo] = best, torch.gather(short_ids, 1, pick)
        # a row left out scores at most its bfloat16 score + slack <= the shortlist's last + slack
        last = short_scores[:, -1]
        todo = todo[~((best[:, -1] > last + slack[todo]) | torch.isneginf(last))]
    return top, torch.where(torch.isneginf(top), -1, ids)


def gathered_products(queries: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(c, kk) float32 products of queries (c, d) with rows[ids] (ids (c, kk)), in blocks of bounded memory."""
    out = torch.empty(ids.shape, dtype=torch.float32, device=queries.device)
    step = max(1, _RESCORE_FLOATS // max(1, ids.shape[1] * rows.shape[1]))
    for a in range(0, len(ids), step):
        picked = rows[ids[a:a + step]].float()  # (b, kk, d)
        out[a:a + step] = torch.bmm(picked, queries[a:a + step, :, None].float()).squeeze(2)
    return out


def exact_topk(queries: torch.Tensor, rows: torch.Tensor, k: int,
               exclude_indptr: np.ndarray | None = None, exclude_indices: np.ndarray | None = None,
               block_floats: int = BLOCK_FLOATS, compute_dtype: torch.dtype = torch.float32,
               row_bias: torch.Tensor | None = None,
               bf16_first: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k rows by inner product for every query.

    queries (N, d) on any device; rows (n, d) of any float dtype, on the device that computes: the products
    run in `compute_dtype` (float32, or bfloat16 for the torch backend's bf16 rows), the top-k on float32
    scores, plus `row_bias` (n,) where given (a per-row term added to every query's score: the label prior,
    xc/eval/label_prior.py). Exclusions as CSR over queries:
    exclude_indices holds row ids (0 <= id < n; others ignored) that query i may not return (its positives).
    Returns (scores (N, k') float32, ids (N, k') int64) on the CPU, k' = min(k, n); where fewer than k'
    rows are allowed for a query, the tail has id -1 and score -inf. One score block holds at most
    `block_floats` scores. `bf16_first`: float32 products reached through a bfloat16 pass (module docstring; the same
    answer, up to the order of float32 sums) wherever the shortlist is shorter than the rows; None: where
    `bf16_products_pay` on the rows' device and `shortlist_pays`.
    """
    num_queries, n = queries.shape[0], rows.shape[0]
    k = min(k, n)
    out_scores = torch.empty(num_queries, k, dtype=torch.float32)
    out_ids = torch.empty(num_queries, k, dtype=torch.int64)
    if bf16_first is None:
        bf16_first = shortlist_pays(k, n, rows.shape[1]) and bf16_products_pay(str(rows.device))
    bias = None if row_bias is None else row_bias.to(rows.device, torch.float32)
    if (bf16_first and compute_dtype == torch.float32 and rows.dtype == torch.float32
            and shortlist_width(k) < n):  # a shortlist of every row has nothing to save
        refined = Bf16Scores(rows)
        block_floats = min(block_floats, BF16_BLOCK_FLOATS)
    else:
        refined, rows_t = None, rows.to(compute_dtype).t()
    chunk = max(1, min(num_queries, block_floats // max(1, n)))
    for start in range(0, num_queries, chunk):
        stop = min(num_queries, start + chunk)
        excluded = None
        if exclude_indptr is not None:
            lo_e, hi_e = int(exclude_indptr[start]), int(exclude_indptr[stop])
            cols = torch.from_numpy(np.asarray(exclude_indices[lo_e:hi_e], dtype=np.int64))
            counts = torch.from_numpy(np.diff(np.asarray(exclude_indptr[start:stop + 1], dtype=np.int64)))
            qrows = torch.repeat_interleave(torch.arange(stop - start), counts)
            inside = (cols >= 0) & (cols < n)
            excluded = (qrows[inside].to(rows.device), cols[inside].to(rows.device))
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


class Bf16Scores:
    """The bfloat16 pass over fixed rows (n, d) float32 and its float32 re-scores (module docstring): one block's
    products once (`products`), then the top-k under any per-row bias (`topk`; the label prior's betas share
    the block)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows
        self.rows_t = rows.to(torch.bfloat16).t()
        self.max_norm = float(rows.norm(dim=1).max()) if len(rows) else 0.0
        self.error = bf16_error(rows.shape[1])

    def products(self, q: torch.Tensor) -> torch.Tensor:
        """(c, n) bfloat16 products of queries q (c, d) float32 with every row."""
        return q.to(torch.bfloat16) @ self.rows_t

    def topk(self, q: torch.Tensor, products: torch.Tensor, k: int, bias: torch.Tensor | None = None,
             excluded=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores (c, k), ids (c, k)) of q's float32 scores plus `bias` (n,) float32, `excluded` (query, row) pairs
        left out, -1 ids at -inf. With a bias the sum is taken in bfloat16 too: its two roundings (the bias, the
        sum) add 2^-8 of |q| max|w| and 2^-7 of max|bias| to the bound."""
        slack = self.error * self.max_norm * q.norm(dim=1)
        approx = products
        if bias is not None:
            approx = products + bias.to(torch.bfloat16)
            unit = 2.0 ** -8
            slack = slack + 1.01 * unit * self.max_norm * q.norm(dim=1) + 2.01 * unit * float(bias.abs().max())
        if excluded is not None:
            approx = approx.clone() if approx is products else approx  # the caller's block may serve other biases
            approx[excluded] = float("-inf")
        return refine_topk(approx, k, slack, lambda which, ids: self._rescore(q[which], ids, bias),
                           lambda which: self._full(q, which, bias, excluded))

    def _rescore(self, q: torch.Tensor, ids: torch.Tensor, bias) -> torch.Tensor:
        exact = gathered_products(q, self.rows, ids)
        return exact + bias[ids] if bias is not None else exact

    def _full(self, q: torch.Tensor, which: torch.Tensor, bias, excluded) -> torch.Tensor:
        exact = q[which] @ self.rows.t()
        if bias is not None:
            exact += bias
        if excluded is not None:
            qrows, cols = excluded
            at = torch.full((len(q),), -1, dtype=torch.int64, device=q.device)
            at[which] = torch.arange(len(which), device=q.device)
            hit = at[qrows] >= 0
            exact[at[qrows[hit]], cols[hit]] = float("-inf")
        return exact
