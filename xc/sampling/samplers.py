"""Uniform, stale-hard, ASTRA-mixture and curriculum samplers, stratified per label shard.

ASTRA's estimator (eq. 2) for shard s with n_s real labels, k_h stored hard negatives H and k_r
uniform draws R from the shard's labels outside H:
    L_s(x) = sum_{l in H} softplus(s_l) + (n_s - |H|) / k_r * sum_{l in R} softplus(s_l)
(positives excluded from both). Summed over shards this is unbiased for the full negative sum.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from xc.config import SamplerConfig
from xc.errors import ConfigError
from xc.sampling.base import HardNegativeSet, NegativeDraw, SampleBatch, Sampler, ShardRows, StepKey, as_batch
from xc.sampling.proposal import PopularityProposal, inclusion_from_proposal
from xc.shards import ShardLayout


# Rejection rounds before the remaining draws fall back to the exact mapping past the excluded ids.
REJECTION_ROUNDS = 8
# Entries of the hashed membership filter (a power of two; one byte each, zeroed per call): it does not grow with
# the shard, and with 4,096 excluded ids a batch, 0.4% of the allowed draws hit it and are compared with their row.
FILTER_BITS = 1 << 20


def uniform_excluding(excluded: torch.Tensor, num_real: int, lo: int, k: int,
                      gen: torch.Generator, torch_only: bool = False) -> NegativeDraw:
    """k uniform draws (with replacement) per query from [lo, lo + num_real) minus `excluded`.

    excluded (B, h) global ids inside the range, -1 for empty slots, distinct within a row.
    Weight per draw = (num_real - |excluded_row|) / k, so the weighted sum estimates the sum over
    every non-excluded label of the range.

    Where the excluded ids are at most half of every row's range, by rejection: draw from the whole range
    and draw again where a draw hit its row's excluded ids, found through a hashed filter of the batch's
    excluded ids, so only the rare filter hits are compared with their row. A (B, k, h) compare for every
    draw was a fifth of a 10^6-label step's batch assembly (docs/gpu_path.md). Otherwise, and for
    the draws still excluded after REJECTION_ROUNDS rounds, the u-th allowed label is found exactly by
    counting the excluded ids below it (`_past_excluded`). Both give i.i.d. uniform draws over the
    allowed labels.

    torch_only (and excluded on a GPU): every draw by the exact mapping, in torch ops on excluded's device with
    no data-dependent branch, so a GPU draws a batch without waiting for its own results (the device batch
    path, xc/train/modes/classifier/device_batches.py); the draws then differ from the host's but have the same
    distribution.
    """
    batch, device = excluded.shape[0], excluded.device
    valid = excluded >= 0
    num_allowed = num_real - valid.sum(1)  # (B,)
    # distinct ids: only a row as wide as the shard can leave nothing (checked without a device sync otherwise)
    if excluded.shape[1] >= num_real and bool((num_allowed <= 0).any()):
        raise ConfigError("sampler.k_hard", f"a shard of {num_real} labels has no label left for uniform negatives")
    weight = (num_allowed.double() / k).float().unsqueeze(1).expand(batch, k).contiguous()
    log_q = (-torch.log(num_allowed.double())).float().unsqueeze(1).expand(batch, k).contiguous()
    if not excluded.shape[1]:
        u = torch.randint(0, num_real, (batch, k), generator=gen, device=device)
        return NegativeDraw(u + lo, weight, log_q)
    offsets = torch.where(valid, excluded - lo, -1)  # (B, h) offsets in the range, -1 = empty
    if torch_only or device.type != "cpu":
        return NegativeDraw(_past_excluded(offsets, num_allowed, k, gen) + lo, weight, log_q)
    if not bool(valid.any()):
        u = torch.randint(0, num_real, (batch, k), generator=gen)
        return NegativeDraw(u + lo, weight, log_q)
    if bool((2 * valid.sum(1) > num_real).any()):  # rejection would waste most draws
        return NegativeDraw(_past_excluded(offsets, num_allowed, k, gen) + lo, weight, log_q)
    u = torch.randint(0, num_real, (batch, k), generator=gen)
    flat_u, off = u.numpy().reshape(-1), offsets.numpy()  # numpy views: its small gathers cost less here
    # keyed by (row, offset), so a small shard's draws do not all hit other rows' excluded ids
    filt = np.zeros(FILTER_BITS, dtype=np.bool_)
    row_base = np.arange(batch, dtype=np.int64)[:, None] * num_real
    filt[(row_base + off)[off >= 0] & (FILTER_BITS - 1)] = True
    check = np.arange(flat_u.size)  # draws to test against their row's excluded ids
    for _ in range(REJECTION_ROUNDS):
        # the filter's hits: the draws that are excluded, and about h B / FILTER_BITS of the others
        check = check[filt[(check // k * num_real + flat_u[check]) & (FILTER_BITS - 1)]]
        bad = check[(flat_u[check][:, None] == off[check // k]).any(1)]
        if not bad.size:
            return NegativeDraw(u + lo, weight, log_q)
        flat_u[bad] = torch.randint(0, num_real, (bad.size,), generator=gen).numpy()
        check = bad
    check = check[(flat_u[check][:, None] == off[check // k]).any(1)]
    for r in np.unique(check // k).tolist():  # vanishingly rare: a draw excluded REJECTION_ROUNDS times running
        cols = check[check // k == r] % k
        u[r, cols] = _past_excluded(offsets[r:r + 1], num_allowed[r:r + 1], cols.size, gen)[0]
    return NegativeDraw(u + lo, weight, log_q)


def _past_excluded(offsets: torch.Tensor, num_allowed: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """(B, k) offsets of k uniform draws per row from [0, n) minus the row's `offsets` (B, h), -1 = empty,
    num_allowed (B,) = n - |row|: the u-th allowed offset, u uniform in [0, num_allowed)."""
    device = offsets.device
    u = (torch.rand(offsets.shape[0], k, generator=gen, dtype=torch.float64, device=device)
         * num_allowed.unsqueeze(1)).long()
    # skip every excluded offset at or below u: with the excluded offsets sorted, e_j - j counts the allowed
    # offsets before e_j
    big = torch.iinfo(torch.int64).max // 4
    sorted_ex = torch.sort(torch.where(offsets >= 0, offsets, big), dim=1).values
    shifted = sorted_ex - torch.arange(sorted_ex.shape[1], device=device).unsqueeze(0)
    return u + (shifted.unsqueeze(1) <= u.unsqueeze(2)).sum(2)


def random_part(num_real: int, lo: int, shape: tuple[int, ...], gen: torch.Generator,
                proposal: PopularityProposal | None, shard: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Global ids (shape) drawn i.i.d. from the shard [lo, lo + num_real), uniformly or from `proposal`, each
    draw's weight (shape) float32: num_real / k or 1 / (k q(l)), k = shape[-1], so the weighted sum estimates the
    sum over the whole shard; and q(l) (shape) float64 for a proposal's draws (None for uniform ones)."""
    k = shape[-1]
    if proposal is None:
        draws = torch.randint(0, num_real, shape, generator=gen, device=gen.device) + lo
        return draws, torch.full(shape, num_real / k if k else 0.0, dtype=torch.float32, device=gen.device), None
    offsets, q = proposal.draw(shard, shape, gen)
    return offsets + lo, (1.0 / (k * q)).float(), q


def shared_pool(hard: torch.Tensor, num_real: int, lo: int, k: int, gen: torch.Generator,
                proposal: PopularityProposal | None = None, shard: int = 0) -> NegativeDraw:
    """ONE pool of negatives for the whole batch (`sampler.shared_pool`): the distinct ids of every query's
    hard negatives `hard` (B, h) (-1 = empty; h may be 0) with weight 1, then k uniform draws (with
    replacement) from the whole shard [lo, lo + num_real) with weight num_real / k, zeroed where a draw falls
    in the hard union. Every query is scored against every column, so for each query the union is summed
    exactly and the uniform part estimates the sum over the labels outside it without bias (each such
    label is drawn k / num_real times in expectation). Returns NegativeDraw(shared=True) with (1, |U| + k).

    Why: a query's own 16 stale hard negatives are a thin slice of the labels that score high for it; the
    batch's union (thousands of rows, mostly the labels that are hard for many queries) and thousands of
    shared uniform rows cost one dense (B, d) x (d, c) product, fewer distinct rows than B x (k_h + k_r)
    per-query draws touch (docs/miner_quality.md).

    proposal (`sampler.random_proposal=popularity`): the k draws come from its q over the shard instead, each
    weighted 1 / (k q(l)), zeroed in the union as above: still unbiased."""
    device = hard.device
    union = torch.unique(hard[hard >= 0]) if hard.numel() else torch.empty(0, dtype=torch.int64, device=device)
    draws, uniform_weight, _ = random_part(num_real, lo, (k,), gen, proposal, shard)
    if union.numel():
        uniform_weight = uniform_weight * ~torch.isin(draws, union)
    ids = torch.cat([union, draws]).unsqueeze(0)
    weight = torch.cat([torch.ones(union.numel(), dtype=torch.float32, device=device), uniform_weight]).unsqueeze(0)
    return NegativeDraw(ids, weight, shared=True)


def pool_inclusion(hard: torch.Tensor, num_real: int, lo: int, k: int, batch: int) -> torch.Tensor:
    """(B, num_real) probability that each label is in the shared pool with a non-zero weight: 1 for the
    batch's hard union, 1 - (1 - 1/num_real)^k for the others (the same for every query)."""
    prob = torch.full((num_real,), 1.0 - (1.0 - 1.0 / num_real) ** k if k else 0.0, dtype=torch.float64)
    if hard.numel():
        prob[hard[hard >= 0] - lo] = 1.0
    return prob.unsqueeze(0).expand(batch, num_real).clone()


def inclusion_with_uniform(hard: torch.Tensor, num_real: int, lo: int, k: int) -> torch.Tensor:
    """(B, num_real) probability that each label of [lo, lo + num_real) is among `hard` (B, h) (-1 =
    empty) plus k uniform draws with replacement from the rest: 1 for hard ids, 1 - (1 - 1/m)^k with
    m = num_real - |hard row| otherwise."""
    batch = hard.shape[0]
    valid = hard >= 0
    allowed = (num_real - valid.sum(1)).double().clamp_min(1).unsqueeze(1)
    prob = (1.0 - (1.0 - 1.0 / allowed) ** k).expand(batch, num_real).clone() if k else \
        torch.zeros(batch, num_real, dtype=torch.float64)
    rows = torch.arange(batch).unsqueeze(1).expand_as(hard)
    prob[rows[valid], hard[valid] - lo] = 1.0
    return prob


class PoolBudget:
    """How many uniform draws a shard's shared pool takes (`sampler.shared_pool` = N > 0, split over shards).

    A batch of B queries with h hard slots in use gets N + B * (k_hard - h) / shards uniform draws: before
    hard negatives exist (and for the uniform sampler, which has the hard budget too), the B * k_hard columns
    the hard union could fill at most go to uniform draws, so every sampler scores at least as many columns
    as ASTRA's pool and ASTRA's uniform epochs equal the uniform sampler's draw for draw."""

    def __init__(self, layout: ShardLayout, cfg: SamplerConfig, include_hard_budget: bool = True):
        self.on = bool(cfg.shared_pool)
        self.base = -(-cfg.shared_pool // layout.num_shards) if self.on else 0  # a ceiling: any N splits
        self.k_hard = layout.split_count(cfg.k_hard, "sampler.k_hard") if include_hard_budget else 0

    def uniform(self, batch: int, hard_in_use: int) -> int:
        return self.base + batch * max(0, self.k_hard - hard_in_use)


class UniformSampler(Sampler):
    """k_random (+ k_hard, so the negative budget is equal) uniform negatives per query."""

    def __init__(self, layout: ShardLayout, cfg: SamplerConfig, include_hard_budget: bool = True):
        super().__init__(layout)
        total = cfg.k_random + (cfg.k_hard if include_hard_budget else 0)
        self.k = layout.split_count(total, "sampler.k_random")
        self.pool = PoolBudget(layout, cfg, include_hard_budget)
        if self.pool.on:
            self.draw_kind = "set"

    def sample(self, key: StepKey, shard: int, batch: SampleBatch | torch.Tensor) -> NegativeDraw:
        lo, _ = self.layout.shard_range(shard)
        batch = as_batch(batch)
        device = batch.query_rows.device
        none = torch.empty(batch.size, 0, dtype=torch.int64, device=device)
        if self.pool.on:
            return shared_pool(none, self.layout.real_count(shard), lo, self.pool.uniform(batch.size, 0),
                               key.generator(shard, device))
        return uniform_excluding(none, self.layout.real_count(shard), lo, self.k, key.generator(shard, device))

    def distribution(self, shard: int, batch: SampleBatch) -> torch.Tensor:
        """Per draw 1/n for per-query draws; with a shared pool, each label's inclusion (a set sampler then)."""
        n = self.layout.real_count(shard)
        if self.pool.on:
            none = torch.empty(batch.size, 0, dtype=torch.int64)
            return pool_inclusion(none, n, self.layout.shard_range(shard)[0], self.pool.uniform(batch.size, 0),
                                  batch.size)
        return torch.full((batch.size, n), 1.0 / n, dtype=torch.float64)


class HardSampler(Sampler):
    """Stale hard negatives alone (ASTRA's 'w-hard'); uniform until the first table exists."""

    draw_kind = "set"

    def __init__(self, layout: ShardLayout, cfg: SamplerConfig):
        super().__init__(layout)
        self.k_hard = layout.split_count(cfg.k_hard, "sampler.k_hard")
        self.warmup = UniformSampler(layout, cfg, include_hard_budget=False) if cfg.k_random else None
        self.hard: HardNegativeSet | None = None
        if self.k_hard < 1:
            raise ConfigError("sampler.k_hard", "the hard sampler needs k_hard >= number of label shards")

    @property
    def wants_hard_negatives(self) -> bool:
        return True

    def update(self, epoch: int, hard_negatives: HardNegativeSet | None,
               shard_rows: ShardRows | None = None, step: int = 0) -> None:
        super().update(epoch, hard_negatives, shard_rows, step)
        self.hard = hard_negatives

    def sample(self, key: StepKey, shard: int, batch: SampleBatch | torch.Tensor) -> NegativeDraw:
        query_rows = as_batch(batch).query_rows
        if self.hard is None:
            lo, _ = self.layout.shard_range(shard)
            none = torch.empty(len(query_rows), 0, dtype=torch.int64, device=query_rows.device)
            k = self.k_hard + (self.warmup.k if self.warmup else 0)
            return uniform_excluding(none, self.layout.real_count(shard), lo, k,
                                     key.generator(shard, query_rows.device))
        ids = self.hard.rows(shard, query_rows)
        return NegativeDraw(ids, (ids >= 0).float())

    def distribution(self, shard: int, batch: SampleBatch) -> torch.Tensor:
        """Inclusion: the stored ids surely, nothing else; uniform draws before the first table."""
        lo, _ = self.layout.shard_range(shard)
        n = self.layout.real_count(shard)
        if self.hard is None:
            none = torch.empty(batch.size, 0, dtype=torch.int64)
            return inclusion_with_uniform(none, n, lo, self.k_hard + (self.warmup.k if self.warmup else 0))
        return inclusion_with_uniform(self.hard.rows(shard, batch.query_rows), n, lo, 0)


class AstraSampler(Sampler):
    """ASTRA: stored hard negatives (weight 1) + uniform negatives from the rest (eq. 2 weights).

    Until hard negatives exist (epochs < tau_s) every negative slot is uniform, as Algorithm 1 says.
    A set sampler: `distribution` gives each label's probability of being among the returned ids.
    """

    draw_kind = "set"

    def __init__(self, layout: ShardLayout, cfg: SamplerConfig, label_counts: np.ndarray | None = None):
        super().__init__(layout)
        self.k_hard = layout.split_count(cfg.k_hard, "sampler.k_hard")
        self.k_random = layout.split_count(cfg.k_random, "sampler.k_random")
        self.hard: HardNegativeSet | None = None
        self.pool = PoolBudget(layout, cfg)
        # sampler.random_proposal: where the random part draws from (None = uniform, eq. 2 as in the paper)
        self.proposal: PopularityProposal | None = None
        if cfg.random_proposal == "popularity":
            if label_counts is None:
                raise ConfigError("sampler.random_proposal", "popularity needs the training label frequencies")
            self.proposal = PopularityProposal(layout, label_counts, cfg.popularity_alpha)
        if self.pool.on:
            self.draw_kind = "set"

    @property
    def wants_hard_negatives(self) -> bool:
        return self.k_hard > 0

    def update(self, epoch: int, hard_negatives: HardNegativeSet | None,
               shard_rows: ShardRows | None = None, step: int = 0) -> None:
        super().update(epoch, hard_negatives, shard_rows, step)
        self.hard = hard_negatives
        if self.proposal is not None:  # this rank's shards (every shard where the caller does not say)
            shards = list(shard_rows) if shard_rows else range(self.layout.num_shards)
            device = next(iter(shard_rows.values())).device if shard_rows else "cpu"
            self.proposal.prepare(shards, device)

    def hard_slots(self) -> int:
        """How many of the stored hard negatives (hardest first) this epoch uses."""
        return self.k_hard

    def sample(self, key: StepKey, shard: int, batch: SampleBatch | torch.Tensor) -> NegativeDraw:
        batch = as_batch(batch)
        query_rows, device = batch.query_rows, batch.query_rows.device
        lo, _ = self.layout.shard_range(shard)
        num_real = self.layout.real_count(shard)
        gen = key.generator(shard, device)
        use = self.hard_slots() if self.hard is not None else 0
        if self.pool.on:
            hard = self.hard.rows(shard, query_rows)[:, :use] if use else \
                torch.empty(len(query_rows), 0, dtype=torch.int64, device=device)
            return shared_pool(hard, num_real, lo, self.pool.uniform(len(query_rows), use), gen, self.proposal, shard)
        if self.proposal is not None:
            hard = self.hard.rows(shard, query_rows)[:, :use] if use else \
                torch.empty(len(query_rows), 0, dtype=torch.int64, device=device)
            return self._with_proposal(hard, num_real, lo, self.k_random + self.k_hard - use, gen, shard)
        if use == 0:
            none = torch.empty(len(query_rows), 0, dtype=torch.int64, device=device)
            return uniform_excluding(none, num_real, lo, self.k_hard + self.k_random, gen)
        hard = self.hard.rows(shard, query_rows)[:, :use]
        # Slots the curriculum does not give to hard negatives go to uniform ones: equal budget.
        uniform = uniform_excluding(hard, num_real, lo, self.k_random + self.k_hard - use, gen, batch.torch_only)
        return NegativeDraw(
            torch.cat([hard, uniform.ids], dim=1),
            torch.cat([(hard >= 0).float(), uniform.weight], dim=1),
            torch.cat([torch.zeros(hard.shape, device=device), uniform.log_q], dim=1),
        )

    def _with_proposal(self, hard: torch.Tensor, num_real: int, lo: int, k: int, gen: torch.Generator,
                       shard: int) -> NegativeDraw:
        """Per query: the hard ids (B, h) with weight 1, then k draws from the proposal over the whole shard, each
        weighted 1 / (k q(l)) and zeroed where it is one of the row's hard ids (as the shared pool does): every
        label outside H keeps an expected weight of 1, so the sum stays unbiased."""
        ids, weight, q = random_part(num_real, lo, (hard.shape[0], k), gen, self.proposal, shard)
        if hard.shape[1]:
            weight = weight * ~(ids.unsqueeze(2) == hard.unsqueeze(1)).any(2)
        log_q = torch.log(q).float()
        return NegativeDraw(torch.cat([hard, ids], dim=1), torch.cat([(hard >= 0).float(), weight], dim=1),
                            torch.cat([torch.zeros(hard.shape, device=hard.device), log_q], dim=1))

    def distribution(self, shard: int, batch: SampleBatch) -> torch.Tensor:
        """Inclusion: 1 for the hard ids in use, 1 - (1 - 1/(n - |H|))^k_uniform for the others (with a
        popularity proposal 1 - (1 - q(l))^k_random; in a shared pool, for every query of the batch)."""
        lo, _ = self.layout.shard_range(shard)
        use = self.hard_slots() if self.hard is not None else 0
        hard = self.hard.rows(shard, batch.query_rows)[:, :use] if use else \
            torch.empty(batch.size, 0, dtype=torch.int64)
        if self.proposal is not None:
            prob = self.proposal.prob(shard)
            if self.pool.on:
                union = hard.reshape(1, -1)
                return inclusion_from_proposal(union, prob, lo, self.pool.uniform(batch.size, use)).expand(
                    batch.size, -1).clone()
            return inclusion_from_proposal(hard, prob, lo, self.k_hard + self.k_random - use)
        if self.pool.on:
            return pool_inclusion(hard, self.layout.real_count(shard), lo, self.pool.uniform(batch.size, use),
                                  batch.size)
        return inclusion_with_uniform(hard, self.layout.real_count(shard), lo, self.k_hard + self.k_random - use)


class CurriculumSampler(AstraSampler):
    """ASTRA Table 5's curriculum: the hard share of the negative budget ramps up over epochs.

    From sampler.start_epoch, the number of stored hard negatives used grows linearly from 0 to
    k_hard over sampler.curriculum_epochs epochs (hardest first: tables are sorted by score); the
    remaining slots of the k_hard + k_random budget are uniform, weighted as in eq. 2, so the loss
    stays unbiased at every stage.
    """

    def __init__(self, layout: ShardLayout, cfg: SamplerConfig, label_counts: np.ndarray | None = None):
        super().__init__(layout, cfg, label_counts)
        start = 1 if cfg.start_epoch is None else cfg.start_epoch  # None: a config not resolved (0 is valid)
        self.start, self.ramp = start, max(1, cfg.curriculum_epochs)

    def hard_slots(self) -> int:
        progress = min(1.0, max(0.0, (self.epoch - self.start + 1) / self.ramp))
        return int(math.floor(self.k_hard * progress + 1e-9))
