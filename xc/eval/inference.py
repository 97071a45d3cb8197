"""Data-parallel encoding and exact sharded inference (per-shard top-k, merged across ranks)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from xc.ann.exact import exact_topk
from xc.distributed import DistContext, all_gather_no_grad
from xc.models.classifier import ClassifierShard

InputFn = Callable[[np.ndarray], dict[str, torch.Tensor]]


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def encode_rows(encoder: torch.nn.Module, inputs: InputFn, rows: np.ndarray, batch_size: int,
                ctx: DistContext, progress=None) -> torch.Tensor:
    """Embeddings (len(rows), d) of the given dataset rows, on every rank (float32, CPU).

    Ranks split each round of world_size * batch_size rows. Only real rows are encoded: the last round's
    gap is padded with zero embeddings for the gather, not with copies of an input (one long query
    repeated batch_size times once cost gigabytes).
    """
    was_training = encoder.training
    encoder.eval()
    per_round = batch_size * ctx.world_size
    num_rounds = -(-len(rows) // per_round)
    parts = []
    for round_idx in range(num_rounds):
        block = rows[round_idx * per_round:(round_idx + 1) * per_round]
        real = len(block)
        mine = block[ctx.rank * batch_size:(ctx.rank + 1) * batch_size]
        # a rank left without rows still encodes one (for the width), then keeps none of it
        emb = encoder(_to_device(inputs(mine if len(mine) else block[:1]), ctx.device)).float()[:len(mine)]
        if ctx.active and len(mine) < batch_size:
            emb = torch.cat([emb, emb.new_zeros(batch_size - len(mine), emb.shape[1])])
        parts.append(all_gather_no_grad(emb, ctx).cpu()[:real])
        if progress is not None:
            progress.update(real)
    encoder.train(was_training)
    return torch.cat(parts) if parts else torch.empty(0, 0)


def merge_topk(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best k of candidate lists (M, c) -> (M, k), padding with -inf / -1 when c < k."""
    if scores.shape[1] < k:
        pad = k - scores.shape[1]
        scores = torch.cat([scores, torch.full((len(scores), pad), float("-inf"))], 1)
        ids = torch.cat([ids, torch.full((len(ids), pad), -1, dtype=ids.dtype)], 1)
    top, pick = torch.topk(scores, k, dim=1)
    return top, torch.gather(ids, 1, pick)


class ExactSearcher:
    """Exact top-k over this rank's real classifier rows, scores plus the shard's `score_bias` where set."""

    def __init__(self, shard: ClassifierShard):
        self.shard = shard

    def search(self, embeddings: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """embeddings (M, d) on any device -> (scores (M, k), global ids (M, k)) on the CPU. The products run where
        the rows live (the rank's GPU in training): copying 10^7 rows to the host and scoring there made one
        evaluation of 5,000 queries take 188 s on an H100 host."""
        rows = self.shard.weight[:self.shard.num_real_rows]
        scores, local = exact_topk(embeddings, rows, k, row_bias=getattr(self.shard, "score_bias", None))
        return scores, torch.where(local >= 0, local + self.shard.lo, -1)


@torch.no_grad()
def sharded_topk(embeddings: torch.Tensor, searcher, k: int, ctx: DistContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k labels for every query: each rank searches its own label range, then all merge.

    embeddings (M, d) identical on every rank; `searcher.search(emb, k)` gives this rank's candidates
    as global ids. -> (scores (M, k), ids (M, k) global label ids, -1 pad).
    """
    scores, ids = merge_topk(*searcher.search(embeddings, k), k)
    if ctx.active:
        m = embeddings.shape[0]
        all_scores = all_gather_no_grad(scores.to(ctx.device), ctx).cpu()
        all_ids = all_gather_no_grad(ids.to(ctx.device), ctx).cpu()
        scores = all_scores.view(ctx.world_size, m, k).permute(1, 0, 2).reshape(m, -1)
        ids = all_ids.view(ctx.world_size, m, k).permute(1, 0, 2).reshape(m, -1)
        scores, ids = merge_topk(scores, ids, k)
    return scores, ids


# with lexical weights (model.lexical_features): the dense ranking's depth beyond k from which the exact combined
# top-k is completed (xc/models/lexical_rank.py: any depth is exact). Exact search goes 512 deeper: the gap to a
# deeper floor rules out more labels; at 10^7 labels (after one epoch) a query's labels scored beside its dense top
# fell from 63,000 to 16,000 and the ranking of 500 test points from 133 s to 106 s (dense and lexical). An ANN
# index finds the 32 deeper, the depth its breadth is tuned on.
LEXICAL_DENSE_EXTRA = 32
LEXICAL_EXACT_EXTRA = 512


def lexical_depth(k: int, searcher) -> int:
    """The dense depth a lexical ranking of k starts from: k + 512 for exact search, k + 32 for an ANN index."""
    return k + (LEXICAL_EXACT_EXTRA if isinstance(searcher, ExactSearcher) else LEXICAL_DENSE_EXTRA)


def dense_scores_of(shard: ClassifierShard, label_ids: torch.Tensor, embedding: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """(P,) the dense scores of global labels `label_ids` (P,) for one embedding, plus `bias` (the shard's rows,
    e.g. a label prior's) where given."""
    local = (label_ids - shard.lo).to(shard.weight.device)
    scores = shard.weight.index_select(0, local).float() @ embedding.to(shard.weight.device)
    if bias is not None:
        scores = scores + bias.to(shard.weight.device).index_select(0, local).float()
    return scores.cpu()


def _installed_scores(shard: ClassifierShard):
    """dense_of for `LexicalRows.rerank`: the dense scores with the bias installed on the shard."""
    return lambda label_ids, e: dense_scores_of(shard, label_ids, e, shard.score_bias)


def lexical_topk(lexical, shard: ClassifierShard, searcher, inputs: InputFn, rows: np.ndarray, emb: torch.Tensor,
                 scores: torch.Tensor, ids: torch.Tensor, k: int, depth: int,
                 ctx: DistContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k of dense + lexical scores (model.lexical_features) of `rows`, from their dense top `depth`
    (scores, ids); queries that depth did not settle are ranked again 4x deeper, until it does (at most every
    label)."""
    top, top_ids, exact = lexical.rerank(inputs(rows), emb, scores, ids, k, _installed_scores(shard))
    return settle_deeper(lexical, shard, searcher, inputs, rows, emb, top, top_ids, exact, k, depth, ctx)


def settle_deeper(lexical, shard: ClassifierShard, searcher, inputs: InputFn, rows: np.ndarray, emb: torch.Tensor,
                  top: torch.Tensor, top_ids: torch.Tensor, exact: np.ndarray, k: int, depth: int,
                  ctx: DistContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank the queries a dense depth `depth` left unsettled (`exact` False) again 4x deeper, until it settles them
    (at most every label); the shard's score bias as installed. -> (scores (M, k), ids (M, k))."""
    dense_of = _installed_scores(shard)
    while not exact.all() and depth < shard.num_labels:
        depth *= 4
        redo = np.nonzero(~exact)[0]
        deeper, deeper_ids = sharded_topk(emb[redo], searcher, depth, ctx)
        top[redo], top_ids[redo], exact[redo] = lexical.rerank(inputs(rows[redo]), emb[redo], deeper, deeper_ids, k,
                                                               dense_of)
    return top, top_ids


def predict(encoder: torch.nn.Module, shard: ClassifierShard, inputs: InputFn, rows: np.ndarray, k: int,
            batch_size: int, ctx: DistContext, progress=None, searcher=None) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (scores (N, k) float32, ids (N, k) int64) for dataset rows, in blocks to bound memory.

    `searcher` defaults to exact search over the shard; `xc.serve.ann.AnnSearcher` uses ANN indexes.
    """
    searcher = searcher or ExactSearcher(shard)
    lexical = getattr(shard, "lexical", None)
    dense_k = k if lexical is None else lexical_depth(k, searcher)
    out_scores, out_ids = [], []
    block = max(batch_size * ctx.world_size, 8192)
    for start in range(0, len(rows), block):
        emb = encode_rows(encoder, inputs, rows[start:start + block], batch_size, ctx, progress)
        scores, ids = sharded_topk(emb, searcher, dense_k, ctx)
        if lexical is not None:
            scores, ids = lexical_topk(lexical, shard, searcher, inputs, rows[start:start + block], emb, scores, ids,
                                       k, dense_k, ctx)
        out_scores.append(scores.numpy())
        out_ids.append(ids.numpy())
    return np.concatenate(out_scores), np.concatenate(out_ids)
