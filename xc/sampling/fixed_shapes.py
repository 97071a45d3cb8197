"""Draws with fixed shapes, for a step that is captured once and replayed (`train.static_shapes`).

A CUDA graph (or torch.compile(mode="reduce-overhead")) replays kernels whose tensor sizes were fixed when it was
captured, and it cannot wait for the host. The dynamic draws have three sizes that depend on the batch:
- the positives' subsample flattens the batch's label rows into nnz entries (nnz = the batch's positives);
- the positives' match table is as wide as the batch's most-labelled query;
- the shared pool's hard union (`torch.unique`) has as many columns as the batch's distinct hard negatives.
Here each is padded to a bound known before training, with masks, and nothing reads a device value on the host:
- positives: each query's labels padded to P = the most positives of any training row (-1 = none);
- the hard union: padded to B * h (every hard slot distinct), -1 past the distinct ids, weight 0 there.

Each function draws exactly what its dynamic counterpart (base.draw_positives, samplers.shared_pool) draws from
the same generator: the same ids, weights and log-q corrections where the masks allow; a padded slot has weight 0
and contributes nothing to the loss. One caveat: the subsample's random keys are the first nnz numbers of a
stream of B * P; a CPU generator's stream has the same prefix whatever its length (so the tests compare the two
paths bit for bit on the CPU), a CUDA generator's need not, and there the draws are equal in distribution.

The per-query draws need nothing here: the hard-negative lookup is a gather of a (B, h) block, and the torch-only
uniform draws (samplers.uniform_excluding(torch_only=True)) are (B, k) with no data-dependent branch.
"""

from __future__ import annotations

import torch

from xc.sampling.base import TABLE_MAX_POSITIVES, NegativeDraw, Positives, SampleBatch, Sampler, StepKey, as_batch
from xc.sampling.proposal import PopularityProposal
from xc.sampling.samplers import AstraSampler, UniformSampler, random_part

# Padding of the sorted positive keys: larger than any real key (query_row * padded_L + label), so the real keys
# stay a sorted prefix and a binary search never matches a pad.
KEY_PAD = torch.iinfo(torch.int64).max


def draw_positives_static(ids: torch.Tensor, counts: torch.Tensor, k_pos: int, padded_labels: int,
                          gen: torch.Generator) -> Positives:
    """Positives of a batch from its label rows padded to a fixed width.

    ids (B, P) int64 global label ids, each row's labels first (in the CSR's order), -1 after; counts (B,) int64
    the labels of each row (<= P). Returns Positives with ids (B, k_pos) and weight (B, k_pos) as
    base.draw_positives gives them, keys (B * P,) sorted with KEY_PAD after the real keys, and table (B, P) (None
    where P > TABLE_MAX_POSITIVES, where is_positive searches the keys instead).

    The dynamic draw sorts one flat list by row * 2 + key; here each row's keys are sorted on their own. Both put a
    row's entries in the order of their keys, so both keep the same k_pos entries (two equal float64 keys in one
    row, the only case that could order them apart, has probability ~P^2 / 2^53). Positives.pool_hits must not
    be given these keys (a pad's row, KEY_PAD // padded_L, is no query): the static assembly masks the pool with
    pool_mask_static instead.
    """
    batch, width = ids.shape
    device = ids.device
    column = torch.arange(width, device=device)
    valid = column.unsqueeze(0) < counts.unsqueeze(1)  # (B, P)
    starts = torch.cumsum(counts, 0) - counts
    # draw_positives gives entry j of row r key number starts[r] + j of one stream of nnz keys: a stream of B * P
    # keys from the same generator begins with the same nnz numbers; the pads take none of them
    stream = torch.rand(batch * width, generator=gen, dtype=torch.float64, device=device)
    slot = torch.where(valid, starts.unsqueeze(1) + column, 0)
    keys = stream[slot].masked_fill(~valid, float("inf"))
    # per row the smallest keys first (pads last): the first k_pos are draw_positives' uniform subset
    order = torch.argsort(keys, dim=1)
    take = min(k_pos, width)
    kept = torch.arange(take, device=device).unsqueeze(0) < counts.unsqueeze(1)
    picked = torch.where(kept, ids.gather(1, order[:, :take]), -1)
    out = torch.full((batch, k_pos), -1, dtype=torch.int64, device=device)
    out[:, :take] = picked
    per_row_weight = torch.where(counts > k_pos, counts.double() / k_pos, torch.ones_like(counts, dtype=torch.float64))
    weight = (out >= 0).float() * per_row_weight.float().unsqueeze(1)
    rows = torch.arange(batch, device=device).unsqueeze(1)
    all_keys = torch.sort(torch.where(valid, rows * padded_labels + ids, KEY_PAD).reshape(-1)).values
    table = torch.where(valid, ids, -1) if width <= TABLE_MAX_POSITIVES else None
    return Positives(out, weight, all_keys, padded_labels, table)


def is_positive_static(positives: Positives, neg_ids: torch.Tensor) -> torch.Tensor:
    """(B, C) global ids -> (B, C) bool, True where the id is one of that query's positives: Positives.is_positive
    without its host filter (a CPU batch there goes through numpy), by the table or the keys' binary search."""
    return positives.by_table(neg_ids) if positives.table is not None else positives.by_search(neg_ids)


def pool_mask_static(positives: Positives, pool_ids: torch.Tensor) -> torch.Tensor:
    """(c,) ids of a batch-shared pool (-1 = empty) -> (B, c) bool, True where a query's own positive sits in the
    column: the dense form of Positives.pool_hits, whose (2, H) list has a data-dependent length. B x c bools are
    what the loss's dense pool weight costs anyway."""
    batch = positives.ids.shape[0]
    return is_positive_static(positives, pool_ids.unsqueeze(0).expand(batch, -1))


def union_static(hard: torch.Tensor) -> torch.Tensor:
    """(B, h) hard negatives (-1 = empty) -> (B * h,) their distinct ids in ascending order, then -1: the first
    |U| entries are torch.unique(hard[hard >= 0]), whose size the host would have to read.

    Sorted with the empty slots last, an id is kept where it differs from its left neighbour; the kept ids are
    scattered to their rank among the kept (a cumulative count), the others to one spare slot dropped after."""
    flat = hard.reshape(-1)
    size = flat.numel()
    big = torch.iinfo(torch.int64).max
    ordered = torch.sort(torch.where(flat >= 0, flat, big)).values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    first &= ordered != big
    rank = torch.cumsum(first.long(), 0) - 1
    out = torch.full((size + 1,), -1, dtype=torch.int64, device=hard.device)
    out.scatter_(0, torch.where(first, rank, size), torch.where(first, ordered, -1))
    return out[:size]


def shared_pool_static(hard: torch.Tensor, num_real: int, lo: int, k: int, gen: torch.Generator,
                       proposal: PopularityProposal | None = None, shard: int = 0) -> NegativeDraw:
    """samplers.shared_pool with the hard union padded: ids and weight (1, B * h + k), the union's columns
    (union_static: distinct ids, then -1 with weight 0) followed by the same k draws from the same generator
    (uniform, or from `proposal`), each weighted as there and zeroed where it falls in the union."""
    device = hard.device
    union = union_static(hard)
    draws, uniform_weight, _ = random_part(num_real, lo, (k,), gen, proposal, shard)
    if union.numel():
        # membership by binary search in the sorted union (its -1 pads mapped past every id): a fixed-size isin
        big = torch.iinfo(torch.int64).max
        ordered = torch.where(union >= 0, union, big)
        at = torch.searchsorted(ordered, draws).clamp_max(union.numel() - 1)
        uniform_weight = uniform_weight * (ordered[at] != draws)
    ids = torch.cat([union, draws]).unsqueeze(0)
    weight = torch.cat([(union >= 0).float(), uniform_weight]).unsqueeze(0)
    return NegativeDraw(ids, weight, shared=True)


def sample_static(sampler: Sampler, key: StepKey, shard: int, batch: SampleBatch | torch.Tensor) -> NegativeDraw:
    """The sampler's draw for one shard with fixed shapes: its shared pool by shared_pool_static (astra, curriculum
    and uniform with `sampler.shared_pool`), every other draw by the sampler itself, whose torch-only per-query
    draws are fixed-shape already. The generator and the order of its calls are the sampler's own.

    Shapes, for a batch of B queries and the h = hard_slots() stored hard negatives the epoch uses:
    - a shared pool: ids and weight (1, B * h + k), k = PoolBudget.uniform(B, h) (h = 0 for uniform, or before
      the first hard negatives); log_q None, as for the dynamic pool;
    - per query (astra, curriculum): ids, weight and log_q (B, k_hard + k_random), the hard block first;
    - hard: ids and weight (B, k_hard); uniform: (B, k_random + k_hard).
    Within an epoch h is fixed (the curriculum moves it at epoch boundaries), so a captured step is re-captured at
    most once an epoch."""
    batch = as_batch(batch)
    if not isinstance(sampler, (AstraSampler, UniformSampler)) or not sampler.pool.on:
        return sampler.sample(key, shard, batch)
    query_rows, device = batch.query_rows, batch.query_rows.device
    lo, _ = sampler.layout.shard_range(shard)
    use = 0
    proposal = sampler.proposal if isinstance(sampler, AstraSampler) else None
    if isinstance(sampler, AstraSampler) and sampler.hard is not None:
        use = sampler.hard_slots()
    hard = sampler.hard.rows(shard, query_rows)[:, :use] if use else \
        torch.empty(len(query_rows), 0, dtype=torch.int64, device=device)
    return shared_pool_static(hard, sampler.layout.real_count(shard), lo, sampler.pool.uniform(len(query_rows), use),
                              key.generator(shard, device), proposal, shard)
