"""Batch assembly on the training device: the training rows' labels and inputs resident there, every draw
made there.

On a GPU, assembling a micro-batch on the host (gathering memmap rows, drawing positives and negatives,
pinning, copying) took longer than the step's own kernels: 3.9 of 7.3 ms at batch 256 on an H100
(docs/gpu_path.md). Here the label CSR and, when they fit, the encoder inputs of every training
row are copied to the device once, and a micro-batch is a handful of gathers and draws there: positives
(`draw_positives` on device tensors), hard-negative lookups (`HardNegativeSet.resident`) and uniform draws by
the exact mapping (`uniform_excluding(torch_only=True)`), from generators on the device keyed by the step's
StepKey, so the draws do not depend on the world size and a resumed run redraws exactly what it would have.
A device generator's stream differs from the host's: the same seed gives other draws with the same
distribution (tests/unit/train/modes/classifier/test_device_batches.py compares them).

The same code runs on CPU tensors (`train.device_batches=true` on a CPU), which is how the tests exercise it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from xc.train.modes.classifier.batches import PreparedBatch
from xc.errors import ConfigError
from xc.sampling import POSITIVE_STREAM, StepKey, draw_positives
from xc.sampling.fixed_shapes import draw_positives_static
from xc.sampling.samplers import AstraSampler, HardSampler, UniformSampler
from xc.train.modes.classifier.step import draw_candidates

log = logging.getLogger("xc")

# Samplers whose draws are torch ops on the query rows' device (curriculum is an AstraSampler); the others read
# embeddings, label probes or host-side structures and keep the host path.
DEVICE_SAMPLERS = (UniformSampler, HardSampler, AstraSampler)
# The resident inputs may take this share of the device's memory; the classifier, optimiser state and
# activations need the rest. Larger inputs stay on the host (pinned, copied each step).
RESIDENT_SHARE = 0.25
# Rows gathered at a time while the resident copy is built (bounds the host's temporaries).
CHUNK_ROWS = 65536


class ResidentCSR:
    """Rows of a CSR matrix kept on one device: indptr (N+1,) int64, indices (nnz,), values (nnz,) or None."""

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, values: np.ndarray | None, device: torch.device):
        self.indptr = torch.from_numpy(np.asarray(indptr, dtype=np.int64)).to(device)
        self.indices = torch.from_numpy(np.ascontiguousarray(indices)).to(device)
        self.values = None if values is None else torch.from_numpy(np.ascontiguousarray(values)).to(device)

    @property
    def nbytes(self) -> int:
        parts = [self.indptr, self.indices] + ([self.values] if self.values is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """rows (B,) int64 on the device -> (indptr (B+1,), indices (nnz_B,), values (nnz_B,) or None)."""
        starts = self.indptr.index_select(0, rows)
        lengths = self.indptr.index_select(0, rows + 1) - starts
        indptr = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        total = int(indptr[-1])  # the one size the gather cannot know ahead
        flat = torch.repeat_interleave(starts - indptr[:-1], lengths, output_size=total) \
            + torch.arange(total, device=rows.device)
        return indptr, self.indices.index_select(0, flat), \
            None if self.values is None else self.values.index_select(0, flat)

    def widest(self) -> int:
        """The most entries of any row (read once, on the host: the static bound of `gather_padded`)."""
        return int((self.indptr[1:] - self.indptr[:-1]).max()) if self.indptr.numel() > 1 else 0

    def gather_padded(self, rows: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """rows (B,) int64 -> (indices (B, width), each row's entries first, -1 after; counts (B,)): `gather`
        without its one host read (the batch's total), for `train.static_shapes`; width >= every row's count."""
        starts = self.indptr.index_select(0, rows)
        counts = self.indptr.index_select(0, rows + 1) - starts
        column = torch.arange(width, device=rows.device)
        valid = column.unsqueeze(0) < counts.unsqueeze(1)
        at = torch.where(valid, starts.unsqueeze(1) + column, 0).clamp_max(max(0, self.indices.numel() - 1))
        return torch.where(valid, self.indices[at].long(), -1), counts


def _chunks(num_rows: int):
    """Consecutive row ranges of at most CHUNK_ROWS rows covering [0, num_rows)."""
    return (np.arange(start, min(start + CHUNK_ROWS, num_rows)) for start in range(0, num_rows, CHUNK_ROWS))


def _joined_csr(parts, device: torch.device, budget_bytes: float = float("inf")) -> ResidentCSR | None:
    """One resident CSR from consecutive row chunks, each (row ends (b,) within the chunk, indices, values or None);
    None once the entries (8-byte index + 4-byte value) pass budget_bytes."""
    pointers, indices, values, total = [np.zeros(1, np.int64)], [], [], 0
    for ends, chunk_indices, chunk_values in parts:
        pointers.append(np.asarray(ends, dtype=np.int64) + total)
        indices.append(chunk_indices)
        values.append(chunk_values)
        total += len(chunk_indices)
        if total * 12 > budget_bytes:
            return None
    return ResidentCSR(np.concatenate(pointers), np.concatenate(indices).astype(np.int64),
                       None if values[0] is None else np.concatenate(values), device)


def _label_csr(train, device: torch.device) -> ResidentCSR:
    """The positives of every training row (points, then label-text rows) as one resident CSR."""
    return _joined_csr(((indptr[1:], indices, None) for indptr, indices in map(train.labels, _chunks(train.num_rows))),
                       device)


class ResidentInputs:
    """Encoder inputs of every training row on the device, for the two input kinds that are rows of a fixed
    matrix: bags of features ({"feat_ids", "feat_offsets", "feat_values"}, row values already normalised as
    xc.data.inputs writes them, so a gathered bag equals the host's) and dense features ({"dense"}). Token
    inputs are padded per batch and stay on the host."""

    def __init__(self, kind: str, csr: ResidentCSR | None = None, dense: torch.Tensor | None = None):
        self.kind, self.csr, self.dense = kind, csr, dense

    @property
    def nbytes(self) -> int:
        return self.csr.nbytes if self.csr is not None else self.dense.numel() * self.dense.element_size()

    def __call__(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.kind == "dense":
            return {"dense": self.dense.index_select(0, rows)}
        indptr, ids, values = self.csr.gather(rows)
        return {"feat_ids": ids, "feat_offsets": indptr[:-1], "feat_values": values}

    @classmethod
    def build(cls, train, device: torch.device, budget_bytes: float) -> "ResidentInputs | None":
        """The resident copy of `train.inputs` over every row, or None where the inputs are tokens or would take
        more than budget_bytes."""
        probe = train.inputs(np.zeros(1, dtype=np.int64))
        if set(probe) == {"dense"}:
            width = probe["dense"].shape[1]
            if train.num_rows * width * 4 > budget_bytes:
                return None
            return cls("dense", dense=torch.cat([train.inputs(rows)["dense"] for rows in _chunks(train.num_rows)])
                       .to(device))
        if set(probe) != {"feat_ids", "feat_offsets", "feat_values"}:
            return None
        bags = map(train.inputs, _chunks(train.num_rows))
        csr = _joined_csr(((np.append(bag["feat_offsets"].numpy()[1:], len(bag["feat_ids"])), bag["feat_ids"].numpy(),
                            bag["feat_values"].numpy()) for bag in bags), device, budget_bytes)
        return None if csr is None else cls("bag", csr=csr)


def device_batches_rule(setting: bool | None, device: torch.device, sampler,
                        static: bool = False) -> tuple[bool, str]:
    """(on, why) for `train.device_batches` (null = on where the ranks train on CUDA and the sampler draws on
    the device, or where `train.static_shapes` is on, which assembles on this path; true forces it, also on a CPU,
    where it runs the same code on host tensors)."""
    supported = sampler is None or isinstance(sampler, DEVICE_SAMPLERS)
    name = "the exact loss" if sampler is None else f"the {type(sampler).__name__}"
    if static and setting is False:
        raise ConfigError("train.static_shapes", "the fixed-shape assembly runs on the device batch path: "
                          "train.static_shapes=on needs train.device_batches=null or true")
    if static and setting is None and supported:
        return True, "train.static_shapes=on"
    if setting is None:
        if device.type != "cuda":
            return False, "the ranks train on the CPU"
        if not supported:
            return False, f"{name} draws on the host"
        return True, f"CUDA, {name} draws on the device"
    if setting and not supported:
        raise ConfigError("train.device_batches", f"{name} draws on the host (it reads embeddings, label probes or "
                          f"host-side tables); the device path supports uniform, hard, astra, curriculum and "
                          f"the exact loss. Use train.device_batches=null")
    return bool(setting), "train.device_batches"


class DeviceBatchPreparer:
    """prepare(micro, rows, key) -> PreparedBatch with every tensor on the training device (the host path is
    xc.train.modes.classifier.batches.BatchPreparer; the trainer uses one or the other)."""

    def __init__(self, cfg, c, ctx):
        self.cfg, self.c, self.ctx = cfg, c, ctx
        self.device = ctx.device
        self.labels = _label_csr(c.train, self.device)
        budget = (torch.cuda.get_device_properties(self.device).total_memory * RESIDENT_SHARE
                  if self.device.type == "cuda" else float("inf"))
        self.inputs = ResidentInputs.build(c.train, self.device, budget)
        log.info("device batches: labels of %d rows resident (%.1f MB), inputs %s", c.train.num_rows,
                 self.labels.nbytes / 1e6, f"resident ({self.inputs.nbytes / 1e6:.1f} MB)" if self.inputs else
                 "gathered on the host (tokens, or over the memory share)")

    def _to_device(self, rows: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        if self.device.type == "cuda":  # a pinned source makes the copy asynchronous
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)

    def __call__(self, micro: int, rows: np.ndarray, key: StepKey) -> PreparedBatch:
        c, ctx = self.c, self.ctx
        b = c.micro_batch // ctx.world_size
        mine = rows[ctx.rank * b:(ctx.rank + 1) * b]
        rows_dev = self._to_device(rows)
        if self.inputs is not None:
            inputs = self.inputs(rows_dev[ctx.rank * b:(ctx.rank + 1) * b])
        else:
            inputs = {k: v.to(self.device) for k, v in c.train.inputs(mine).items()}
        positives, cand = self._draw(rows_dev, key)
        return PreparedBatch(micro, key, rows, mine, inputs, positives, cand)

    def _draw(self, rows_dev: torch.Tensor, key: StepKey):
        """(positives, candidates) of the batch's rows (B,) on the device."""
        cfg, c = self.cfg, self.c
        indptr, indices, _ = self.labels.gather(rows_dev)
        positives = draw_positives(indptr, indices, cfg.sampler.k_pos, c.layout.padded_labels,
                                   key.generator(POSITIVE_STREAM, self.device))
        cand = None if c.sampler is None else draw_candidates(cfg.sampler, c, self.ctx, rows_dev, key, positives,
                                                              torch_only=True)
        return positives, cand


class StaticBatchPreparer(DeviceBatchPreparer):
    """The device batch path with every size of the batch's assembly fixed before training (`train.static_shapes`):
    label rows padded to the widest training row, positives and candidates drawn by xc/sampling/fixed_shapes.py,
    nothing read back to the host, so the assembly can be captured as a CUDA graph. Same draws as the parent
    (on a CPU bit for bit, tests/unit/train/modes/classifier/test_static_shapes.py). The encoder inputs are still
    gathered at the batch's size (a bag of features has as many entries as its rows' non-zeros)."""

    def __init__(self, cfg, c, ctx):
        super().__init__(cfg, c, ctx)
        self.width = max(1, self.labels.widest())
        log.info("static shapes: positives padded to %d a query", self.width)

    def _draw(self, rows_dev: torch.Tensor, key: StepKey):
        cfg, c = self.cfg, self.c
        ids, counts = self.labels.gather_padded(rows_dev, self.width)
        positives = draw_positives_static(ids, counts, cfg.sampler.k_pos, c.layout.padded_labels,
                                          key.generator(POSITIVE_STREAM, self.device))
        cand = draw_candidates(cfg.sampler, c, self.ctx, rows_dev, key, positives, torch_only=True, static=True)
        return positives, cand
