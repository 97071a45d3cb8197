"""Serving from the query's nearest training points: `--ann neighbours` (`xc-eval`, `xc-predict`, `use_ann`).

    model = xc.load("runs/big"); model.use_prior(False)
    model.use_ann("neighbours")            # or: xc-eval runs/big --ann neighbours

Why: a graph index over the classifier rows answers inner-product queries from another distribution than the rows
it was built on, and the wider the rows the worse it does: with the same build and breadth DiskANN kept 95.2% of
exact search's top 5 over 10^6 rows 128 wide and 78.7% over 512 wide, and reached 96% there only with a denser build
searched so widely that it was slower than exact search (docs/serving.md). The training points' embeddings come
from the queries' own distribution, and a query's top labels are mostly labels that training points near it carry,
so the shortlist is found among the points instead of among the rows:

1. the query's `m` nearest training points by cosine of the embeddings, by exact blocked products
   (`exact_topk`, N x d multiply-adds a query for N training points, against L x d for exact search: N is about a
   tenth of L where labels are many and most have a handful of points);
2. candidates: every label those points carry, and the `head` longest rows (`ann.exact_head`: the labels a model
   ranks high for most queries, as the miner's norm head keeps them, xc/ann/norm_head.py);
3. every candidate scored exactly (q . w_l), the top k kept. Scores are the plain model's, as every `--ann` search
   serves them (no label prior, no fusion).

`m` is the search's breadth, tuned as a graph's is (xc/ann/breadth.py): on the first queries served it doubles from
`ann.serve_neighbours` until recall@k against exact search reaches `ann.serve_recall`. Nothing is built or saved:
the training points are encoded once, when the searcher is made (10^5 points of 200k features in 3 s on 2 cores).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import scipy.sparse as sp
import torch

from xc.ann.base import NEIGHBOURS_SAVE_REFUSED
from xc.ann.bf16_rows import row_norms
from xc.ann.breadth import PROBE_QUERIES, BreadthTuning, tune_breadth
from xc.ann.exact import exact_topk
from xc.ann.norm_head import head_rows
from xc.config import AnnConfig
from xc.data.sparse import SparseMatrix
from xc.errors import XCError
from xc.fitting.knn import labels_csr
from xc.models.classifier import ClassifierShard

log = logging.getLogger(__name__)

BREADTH_NAME = "ann.serve_neighbours"
QUERY_BLOCK = 256  # queries whose candidates are gathered at once
PAIR_CHUNK = 1 << 15  # (query, candidate) pairs scored at once: PAIR_CHUNK x d floats of gathered rows


class NeighbourSearcher:
    """Top-k labels from the query's nearest training points and the longest rows, scored exactly.

    shard: the classifier rows [lo, hi) (every label, in one process); train_embeddings (N, d) float32, the training
    points' embeddings by the same encoder; train_labels (N, L) CSR, their labels; `neighbours` the breadth m to
    start from; `head` the longest rows every query scores; `target` the recall@k the breadth is tuned to (0: m as
    given)."""

    def __init__(self, shard: ClassifierShard, train_embeddings: torch.Tensor, train_labels: sp.csr_matrix,
                 neighbours: int, head: int, target: float):
        start = time.perf_counter()
        if train_embeddings.shape[0] != train_labels.shape[0]:
            raise ValueError(f"{train_embeddings.shape[0]} training embeddings for {train_labels.shape[0]} label rows")
        self.shard, self.target, self.neighbours = shard, target, max(1, int(neighbours))
        self.points = torch.nn.functional.normalize(train_embeddings.float(), dim=1)
        self.labels = sp.csr_matrix(train_labels, dtype=np.float32)
        # norms a block at a time: 10^7 bfloat16 rows of 256 read as float32 at once would be 10 GB
        self.head = (torch.topk(row_norms(self._rows()), head).indices.sort().values + shard.lo if head > 0
                     else torch.zeros(0, dtype=torch.int64))
        self.in_head = np.zeros(shard.num_labels, dtype=bool)
        self.in_head[self.head.numpy()] = True
        self.tuning: BreadthTuning | None = None
        self.reused = False  # nothing is saved or loaded: the same attributes as AnnSearcher
        self.build_seconds = time.perf_counter() - start
        self.search_seconds = 0.0

    def _rows(self) -> torch.Tensor:
        return self.shard.weight[:self.shard.num_real_rows]

    def search(self, embeddings: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """embeddings (M, d) -> (scores (M, k), global label ids (M, k), -1 pads) on the CPU."""
        queries = embeddings.float().cpu()
        if self.tuning is None and self.target > 0 and len(queries):
            self._tune(queries[:PROBE_QUERIES], k)
        start = time.perf_counter()
        out = self._search(queries, k, self.neighbours)
        self.search_seconds += time.perf_counter() - start
        return out

    def _tune(self, probe: torch.Tensor, k: int) -> None:
        clock = time.perf_counter()
        scores, local = exact_topk(probe, self._rows(), k)
        truth = torch.where(local >= 0, local + self.shard.lo, -1).numpy()
        exact_seconds = time.perf_counter() - clock
        self.tuning = tune_breadth(lambda m: self._search(probe, k, m)[1].numpy(), truth, BREADTH_NAME,
                                   self.neighbours, self.target)
        self.neighbours = self.tuning.chosen
        self.tuning.seconds = time.perf_counter() - clock
        self.tuning.exact_query_seconds = exact_seconds / len(probe)
        (log.info if self.tuning.reached else log.warning)("neighbour serving searches at %s", self.tuning.summary())

    def _search(self, queries: torch.Tensor, k: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self._block(queries[i:i + QUERY_BLOCK], k, m) for i in range(0, len(queries), QUERY_BLOCK)]
        if not parts:
            return torch.zeros(0, k), torch.zeros(0, k, dtype=torch.int64)
        return torch.cat([s for s, _ in parts]), torch.cat([i for _, i in parts])

    def _block(self, queries: torch.Tensor, k: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One block of B queries: (scores (B, k), ids (B, k))."""
        b = len(queries)
        m = min(m, self.points.shape[0])
        _, near = exact_topk(torch.nn.functional.normalize(queries, dim=1), self.points, m)
        near = near.numpy()
        valid = near >= 0
        pick = sp.csr_matrix((np.ones(int(valid.sum()), np.float32), near[valid],
                              np.concatenate([[0], np.cumsum(valid.sum(1))])), shape=(b, self.points.shape[0]))
        cands = (pick @ self.labels).tocsr()  # (B, L): the labels the neighbours carry, each once
        cands.sort_indices()
        cols = cands.indices.astype(np.int64)
        lo, hi = self.shard.lo, self.shard.lo + self.shard.num_real_rows
        keep = ~self.in_head[cols] & (cols >= lo) & (cols < hi)  # a head label is scored with the head; another
        # rank's labels by that rank
        row_of = np.repeat(np.arange(b), np.diff(cands.indptr))[keep]
        cols = cols[keep]
        pair_scores = self._score_pairs(queries, row_of, cols)
        counts = np.bincount(row_of, minlength=b)
        width = max(int(counts.max()) if b else 0, 1)
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
        slot = np.arange(len(cols)) - np.repeat(offsets, counts)
        scores = torch.full((b, width), -torch.inf)
        ids = torch.full((b, width), -1, dtype=torch.int64)
        scores[row_of, slot] = pair_scores
        ids[row_of, slot] = torch.from_numpy(cols)
        if len(self.head):
            head_scores = queries @ self._rows()[self.head - self.shard.lo].float().T
            scores = torch.cat([scores, head_scores], 1)
            ids = torch.cat([ids, self.head.expand(b, -1)], 1)
        kk = min(k, scores.shape[1])
        top, at = torch.topk(scores, kk, dim=1)
        chosen = torch.gather(ids, 1, at)
        chosen = torch.where(torch.isfinite(top), chosen, -1)
        if kk < k:  # fewer candidates than k: pad as exact search pads
            top = torch.cat([top, torch.full((b, k - kk), -torch.inf)], 1)
            chosen = torch.cat([chosen, torch.full((b, k - kk), -1, dtype=torch.int64)], 1)
        return top, chosen

    def _score_pairs(self, queries: torch.Tensor, row_of: np.ndarray, cols: np.ndarray) -> torch.Tensor:
        """q_row . w_col for each (query row, global label) pair, (P,) float32."""
        rows = self._rows()
        out = torch.empty(len(cols), dtype=torch.float32)
        for s in range(0, len(cols), PAIR_CHUNK):
            r = torch.from_numpy(row_of[s:s + PAIR_CHUNK])
            c = torch.from_numpy(cols[s:s + PAIR_CHUNK] - self.shard.lo)
            out[s:s + PAIR_CHUNK] = (queries[r] * rows[c].float()).sum(1)
        return out


def neighbour_searcher(ann: AnnConfig, shard: ClassifierShard, train_labels: SparseMatrix | None,
                       encode_points: Callable[[], torch.Tensor | None], save_index: bool = False) -> NeighbourSearcher:
    """The searcher `--ann neighbours` serves with (`ann`: the run's `miner.ann`, its `serve_neighbours`, `exact_head`
    (cut as the norm head's is, `head_rows`) and `serve_recall`); `encode_points()` gives the training points'
    embeddings (N, d) or None where the model holds none, and its time counts in `build_seconds`. Refused in one
    line where there is nothing to search or an index is to be saved, before anything is encoded."""
    if save_index:
        raise XCError(NEIGHBOURS_SAVE_REFUSED)
    clock = time.perf_counter()
    train_embeddings = encode_points()
    if train_embeddings is None or train_labels is None:
        raise XCError("--ann neighbours needs the training points' features and labels, which this model does not "
                      "hold: serve it without --ann, or with --ann diskann")
    if train_labels.num_rows == 0:
        raise XCError("--ann neighbours: the model has no training points to search; serve it without --ann")
    searcher = NeighbourSearcher(shard, train_embeddings, labels_csr(train_labels), ann.serve_neighbours,
                                 head_rows(ann, shard.num_real_rows), ann.serve_recall)
    searcher.build_seconds = time.perf_counter() - clock  # the training points' encoding included
    return searcher
