"""One micro-step's loss in the dual-encoder (label-feature) mode, on this rank's label range.

Candidates S per shard = positives in the shard + hard negatives mined by the shard's TargetCacheSource
from its (possibly stale) label-embedding cache + uniform negatives of the shard. S is then scored with
FRESH label-tower encodings g(text_l) (gradients flow into g; the cache only chose the ids), plus the free
vectors w_l when the model has them, and fed to the existing losses (xc.train.loss): sampled softmax with the
draws' importance weights (logQ correction) or ASTRA's weighted BCE.

Importance weights (NegativeDraw.weight, what the losses read):
- a deterministic top-k source (log_q None): hard negatives weigh 1 and the k_r uniform draws come from
  the rest of the shard with weight (n - k_h) / k_r (ASTRA eq. 2, via `uniform_excluding`);
- a sampling source (log_q given): hard and uniform draws are two unbiased estimators of the shard's sum,
  averaged with weights k_h / (k_h + k_r) and k_r / (k_h + k_r): a hard draw weighs
  1 / ((k_h + k_r) q), a uniform one n / (k_h + k_r).

In-batch negatives (`sampler.inbatch_negatives`, NGAME/DEXA): the batch's own positives I (the labels the
step encodes anyway) join every query's candidates as negatives. I is fixed by the batch before any negative
is drawn, so it is one more deterministic set, exactly like ASTRA's hard set: each id of I counts with
weight 1 (once per query, and not at all where it is the query's own positive), and the estimators above
then estimate the sum over the shard outside I: a top-k source's uniform draws exclude H_q and I (weight
(n - |H_q u I|) / k_r), any other draw that lands in I weighs 0. The loss stays an unbiased estimate of the
full one; the step encodes no extra label.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from xc.data.inputs import InputFn
from xc.distributed import all_reduce
from xc.train.loss import Candidates, assemble_candidates, sampled_softmax, weighted_bce
from xc.models.classifier import ClassifierShard, score
from xc.sampling import NegativeDraw, Positives, StepKey, uniform_excluding
from xc.sampling.target_cache import TargetCacheSource
from xc.shards import ShardLayout


@dataclass
class DualStepResult:
    """loss: this rank's share of the batch loss; unique (U,) local ids of the rank's range scored;
    fresh (U, d) their fresh label-tower encodings (with autograd); free_leaf (U, d) the free-vector leaf
    (None without free vectors)."""

    loss: torch.Tensor
    unique: torch.Tensor
    fresh: torch.Tensor
    free_leaf: torch.Tensor | None


def shared_uniform(hard: torch.Tensor, num_real: int, lo: int, k: int, gen: torch.Generator,
                   exclude_hard: bool) -> NegativeDraw:
    """k uniform draws from the whole shard [lo, lo + num_real), ONE set shared by every query of the batch
    (NGAME/DEXA's shared negatives: the batch encodes k labels, not B * k). Weight num_real / k, so the
    weighted sum estimates the sum over the shard; with `exclude_hard` a draw that is one of the query's
    hard ids weighs 0, and the rest still estimate the sum over the labels outside them without bias:
    each of those is drawn k / num_real times in expectation."""
    batch = hard.shape[0]
    ids = ((torch.rand(1, k, generator=gen, dtype=torch.float64) * num_real).long() + lo).expand(batch, k)
    weight = torch.full((batch, k), num_real / k, dtype=torch.float32)
    if exclude_hard and hard.shape[1]:
        weight = weight * ~(ids.unsqueeze(2) == hard.unsqueeze(1)).any(2)
    return NegativeDraw(ids.contiguous(), weight)


def _dedupe_against(extra: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
    """extra (B, m) with every id that is also in the same row of hard (B, h) replaced by -1."""
    if not hard.shape[1] or not extra.shape[1]:
        return extra
    dup = (extra.unsqueeze(2) == hard.unsqueeze(1)).any(2)
    return torch.where(dup, -1, extra)


def shard_draw(source: TargetCacheSource, emb: torch.Tensor, lo: int, num_real: int, k_hard: int, k_random: int,
               gen: torch.Generator, shared: bool = False, inbatch: torch.Tensor | None = None) -> NegativeDraw:
    """One shard's negatives (B, k_hard + m + k_random) as global ids with importance weights (module doc);
    `shared`: the uniform part is one draw for the whole batch (`shared_uniform`); inbatch (m,) distinct
    global ids of this shard (the batch's positives) added as a deterministic set, m = 0 without."""
    batch = emb.shape[0]
    local, log_q = source.mine(emb.detach(), k_hard, gen)
    hard = local.to(torch.int64) + lo
    extra = torch.zeros((batch, 0), dtype=torch.int64)
    if inbatch is not None and inbatch.numel():
        extra = inbatch.to(torch.int64).unsqueeze(0).expand(batch, -1)
        if log_q is None:  # a hard id that is also in I counts once (as hard)
            extra = _dedupe_against(extra, hard)
    extra_weight = (extra >= 0).float()
    in_extra = (lambda ids: (ids.unsqueeze(2) == extra.unsqueeze(1)).any(2)) if extra.shape[1] else None
    if shared:
        uniform = shared_uniform(torch.cat([hard, extra], 1) if log_q is None else extra, num_real, lo, k_random,
                                 gen, exclude_hard=True)
        if log_q is None:
            hard_weight = torch.ones(hard.shape, dtype=torch.float32)
        else:  # the two estimators averaged, as below
            total = k_hard + k_random
            uniform.weight = uniform.weight * (k_random / total)
            hard_weight = (torch.exp(-log_q.double()) / total).float()
            if in_extra is not None:
                hard_weight = hard_weight * ~in_extra(hard)
        return NegativeDraw(torch.cat([hard, extra, uniform.ids], 1),
                            torch.cat([hard_weight, extra_weight, uniform.weight], 1))
    if log_q is None:
        uniform = uniform_excluding(torch.cat([hard, extra], 1), num_real, lo, k_random, gen)
        hard_weight = torch.ones(hard.shape, dtype=torch.float32)
    else:
        total = k_hard + k_random
        uniform = uniform_excluding(torch.zeros((batch, 0), dtype=torch.int64), num_real, lo, k_random, gen)
        uniform.weight = torch.full((batch, k_random), num_real / total, dtype=torch.float32)
        hard_weight = (torch.exp(-log_q.double()) / total).float()
        if in_extra is not None:  # draws landing in I are counted by I itself
            uniform.weight = uniform.weight * ~in_extra(uniform.ids)
            hard_weight = hard_weight * ~in_extra(hard)
    return NegativeDraw(torch.cat([hard, extra, uniform.ids], 1),
                        torch.cat([hard_weight, extra_weight, uniform.weight], 1))


def batch_positive_ids(positives: Positives, s_lo: int, s_hi: int) -> torch.Tensor:
    """(m,) the distinct global ids of the batch's (kept) positives inside [s_lo, s_hi), sorted."""
    ids = positives.ids[(positives.ids >= s_lo) & (positives.ids < s_hi)]
    return torch.unique(ids)


def draw_dual_candidates(layout: ShardLayout, shards: range, sources: dict[int, TargetCacheSource], emb: torch.Tensor,
                         key: StepKey, positives: Positives, k_hard: int, k_random: int, lo: int, hi: int,
                         shared: bool = False, inbatch: bool = False) -> Candidates:
    """This rank's candidates (host tensors (B, C)) for the global batch; emb (B, d) all-gathered queries.

    k_hard, k_random are PER SHARD. Randomness per shard from key.generator(shard): the same draws
    whichever rank holds the shard. `inbatch`: the batch's positives in the shard join as negatives."""
    draws = []
    for s in shards:
        s_lo, _ = layout.shard_range(s)
        num_real = layout.real_count(s)
        ids = batch_positive_ids(positives, s_lo, s_lo + num_real) if inbatch else None
        draws.append(shard_draw(sources[s], emb, s_lo, num_real, k_hard, k_random, key.generator(s), shared, ids))
    return assemble_candidates(positives, draws, lo, hi)


def dual_loss(label_tower: torch.nn.Module, label_inputs: InputFn, free: ClassifierShard | None, emb: torch.Tensor,
              cand: Candidates, positives: Positives, loss_kind: str, normalizer: float, ctx,
              lo: int) -> DualStepResult:
    """Score the candidates with fresh label encodings and reduce them to this rank's loss share.

    label_tower g in train mode (gradients flow into it); emb (B, d) all-gathered queries (autograd);
    lo = the rank's first global label id."""
    device = emb.device
    # Inactive slots (weight 0: padding, a negative that is a positive) point at an active row, so only rows
    # that count are encoded, and a label is encoded once per step whichever rank holds it.
    active = cand.weight > 0
    fill = cand.local_ids[active].min() if bool(active.any()) else cand.local_ids.new_zeros(())
    unique, inverse = torch.unique(torch.where(active, cand.local_ids, fill), return_inverse=True)
    batch = {k: v.to(device) for k, v in label_inputs(unique.numpy() + lo).items()}
    fresh = label_tower(batch).float()  # (U, d)
    rows, free_leaf = fresh, None
    if free is not None:
        free_leaf = free.weight.index_select(0, unique.to(device)).float().detach().requires_grad_(True)
        rows = fresh + free_leaf
    scores = score(emb, rows, inverse.to(device))
    cand_d = Candidates(cand.local_ids.to(device), cand.weight.to(device), cand.target.to(device), cand.num_pos)
    if loss_kind == "softmax":
        loss = sampled_softmax(scores, cand_d, positives, normalizer, ctx)
    else:
        loss = weighted_bce(scores, cand_d, normalizer)
    return DualStepResult(loss, unique, fresh, free_leaf)


def split_by_shard(layout: ShardLayout, shards: range, unique: torch.Tensor, lo: int) -> dict[int, torch.Tensor]:
    """{shard: positions into `unique` (rank-local ids, sorted) that fall in that shard}."""
    glob = unique + lo
    out = {}
    for s in shards:
        s_lo, s_hi = layout.shard_range(s)
        out[s] = torch.nonzero((glob >= s_lo) & (glob < s_hi)).flatten()
    return out


def all_reduce_grads(params: list[torch.nn.Parameter], ctx) -> None:
    """Sum the towers' gradients over ranks in one flat buffer (the towers' data parallelism).

    Not DDP: a shared tower runs forward twice per step (queries, then label texts), which DDP's reducer
    does not allow before backward. Sum, not mean, for the reason xc.distributed._sum_allreduce_hook gives:
    each rank's loss is its shard's share of the global loss."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not ctx.active:
        return
    flat = all_reduce(torch.cat([p.grad.reshape(-1) for p in params]), ctx)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def as_numpy_ids(ids: torch.Tensor) -> np.ndarray:
    return ids.cpu().numpy().astype(np.int64)
