"""Samplers that follow the model: stochastic negative mining, MIDX and LSH (per label shard).

Each keeps its per-shard index on the CPU, rebuilt from the shard's live rows: MIDX at every epoch
boundary (warm-started K-means, as the paper does), LSH at epoch boundaries with fresh hash functions
and re-hashed every `lsh_rebuild_every` steps or when the rows drift. Query embeddings come detached
from the trainer (SampleBatch.embeddings), so no gradient flows through a proposal.
"""

from __future__ import annotations

import logging
import math

import torch

from xc.config import SamplerConfig
from xc.sampling.base import NegativeDraw, SampleBatch, Sampler, ShardRows, StepKey, as_batch, mix_seed
from xc.sampling.lsh import HashFamily, LshTables, inclusion_probability, take_budget, unique_per_row
from xc.sampling.midx import MidxIndex, build_index, learn_codewords
from xc.shards import ShardLayout

log = logging.getLogger(__name__)


def _need(batch: SampleBatch, what: str) -> torch.Tensor:
    value = getattr(batch, what)
    if value is None:
        raise ValueError(f"this sampler needs SampleBatch.{what}")
    return value.detach().float().cpu()


class SnmSampler(Sampler):
    """Stochastic negative mining: draw `pool` uniform candidates, keep the k highest-scoring slots.

    Deliberately biased towards hard labels (weight 1, no correction). Stated distribution: with m
    i.i.d. uniform candidates from n labels, label i (r labels score strictly higher) is kept iff it is
    drawn and fewer than k draws land above it:
        P(i) = sum_{j<k} C(m, j) a^j [(1 - a)^(m-j) - (1 - a - 1/n)^(m-j)],  a = r / n.
    """

    draw_kind = "set"
    needs_embeddings = True

    def __init__(self, layout: ShardLayout, cfg: SamplerConfig):
        super().__init__(layout)
        self.k = layout.split_count(cfg.k_hard + cfg.k_random, "sampler.k_random")
        self.pool = max(self.k, cfg.snm_pool // layout.num_shards)
        self.rows: ShardRows = {}

    def update(self, epoch, hard_negatives, shard_rows=None, step=0) -> None:
        super().update(epoch, hard_negatives, shard_rows, step)
        self.rows = shard_rows or {}

    def sample(self, key: StepKey, shard: int, batch: SampleBatch | torch.Tensor) -> NegativeDraw:
        batch = as_batch(batch)
        z = _need(batch, "embeddings")
        rows = self.rows[shard]
        n = rows.shape[0]
        cand = torch.randint(n, (batch.size, self.pool), generator=key.generator(shard))
        with torch.no_grad():
            scores = torch.bmm(rows[cand].float().cpu(), z.unsqueeze(2)).squeeze(2)
        top = scores.topk(self.k, dim=1).indices
        ids = unique_per_row(cand.gather(1, top))
        lo, _ = self.layout.shard_range(shard)
        return NegativeDraw(torch.where(ids >= 0, ids + lo, -1), (ids >= 0).float())

    def distribution(self, shard: int, batch: SampleBatch) -> torch.Tensor:
        z = _need(batch, "embeddings").double()
        rows = self.rows[shard].double().cpu()
        n, m = rows.shape[0], self.pool
        scores = z @ rows.t()
        above = (scores.unsqueeze(2) > scores.unsqueeze(1)).sum(1).double()  # (B, n): r_i
        a, e = above / n, 1.0 / n
        total = torch.zeros_like(a)
        for j in range(min(self.k, m + 1)):
            log_comb = math.lgamma(m + 1) - math.lgamma(j + 1) - math.lgamma(m - j + 1)
            term = torch.exp(log_comb + j * torch.log(a.clamp_min(1e-300))) if j else torch.exp(torch.zeros_like(a))
            term = torch.where((a == 0) & (j > 0), torch.zeros_like(a), term)
            total += term * ((1 - a) ** (m - j) - (1 - a - e).clamp_min(0) ** (m - j))
        return total


class MidxSampler(Sampler):
    """MIDX ("Adaptive Sampled Softmax with Inverted Multi-Index"): i.i.d. draws from the softmax over the shard's quantised rows.

    Returns log Q per draw (normalised within the shard) and importance weights 1 / (k Q).
    """

    needs_embeddings = True

    def __init__(self, layout: ShardLayout, cfg: SamplerConfig, quantizer: str, seed: int):
        super().__init__(layout)
        self.k = layout.split_count(cfg.k_hard + cfg.k_random, "sampler.k_random")
        self.quantizer, self.seed = quantizer, seed
        self.codewords, self.iters = cfg.midx_codewords, cfg.midx_kmeans_iters
        self.learn_steps, self.learn_lr = cfg.midx_learn_steps, cfg.midx_learn_lr
        self.index: dict[int, MidxIndex] = {}
        self._recent: list[torch.Tensor] = []  # recent query embeddings, for learned codewords

    def update(self, epoch, hard_negatives, shard_rows=None, step=0) -> None:
        super().update(epoch, hard_negatives, shard_rows, step)
        for shard, rows in (shard_rows or {}).items():
            gen = torch.Generator().manual_seed(mix_seed(self.seed, epoch, shard, 0x3D1))
            index = build_index(rows, self.codewords, self.quantizer, self.iters, gen, self.index.get(shard))
            if self.learn_steps and self._recent:
                index = learn_codewords(index, rows, torch.cat(self._recent), self.learn_steps, self.learn_lr, gen)
            self.index[shard] = index
        self._recent = []

    _FIELDS = ("c1", "c2", "a1", "a2", "counts", "order", "indptr")

    def state_dict(self) -> dict:
        return {f"shard{s}.{f}": getattr(index, f) for s, index in self.index.items() for f in self._FIELDS}

    def load_state_dict(self, state: dict) -> None:
        shards = {int(key.split(".")[0][len("shard"):]) for key in state}
        self.index = {s: MidxIndex(self.quantizer, *(state[f"shard{s}.{f}"] for f in self._FIELDS)) for s in shards}

    def resume(self, epoch, hard_negatives, shard_rows, step) -> None:
        if set(shard_rows) <= set(self.index):  # the epoch's index came back with the checkpoint
            Sampler.update(self, epoch, hard_negatives, shard_rows, step)
        else:
            self.update(epoch, hard_negatives, shard_rows, step)

    def sample(self, key: StepKey, shard: int, batch: SampleBatch | torch.Tensor) -> NegativeDraw:
        batch = as_batch(batch)
        z = _need(batch, "embeddings")
        if self.learn_steps and sum(len(r) for r in self._recent) < 4096:
            self._recent.append(z[:256])
        offsets, log_q = self.index[shard].sample(z, self.k, key.generator(shard))
        lo, _ = self.layout.shard_range(shard)
        weight = torch.exp(-log_q.double() - math.log(self.k)).float()
        return NegativeDraw(offsets + lo, weight, log_q.float())

    def distribution(self, shard: int, batch: SampleBatch) -> torch.Tensor:
        z = _need(batch, "embeddings").double()
        return torch.softmax(z @ self.index[shard].reconstruct().double().t(), dim=1)


class LshSampler(Sampler):
    """LSH negative sampling ("A Tale of Two Efficient and Informative Negative Sampling Distributions"): probe L tables with the query embedding (LSH-Embedding) or
    a true label's classifier vector (LSH-Label); the union of the buckets, capped at the budget and
    padded with uniform labels when short, are the negatives.

    Weights: the importance weight 1 / P(included) for LSH ids (1 - (1 - beta)^L with beta the per-table
    collision probability: exact for simhash, estimated from bucket agreement for dwta) and 1 for padding. The paper trains without
    correction; sampler.logq_correction=false (the lsh presets' default) makes every weight 1.
    """

    draw_kind = "set"
    needs_embeddings = True

    def __init__(self, layout: ShardLayout, cfg: SamplerConfig, probe: str, seed: int):
        super().__init__(layout)
        self.k = layout.split_count(cfg.k_hard + cfg.k_random, "sampler.k_random")
        self.probe_with, self.seed = probe, seed
        self.needs_label_probe = probe == "label"
        self.family_kind, self.bits, self.num_tables = cfg.lsh_family, cfg.lsh_bits, cfg.lsh_tables
        self.bin_size = cfg.lsh_dwta_bin
        self.window = cfg.lsh_window or 2 * math.ceil(self.k / self.num_tables)
        self.rebuild_every, self.drift_threshold = cfg.lsh_rebuild_every, cfg.lsh_drift_threshold
        self.families: dict[int, HashFamily] = {}
        self.tables: dict[int, LshTables] = {}
        self.rows: ShardRows = {}
        self._probe_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rebuilds = 0

    def update(self, epoch, hard_negatives, shard_rows=None, step=0) -> None:
        super().update(epoch, hard_negatives, shard_rows, step)
        self.rows = shard_rows or {}
        for shard, rows in self.rows.items():  # fresh hash functions every epoch
            gen = torch.Generator().manual_seed(mix_seed(self.seed, epoch, shard, 0x15A))
            self.families[shard] = HashFamily.draw(self.family_kind, rows.shape[1], self.bits, self.num_tables,
                                                   gen, self.bin_size)
            self._rehash(shard, mix_seed(self.seed, epoch, shard, step))

    def _rehash(self, shard: int, seed: int) -> None:
        rows = self.rows[shard]
        gen = torch.Generator().manual_seed(seed)
        self.tables[shard] = LshTables(self.families[shard], rows, gen)
        sample = torch.randint(rows.shape[0], (min(1024, rows.shape[0]),), generator=gen)
        self._probe_rows[shard] = (sample, rows[sample].float().cpu().clone())
        self.rebuilds += 1

    def after_step(self, step: int, shard_rows: ShardRows) -> None:
        self.rows = shard_rows
        for shard in self.tables:
            due = self.rebuild_every and step % self.rebuild_every == 0
            if not due and self.drift_threshold > 0:
                sample, old = self._probe_rows[shard]
                now = shard_rows[shard][sample].float().cpu()
                due = float((now - old).norm() / old.norm().clamp_min(1e-12)) > self.drift_threshold
            if due:
                self._rehash(shard, mix_seed(self.seed, self.epoch, shard, step))

    def _probes(self, batch: SampleBatch) -> torch.Tensor:
        z = _need(batch, "embeddings")
        if self.probe_with == "embedding":
            return z
        probe = _need(batch, "label_probe")
        missing = probe.abs().sum(1) == 0  # no positive: fall back to the query embedding
        return torch.where(missing.unsqueeze(1), z, probe)

    def probe_union(self, shard: int, batch: SampleBatch, gen: torch.Generator) -> torch.Tensor:
        """Row offsets (B, L * window) of the union of the probed buckets, each once; -1 = hole."""
        return unique_per_row(self.tables[shard].probe(self._probes(batch), self.window, gen))

    def sample(self, key: StepKey, shard: int, batch: SampleBatch | torch.Tensor) -> NegativeDraw:
        batch = as_batch(batch)
        gen = key.generator(shard)
        probes = self._probes(batch)
        ids, _ = take_budget(self.probe_union(shard, batch, gen), self.k, gen)
        n = self.layout.real_count(shard)
        lo, _ = self.layout.shard_range(shard)
        holes = ids < 0
        if bool(holes.any()):  # pad short unions with uniform labels, as the LNS code does
            fill = torch.randint(n, ids.shape, generator=gen)
            ids = torch.where(holes, fill, ids)
        p = self._inclusion(shard, probes, ids.clamp_min(0))
        log_q = torch.where(holes, torch.full_like(p, math.log(self.k / n)), torch.log(p.clamp_min(1e-30)))
        weight = torch.where(holes, torch.ones_like(p), 1.0 / p.clamp_min(1e-6))
        return NegativeDraw(ids + lo, weight.float(), log_q.float())

    def _inclusion(self, shard: int, probes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        family = self.families[shard]
        if family.kind == "simhash":
            beta = family.table_collision_probability(probes, self.rows[shard][offsets].float().cpu())
        else:
            tables = self.tables[shard]
            beta = family.table_collision_probability(probes, None, tables.codes[offsets], family.codes(probes))
        return inclusion_probability(beta, family.tables)

    def distribution(self, shard: int, batch: SampleBatch) -> torch.Tensor:
        probes = self._probes(batch)
        n = self.layout.real_count(shard)
        every = torch.arange(n).unsqueeze(0).expand(batch.size, -1)
        return self._inclusion(shard, probes, every)
