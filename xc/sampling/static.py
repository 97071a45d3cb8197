"""Samplers that do not look at the model: popularity (unigram^alpha) and in-batch negatives."""

from __future__ import annotations

import numpy as np
import torch

from xc.config import SamplerConfig
from xc.sampling.base import NegativeDraw, SampleBatch, Sampler, StepKey, as_batch
from xc.sampling.proposal import PopularityProposal
from xc.sampling.samplers import uniform_excluding
from xc.shards import ShardLayout


def _shard_counts(layout: ShardLayout, label_counts: np.ndarray, shard: int) -> torch.Tensor:
    lo, _ = layout.shard_range(shard)
    n = layout.real_count(shard)
    return torch.from_numpy(np.asarray(label_counts[lo:lo + n], dtype=np.float64))


class PopularitySampler(Sampler):
    """i.i.d. draws with q(l) proportional to (train frequency of l + 1) ** alpha inside each shard.

    The +1 keeps every label drawable, so the importance weights 1 / (k q) stay finite and the
    estimate of the negative sum stays unbiased. Inverse-CDF sampling: O(log n) per draw.
    """

    def __init__(self, layout: ShardLayout, cfg: SamplerConfig, label_counts: np.ndarray):
        super().__init__(layout)
        self.k = layout.split_count(cfg.k_hard + cfg.k_random, "sampler.k_random")
        self.proposal = PopularityProposal(layout, label_counts, cfg.popularity_alpha)

    def sample(self, key: StepKey, shard: int, batch: SampleBatch | torch.Tensor) -> NegativeDraw:
        batch = as_batch(batch)
        offsets, q = self.proposal.draw(shard, (batch.size, self.k), key.generator(shard))
        lo, _ = self.layout.shard_range(shard)
        return NegativeDraw(offsets + lo, (1.0 / (self.k * q)).float(), torch.log(q).float())

    def distribution(self, shard: int, batch: SampleBatch) -> torch.Tensor:
        return self.proposal.prob(shard).unsqueeze(0).expand(batch.size, -1)


class InBatchSampler(Sampler):
    """Other queries' positives: k i.i.d. draws from the multiset of the batch's positives in the shard.

    Conditional on the batch, label l is drawn with probability count_in_batch(l) / pool size (the
    stated distribution and log_q). Its marginal over random batches is the label frequency, so the
    importance weight uses the training frequency, q(l) = freq(l) / sum freq, as in sampling-bias-
    corrected in-batch softmax. A query's own positives are masked by the loss (accidental hits).
    A shard without any positive in the batch falls back to uniform draws.
    """

    def __init__(self, layout: ShardLayout, cfg: SamplerConfig, label_counts: np.ndarray):
        super().__init__(layout)
        self.k = layout.split_count(cfg.k_hard + cfg.k_random, "sampler.k_random")
        self.label_counts = label_counts
        self._freq: dict[int, torch.Tensor] = {}

    def _pool(self, shard: int, batch: SampleBatch) -> torch.Tensor:
        if batch.positives is None:
            raise ValueError("the in-batch sampler needs the batch's positives")
        lo, _ = self.layout.shard_range(shard)
        labels = batch.positives.keys % batch.positives.padded_labels
        return labels[(labels >= lo) & (labels < lo + self.layout.real_count(shard))] - lo

    def _marginal(self, shard: int) -> torch.Tensor:
        if shard not in self._freq:
            counts = _shard_counts(self.layout, self.label_counts, shard)
            self._freq[shard] = counts.clamp_min(1.0) / counts.clamp_min(1.0).sum()
        return self._freq[shard]

    def sample(self, key: StepKey, shard: int, batch: SampleBatch | torch.Tensor) -> NegativeDraw:
        batch = as_batch(batch)
        gen = key.generator(shard)
        lo, _ = self.layout.shard_range(shard)
        pool = self._pool(shard, batch)
        if pool.numel() == 0:
            none = torch.empty(batch.size, 0, dtype=torch.int64)
            return uniform_excluding(none, self.layout.real_count(shard), lo, self.k, gen)
        picks = pool[torch.randint(pool.numel(), (batch.size, self.k), generator=gen)]
        counts = torch.bincount(pool, minlength=self.layout.real_count(shard)).double()
        log_q = torch.log(counts[picks] / pool.numel()).float()
        weight = (1.0 / (self.k * self._marginal(shard)[picks])).float()
        return NegativeDraw(picks + lo, weight, log_q)

    def distribution(self, shard: int, batch: SampleBatch) -> torch.Tensor:
        pool = self._pool(shard, batch)
        n = self.layout.real_count(shard)
        if pool.numel() == 0:
            return torch.full((batch.size, n), 1.0 / n, dtype=torch.float64)
        prob = torch.bincount(pool, minlength=n).double() / pool.numel()
        return prob.unsqueeze(0).expand(batch.size, -1)
