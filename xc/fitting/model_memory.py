"""One model's side of the final fusion (xc/fitting/memory.py): its scorer, the points that trained it and its
validation split, its test inputs, its embedding-space neighbour search, and the hard negatives it trained on,
which the lexical ranker pairs with its training points."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from xc.fitting.fusion import ModelScorer
from xc.fitting.knn import Neighbours, dense_neighbours
from xc.fitting.ranker import LexicalRanker


class ModelMemory:
    """One model's side of fusion: its scorer, its training view (memory, validation split), its test inputs
    and its embedding-space searches. `train` is a TrainingView (split_inputs, train_ids, valid_ids);
    `hard_negatives` (training points, c) int64 label ids, -1 pads, by training point: the model's own hard
    negatives (`hard_negatives_by_point`), which the lexical ranker pairs with its training points.
    `trained_ranker`: where this model's own run already trained the lexical ranker on its training points with the
    same settings (an ensemble member's, RUN_DIR/ranker/), a loader of it, so a cross-fitted fold reuses it."""

    def __init__(self, eval_cfg, loss: str, encoder, shard, train, test_inputs, inv_propensity, dataset, ctx,
                 hard_negatives: np.ndarray | None = None):
        self.fc, self.ks, self.topk = eval_cfg.knn_fusion, tuple(eval_cfg.ks), eval_cfg.topk
        self.rc = eval_cfg.ranker
        self.scorer = ModelScorer(encoder, shard, ctx, eval_cfg.batch_size, loss)
        self.train, self.test_inputs, self.inv_propensity = train, test_inputs, inv_propensity
        self.dataset, self.ctx = dataset, ctx
        self.hard_negatives = hard_negatives
        self.trained_ranker: Callable[[], LexicalRanker] | None = None
        self._train_emb: torch.Tensor | None = None

    @classmethod
    def of(cls, cfg, c, dataset, ctx, hard_tables: dict[int, np.ndarray] | None = None) -> ModelMemory:
        """From a run's config and its Components (or anything with encoder, shard, train, test_inputs and
        inv_propensity); `hard_tables` {shard: (training rows, k) label ids}: every shard's hard negatives in use."""
        hard = (hard_negatives_by_point(hard_tables, c.train.train_ids, dataset.train.num_points,
                                        cfg.eval.ranker.hard_negatives) if hard_tables else None)
        return cls(cfg.eval, cfg.sampler.loss, c.encoder, c.shard, c.train, c.test_inputs, c.inv_propensity,
                   dataset, ctx, hard)

    def train_embeddings(self) -> torch.Tensor:
        if self._train_emb is None:
            rows = np.arange(self.dataset.train.num_points, dtype=np.int64)
            self._train_emb = self.scorer.encode(self.train.split_inputs, rows)
        return self._train_emb

    def embedding_neighbours(self, query_emb: torch.Tensor, memory_rows: np.ndarray, max_k: int) -> Neighbours:
        return dense_neighbours(query_emb, self.train_embeddings()[torch.from_numpy(memory_rows)], max_k)


def hard_negatives_by_point(tables: dict[int, np.ndarray], train_ids: np.ndarray, num_points: int,
                            width: int) -> np.ndarray | None:
    """(num_points, c) int64 label ids, -1 pads: each training point's first ceil(width / shards) hard negatives
    of every label shard's table (tables {shard: (training rows, k)}, row r the point train_ids[r]; rows past
    the points are label-text rows), shards in order; points that did not train (validation) get none. The
    tables are each shard's best first, so a run with the same label shards gives the same negatives on any
    number of ranks."""
    if width <= 0 or not tables:
        return None
    per_shard = -(-width // len(tables))
    parts = [np.asarray(tables[s])[:len(train_ids), :per_shard] for s in sorted(tables)]
    out = np.full((num_points, sum(p.shape[1] for p in parts)), -1, dtype=np.int64)
    out[train_ids] = np.concatenate(parts, axis=1)
    return out
