"""Synchronous exact hard-negative mining: the stand-in the asynchronous ANN miner replaces.

It produces exactly what the miner's hand-off delivers: per label shard, a (N, k) int32 table of the
k highest-scoring *non-positive* labels of the shard for each of the N training rows, as global ids.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from xc.ann.exact import exact_topk
from xc.models.classifier import ClassifierShard
from xc.shards import ShardLayout

LabelFn = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def mine_exact(queries: torch.Tensor, shard: ClassifierShard, layout: ShardLayout, shards: range, k: int,
               labels: LabelFn, block: int = 4096) -> dict[int, np.ndarray]:
    """Hard-negative tables for the label shards this rank holds.

    queries (N, d) embeddings of every training row; `labels(rows)` gives their positives as CSR.
    Returns {shard: (N, k) int32 global label ids, -1 where the shard has fewer than k negatives}.
    """
    num_rows = queries.shape[0]
    tables = {s: np.full((num_rows, k), -1, dtype=np.int32) for s in shards}
    for start in range(0, num_rows, block):
        rows = np.arange(start, min(num_rows, start + block), dtype=np.int64)
        indptr, indices = labels(rows)
        for s in shards:
            lo, _ = layout.shard_range(s)
            n = layout.real_count(s)
            first = lo - shard.lo
            local = indices - lo  # exact_topk ignores ids outside [0, n)
            _, ids = exact_topk(queries[start:start + len(rows)], shard.weight[first:first + n], k, indptr, local)
            tables[s][rows, :ids.shape[1]] = torch.where(ids >= 0, ids + lo, -1).numpy().astype(np.int32)
    return tables
