"""Query-clustered search: the miner's many queries share their candidates, scored exactly by dense products.

    miner.ann.backend=clustered          # queries per cluster, candidates and slack: ann.cluster_* fields

Why: the miner does not answer one query, it answers every training query of the epoch against the same rows
(2M queries x 10^6 rows at the 10^6 benchmark). A graph built on the rows alone reaches a query's top-k poorly
once training spreads that top-k over rows of every norm: on the pooled 10^6 rows (docs/miner_search.md) DiskANN and HNSW with an exact head of the 1,024 longest rows found 0.62-0.66 of the exact top-16, and
a 3x wider graph search 0.69. Queries that lie close together have mostly the same top rows, so a batch of them
can share one candidate list, found once for the whole cluster, and every member is then scored exactly against
it with one matrix product, which a CPU (or GPU) runs at full speed, unlike a graph walk.

Per search call (the miner's query block):
1. k-means (`_KMEANS_ITERS` Lloyd steps, seeded) splits the m queries into ceil(m / cluster_size) clusters;
   r_c = the root-mean-square distance of cluster c's members to its centroid c.
2. Candidates of a cluster: the `cluster_candidates` rows w with the largest c.w + z r_c |w| / sqrt(d),
   z = `cluster_slack`. For a member q, q.w = c.w + (q - c).w, and (q - c).w has spread about r_c |w| / sqrt(d)
   over directions; the term keeps rows that some member ranks high although the centroid does not (long rows
   most of all: the norm head's reason, xc/ann/norm_head.py, without a fixed head size).
3. Every member's scores against its cluster's candidates (one (members, d) x (d, K) product), its excluded
   rows (positives) masked, its top-k kept. Scores returned are true inner products.

Before step 1, rows too short to reach any member's top-k are left out (`ann.cluster_norm_floor`, xc/ann/norm_floor.py:
exact by |q.w| <= |q| |w|): where most rows never learned (labels without training points) the centroid scan then
multiplies only the rest, and the queries whose own floor is lower scan every row.

Exact where it can be: a cluster of one query has r = 0 and takes its own exact top-K; K >= n scores all rows.
Measured on the pooled 10^6 rows, d = 128 (docs/miner_search.md): recall@16 0.974 with 512 queries per cluster,
8,192 candidates and z = 1.5, against 0.66 for DiskANN with the exact head, in less search time. The default
is 1,024 queries per cluster: on a later snapshot 0.975 against 0.980 for 512, in 25% less
time (130 s against 173 s for 2M queries on one core), as the centroid scan and its top-K halve.

Cost per query: K d multiply-adds (the candidates) + n d / cluster_size (its share of the centroid scan), in
dense products; the k-means adds about 2 C d multiply-adds per query and Lloyd step. The rows are held as given
(no build), on `torch_device` in float32 (the torch backend's placement).
"""

from __future__ import annotations

import math
import time
import warnings

import numpy as np

from xc.ann.base import _check_exclusions
from xc.arrays import csr_rows, find_sorted
from xc.ann.bf16_rows import is_bf16, products, row_norms
from xc.ann.exact import first_pass_dtype
from xc.ann.kmeans import lloyd
from xc.ann.norm_floor import NormFloor, head_size
from xc.ann.shortlist import ShortlistScores, shortlist_pays, shortlist_width
from xc.ann.torch_backend import TorchIndex

_KMEANS_ITERS = 8  # Lloyd steps: the partition only has to group neighbours, not converge
_BOUND_BLOCK_FLOATS = 1 << 26  # centroid x row bounds per block (256 MiB of float32)
_SEED = 0x5EED


class ClusteredIndex(TorchIndex):
    """Rows (n, d) kept as they are; search clusters the queries and scores each cluster's candidates exactly.

    Persistence is the exact backend's (the rows). Scores are float32: ann.torch_dtype=bfloat16 is refused, and
    bfloat16 rows (a bfloat16 snapshot's) are upcast a block at a time (xc/ann/bf16_rows.py).
    """

    name = "clustered"

    def build(self, vectors: np.ndarray) -> None:
        with warnings.catch_warnings():  # a snapshot's rows may be a read-only memmap; they are only read here
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            super().build(vectors)

    def _place(self, rows) -> None:
        if self.params.torch_dtype != "float32":
            raise ValueError("clustered: rows are scored in float32 (ann.torch_dtype must be float32)")
        super()._place(rows)
        self._norms = row_norms(self._rows)  # (n,) float32, also of bfloat16 rows
        self._floor = (NormFloor(self._rows, self._norms, head_size(self.n, self.params.cluster_size))
                       if self.params.cluster_norm_floor else None)  # xc/ann/norm_floor.py
        self._first_pass = first_pass_dtype(str(self._rows.device))

    # search / search_excluding are the exact backend's, which both call _search
    def _search(self, queries, k, exclude_indptr, exclude_indices) -> tuple[np.ndarray, np.ndarray]:
        import torch

        queries = self._check_queries(queries, k)
        m, n = queries.shape[0], self.n
        scores_out, ids_out = self._empty_result(m, k)
        if m == 0 or n == 0:
            return scores_out, ids_out
        start = time.perf_counter()
        q = torch.from_numpy(np.array(queries, dtype=np.float32)).to(self.device)  # writable: torch's rule
        if exclude_indptr is not None:
            exclude_indptr, exclude_indices = _check_exclusions(m, exclude_indptr, exclude_indices)
        split = self._floor.split(q, k, exclude_indptr, exclude_indices) if self._floor is not None else None
        if split is None:
            parts = [(np.arange(m), None, self._rows, self._norms)]
        else:  # the queries whose floor holds search the kept rows, the rest every row (xc/ann/norm_floor.py)
            parts = [(np.flatnonzero(~split.scan_all), split.row_ids, split.rows, split.norms),
                     (np.flatnonzero(split.scan_all), None, self._rows, self._norms)]
        clusters = 0
        for query_ids, row_ids, rows, norms in parts:
            if len(query_ids) == 0:
                continue
            indptr, indices = _restrict(exclude_indptr, exclude_indices, query_ids, row_ids)
            scores, ids, made = self._search_rows(q[torch.from_numpy(query_ids).to(q.device)], rows, norms, k,
                                                  indptr, indices)
            if row_ids is not None:
                ids = np.where(ids >= 0, row_ids.cpu().numpy()[np.maximum(ids, 0)], -1)
            scores_out[query_ids, :ids.shape[1]], ids_out[query_ids, :ids.shape[1]] = scores, ids
            clusters += made
        self.last_search = {"clusters": clusters, "candidates": min(self.params.cluster_candidates, n),
                            "rows_scanned": n if split is None else int(split.row_ids.shape[0]),
                            "floor": 0.0 if split is None else split.floor,
                            "seconds": time.perf_counter() - start}
        return scores_out, ids_out

    def _search_rows(self, q, rows, norms, k: int, exclude_indptr, exclude_indices):
        """(scores (m, keep) float32, ids (m, keep) int64 of `rows`, -1 padded; the clusters made) of queries q (m, d)
        over rows (n, d) with their norms (n,), exclusions as CSR of ids into `rows`; keep = min(k, candidates)."""
        import torch

        m, n = q.shape[0], rows.shape[0]
        assign, centroids, radius = kmeans(q, max(1, math.ceil(m / self.params.cluster_size)))
        order = torch.argsort(assign, stable=True)
        counts = torch.bincount(assign, minlength=centroids.shape[0]).cpu().numpy()
        bounds = np.concatenate([[0], np.cumsum(counts)])
        place = torch.empty(m, dtype=torch.int64, device=q.device)  # query -> its position in `order`
        place[order] = torch.arange(m, device=q.device)
        excl = _excluded_pairs(m, n, exclude_indptr, exclude_indices, place.cpu().numpy())
        cand_k = min(self.params.cluster_candidates, n)
        keep = min(k, cand_k)
        slack = self.params.cluster_slack / math.sqrt(self.dim)
        where = torch.full((n,), -1, dtype=torch.int64, device=q.device)  # row -> candidate position, reused
        top_scores = torch.full((m, keep), float("-inf"))
        top_ids = torch.full((m, keep), -1, dtype=torch.int64)
        block = max(1, _BOUND_BLOCK_FLOATS // n)
        for c0 in range(0, centroids.shape[0], block):
            c1 = min(centroids.shape[0], c0 + block)
            bound = _products(centroids[c0:c1], rows)  # (b, n)
            bound += (slack * radius[c0:c1])[:, None] * norms[None, :]
            candidates = torch.topk(bound, cand_k, dim=1).indices if cand_k < n else None
            del bound
            for c in range(c0, c1):
                a, b = int(bounds[c]), int(bounds[c + 1])
                if a == b:
                    continue
                members = order[a:b]
                cand = candidates[c - c0] if candidates is not None else torch.arange(n, device=q.device)
                qm = q[members]
                excluded = None
                lo, hi = np.searchsorted(excl[0], [a, b])
                if hi > lo:
                    where[cand] = torch.arange(cand.shape[0], device=q.device)
                    rows_e = torch.from_numpy(excl[0][lo:hi] - a).to(q.device)
                    cols_e = where[torch.from_numpy(excl[1][lo:hi]).to(q.device)]
                    hit = cols_e >= 0
                    excluded = (rows_e[hit], cols_e[hit])
                    where[cand] = -1
                ts, ti = self._members_topk(qm, rows, cand, keep, excluded)
                top_scores[a:b] = ts.cpu()
                top_ids[a:b] = torch.where(torch.isneginf(ts), -1, cand[ti]).cpu()
        back = order.cpu().numpy()
        scores, ids = np.empty((m, keep), np.float32), np.empty((m, keep), np.int64)
        scores[back], ids[back] = top_scores.numpy(), top_ids.numpy()
        return scores, ids, int(centroids.shape[0])

    def _members_topk(self, qm, rows, cand, keep: int, excluded):
        """(scores (m, keep), candidate positions (m, keep)) of a cluster's members qm (m, d) over its candidate
        rows `rows[cand]` (K,), `excluded` (member, position) pairs at -inf. Where a shortlist pays over the K
        candidates (`xc.ann.shortlist.shortlist_pays`: K d past 2^18 shortlisted rows, e.g. d 2,048 at k 16), the
        canonical top-k through a first pass in bfloat16 where the device multiplies it faster (xc/ann/shortlist.py:
        the same answer either way), else the plain float32 product."""
        import torch

        rows = rows[cand].float()  # (K, d): bfloat16 rows are scored in float32
        if shortlist_pays(keep, len(cand), self.dim) and shortlist_width(keep) < len(cand):
            scores = ShortlistScores(rows, self._first_pass)
            top, pick = scores.topk(qm, scores.products(qm), keep, None, excluded)
            return top, pick.clamp_min(0)  # -1 at -inf: the caller keeps -1 for those
        scores = qm @ rows.T  # (m, K)
        if excluded is not None:
            scores[excluded] = float("-inf")
        top, pick = torch.topk(scores, keep, dim=1)
        return top.float(), pick


def _products(x, rows):
    """(b, n) float32 x @ rows.T for x (b, d): bfloat16 rows upcast a block at a time."""
    if is_bf16(rows):
        return products(x, rows)
    return x @ rows.T


def _restrict(indptr, indices, query_ids: np.ndarray, row_ids):
    """Exclusions (CSR of row ids over all queries, or None) of just `query_ids`, as ids into the kept rows
    `row_ids` ((n',) ascending tensor; None = every row kept): rows not kept are dropped."""
    if indptr is None:
        return None, None
    indptr, indices = csr_rows(indptr, indices, query_ids)
    if row_ids is None:
        return indptr, indices
    at, kept = find_sorted(row_ids.cpu().numpy(), indices)  # a binary search: no (n,) lookup table per block
    counts = np.bincount(np.repeat(np.arange(len(query_ids)), np.diff(indptr))[kept], minlength=len(query_ids))
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), at[kept]


def kmeans(x, num_clusters: int, iters: int = _KMEANS_ITERS):
    """(assign (m,) int64, centroids (C, d), rms radius (C,)) of x (m, d) by seeded Lloyd steps.

    Centres start at C distinct queries drawn with a fixed seed (the result is a function of x alone); an
    emptied cluster keeps its centre (xc/ann/kmeans.py `lloyd`)."""
    import torch

    m = x.shape[0]
    num_clusters = min(num_clusters, m)
    gen = torch.Generator().manual_seed(_SEED)
    centroids = x[torch.randperm(m, generator=gen)[:num_clusters].to(x.device)]
    centroids, assign, _ = lloyd(x, centroids, iters, max(1, _BOUND_BLOCK_FLOATS // max(1, num_clusters)))
    dist2 = ((x - centroids[assign]) ** 2).sum(dim=1)
    counts = torch.bincount(assign, minlength=num_clusters).clamp_min(1).to(x.dtype)
    radius = (torch.zeros(num_clusters, dtype=x.dtype, device=x.device).index_add_(0, assign, dist2) / counts).sqrt()
    return assign, centroids, radius


def _excluded_pairs(m: int, n: int, exclude_indptr, exclude_indices, place: np.ndarray):
    """(positions, rows): every excluded (query, row) pair with the query as its position in cluster order,
    sorted by position; rows outside [0, n) dropped."""
    if exclude_indptr is None:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    indptr, indices = _check_exclusions(m, exclude_indptr, exclude_indices)
    qrow = np.repeat(np.arange(m, dtype=np.int64), np.diff(indptr))
    cols = indices[: indptr[-1]]
    inside = (cols >= 0) & (cols < n)
    pos, cols = place[qrow[inside]], cols[inside]
    order = np.argsort(pos, kind="stable")
    return pos[order], cols[order]
