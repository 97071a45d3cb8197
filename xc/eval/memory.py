"""Final evaluation with instance memory (`eval.knn_fusion`): choose lam, k and the space on the
validation split, then report the fused model on test beside the plain model and the kNN vote alone.

Every rank runs this (the model side is collective over label shards); the neighbour searches are
deterministic numpy/torch, so every rank reaches the same choice without communicating it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from xc.config import XCConfig
from xc.distributed import broadcast_object
from xc.eval.fusion import Candidates, FusionChoice, ModelScorer, build_candidates, choose, fixed_choice, votes_for
from xc.eval.knn import (LabelVotes, MixedVotes, Neighbours, dense_neighbours, input_vectors, input_weights,
                         labels_csr, sparse_neighbours)
from xc.eval.metrics import evaluate as evaluate_metrics
from xc.eval.metrics import precision_at_k, true_labels
from xc.fsutil import write_json_atomic

if TYPE_CHECKING:  # the training components are only read here; eval/ never imports training
    from xc.train.components import Components

log = logging.getLogger(__name__)


class MemoryEvaluation:
    """Holds what both phases (validation choice, test) share: the scorer and the searchable spaces."""

    def __init__(self, cfg: XCConfig, c: Components, dataset, ctx):
        self.cfg, self.c, self.dataset, self.ctx = cfg, c, dataset, ctx
        self.fc = cfg.eval.knn_fusion
        self.scorer = ModelScorer(c.encoder, c.shard, ctx, cfg.eval.batch_size, cfg.sampler.loss)
        self.width = max(self.fc.candidates, cfg.eval.topk)
        features = dataset.train.features
        self.spaces = [s for s in self.fc.spaces if s == "embedding" or features is not None]
        self.weights = (input_weights(features, bool(dataset.meta.get("text_features")))
                        if features is not None else None)
        self.max_k = max(self.fc.ks + ([self.fc.k] if self.fc.k else []))
        self._train_emb: torch.Tensor | None = None

    # ----------------------------------------------------------------- searches
    def _train_embeddings(self) -> torch.Tensor:
        if self._train_emb is None:
            rows = np.arange(self.dataset.train.num_points, dtype=np.int64)
            self._train_emb = self.scorer.encode(self.c.train.split_inputs, rows)
        return self._train_emb

    def neighbours(self, space: str, query_split, query_rows: np.ndarray, query_emb: torch.Tensor,
                   memory_rows: np.ndarray) -> dict[str, Neighbours]:
        """{base space: neighbours} that `space` needs ("both" = input and embedding)."""
        bases = ("input", "embedding") if space == "both" else (space,)
        return {b: self._search(b, query_split, query_rows, query_emb, memory_rows) for b in bases}

    def _search(self, space: str, query_split, query_rows: np.ndarray, query_emb: torch.Tensor,
                memory_rows: np.ndarray) -> Neighbours:
        if space == "input":
            queries = input_vectors(query_split.features, self.weights, query_rows)
            memory = input_vectors(self.dataset.train.features, self.weights, memory_rows)
            return sparse_neighbours(queries, memory, self.max_k)
        return dense_neighbours(query_emb, self._train_embeddings()[torch.from_numpy(memory_rows)], self.max_k)

    def candidates(self, k: int, nbrs: dict[str, Neighbours], memory_rows: np.ndarray, emb: torch.Tensor,
                   model: tuple[np.ndarray, np.ndarray], width: int | None = None) -> Candidates:
        memory = labels_csr(self.dataset.train.labels, memory_rows)
        parts = [votes_for(n, k, memory, self.dataset.num_labels) for n in nbrs.values()]
        votes: LabelVotes | MixedVotes = parts[0] if len(parts) == 1 else MixedVotes(parts)
        return build_candidates(self.scorer, emb, model[0], model[1], votes, width or self.width)

    # ----------------------------------------------------------------- phases
    def choose_on_validation(self) -> tuple[FusionChoice, list]:
        """The fixed choice when `eval.knn_fusion` gives lam, k and space; otherwise the best grid point
        on the validation split (memory = the points that trained the model)."""
        fc = self.fc
        if fc.lam is not None:
            return fixed_choice(fc, self.spaces), []
        train = self.c.train
        valid_rows = train.valid_ids
        memory_rows = train.train_ids
        emb = self.scorer.encode(train.split_inputs, valid_rows)
        model = self.scorer.top(emb, self.width)
        indptr, indices = true_labels(self.dataset.train.labels, valid_rows)
        ks = tuple(self.cfg.eval.ks)

        def metric(ids: np.ndarray) -> float:
            return float(np.mean(list(precision_at_k(ids, indptr, indices, ks).values())))

        grid, found = {}, {}
        for space in self.spaces:
            for base in (("input", "embedding") if space == "both" else (space,)):
                if base not in found:
                    found[base] = self._search(base, self.dataset.train, valid_rows, emb, memory_rows)
            nbrs = {b: found[b] for b in (("input", "embedding") if space == "both" else (space,))}
            for k in fc.ks:
                grid[(space, k)] = self.candidates(k, nbrs, memory_rows, emb, model)
        return choose(grid, fc.lambdas, max(ks), metric, fc.temperatures)

    def fused_candidates(self, choice: FusionChoice, query_split, rows: np.ndarray, emb: torch.Tensor,
                         width: int | None = None) -> Candidates:
        """Candidates of queries `rows` of `query_split` (anything with `.features`, a SparseMatrix or None)
        with embeddings emb (M, d); memory = every training point. `width` (default: the configured one)
        is raised to at least the configured width."""
        memory_rows = np.arange(self.dataset.train.num_points, dtype=np.int64)
        width = max(self.width, width or 0)
        model = self.scorer.top(emb, width)
        nbrs = self.neighbours(choice.space, query_split, rows, emb, memory_rows)
        return self.candidates(choice.k, nbrs, memory_rows, emb, model, width).at_temperature(choice.temperature)

    def test_metrics(self, choice: FusionChoice, rows: np.ndarray) -> dict[str, float]:
        """Metrics on test rows (rank 0; {} elsewhere): the fused model under the plain keys, and
        `model/...` (lam = 0) and `knn/...` (lam = 1, the vote alone) beside them. The fused top-k
        (scores, ids) stay in `self.test_predictions` (for `xc-eval --predictions`)."""
        c, dataset = self.c, self.dataset
        emb = self.scorer.encode(c.test_inputs, rows)
        cands = self.fused_candidates(choice, dataset.test, rows, emb)
        self.test_predictions = cands.fuse(choice.lam, self.cfg.eval.topk)
        if not self.ctx.is_main:
            return {}
        indptr, indices = true_labels(dataset.test.labels, rows)
        ks, topk = tuple(self.cfg.eval.ks), self.cfg.eval.topk

        def score(lam: float) -> dict[str, float]:
            return evaluate_metrics(cands.fuse(lam, topk)[1], indptr, indices, c.inv_propensity, ks=ks)

        out = score(choice.lam)
        out.update({f"model/{k}": v for k, v in score(0.0).items()})
        out.update({f"knn/{k}": v for k, v in score(1.0).items()})
        return out


def fusion_record(choice: FusionChoice, tried: list, valid_points: int, choose_seconds: float,
                  test_seconds: float) -> dict:
    """What RUN_DIR/fusion.json holds: the choice, validation P@k of the plain and the fused model, the grid."""
    at_zero = [t["value"] for t in tried if t["lambda"] == 0.0]
    return dict(choice.as_dict(), valid_points=int(valid_points),
                valid_model=round(100 * at_zero[0], 3) if at_zero else None,
                valid_fused=round(100 * max(t["value"] for t in tried), 3) if tried else None, grid=tried,
                choose_seconds=round(choose_seconds, 2), test_seconds=round(test_seconds, 2))


def evaluate_with_memory(cfg: XCConfig, c: Components, dataset, ctx, rows: np.ndarray) -> tuple[dict, dict]:
    """(metrics, fusion record) of the final evaluation; metrics are {} off rank 0."""
    start = time.perf_counter()
    mem = MemoryEvaluation(cfg, c, dataset, ctx)
    choice, tried = mem.choose_on_validation()
    chosen_at = time.perf_counter()
    metrics = mem.test_metrics(choice, rows)
    record = fusion_record(choice, tried, len(c.train.valid_ids), chosen_at - start, time.perf_counter() - chosen_at)
    if ctx.is_main:
        log.info("kNN fusion: lambda %.2f, k %d, %s space, model at temperature %g (chosen on %d validation points "
                 "in %.1fs); P@1 fused %.2f, model %.2f, kNN %.2f", choice.lam, choice.k, choice.space,
                 choice.temperature, len(c.train.valid_ids),
                 chosen_at - start, metrics.get("P@1", 0.0), metrics.get("model/P@1", 0.0), metrics.get("knn/P@1", 0.0))
    return metrics, record


def final_fused_metrics(cfg: XCConfig, c: Components, dataset, ctx, logger, epoch: int, step: int) -> dict | None:
    """The trainer's final metrics with kNN fusion, on every rank, when fusion is on and has a validation
    split (or a fixed lambda); None otherwise. The choice and its grid go to RUN_DIR/fusion.json, the
    metrics to log.jsonl as an `eval_fusion` event."""
    fc = cfg.eval.knn_fusion
    if not fc.enabled or (fc.lam is None and not len(c.train.valid_ids)):
        return None
    if fc.max_train_points and dataset.train.num_points > fc.max_train_points:
        log.info("kNN fusion skipped: %d training points exceed eval.knn_fusion.max_train_points=%d",
                 dataset.train.num_points, fc.max_train_points)
        return None
    n = c.test.num_points if not cfg.eval.max_points else min(cfg.eval.max_points, c.test.num_points)
    metrics, record = evaluate_with_memory(cfg, c, dataset, ctx, np.arange(n, dtype=np.int64))
    if ctx.is_main:
        write_json_atomic(os.path.join(cfg.run_dir, "fusion.json"), record)
        logger.event("eval_fusion", epoch=epoch, global_step=step,
                     fusion={k: v for k, v in record.items() if k != "grid"}, **metrics)
    return broadcast_object(metrics, ctx)
