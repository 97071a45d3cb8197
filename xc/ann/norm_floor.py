"""Rows too short to reach a query's top-k, left out of the clustered search before it scans (a norm floor).

    miner.ann.cluster_norm_floor=true        # the default; false scans every row

Why: where most labels have no training point, most rows never learn. At 10^7 labels and 10^6 training points
8.9 of the 10 million rows keep their small random start (norms 0.16 to 1.05) while the rows started at their labels'
points (xc/train/row_init.py) have norms 21 to 31 (docs/row_init.md), and every query's exact top-16 lay among
those. The clustered search's centroid scan (xc/ann/clustered.py) still multiplied every centroid by all 10^7 rows:
leaving the short ones out, the search of the run's 995,000 queries takes 301 s against 1,580 s over every row (one
thread) at the same recall (docs/miner_search.md, "Rows that never learned").

The rule is exact, by Cauchy-Schwarz: q.w <= |q| |w|. The k-th best score of query q over the h longest rows it does
not exclude (h = `head_size`), b_q, bounds its k-th best over all rows from below, so every row with |w| < b_q / |q|
scores below its k-th best and cannot be in its top-k. A search block's floor f is the `FLOOR_QUANTILE` quantile of
its queries' own floors b_q / |q| (taken a hair lower for rounding); rows of norm >= f are kept. The queries whose
own floor is f or more are searched over the kept rows only, the others (an empty query, one whose head scores are
all negative) over every row, so no query's answer leaves out a row that could be in it. The floor is applied only
where it keeps at most `FLOOR_PAYS` of the rows: trained rows whose norms spread smoothly (a random start trained
for an epoch) lose a few rows and gain nothing worth the gather.

Cost per block of m queries: m x h products of width d (the head's scores; h is at most `HEAD_COST` of the centroid
scan's m / cluster_size x n, so where rows are few the head is too small to bound anything and the floor stays off),
the norms compared, and the kept rows copied once (at most `FLOOR_PAYS` of the rows; reused by later blocks while
their floor is no lower).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xc.arrays import find_sorted

FLOOR_HEAD = 4096  # at most this many longest rows bound each query's k-th best from below
# ... and at most this share of the centroid scan's products: m x head against (m / cluster_size) x n
HEAD_COST = 1 / 16
FLOOR_QUANTILE = 0.001  # the block's floor: this quantile of its queries' own; the queries under it scan every row
FLOOR_PAYS = 0.25  # applied only where the rows kept (copied once) are at most this share of all rows
_ROUNDING = 1e-3  # floors taken this much lower: float32 products of bfloat16 rows round
_SCORE_BLOCK_FLOATS = 1 << 24  # queries x head scores per block (64 MiB of float32)


@dataclass
class FloorSplit:
    """A search block's split: `row_ids` (n',) int64 ascending, the rows kept, as `rows` (n', d) and `norms` (n',);
    `scan_all` (m,) bool, the queries searched over every row instead."""

    floor: float
    row_ids: object  # torch.Tensor
    rows: object
    norms: object
    scan_all: np.ndarray


def head_size(n: int, cluster_size: int) -> int:
    """The head that bounds the queries' k-th best: `FLOOR_HEAD` rows, at most `HEAD_COST` of the centroid scan
    (n / cluster_size rows a query), at most n."""
    return int(min(FLOOR_HEAD, HEAD_COST * n / cluster_size, n))


class NormFloor:
    """The rows' norms and their longest `FLOOR_HEAD` rows, for the floor of each search block (`split`).

    rows (n, d) float32 or bfloat16 tensor; norms (n,) float32 on the rows' device."""

    def __init__(self, rows, norms, head: int = FLOOR_HEAD):
        import torch

        self.rows, self.norms, self.n = rows, norms, rows.shape[0]
        self.head_ids = torch.topk(norms, min(head, self.n)).indices  # longest first
        ids = self.head_ids.cpu().numpy()
        self._head_order = np.argsort(ids)  # head positions by ascending row id, to find excluded head rows
        self._head_sorted = ids[self._head_order]
        self.head_rows = rows[self.head_ids].float()  # (h, d)
        self._kept: FloorSplit | None = None  # the last split's kept rows, reused while a floor is no lower

    def query_floors(self, q, k: int, exclude_indptr: np.ndarray | None, exclude_indices: np.ndarray | None):
        """(m,) float32 tensor: each query's norm floor b_q / |q| (a hair lower), 0 where b_q <= 0, |q| = 0 or fewer
        than k head rows are allowed. q (m, d) float32; exclusions as CSR of row ids over the queries."""
        import torch

        m, h = q.shape[0], self.head_ids.shape[0]
        floors = torch.zeros(m, dtype=torch.float32, device=q.device)
        if h < k or k < 1:
            return floors
        pairs = self._head_exclusions(m, exclude_indptr, exclude_indices)
        block = max(1, _SCORE_BLOCK_FLOATS // h)
        for a in range(0, m, block):
            b = min(m, a + block)
            scores = q[a:b] @ self.head_rows.T  # (b - a, h)
            lo, hi = np.searchsorted(pairs[0], [a, b])
            if hi > lo:
                scores[torch.from_numpy(pairs[0][lo:hi] - a), torch.from_numpy(pairs[1][lo:hi])] = float("-inf")
            kth = torch.topk(scores, k, dim=1).values[:, -1]
            size = q[a:b].norm(dim=1)
            ok = (kth > 0) & (size > 0)
            floors[a:b] = torch.where(ok, kth / size.clamp_min(1e-30) * (1 - _ROUNDING), torch.zeros_like(kth))
        return floors

    def _head_exclusions(self, m: int, indptr, indices) -> tuple[np.ndarray, np.ndarray]:
        """(queries, head positions): every excluded (query, row) pair whose row is in the head, sorted by query."""
        if indptr is None:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        indptr = np.asarray(indptr, dtype=np.int64)
        cols = np.asarray(indices, dtype=np.int64)[: indptr[-1]]
        queries = np.repeat(np.arange(m, dtype=np.int64), np.diff(indptr))
        at, hit = find_sorted(self._head_sorted, cols)
        return queries[hit], self._head_order[at[hit]]

    def split(self, q, k: int, exclude_indptr=None, exclude_indices=None) -> FloorSplit | None:
        """The block's split (`FloorSplit`), or None where the floor keeps more than `FLOOR_PAYS` of the rows (or
        is 0): every query then scans every row."""
        import torch

        floors = self.query_floors(q, k, exclude_indptr, exclude_indices)
        floor = float(torch.quantile(floors, FLOOR_QUANTILE)) if q.shape[0] else 0.0
        if floor <= 0:
            return None
        kept = self._kept
        if kept is None or floor < kept.floor:  # a lower floor keeps more rows: gathered anew
            row_ids = torch.nonzero(self.norms >= floor).flatten()
            if row_ids.shape[0] > FLOOR_PAYS * self.n:
                return None
            kept = self._kept = FloorSplit(floor, row_ids, self.rows[row_ids], self.norms[row_ids], np.zeros(0, bool))
        # the kept rows hold every row of norm >= kept.floor; a query may use them where its own floor is that or more
        scan_all = (floors < kept.floor).cpu().numpy()
        return FloorSplit(kept.floor, kept.row_ids, kept.rows, kept.norms, scan_all)
