"""Losses on one rank's label range: ASTRA's weighted BCE and sampled softmax over sampled
candidates, and their exact full-label versions.

Each rank computes its part of the *global* batch loss, normalised by the global batch size; the sum
over ranks is the loss of single-process training, so gradients agree across world sizes. BCE splits
over labels by itself. Softmax does not (its denominator spans every shard): each rank reduces its
negatives to one log-sum-exp per query, those are all-gathered with autograd, and every rank computes
the whole batch loss divided by the world size, so the sum over ranks is still the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from xc.distributed import DistContext, all_gather_with_grad
from xc.sampling.base import NegativeDraw, Positives
from xc.sampling.fixed_shapes import is_positive_static, pool_mask_static

# Stands in for -inf in masked logits: exp() of it is exactly 0, yet gradients stay finite.
_MASKED = -1e30


@dataclass
class Candidates:
    """One rank's candidates for the global batch: local_ids (B, C) int64 rows of the rank's range,
    weight (B, C) float32 loss weights (0 = inactive slot), target (B, C) float32 (1 = positive).

    pool_ids (c,) int64 local rows of a batch-shared pool (`sampler.shared_pool`), scored for every query
    after the C per-query columns; None without one. The pool is kept compact until the loss: pool_weight (c,)
    the weight of each column (the same for every query) and pool_hits (2, H) int64 the (query, column) pairs
    where a query's own positive sits in the pool (weight 0 for that query). A dense (B, c) weight and target
    would be 2 x B x c floats built on the host and copied every step: 0.5 GB at B = 2048, where the hard union
    alone is 32k columns. `dense()` gives the (B, C + c) weight and target on the device the loss runs on."""

    local_ids: torch.Tensor
    weight: torch.Tensor
    target: torch.Tensor
    num_pos: int = 0  # the first num_pos columns are the positive slots
    pool_ids: torch.Tensor | None = None
    pool_weight: torch.Tensor | None = None
    pool_hits: torch.Tensor | None = None
    # (B, c) bool, True where a query's own positive sits in the pool column: the fixed-shape form of pool_hits
    # (`train.static_shapes`, xc/sampling/fixed_shapes.py); one of the two is set with a pool
    pool_mask: torch.Tensor | None = None

    def dense(self) -> "Candidates":
        """The same candidates with the pool's columns written out: weight and target (B, C + c)."""
        if self.pool_weight is None:
            return self
        batch, width = self.weight.shape[0], self.pool_weight.numel()
        pool_weight = self.pool_weight.to(self.weight.device).unsqueeze(0).expand(batch, width).clone()
        if self.pool_mask is not None:
            pool_weight = pool_weight.masked_fill(self.pool_mask.to(self.weight.device), 0.0)
        else:
            hits = self.pool_hits.to(self.weight.device)
            pool_weight[hits[0], hits[1]] = 0.0
        target = torch.zeros(batch, width, dtype=self.target.dtype, device=self.target.device)
        return Candidates(self.local_ids, torch.cat([self.weight, pool_weight], 1), torch.cat([self.target, target], 1),
                          self.num_pos, self.pool_ids)


def assemble_candidates(positives: Positives, draws: list[NegativeDraw], lo: int, hi: int,
                        static: bool = False) -> Candidates:
    """Positives falling in [lo, hi) plus every shard draw of this rank, with masking.

    Negatives that are actually positives of the query get weight 0 (ASTRA's L- sums over l not in
    P); empty slots (-1) too. Inactive slots point at local row 0 with weight 0, so they cost a
    gather but contribute nothing. Shared draws (one pool for the batch) go last, as pool_ids, kept compact:
    each query's own positives among them are listed as pool_hits, masked when the loss writes the pool out.
    static (`train.static_shapes`): accidental hits found by torch ops alone, and the pool's as a (B, c) pool_mask,
    so no size depends on the batch (xc/sampling/fixed_shapes.py); the weights are the same.
    """
    pos_in = (positives.ids >= lo) & (positives.ids < hi)
    ids = [torch.where(pos_in, positives.ids - lo, 0)]
    weights = [positives.weight * pos_in]
    targets = [torch.ones_like(positives.weight)]
    pool_ids, pool_weights, pool_hits, columns = [], [], [], 0
    for draw in draws:
        if draw.shared:
            pool = draw.ids[0]
            if static:
                pool_hits.append(pool_mask_static(positives, pool))
            else:
                hits = positives.pool_hits(pool)
                pool_hits.append(hits + torch.tensor([[0], [columns]], device=hits.device))
            pool_ids.append(torch.where(pool >= 0, pool - lo, 0))
            pool_weights.append(draw.weight[0])
            columns += pool.numel()
            continue
        hit = is_positive_static(positives, draw.ids) if static else positives.is_positive(draw.ids)
        active = (draw.ids >= 0) & ~hit
        ids.append(torch.where(active, draw.ids - lo, 0))
        weights.append(draw.weight * active)
        targets.append(torch.zeros_like(draw.weight))
    cand = Candidates(torch.cat(ids, 1), torch.cat(weights, 1), torch.cat(targets, 1), positives.ids.shape[1])
    if pool_ids:
        cand.pool_ids, cand.pool_weight = torch.cat(pool_ids), torch.cat(pool_weights)
        if static:
            cand.pool_mask = torch.cat(pool_hits, 1)
        else:
            cand.pool_hits = torch.cat(pool_hits, 1)
    return cand


def weighted_bce(scores: torch.Tensor, cand: Candidates, normalizer: float) -> torch.Tensor:
    """sum(weight * BCE(score, target)) / normalizer; scores (B, C). BCE with logits is
    softplus(s) - y*s, i.e. log(1+exp(-s)) for positives and softplus(s) for negatives (eq. 1)."""
    cand = cand.dense()
    losses = F.binary_cross_entropy_with_logits(scores, cand.target, reduction="none")
    return (losses * cand.weight).sum() / normalizer


def full_bce(scores: torch.Tensor, positives: Positives, lo: int, num_real: int, normalizer: float) -> torch.Tensor:
    """Exact BCE over every real label of the rank's range — the O(L) reference (Renée's loss).

    scores (B, hi - lo); every positive counts (no subsampling), padding rows are excluded.
    """
    batch, width = scores.shape
    target = torch.zeros_like(scores)
    rows = positives.keys // positives.padded_labels
    labels = positives.keys % positives.padded_labels
    mine = (labels >= lo) & (labels < lo + width)
    target[rows[mine], labels[mine] - lo] = 1.0
    losses = F.binary_cross_entropy_with_logits(scores[:, :num_real], target[:, :num_real], reduction="sum")
    return losses / normalizer


def _softmax_from_parts(neg_lse: torch.Tensor, pos_logit: torch.Tensor, pos_weight: torch.Tensor,
                        normalizer: float, ctx: DistContext | None) -> torch.Tensor:
    """Combine per-rank parts into this rank's share of the batch's sampled-softmax loss.

    neg_lse (B,): log of this rank's (estimated) sum of exp(logit) over negatives; pos_logit (B, P):
    positive logits where this rank holds the label, 0 elsewhere; pos_weight (B, P) the same on every
    rank. Each positive p of a query gets its own softmax against the shared negatives:
        loss_p = log(exp(o_p) + Z) - o_p,   Z = sum over ranks of exp(neg_lse).
    """
    world = 1 if ctx is None or not ctx.active else ctx.world_size
    parts = torch.cat([neg_lse.unsqueeze(1), pos_logit], dim=1)  # (B, 1 + P)
    if world > 1:
        parts = all_gather_with_grad(parts, ctx).reshape(world, *parts.shape)
    else:
        parts = parts.unsqueeze(0)
    log_z = torch.logsumexp(parts[:, :, 0], dim=0)  # (B,)
    logits = parts[:, :, 1:].sum(0)  # (B, P): exactly one rank contributes each positive
    losses = torch.logaddexp(logits, log_z.unsqueeze(1)) - logits
    return (losses * pos_weight).sum() / normalizer / world


def sampled_softmax(scores: torch.Tensor, cand: Candidates, positives: Positives, normalizer: float,
                    ctx: DistContext | None = None, correct: bool = True) -> torch.Tensor:
    """Sampled softmax with logQ correction over this rank's candidates; scores (B, C).

    Negative j enters the denominator as exp(o_j + log w_j): w_j = 1 / (c q_j) is the draw's
    importance weight, so this is o_j - log(c q_j), the logQ-corrected logit ("Adaptive Sampled Softmax with Inverted Multi-Index", eq. 1);
    hard negatives (w = 1) enter as themselves. Accidental hits (w = 0) are removed.
    correct=False drops the correction (every active negative counts once, LNS's loss).
    """
    cand = cand.dense()
    k = cand.num_pos
    neg_scores, neg_w = scores[:, k:], cand.weight[:, k:]
    active = neg_w > 0
    shift = torch.log(neg_w.clamp_min(1e-30)) if correct else torch.zeros_like(neg_w)
    neg = torch.where(active, neg_scores + shift, torch.full_like(neg_scores, _MASKED))
    neg_lse = torch.logsumexp(neg, dim=1) if neg.shape[1] else torch.full((scores.shape[0],), _MASKED)
    mine = cand.weight[:, :k] > 0
    pos_logit = torch.where(mine, scores[:, :k], torch.zeros_like(scores[:, :k]))
    return _softmax_from_parts(neg_lse, pos_logit, positives.weight.to(scores.device), normalizer, ctx)


def full_softmax(scores: torch.Tensor, positives: Positives, lo: int, num_real: int, normalizer: float,
                 ctx: DistContext | None = None) -> torch.Tensor:
    """Exact softmax over every real label of the rank's range (the O(L) reference); scores (B, hi - lo).

    Each (subsampled) positive gets its own softmax against all non-positive labels.
    """
    batch, width = scores.shape
    is_pos = torch.zeros_like(scores, dtype=torch.bool)
    rows = positives.keys // positives.padded_labels
    labels = positives.keys % positives.padded_labels
    here = (labels >= lo) & (labels < lo + width)
    is_pos[rows[here], labels[here] - lo] = True
    real = torch.arange(width, device=scores.device) < num_real
    neg = torch.where(real.unsqueeze(0) & ~is_pos, scores, torch.full_like(scores, _MASKED))
    neg_lse = torch.logsumexp(neg, dim=1)
    ids = positives.ids.to(scores.device)
    mine = (ids >= lo) & (ids < lo + width)
    picked = scores.gather(1, torch.where(mine, ids - lo, 0))
    pos_logit = torch.where(mine, picked, torch.zeros_like(picked))
    return _softmax_from_parts(neg_lse, pos_logit, positives.weight.to(scores.device), normalizer, ctx)
