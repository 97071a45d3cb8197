"""One micro-step's loss of the classifier mode on this rank: positives and sampled negatives in, scored and
reduced.

The trainer owns the loop, the optimisers and the bookkeeping; this module owns what a step
computes: which candidates each rank scores (positives in its range plus its shards' negatives),
the label probes some samplers need, and which loss (BCE or softmax, sampled or full) they feed.
"""

from __future__ import annotations

import numpy as np
import torch

from xc.config import SamplerConfig
from xc.distributed import DistContext, all_reduce
from xc.train.loss import Candidates, assemble_candidates, full_bce, full_softmax, sampled_softmax, weighted_bce
from xc.models.classifier import score
from xc.train.phases import NullTimer
from xc.sampling import Positives, SampleBatch, StepKey
from xc.sampling.fixed_shapes import sample_static

_NO_TIMER = NullTimer()


def shard_rows(c) -> dict[int, torch.Tensor]:
    """Live views (n_real, d) of the real rows of each of this rank's shards (for samplers' indexes)."""
    views = {}
    for shard in c.my_shards:
        lo, _ = c.layout.shard_range(shard)
        start = lo - c.shard.lo
        views[shard] = c.shard.weight[start:start + c.layout.real_count(shard)]
    return views


def label_probe(c, ctx: DistContext, positives: Positives) -> torch.Tensor:
    """(B, d): the classifier vector of each query's first (randomly chosen) positive, zeros where it
    has none; summed over ranks since each label's row lives on exactly one rank (LSH-Label probes)."""
    first = positives.ids[:, 0].to(ctx.device)
    mine = (first >= c.shard.lo) & (first < c.shard.hi)
    rows = c.shard.weight.index_select(0, torch.where(mine, first - c.shard.lo, 0)).float()
    return all_reduce(rows * mine.unsqueeze(1), ctx)


def draw_candidates(sampler_cfg: SamplerConfig, c, ctx: DistContext, rows: np.ndarray | torch.Tensor, key: StepKey,
                    positives: Positives, emb: torch.Tensor | None = None, torch_only: bool = False,
                    static: bool = False) -> Candidates:
    """This rank's candidates (B, C): positives in its range plus its shards' negatives, on the host, or on the
    device of `rows` when they are a tensor there (the device batch path, `torch_only`); static
    (`train.static_shapes`, with torch_only): every size fixed before training, the same draws
    (xc/sampling/fixed_shapes.py).

    emb (B, d) is read only by samplers with needs_embeddings; samplers that need neither it nor a label
    probe can be drawn before the step runs (xc.train.modes.classifier.batches), with the same keyed generators.
    """
    sampler = c.sampler
    query_rows = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.asarray(rows, dtype=np.int64))
    batch = SampleBatch(query_rows, positives, emb.detach() if sampler.needs_embeddings else None,
                        label_probe(c, ctx, positives) if sampler.needs_label_probe else None, torch_only)
    draws = [sample_static(sampler, key, s, batch) if static else sampler.sample(key, s, batch) for s in c.my_shards]
    if not sampler_cfg.logq_correction:  # uncorrected: every sampled negative counts once
        for draw in draws:
            draw.weight = (draw.ids >= 0).float()
    return assemble_candidates(positives, draws, c.shard.lo, c.shard.hi, static)


def batch_loss(sampler_cfg: SamplerConfig, c, ctx: DistContext, emb: torch.Tensor, rows: np.ndarray, key: StepKey,
               positives: Positives, normalizer: float, cand: Candidates | None = None,
               timer=None, features: dict[str, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's share of the global batch loss.

    emb (B, d) all-gathered query embeddings (with autograd); rows (B,) the batch's dataset rows; cand
    this rank's candidates if they were drawn ahead (else drawn here); timer an xc.train.phases timer.
    features: the batch's encoder inputs, read by the lexical rows (model.lexical_features) where the run has them.
    Returns (loss, unique (U,) local row ids scored, rows_leaf (U, d) the differentiable rows, lexical_leaf (U, S)
    the differentiable lexical weights of the same rows, or None).
    """
    timer = timer or _NO_TIMER
    softmax = sampler_cfg.loss == "softmax"
    if c.sampler is None:  # every label: the exact O(L) losses
        rows_leaf = c.shard.all_rows()
        unique = torch.arange(c.shard.num_rows, device=ctx.device)
        scores = emb @ rows_leaf.t()
        pos = to_device(positives, ctx.device)
        timer.mark("classifier_forward")
        if softmax:
            loss = full_softmax(scores, pos, c.shard.lo, c.shard.num_real_rows, normalizer, ctx)
        else:
            loss = full_bce(scores, pos, c.shard.lo, c.shard.num_real_rows, normalizer)
        timer.mark("loss")
        return loss, unique, rows_leaf, None
    if cand is None:
        cand = draw_candidates(sampler_cfg, c, ctx, rows, key, positives, emb)
    cand = to_device(cand, ctx.device)
    if cand.pool_ids is None:
        unique, rows_leaf, inverse = c.shard.gather(cand.local_ids)
        scores = score(emb, rows_leaf, inverse)
    else:  # per-query columns through the gathered rows, the batch's pool as one dense product
        per_query = cand.local_ids.numel()
        unique, rows_leaf, inverse = c.shard.gather(torch.cat([cand.local_ids.reshape(-1), cand.pool_ids]))
        scores = torch.cat([score(emb, rows_leaf, inverse[:per_query].reshape(cand.local_ids.shape)),
                            emb @ rows_leaf.index_select(0, inverse[per_query:]).t()], dim=1)
    lexical_leaf = None
    if c.lexical is not None:
        batch = c.lexical.batch_features(features, emb.shape[0])
        columns, lexical_leaf = c.lexical.gather(unique, batch)
        if cand.pool_ids is None:
            scores = scores + batch.pair_scores(columns, lexical_leaf, inverse)
        else:
            scores = scores + torch.cat([
                batch.pair_scores(columns, lexical_leaf, inverse[:per_query].reshape(cand.local_ids.shape)),
                batch.shared_scores(columns, lexical_leaf, inverse[per_query:])], dim=1)
    timer.mark("classifier_forward")
    if softmax:
        loss = sampled_softmax(scores, cand, to_device(positives, ctx.device), normalizer, ctx)
    else:
        loss = weighted_bce(scores, cand, normalizer)
    timer.mark("loss")
    return loss, unique, rows_leaf, lexical_leaf


def to_device(obj, device: torch.device):
    """Move every tensor field of a small dataclass to `device` (no-op on CPU)."""
    if device.type == "cpu":
        return obj
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            setattr(obj, name, value.to(device, non_blocking=True))
    return obj
