"""Losses on one rank's label range: ASTRA's weighted BCE over sampled candidates, and full BCE.

Each rank computes its shard's part of the *global* batch loss, normalised by the global batch size;
the sum over ranks is the loss of single-process training, so gradients agree across world sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from xc.sampling.base import NegativeDraw, Positives


@dataclass
class Candidates:
    """One rank's candidates for the global batch: local_ids (B, C) int64 rows of the rank's range,
    weight (B, C) float32 loss weights (0 = inactive slot), target (B, C) float32 (1 = positive)."""

    local_ids: torch.Tensor
    weight: torch.Tensor
    target: torch.Tensor


def assemble_candidates(positives: Positives, draws: list[NegativeDraw], lo: int, hi: int) -> Candidates:
    """Positives falling in [lo, hi) plus every shard draw of this rank, with masking.

    Negatives that are actually positives of the query get weight 0 (ASTRA's L- sums over l not in
    P); empty slots (-1) too. Inactive slots point at local row 0 with weight 0, so they cost a
    gather but contribute nothing.
    """
    pos_in = (positives.ids >= lo) & (positives.ids < hi)
    ids = [torch.where(pos_in, positives.ids - lo, 0)]
    weights = [positives.weight * pos_in]
    targets = [torch.ones_like(positives.weight)]
    for draw in draws:
        active = (draw.ids >= 0) & ~positives.is_positive(draw.ids)
        ids.append(torch.where(active, draw.ids - lo, 0))
        weights.append(draw.weight * active)
        targets.append(torch.zeros_like(draw.weight))
    return Candidates(torch.cat(ids, 1), torch.cat(weights, 1), torch.cat(targets, 1))


def weighted_bce(scores: torch.Tensor, cand: Candidates, normalizer: float) -> torch.Tensor:
    """sum(weight * BCE(score, target)) / normalizer; scores (B, C). BCE with logits is
    softplus(s) - y*s, i.e. log(1+exp(-s)) for positives and softplus(s) for negatives (eq. 1)."""
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
