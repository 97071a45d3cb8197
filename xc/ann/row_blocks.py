"""Exact rankings over more rows than a score block holds for a matrix product's worth of queries.

A ranking block holds `block_floats` scores, so over n rows it takes block_floats // n queries at a time: at 10^7
rows of 64 and a bfloat16 block of 2^23 scores, one. Each product is then a matrix-vector one that reads every row
for a single query (1.3 GB at 10^7 x 64 in bfloat16), and 5,000 test queries took about half an hour on 2 cores.
Here the rows are walked in blocks instead, each scored for MIN_QUERY_CHUNK queries at once (a matrix product
that reads a block once per chunk), and each query keeps a running top list merged block by block.

The answer is the one-block answer:
- without a first pass (`first_pass=None`) the ranking is the plain float32 product, a row kept where it is among
  the k best of its block and of the running list (ties as `torch.topk` leaves them);
- with one (bfloat16 or float32, xc/ann/shortlist.py) the running list is each query's first-pass shortlist over
  all rows; it is re-scored canonically once at the end and settled by the same bound as `refine_topk` (a row
  left out scores at most the shortlist's last first-pass score plus the bound). A bfloat16 pass hands the
  queries it cannot settle to a float32 pass of their own, and later chunks start in float32 once more than half
  of the queries seen needed it; what a float32 pass cannot settle goes to the one-block search, whose rows within
  reach and, last, every row settle it.
"""

from __future__ import annotations

import numpy as np
import torch

from xc.ann.bf16_rows import row_norms
from xc.ann.long_rows import long_row_split, rank_long_first, subset_csr
from xc.ann.shortlist import ShortlistScores, best_k, canonical_products, first_pass_slack, shortlist_width

# Queries per pass over the row blocks. 256 x 64 products make a block's product compute-bound on a CPU's
# matrix units; a block then holds block_floats // 256 rows (32,768 in bfloat16's 2^23).
MIN_QUERY_CHUNK = 256
# A block's top list is found among the groups of GROUP adjacent rows with the highest maxima (`block_topk`):
# 6x faster than torch.topk over 256 x 262,144 float32 scores on one core (0.034 against 0.20 s).
GROUP = 128

Pairs = tuple[torch.Tensor, torch.Tensor]


def row_blocks_pay(num_queries: int, n: int, block_floats: int) -> bool:
    """Whether a ranking of num_queries over n rows walks the rows in blocks: a one-block pass would hold fewer
    than MIN_QUERY_CHUNK queries (and fewer than there are)."""
    per_block = block_floats // max(1, n)
    return per_block < MIN_QUERY_CHUNK and per_block < num_queries


def topk_in_row_blocks(queries: torch.Tensor, rows: torch.Tensor, k: int, biases: list[torch.Tensor | None],
                       block_floats: int, first_pass: torch.dtype | None = None,
                       exclude: tuple[np.ndarray, np.ndarray] | None = None, split_long: bool = True,
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(scores (N, k') float32, ids (N, k') int64) on the CPU] for each of `biases` ((n,) float32 added to every
    query's scores, or None): the top k' = min(k, n) rows (n, d) float32 of queries (N, d), -1 ids at -inf.
    `exclude`: CSR (indptr (N + 1,), indices) of the row ids each query may not return. One block of scores holds
    at most `block_floats` scores; `first_pass` as above (module docstring). `split_long`: where the rows' norms
    fall apart into long and short ones, the long rows ranked first (xc/ann/long_rows.py: the same answer)."""
    m, n = queries.shape[0], rows.shape[0]
    k = min(k, n)
    outs = [(torch.empty(m, k, dtype=torch.float32), torch.empty(m, k, dtype=torch.int64)) for _ in biases]
    if m == 0 or k == 0:
        return outs
    split = long_row_split(rows) if split_long else None
    if split is not None and len(split.ids) >= k:
        def rank(q, some_rows, kk, some_biases, some_exclude):
            return topk_in_row_blocks(q, some_rows, kk, some_biases, block_floats, first_pass, some_exclude, False)
        return rank_long_first(rank, queries, rows, k, biases, exclude, split)
    width = k if first_pass is None else min(n, shortlist_width(k))
    chunk = min(m, MIN_QUERY_CHUNK)
    step = max(width, block_floats // chunk)
    step = step // GROUP * GROUP if step >= GROUP else step  # whole groups in every block but the last
    # the pass's products run in `first_pass` (a copy of the rows in it, where they are another dtype) or float32;
    # bfloat16 rows in a float32 pass are upcast a block at a time in `_walk`, never copied whole
    low = None if first_pass in (None, torch.float32) else rows.to(first_pass)
    max_norm = float(row_norms(rows).max())
    unsettled = {dtype: [[] for _ in biases] for dtype in (torch.bfloat16, torch.float32)}
    seen = left = 0
    for start in range(0, m, chunk):
        stop = min(m, start + chunk)
        q = queries[start:stop].to(rows.device, torch.float32)
        if low is not None and seen >= 64 and 2 * left > seen:
            low = None  # most queries need the float32 pass: go there directly
        blocks, dtype = (rows, torch.float32) if low is None else (low, low.dtype)
        pass_dtype = dtype if first_pass is not None else None
        excluded = excluded_pairs(exclude, start, stop, n, rows.device)
        found = _walk(q.to(dtype), blocks, width, step, biases, excluded)
        for j, (short_scores, short_ids) in enumerate(found):
            if pass_dtype is None:
                outs[j][0][start:stop] = short_scores.cpu()
                outs[j][1][start:stop] = torch.where(torch.isneginf(short_scores), -1, short_ids).cpu()
                continue
            top, ids, todo = _settle(q, rows, k, short_scores, short_ids, biases[j], pass_dtype, max_norm)
            outs[j][0][start:stop], outs[j][1][start:stop] = top.cpu(), ids.cpu()
            unsettled[pass_dtype][j].append(todo.cpu() + start)
            if pass_dtype == torch.bfloat16 and j == 0:
                seen, left = seen + (stop - start), left + len(todo)
    for dtype, per_bias in unsettled.items():
        for j, bias in enumerate(biases):
            if per_bias[j]:
                todo = torch.cat(per_bias[j]).numpy()
                if len(todo):
                    _finish(queries, rows, k, bias, block_floats, exclude, todo, outs[j], dtype)
    return outs


def _walk(q: torch.Tensor, blocks: torch.Tensor, width: int, step: int, biases, excluded: Pairs | None):
    """[(scores (c, w), ids (c, w))] per bias: each query's `width` best first-pass scores over every row (in q's
    dtype, each block of rows converted to it, returned as float32), ids global."""
    c, n = q.shape[0], blocks.shape[0]
    best = [(torch.empty(c, 0, dtype=torch.float32, device=q.device),
             torch.empty(c, 0, dtype=torch.int64, device=q.device)) for _ in biases]
    for a in range(0, n, step):
        b = min(n, a + step)
        products = q @ blocks[a:b].to(q.dtype).T  # (c, b - a); a block of bfloat16 rows upcast for a float32 pass
        inside = None
        if excluded is not None:
            keep = (excluded[1] >= a) & (excluded[1] < b)
            inside = (excluded[0][keep], excluded[1][keep] - a)
        for j, bias in enumerate(biases):
            scores = products if bias is None else products + bias[a:b].to(products.dtype)
            if inside is not None:
                scores = scores.clone() if scores is products else scores  # the next bias reads the products
                scores[inside] = float("-inf")
            top, ids = block_topk(scores, min(width, b - a))
            merged = torch.cat([best[j][0], top.float()], dim=1)
            keep_scores, pick = torch.topk(merged, min(width, merged.shape[1]), dim=1)
            best[j] = keep_scores, torch.gather(torch.cat([best[j][1], ids + a], dim=1), 1, pick)
            del scores, top, ids
    return best


def block_topk(scores: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (c, width), positions (c, width)): the `width` highest scores of each row of (c, w), the same values
    as torch.topk. Where w is whole groups of GROUP and long enough, they are found among the `width` groups with the
    highest maxima: a value among the top `width` lies in such a group, or else `width` groups hold a maximum at
    least as high, which makes `width` values of the chosen groups at least as high (ties may pick other rows)."""
    c, w = scores.shape
    if w % GROUP or w < 8 * GROUP * width or not scores.is_contiguous():
        return torch.topk(scores, width, dim=1)
    grouped = scores.view(c, w // GROUP, GROUP)
    groups = torch.topk(grouped.amax(dim=2), width, dim=1).indices  # (c, width)
    members = torch.gather(grouped, 1, groups[:, :, None].expand(-1, -1, GROUP)).reshape(c, width * GROUP)
    top, pos = torch.topk(members, width, dim=1)
    return top, torch.gather(groups, 1, pos // GROUP) * GROUP + pos % GROUP


def _settle(q, rows, k, short_scores, short_ids, bias, dtype, max_norm):
    """(top (c, k), ids (c, k), unsettled query positions (u,)) from each query's first-pass shortlist: the
    shortlist re-scored canonically, settled where its k-th clears the shortlist's last first-pass score by the
    bound (`refine_topk`'s rule)."""
    exact = canonical_products(q, rows, short_ids.clamp_min(0))
    if bias is not None:
        exact = exact + bias[short_ids.clamp_min(0)]
    exact = torch.where(torch.isneginf(short_scores), float("-inf"), exact)
    top, ids = best_k(exact, short_ids, k)
    last = short_scores[:, -1]
    slack = first_pass_slack(dtype, rows.shape[1], max_norm, q.norm(dim=1), bias)
    settled = (top[:, -1] > last + slack) | torch.isneginf(last) | (short_scores.shape[1] >= rows.shape[0])
    return top, torch.where(torch.isneginf(top), -1, ids), torch.nonzero(~settled).flatten()


def _finish(queries, rows, k, bias, block_floats, exclude, todo: np.ndarray, out, pass_dtype) -> None:
    """Rank the queries `todo` (u,) a `pass_dtype` first pass left: a float32 row-block pass after a bfloat16 one,
    the one-block search (rows within reach, every row) after a float32 one. Writes into out (scores, ids)."""
    sub = queries[torch.from_numpy(todo)]
    sub_exclude = subset_csr(exclude, todo)
    if pass_dtype == torch.bfloat16:
        (top, ids), = topk_in_row_blocks(sub, rows, k, [bias], block_floats, torch.float32, sub_exclude, False)
        out[0][torch.from_numpy(todo)], out[1][torch.from_numpy(todo)] = top, ids
        return
    scores = ShortlistScores(rows, torch.float32)
    per_block = max(1, block_floats // max(1, rows.shape[0]))
    for a in range(0, len(todo), per_block):
        b = min(len(todo), a + per_block)
        q = sub[a:b].to(rows.device, torch.float32)
        pairs = excluded_pairs(sub_exclude, a, b, rows.shape[0], rows.device)
        top, ids = scores.topk(q, scores.products(q), k, bias, pairs)
        which = torch.from_numpy(todo[a:b])
        out[0][which], out[1][which] = top.cpu(), ids.cpu()


def excluded_pairs(exclude, start: int, stop: int, n: int, device) -> Pairs | None:
    """(chunk-local query positions, row ids) of the excluded pairs of queries [start, stop), ids outside [0, n)
    dropped; None without."""
    if exclude is None:
        return None
    indptr, indices = exclude
    lo, hi = int(indptr[start]), int(indptr[stop])
    cols = torch.from_numpy(np.asarray(indices[lo:hi], dtype=np.int64))
    counts = torch.from_numpy(np.diff(np.asarray(indptr[start:stop + 1], dtype=np.int64)))
    qrows = torch.repeat_interleave(torch.arange(stop - start), counts)
    inside = (cols >= 0) & (cols < n)
    return qrows[inside].to(device), cols[inside].to(device)

