"""The canonical top-k of a ranking, reached through a cheap first pass and a re-scored shortlist.

Every exact ranking large enough for a shortlist to pay (`shortlist_pays`) returns the same answer whichever way
its first pass ran, so that a speed probe (`xc.ann.exact.bf16_products_pay`: does this CPU multiply bfloat16
faster?) chooses how a ranking is computed, never what it returns. The answer is defined once here:

- a row's **canonical score** for a query is its product summed in float64 from the float32 inputs (each product of
  two float32 numbers is exact in float64) and rounded once to float32 (`canonical_products`), plus the row's bias
  in float32. Up to the float64 sum's order (an error of d 2^-53 of the score's scale: a one-in-a-million chance of
  one ulp at d 1,024), it is the float32 rounding of the exact product, on any CPU or GPU;
- the **top k** are the k highest canonical scores, a tie going to the lower row id.

The first pass scores every row in bfloat16 or float32 (`ShortlistScores`), each with a bound on its distance to
the canonical score (`bf16_error`, `f32_error`); a shortlist of the best SHORTLIST_FACTOR k + SHORTLIST_EXTRA
rows is re-scored canonically, and a row left out cannot beat the shortlist's k-th when that clears the
shortlist's last first-pass score by more than the bound (`refine_topk`). A query the shortlist cannot settle gets
one eight times as long, then the rows within reach: those whose first-pass score plus the bound reaches the k-th
canonical score found so far (the top k are among them); only where those are more than an eighth of the rows does
it score every row, at about 0.1 s a query at 10^6 rows of 128. A bfloat16 first pass hands the queries its first
shortlist leaves to a float32 pass instead (`ShortlistScores`).
"""

from __future__ import annotations

from typing import Callable

import torch

from xc.ann.bf16_rows import products as bf16_products
from xc.ann.bf16_rows import row_norms

# Rows per query scored again canonically: SHORTLIST_FACTOR * k + SHORTLIST_EXTRA. On a trained debian-deps model
# (11k test queries, 38k rows, d 1024) the bfloat16 bound settled 99.2% of queries at k 5, 97.5% at k 20, 95% at k 50.
SHORTLIST_FACTOR, SHORTLIST_EXTRA = 2, 16
RESCORE_MULTIPLY_ADDS = 1 << 18  # `shortlist_pays`
REACH_SHARE = 8  # a query whose rows within reach exceed 1/REACH_SHARE of the rows is scored on every row
# gathered float64 products per re-scoring block (8 MiB): larger blocks leave the heap (a fresh mapping, zeroed
# page by page) and the cache
_RESCORE_DOUBLES = 1 << 20
_UNIT32 = 2.0 ** -24


def bf16_error(dim: int) -> float:
    """The bound e with |bf16 product - float32 product| <= e |q| |w| for vectors of `dim` floats: both rounded to
    bfloat16 (relative 2^-8 each: 2 2^-8 on a product, which float32 holds exactly), summed in float32 (at most
    dim 2^-24 of sum |q_i w_i| <= |q| |w| for either sum), the result rounded to bfloat16 (2^-8 more); a quarter
    of 2^-8 on top for the second-order terms. It bounds the distance to the canonical score too, which is within
    2^-24 of the exact product."""
    return 3.25 * 2.0 ** -8 + 2.0 * dim * _UNIT32


def f32_error(dim: int) -> float:
    """The bound e with |float32 product - canonical score| <= e |q| |w|: a float32 sum of `dim` products in any
    order is within (dim + 1) 2^-24 sum |q_i w_i| of the exact one (Higham, Accuracy and Stability of Numerical
    Algorithms, 3.1), the canonical score within 2^-24; 1% on top for the second-order terms."""
    return 1.01 * (dim + 2) * _UNIT32


def first_pass_slack(dtype: torch.dtype, dim: int, max_norm: float, q_norms: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """(c,) each query's bound on |first-pass score - canonical score| over every row: the product's (`bf16_error`
    or `f32_error` of |q| max|w|) and, with a per-row `bias` added in the pass's dtype, its two roundings (the
    bias, the sum: a unit of that dtype of |q| max|w| and two of max|bias|; the canonical sum's own rounding,
    2^-24 of both, within them)."""
    bf16 = dtype == torch.bfloat16
    slack = (bf16_error(dim) if bf16 else f32_error(dim)) * max_norm * q_norms
    if bias is not None:
        unit = 2.0 ** -8 if bf16 else 2.0 * _UNIT32
        # rows masked by a -inf bias score -inf in both passes and never rank: their bias bounds no rounding (counted
        # in, the slack was infinite and no query settled: the label prior's pass over the rows without a positive)
        finite = bias[torch.isfinite(bias)]
        largest = float(finite.abs().max()) if len(finite) else 0.0
        slack = slack + 1.01 * unit * max_norm * q_norms + 2.01 * unit * largest
    return slack


def shortlist_width(k: int) -> int:
    """Rows per query the first shortlist re-scores canonically."""
    return SHORTLIST_FACTOR * k + SHORTLIST_EXTRA


def shortlist_pays(k: int, n: int, dim: int) -> bool:
    """Whether a top-k over n rows of `dim` floats saves more in a bfloat16 pass than its shortlist costs: a row
    re-scored (gathered: about 1.2 us at d 1,024 on the test machine) costs what bfloat16 saves on about 2^17
    multiply-adds there (float32 140, bfloat16 329 GFLOP/s), so the pass is taken where the n d multiply-adds per
    query reach RESCORE_MULTIPLY_ADDS (2^18, twice that) per shortlisted row. debian-deps' rankings (38k rows,
    d 1,024, shortlists of 26-116) take it; Bibtex's and Delicious' (159 and 983 labels), where the float32 product
    costs less than the re-scores, do not (Delicious' exact miner: 8.9 s against 0.8 s in float32). Where it does
    not pay the ranking is the plain float32 one, on every machine."""
    return shortlist_width(k) * RESCORE_MULTIPLY_ADDS <= n * dim


def canonical_products(queries: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(c, w) canonical scores (module docstring) of queries (c, d) with rows[ids], ids (c, w) int64 in [0, n).
    The elementwise products and their sum over d run in float64, each pair on its own, so a score does not
    depend on which other rows or queries share its block."""
    out = torch.empty(ids.shape, dtype=torch.float32, device=queries.device)
    step = max(1, _RESCORE_DOUBLES // max(1, ids.shape[1] * rows.shape[1]))
    for a in range(0, len(ids), step):
        picked = rows[ids[a:a + step]].double()  # (b, w, d)
        picked.mul_(queries[a:a + step, None, :].double())  # in place: a third less time than a fresh product
        out[a:a + step] = picked.sum(dim=2).float()
    return out


def canonical_all(queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(c, n) canonical scores of queries (c, d) with every row (n, d), in blocks of bounded memory."""
    n = rows.shape[0]
    out = torch.empty(len(queries), n, dtype=torch.float32, device=queries.device)
    step = max(1, _RESCORE_DOUBLES // max(1, rows.shape[1]))
    for a in range(0, n, step):
        ids = torch.arange(a, min(n, a + step), device=queries.device).expand(len(queries), -1)
        out[:, a:a + step] = canonical_products(queries, rows, ids)
    return out


def best_k(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores (c, k), ids (c, k)): each row's k highest scores of (c, w), a tie going to the lower id."""
    by_id = torch.argsort(ids, dim=1)
    scores, ids = torch.gather(scores, 1, by_id), torch.gather(ids, 1, by_id)
    pick = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.gather(scores, 1, pick), torch.gather(ids, 1, pick)


def refine_topk(approx: torch.Tensor, k: int, slack: torch.Tensor,
                rescore: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                full: Callable[[torch.Tensor], torch.Tensor],
                finish: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical top-k of a block from its first-pass scores.

    approx (c, n) first-pass scores (-inf: excluded rows); slack (c,) each query's bound on |approx - canonical|
    over every row; rescore(queries (b,), ids (b, w)) -> those queries' canonical scores of ids (b, w); full(queries
    (b,)) -> their canonical scores of every row (b, n), excluded rows -inf. The shortlist is SHORTLIST_FACTOR k +
    SHORTLIST_EXTRA rows, 8x that for the queries it cannot settle, then the rows within reach of the k-th, every
    row where those are too many; with `finish(queries (b,)) -> (scores (b, k), ids (b, k))` the queries the first
    shortlist leaves go to it instead.
    Returns (scores (c, k), ids (c, k)), -1 ids at -inf."""
    c, n = approx.shape
    top = torch.empty(c, k, dtype=torch.float32, device=approx.device)
    ids = torch.empty(c, k, dtype=torch.int64, device=approx.device)
    todo = torch.arange(c, device=approx.device)
    first = shortlist_width(k)
    for width in (first,) if finish is not None else (first, 8 * first):
        if not len(todo) or width >= n:
            break
        short_scores, short_ids = torch.topk(approx if len(todo) == c else approx[todo], width, dim=1)
        short_scores = short_scores.float()
        exact = torch.where(torch.isneginf(short_scores), float("-inf"), rescore(todo, short_ids))
        best, best_ids = best_k(exact, short_ids, k)
        top[todo], ids[todo] = best, best_ids
        # a row left out scores at most its first-pass score + slack <= the shortlist's last + slack
        last = short_scores[:, -1]
        todo = todo[~((best[:, -1] > last + slack[todo]) | torch.isneginf(last))]
    if len(todo) and finish is not None:
        top[todo], ids[todo] = finish(todo)
        todo = todo[:0]
    if len(todo) and 8 * first < n:
        todo = _within_reach(approx, top, ids, todo, slack, rescore, n // REACH_SHARE)
    if len(todo):
        every = torch.arange(n, device=approx.device).expand(len(todo), -1)
        top[todo], ids[todo] = best_k(full(todo), every, k)
    return top, torch.where(torch.isneginf(top), -1, ids)


def _within_reach(approx, top, ids, todo, slack, rescore, most: int) -> torch.Tensor:
    """Settle the queries `todo` on the rows that could still beat their k-th canonical score so far (top[:, -1]):
    a row's canonical score is at most its first-pass score plus the bound, so the rows below that are out; the
    rows in reach hold the whole top-k (its rows score at least that k-th). Writes top/ids of the queries settled;
    returns those left: more than `most` rows in reach, or no k-th yet (fewer than k allowed rows seen)."""
    kth = top[todo, -1]
    reach = approx[todo].float() >= (kth - slack[todo])[:, None]
    counts = reach.sum(dim=1)
    ok = (counts <= most) & torch.isfinite(kth)
    if not bool(ok.any()):
        return todo
    settle = todo[ok]
    masked = torch.where(reach[ok], approx[settle].float(), float("-inf"))
    width = int(counts[ok].max())
    cand_scores, cand_ids = torch.topk(masked, width, dim=1)
    exact = torch.where(torch.isneginf(cand_scores), float("-inf"), rescore(settle, cand_ids))
    top[settle], ids[settle] = best_k(exact, cand_ids, top.shape[1])
    return todo[~ok]


class ShortlistScores:
    """The first pass over fixed rows (n, d) float32 in `dtype` (bfloat16 or float32) and its canonical re-scores:
    one block's products once (`products`), then the top-k under any per-row bias (`topk`; the label prior's betas
    share the block).

    bfloat16's bound (about 1% of |q| max|w|) settles a query where few rows score near its k-th: 99% of debian-deps'
    at k 5. Where many do it settles none (10^6 trained rows of 128, k 16: 0 of 64, hub rows setting max|w|); the
    queries the first shortlist leaves get a float32 pass of their own, whose bound (d 2^-24) settles them, and
    once more than half of the queries seen needed it, the next blocks' products run in float32 from the start."""

    def __init__(self, rows: torch.Tensor, dtype: torch.dtype):
        self.rows, self.dtype = rows, dtype
        self.rows_t = self._transposed(dtype)
        self.max_norm = float(row_norms(rows).max()) if len(rows) else 0.0
        self.seen = self.unsettled = 0  # queries through a bfloat16 pass, and those it left to a float32 one

    def _transposed(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The rows transposed in `dtype`; None for bfloat16 rows in a float32 pass, which are upcast a block at a time
        (xc/ann/bf16_rows.py) instead of copied whole (10^7 rows of 256: 10 GB)."""
        if self.rows.dtype == torch.bfloat16 and dtype == torch.float32:
            return None
        return self.rows.to(dtype).t()

    def products(self, q: torch.Tensor) -> torch.Tensor:
        """(c, n) first-pass products of queries q (c, d) float32 with every row."""
        if self.dtype == torch.bfloat16 and self.seen >= 64 and 2 * self.unsettled > self.seen:
            self.dtype, self.rows_t = torch.float32, self._transposed(torch.float32)  # the bfloat16 copy is dropped
        return self._float32_products(q) if self.rows_t is None else q.to(self.dtype) @ self.rows_t

    def _float32_products(self, q: torch.Tensor) -> torch.Tensor:
        """(c, n) float32 products of q (c, d) with every row, whatever the rows' dtype."""
        if self.rows.dtype == torch.bfloat16:
            return bf16_products(q.float(), self.rows)
        return q.float() @ self.rows.t()

    def topk(self, q: torch.Tensor, products: torch.Tensor, k: int, bias: torch.Tensor | None = None,
             excluded=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores (c, k), ids (c, k)) of q's canonical scores plus `bias` (n,) float32, `excluded` (query, row)
        pairs left out (index tensors, as `approx[excluded]`), -1 ids at -inf; `products` as `products(q)` gave
        them, in either dtype. With a bias the sum is taken in the pass's dtype too: its two roundings (the bias,
        the sum) add a unit of that dtype of |q| max|w| and two of max|bias| to the bound (the canonical sum's own
        rounding, 2^-24 of both, within them)."""
        if products.dtype != torch.bfloat16:
            return self._refine(q, products, k, bias, excluded)
        left = []

        def in_float32(which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            left.append(len(which))
            sub = q[which]
            return self._refine(sub, self._float32_products(sub), k, bias, _subset_pairs(excluded, which, len(q)))

        top, ids = self._refine(q, products, k, bias, excluded, in_float32)
        self.seen, self.unsettled = self.seen + len(q), self.unsettled + sum(left)
        return top, ids

    def _refine(self, q, products, k, bias, excluded, finish=None) -> tuple[torch.Tensor, torch.Tensor]:
        slack = first_pass_slack(products.dtype, self.rows.shape[1], self.max_norm, q.norm(dim=1), bias)
        approx = products if bias is None else products + bias.to(products.dtype)

        if excluded is not None:
            approx = approx.clone() if approx is products else approx  # the caller's block may serve other biases
            approx[excluded] = float("-inf")
        return refine_topk(approx, k, slack, lambda which, ids: self._rescore(q[which], ids, bias),
                           lambda which: self._full(q, which, bias, excluded), finish)

    def _rescore(self, q: torch.Tensor, ids: torch.Tensor, bias) -> torch.Tensor:
        exact = canonical_products(q, self.rows, ids)
        return exact + bias[ids] if bias is not None else exact

    def _full(self, q: torch.Tensor, which: torch.Tensor, bias, excluded) -> torch.Tensor:
        exact = canonical_all(q[which], self.rows)
        if bias is not None:
            exact += bias
        if excluded is not None:
            qrows, cols = _subset_pairs(excluded, which, len(q))
            exact[qrows, cols] = float("-inf")
        return exact


def _subset_pairs(excluded, which: torch.Tensor, num_queries: int):
    """The excluded (query, row) pairs of queries `which` (b,) of num_queries, queries renumbered 0..b-1."""
    if excluded is None:
        return None
    qrows, cols = excluded
    at = torch.full((num_queries,), -1, dtype=torch.int64, device=which.device)
    at[which] = torch.arange(len(which), device=which.device)
    hit = at[qrows] >= 0
    return at[qrows[hit]], cols[hit]
