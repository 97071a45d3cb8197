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


class KnownTops:
    """Exact rankings already made of a model as it scores now, kept for the final phase to read again instead of
    ranking the same queries anew: each entry the query set (its InputFn and dataset rows) and its top (scores (n, w),
    label ids (n, w)). At 10^7 labels a ranking of 5,000 points is 8-11 minutes on 2 cores, and the final phase read
    the last epoch's test and validation rankings again for the fusion. The owner clears it whenever the model's
    scores change (weights loaded or trained, a label prior installed)."""

    def __init__(self):
        self._entries: list[tuple] = []

    def add(self, inputs, rows: np.ndarray, scores: np.ndarray, ids: np.ndarray) -> None:
        self._entries = [e for e in self._entries if not (e[0] is inputs and np.array_equal(e[1], rows))]
        self._entries.append((inputs, np.asarray(rows).copy(), scores, ids))

    def clear(self) -> None:
        self._entries = []

    def top(self, queries, width: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The kept top `width` of `queries` (InputFn, rows), or None where none as wide is kept for them. An exact
        ranking's top `width` is the first `width` of a wider one (ties go to the lower label id)."""
        if queries is None:
            return None
        inputs, rows = queries
        for known_inputs, known_rows, scores, ids in self._entries:
            if known_inputs is inputs and ids.shape[1] >= width and np.array_equal(known_rows, rows):
                return scores[:, :width], ids[:, :width]
        return None


class ModelMemory:
    """One model's side of fusion: its scorer, its training view (memory, validation split), its test inputs
    and its embedding-space searches. `train` is a TrainingView (split_inputs, train_ids, valid_ids);
    `hard_negatives` (training points, c) int64 label ids, -1 pads, by training point: the model's own hard
    negatives (`hard_negatives_by_point`), which the lexical ranker pairs with its training points.
    `trained_ranker`: where this model's own run already trained the lexical ranker on its training points with the
    same settings (an ensemble member's, RUN_DIR/ranker/), a loader of it, so a cross-fitted fold reuses it.
    `known`: rankings of the model as it scores now that its exact tops are read from (`KnownTops`)."""

    def __init__(self, eval_cfg, loss: str, encoder, shard, train, test_inputs, inv_propensity, dataset, ctx,
                 hard_negatives: np.ndarray | None = None, known: KnownTops | None = None):
        self.fc, self.ks, self.topk = eval_cfg.knn_fusion, tuple(eval_cfg.ks), eval_cfg.topk
        self.rc = eval_cfg.ranker
        self.scorer = ModelScorer(encoder, shard, ctx, eval_cfg.batch_size, loss)
        self.train, self.test_inputs, self.inv_propensity = train, test_inputs, inv_propensity
        self.dataset, self.ctx = dataset, ctx
        self.hard_negatives = hard_negatives
        self.known = known or KnownTops()
        self.trained_ranker: Callable[[], LexicalRanker] | None = None
        self._train_emb: torch.Tensor | None = None

    @classmethod
    def of(cls, cfg, c, dataset, ctx, hard_tables: dict[int, np.ndarray] | None = None,
           known: KnownTops | None = None) -> ModelMemory:
        """From a run's config and its Components (or anything with encoder, shard, train, test_inputs and
        inv_propensity); `hard_tables` {shard: (training rows, k) label ids}: every shard's hard negatives in use."""
        hard = (hard_negatives_by_point(hard_tables, c.train.train_ids, dataset.train.num_points,
                                        cfg.eval.ranker.hard_negatives) if hard_tables else None)
        return cls(cfg.eval, cfg.sampler.loss, c.encoder, c.shard, c.train, c.test_inputs, c.inv_propensity,
                   dataset, ctx, hard, known)

    def top(self, emb: torch.Tensor, width: int, queries=None) -> tuple[np.ndarray, np.ndarray]:
        """The model's exact top `width` (scores (n, w), ids (n, w)) of queries `emb` (n, d), encoded from `queries`
        (InputFn, rows): read from `known` where it holds them, else searched."""
        return self.known.top(queries, width) or self.scorer.top(emb, width, queries)

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
