"""Serving with ANN indexes over trained classifier shards (one index per label shard, top-k merged).

    from xc.serving import AnnSearcher
    searcher = AnnSearcher(shard, layout, shards, cfg.miner.ann)       # builds the indexes
    scores, ids = predict(encoder, shard, inputs, rows, k, batch, ctx, searcher=searcher)
"""

from __future__ import annotations

import time

import numpy as np
import torch

from xc.config import AnnConfig
from xc.models.classifier import ClassifierShard
from xc.shards import ShardLayout


class AnnSearcher:
    """ANN indexes over the label shards this rank holds; `search` merges their candidates."""

    def __init__(self, shard: ClassifierShard, layout: ShardLayout, shards: range, ann: AnnConfig, threads: int = 0):
        from xc.miner.params import build_ann

        threads = threads or torch.get_num_threads()
        self.indexes = []
        start = time.perf_counter()
        for s in shards:
            lo, _ = layout.shard_range(s)
            n = layout.real_count(s)
            rows = shard.weight[lo - shard.lo:lo - shard.lo + n].float().cpu().numpy()
            index = build_ann(ann, threads)
            index.build(np.ascontiguousarray(rows))
            self.indexes.append((lo, index))
        self.build_seconds = time.perf_counter() - start
        self.search_seconds = 0.0

    def search(self, embeddings: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        queries = np.ascontiguousarray(embeddings.float().cpu().numpy())
        all_scores, all_ids = [], []
        for lo, index in self.indexes:
            scores, ids = index.search(queries, k)
            all_scores.append(torch.from_numpy(np.where(ids >= 0, scores, -np.inf).astype(np.float32)))
            all_ids.append(torch.from_numpy(np.where(ids >= 0, ids + lo, -1).astype(np.int64)))
        self.search_seconds += time.perf_counter() - start
        return torch.cat(all_scores, 1), torch.cat(all_ids, 1)
