"""Exact rankings over rows whose norms fall apart into a few long ones and many short ones: the long rows ranked,
the short ones read only by the queries whose answer they could change.

Why: where most labels have no training point, most rows never learn. At 10^7 labels and 10^6 training points, rows
started at their labels' points (xc/train/row_init.py) reach norms of 21 to 31 while 8.9 of the 10 million keep
their random start (0.16 to 1.05; docs/miner_search.md, "Rows that never learned"), and the exact rankings of
training (each epoch's validation, the test split, the label prior's betas, xc/eval/inference.py) multiplied every
query by all 10^7 of them: the products were over half of a 5,000-point ranking's 8 to 13 minutes on 2 cores.

The rule is exact, by Cauchy-Schwarz: a short row w scores at most |q| |w| + its bias for query q. The long rows are
ranked first (the same ranking, `topk_in_row_blocks`, over them alone); a query whose k-th best there beats
|q| * (the longest short row's norm) + (the largest bias of a short row), with a margin for float32 rounding, has
its answer: no short row can enter it. The other queries are ranked over every row. Ids are global and ties go as
the ranking over every row sends them (to the lower id), so the answer is the same (a canonical ranking's to the
bit; the plain float32 product's, whose sums depend on the block, within their rounding).

The split: the rows' norms sorted, the largest ratio between neighbours among the longest `LONG_SHARE` of the rows; it
is used where that ratio is at least `NORM_GAP` and there are at least `MIN_ROWS` rows (below that a ranking is
cheap, and rows trained as negatives spread their norms smoothly: at 10^6 labels the miner's own floor kept 47 to
78% of the rows, docs/miner_search.md). Cost: the norms (one read of the rows) and a copy of the long rows (at 10^7
labels, 1.09 million of 256 in bfloat16: 0.56 GB while the ranking runs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from xc.ann.bf16_rows import row_norms

NORM_GAP = 4.0  # long rows at least this many times longer than the longest short one
LONG_SHARE = 0.25  # the long rows at most this share of all rows
MIN_ROWS = 1 << 20  # only rankings over at least this many rows split
_ROUNDING = 1e-3  # the bound taken this much higher: float32 products and norms round

log = logging.getLogger(__name__)


@dataclass
class LongRows:
    """`ids` (n_long,) int64 ascending, the long rows; `short_norm`, the longest short row's norm; `is_long` (n,)
    bool on the rows' device."""

    ids: torch.Tensor
    short_norm: float
    is_long: torch.Tensor


def long_row_split(rows: torch.Tensor, min_rows: int | None = None) -> LongRows | None:
    """The long rows of `rows` (n, d) by the module's rule, or None where their norms do not fall apart."""
    n = rows.shape[0]
    if n < (MIN_ROWS if min_rows is None else min_rows) or n < 2:
        return None
    norms = row_norms(rows)
    cap = max(1, int(LONG_SHARE * n))
    top = torch.topk(norms, min(n, cap + 1)).values  # descending
    ratio = top[:-1] / top[1:].clamp_min(torch.finfo(torch.float32).tiny)
    at = int(torch.argmax(ratio))
    if float(ratio[at]) < NORM_GAP:
        return None
    is_long = norms >= top[at]
    return LongRows(torch.nonzero(is_long).flatten().cpu(), float(top[at + 1]), is_long)


def rank_long_first(rank, queries: torch.Tensor, rows: torch.Tensor, k: int, biases: list[torch.Tensor | None],
                    exclude, split: LongRows) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`rank(queries, rows, k, biases, exclude)` (`topk_in_row_blocks` without a split: [(scores (N, k), ids (N, k))]
    per bias, -1 ids at -inf) over the long rows of `split` first, then over every row for the queries the short
    rows could change; the same answer as `rank` over every row."""
    ids = split.ids.to(rows.device)
    outs = rank(queries, rows[ids], k, [None if b is None else b[ids] for b in biases], _remapped(exclude, split.ids))
    q_norms = queries.float().norm(dim=1).cpu()
    short = ~split.is_long
    for j, bias in enumerate(biases):
        scores, local = outs[j]
        found = torch.where(local >= 0, split.ids[local.clamp_min(0)], -1)
        top_bias = 0.0 if bias is None else float(bias[short].max())
        if top_bias == float("-inf"):  # every short row masked out
            bound = torch.full_like(q_norms, float("-inf"))
        else:
            bound = q_norms * split.short_norm * (1 + _ROUNDING) + top_bias + _ROUNDING * abs(top_bias) + 1e-6
        redo = torch.nonzero(~(scores[:, -1] > bound)).flatten().numpy()  # -inf: too few long rows allowed
        log.debug("long rows first: %d of %d rows; %d of %d queries then over every row", len(ids), len(rows),
                  len(redo), len(queries))
        if len(redo):
            (again, again_ids), = rank(queries[torch.from_numpy(redo)], rows, k, [bias], subset_csr(exclude, redo))
            scores[redo], found[redo] = again, again_ids
        outs[j] = scores, found
    return outs


def _remapped(exclude, ids: torch.Tensor):
    """The exclusion CSR (indptr, indices: global row ids) over the rows `ids` (ascending): each id as its position
    among them, -1 (ignored) where it is not one of them; None without."""
    if exclude is None:
        return None
    indptr, indices = exclude
    indices = np.asarray(indices, dtype=np.int64)
    kept = ids.numpy()
    pos = np.minimum(np.searchsorted(kept, indices), len(kept) - 1)
    return indptr, np.where(kept[pos] == indices, pos, -1)


def subset_csr(exclude, which: np.ndarray):
    """The CSR of `exclude` restricted to queries `which` (u,), renumbered 0..u-1; None without."""
    if exclude is None:
        return None
    indptr, indices = (np.asarray(a, dtype=np.int64) for a in exclude)
    counts = indptr[which + 1] - indptr[which]
    sub_ptr = np.concatenate([[0], np.cumsum(counts)])
    sub_idx = np.concatenate([indices[indptr[i]:indptr[i + 1]] for i in which]) if len(which) else indices[:0]
    return sub_ptr, sub_idx
