"""The sampler interface, positives, and per-step randomness that does not depend on the world size.

Every random draw of a step comes from a generator seeded by (seed, epoch, step, shard), never from a
rank's global RNG: the same global batch therefore gets the same positives and negatives whether the
label shards live on one process or on many, and a resumed run redraws exactly what it would have.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from xc.arrays import find_sorted
from xc.shards import ShardLayout

_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from several integers (splitmix64 rounds)."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state & ((1 << 63) - 1)


@dataclass(frozen=True)
class StepKey:
    """Identifies one optimizer micro-step; all randomness of the step derives from it."""

    seed: int
    epoch: int
    step: int  # micro-step index within the epoch

    def generator(self, stream: int, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator for one stream of the step (a shard id, or a negative number for non-shard draws)."""
        gen = torch.Generator(device=device)
        gen.manual_seed(mix_seed(self.seed, self.epoch, self.step, stream + 1_000_000))
        return gen


POSITIVE_STREAM = -1


@dataclass
class Positives:
    """The global batch's positives.

    ids (B, k_pos) int64 global label ids, -1 = empty slot; weight (B, k_pos) float32 (|P|/k_pos when
    a query's positives were subsampled, 1 otherwise, 0 on empty slots); keys: sorted int64 of
    query_row * padded_L + label over ALL positives of the batch (subsampled or not), to recognise
    accidental positives among negatives; table (B, P_max) int64 every positive of each query (-1 pads)
    when no query of the batch has more than TABLE_MAX_POSITIVES, else None.
    """

    ids: torch.Tensor
    weight: torch.Tensor
    keys: torch.Tensor
    padded_labels: int
    table: torch.Tensor | None = None

    def is_positive(self, neg_ids: torch.Tensor) -> torch.Tensor:
        """(B, C) global ids -> (B, C) bool, True where the id is one of that query's positives."""
        if neg_ids.device.type == "cpu":
            return self.by_filter(neg_ids)
        return self.by_table(neg_ids) if self.table is not None else self.by_search(neg_ids)

    def pool_hits(self, pool_ids: torch.Tensor) -> torch.Tensor:
        """(c,) global ids of a batch-shared pool (-1 = empty) -> (2, H) int64 (query row, pool column) pairs where
        the column's id is a positive of that query.

        From the positives' side: each of the batch's positive keys is looked up among the pool's distinct ids and
        expanded to the columns holding that id, so the cost is the batch's positives and the hits, never B x c
        (c is thousands in a shared pool, tens of thousands at large batches)."""
        device = pool_ids.device
        distinct, column_of = torch.unique(pool_ids, return_inverse=True)
        if not self.keys.numel() or not distinct.numel():
            return torch.empty(2, 0, dtype=torch.int64, device=device)
        keys = self.keys.to(device)
        rows, labels = keys // self.padded_labels, keys % self.padded_labels
        at = torch.searchsorted(distinct, labels).clamp_max(distinct.numel() - 1)
        found = (distinct[at] == labels) & (labels >= 0)
        rows, at = rows[found], at[found]
        # the columns of each distinct id, grouped: columns_by_id[first[i]:first[i] + count[i]] hold id i
        columns_by_id = torch.argsort(column_of, stable=True)
        count = torch.bincount(column_of, minlength=distinct.numel())
        first = torch.cumsum(count, 0) - count
        reps = count[at]
        start = torch.repeat_interleave(first[at], reps)
        offset = torch.arange(start.numel(), device=device) - torch.repeat_interleave(torch.cumsum(reps, 0) - reps, reps)
        columns = columns_by_id[start + offset]
        rows = torch.repeat_interleave(rows, reps)
        keep = pool_ids[columns] >= 0
        return torch.stack([rows[keep], columns[keep]])

    def by_table(self, neg_ids: torch.Tensor) -> torch.Tensor:
        """is_positive by comparing with each query's positives, column by column (needs `table`)."""
        table = self.table.to(neg_ids.device)
        hit = neg_ids == table[:, :1]
        for j in range(1, table.shape[1]):  # column by column: no (B, C, P) temporary
            hit |= neg_ids == table[:, j:j + 1]
        return hit & (neg_ids >= 0)

    def by_search(self, neg_ids: torch.Tensor) -> torch.Tensor:
        """is_positive by binary search of (row, id) keys in the sorted `keys`: its cost does not grow with the
        most-labelled query (2-3x faster than torch.isin, which sorts both sides)."""
        rows = torch.arange(neg_ids.shape[0], device=neg_ids.device).unsqueeze(1)
        keys = rows * self.padded_labels + neg_ids.clamp_min(0)
        if not self.keys.numel():
            return torch.zeros_like(keys, dtype=torch.bool)
        pos = torch.searchsorted(self.keys, keys).clamp_max(self.keys.numel() - 1)
        return (self.keys[pos] == keys) & (neg_ids >= 0)

    def by_filter(self, neg_ids: torch.Tensor) -> torch.Tensor:
        """is_positive on the host: (row, id) keys through a hashed filter of the batch's positive keys, and only
        the filter's hits (the positives and about |keys| / POSITIVE_FILTER_BITS of the others) binary-searched.
        Each torch op on a (256, 88) batch costs tens of microseconds on a CPU; the column loop of `by_table`
        took a tenth of a 10^6-label step's batch assembly (docs/gpu_path.md)."""
        ids = neg_ids.numpy()
        out = np.zeros(ids.size, dtype=np.bool_)
        sorted_keys = self.keys.numpy()
        if sorted_keys.size:
            keys = (np.arange(ids.shape[0], dtype=np.int64)[:, None] * self.padded_labels + ids).reshape(-1)
            mask = POSITIVE_FILTER_BITS - 1
            filt = np.zeros(POSITIVE_FILTER_BITS, dtype=np.bool_)
            filt[sorted_keys & mask] = True
            cand = np.flatnonzero(filt[keys & mask])
            out[cand[find_sorted(sorted_keys, keys[cand])[1]]] = True
            out &= ids.reshape(-1) >= 0  # an empty slot (-1) is never a positive, whatever its key hashes to
        return torch.from_numpy(out.reshape(ids.shape))


# Entries of the host's hashed filter of positive keys (one byte each, zeroed per call).
POSITIVE_FILTER_BITS = 1 << 18

# Up to this many positives per query, accidental hits are found by comparing each candidate with the query's
# own positives (B x C x P_max compares, cheaper than a binary search over the batch's keys); above it, by
# binary search, whose cost does not grow with the most-labelled query.
TABLE_MAX_POSITIVES = 32


def draw_positives(indptr: np.ndarray | torch.Tensor, indices: np.ndarray | torch.Tensor, k_pos: int,
                   padded_labels: int, gen: torch.Generator) -> Positives:
    """Positives for a batch given its label rows as CSR (indptr (B+1,), indices (nnz,)): numpy arrays, or
    int64 tensors on the generator's device (the device batch path, xc/train/modes/classifier/device_batches.py),
    where every tensor of the result then lives.

    A query with more than k_pos positives keeps a uniform subset of k_pos, weighted |P|/k_pos so
    the positive term of the loss stays unbiased.
    """
    batch = len(indptr) - 1
    if isinstance(indptr, np.ndarray):
        counts = torch.from_numpy(np.diff(indptr).astype(np.int64))
        flat = torch.from_numpy(np.asarray(indices, dtype=np.int64))
    else:
        counts, flat = indptr[1:] - indptr[:-1], indices
    device = flat.device
    row_of = torch.repeat_interleave(torch.arange(batch, device=device), counts, output_size=flat.numel())
    # Random key per entry, sorted within rows: the first k_pos entries of each row are a uniform subset.
    keys = torch.rand(flat.numel(), generator=gen, dtype=torch.float64, device=device)
    order = torch.argsort(row_of.double() * 2.0 + keys)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_row = torch.arange(flat.numel(), device=device) - starts[row_of[order]]
    keep = rank_in_row < k_pos
    ids = torch.full((batch, k_pos), -1, dtype=torch.int64, device=device)
    ids[row_of[order][keep], rank_in_row[keep]] = flat[order][keep]
    per_row_weight = torch.where(counts > k_pos, counts.double() / k_pos, torch.ones_like(counts, dtype=torch.float64))
    weight = (ids >= 0).float() * per_row_weight.float().unsqueeze(1)
    all_keys = torch.sort(row_of * padded_labels + flat).values
    table = None
    most = int(counts.max()) if batch else 0
    if most <= TABLE_MAX_POSITIVES:
        table = torch.full((batch, max(1, most)), -1, dtype=torch.int64, device=device)
        table[row_of, torch.arange(flat.numel(), device=device) - starts[row_of]] = flat
    return Positives(ids, weight, all_keys, padded_labels, table)


@dataclass
class NegativeDraw:
    """Negatives for one label shard.

    ids (B, c) global label ids (-1 = empty slot); weight (B, c) float32, the importance weight of
    each draw: 1 / (c * q(id)) for c i.i.d. draws from a proposal q (so sum(weight * f) estimates the
    sum of f over the shard), 1 for deterministic or uncorrected negatives. Both losses use it: BCE
    multiplies each negative's term by it, sampled softmax adds log(weight) to the logit (the logQ
    correction o - log(c q)). log_q (B, c), where the sampler knows it cheaply, is the log
    probability it states for each returned id: per draw for i.i.d. samplers, of inclusion for set
    samplers (see Sampler.draw_kind). shared: ids and weight are (1, c), ONE pool scored for every query of
    the batch (`sampler.shared_pool`); the loss masks each query's own positives out of it.
    """

    ids: torch.Tensor
    weight: torch.Tensor
    log_q: torch.Tensor | None = None
    shared: bool = False


@dataclass
class SampleBatch:
    """What a sampler may look at for one global batch.

    query_rows (B,) int64 dataset rows; positives (the batch's Positives, or None); embeddings (B, d)
    detached query embeddings (given to samplers with needs_embeddings); label_probe (B, d) the
    classifier vector of one true label per query, zeros where a query has none (needs_label_probe).
    """

    query_rows: torch.Tensor
    positives: Positives | None = None
    embeddings: torch.Tensor | None = None
    label_probe: torch.Tensor | None = None
    torch_only: bool = False  # draw with torch ops on query_rows' device (the device batch path), no numpy

    @property
    def size(self) -> int:
        return int(self.query_rows.shape[0])


ShardRows = dict[int, torch.Tensor]  # shard -> its real rows (n_real, d), a live view of the weights


class Sampler(ABC):
    """One interface for every negative sampler.

    `update(epoch, hard_negatives, shard_rows, step)` is called at each epoch boundary with the
    hard-negative tables in use (or None) and a view of the classifier rows of each of this rank's
    shards; `after_step(step, shard_rows)` after every optimizer step (for samplers whose index follows
    the weights); `sample(key, shard, batch)` draws the negatives of one label shard for the global
    batch. `distribution(shard, batch)` is the probability the sampler states, over the shard's real
    labels, computed the slow exact way: per draw for draw_kind "iid", the probability that a label
    is among the returned ids for draw_kind "set". Tests compare it with empirical frequencies.
    """

    draw_kind = "iid"
    needs_embeddings = False
    needs_label_probe = False

    def __init__(self, layout: ShardLayout):
        self.layout = layout
        self.epoch = 0

    def update(self, epoch: int, hard_negatives: "HardNegativeSet | None",
               shard_rows: ShardRows | None = None, step: int = 0) -> None:
        self.epoch = epoch

    def after_step(self, step: int, shard_rows: ShardRows) -> None:
        pass

    def state_dict(self) -> dict:
        """Tensors that make a resumed run sample exactly as the original (checkpointed per rank)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def resume(self, epoch: int, hard_negatives: "HardNegativeSet | None", shard_rows: ShardRows,
               step: int) -> None:
        """Called instead of `update` when a run resumes mid-epoch: by default rebuild from the rows
        as they are now (a sampler whose index is in its state_dict keeps that index instead)."""
        self.update(epoch, hard_negatives, shard_rows, step)

    @property
    def wants_hard_negatives(self) -> bool:
        return False

    @abstractmethod
    def sample(self, key: StepKey, shard: int, batch: "SampleBatch | torch.Tensor") -> NegativeDraw:
        ...

    @abstractmethod
    def distribution(self, shard: int, batch: SampleBatch) -> torch.Tensor:
        """(B, n_real) float64: per-draw probability ("iid") or inclusion probability ("set")."""


def as_batch(batch: "SampleBatch | torch.Tensor") -> SampleBatch:
    """Accept bare query rows (B,) where a sampler needs nothing else."""
    return batch if isinstance(batch, SampleBatch) else SampleBatch(batch)


@dataclass
class HardNegativeSet:
    """Hard negatives in use: per shard a (N, k_hard_per_shard) int32 table of global label ids
    (-1 = none), for the N training rows, plus where they came from."""

    tables: dict[int, np.ndarray]
    generation: int
    made_at_epoch: int
    made_at_step: int  # the snapshot's step: the rows the miner searched
    ranked_at_step: int | None = None  # the switch that re-ranked the candidates by its rows (xc/refresh/rerank.py)
    # (N,) int64: each training row's snapshot step where generations mine slices of the rows (-1: none mined
    # yet; xc/refresh/slices.py); None: every row's is made_at_step
    row_steps: np.ndarray | None = None

    def __post_init__(self):
        self._resident: dict[tuple[int, str], torch.Tensor] = {}

    def rows(self, shard: int, query_rows: torch.Tensor) -> torch.Tensor:
        """(B, k) int64 hard negatives of `query_rows` (B,), on the rows' device: a host lookup for host rows,
        else a gather from a copy of the whole table made on that device the first time it is asked for."""
        if query_rows.device.type == "cpu":
            return torch.from_numpy(np.asarray(self.tables[shard][query_rows.numpy()], dtype=np.int64))
        return self.resident(shard, query_rows.device).index_select(0, query_rows).long()

    def resident(self, shard: int, device: torch.device) -> torch.Tensor:
        """(N, k) int32: shard's whole table on `device` (copied once per generation and device)."""
        key = (shard, str(device))
        if key not in self._resident:
            self._resident[key] = torch.from_numpy(np.ascontiguousarray(self.tables[shard], dtype=np.int32)).to(device)
        return self._resident[key]
