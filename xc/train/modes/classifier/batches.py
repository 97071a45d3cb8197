"""Host-side preparation of micro-batches, optionally one step ahead on a background thread.

A `PreparedBatch` is everything a micro-step needs that does not depend on the current model: this
rank's encoder inputs, the batch's positives and, for samplers that look at neither the embeddings nor
the classifier rows (`can_draw_ahead`: uniform, astra, hard, curriculum, popularity, inbatch, ehard),
this rank's sampled candidates. Every random draw in it comes from generators keyed by the micro-step's
StepKey, so preparing a batch early (or twice) gives exactly the tensors the step would have drawn
itself: a run with `train.prefetch=true` is bit-identical to one without.

On CUDA the tensors are placed in pinned (page-locked) host memory, so that the copies the trainer
issues with `non_blocking=True` are asynchronous DMA transfers that overlap the previous step's kernels;
on the CPU both are no-ops. `Prefetcher` runs `prepare` on one daemon thread with a bounded queue of
`PREFETCH_DEPTH` batches, in micro-step order; an exception there is re-raised by `get` in the trainer.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from xc.train.loss import Candidates
from xc.sampling import POSITIVE_STREAM, Positives, Sampler, StepKey, draw_positives
from xc.train.modes.classifier.step import draw_candidates, to_device

PREFETCH_DEPTH = 2


def can_draw_ahead(sampler: Sampler | None) -> bool:
    """Whether the sampler's draws for a step can be made before the step runs: it needs no query
    embeddings or label probes, and its state changes only at epoch boundaries (no after_step)."""
    return (sampler is not None and not sampler.needs_embeddings and not sampler.needs_label_probe
            and type(sampler).after_step is Sampler.after_step)


@dataclass
class PreparedBatch:
    """One micro-step's host-side work.

    rows (B,) dataset rows of the global micro-batch; mine (b,) = this rank's slice (b = B / world);
    inputs: encoder inputs for `mine` (tensor dict); positives: the batch's Positives; cand: this rank's
    Candidates (local_ids/weight/target (B, C)) when drawn ahead, else None.
    """

    micro: int
    key: StepKey
    rows: np.ndarray
    mine: np.ndarray
    inputs: dict[str, torch.Tensor]
    positives: Positives
    cand: Candidates | None


def _pin(obj):
    """Pin every tensor (of a dict, or of a dataclass's fields) in page-locked host memory."""
    if isinstance(obj, dict):
        return {k: v.pin_memory() for k, v in obj.items()}
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            setattr(obj, name, value.pin_memory())
    return obj


class BatchPreparer:
    """prepare(micro, rows, key) -> PreparedBatch, the same code with or without a prefetch thread."""

    def __init__(self, cfg, c, ctx):
        self.cfg, self.c, self.ctx = cfg, c, ctx
        self.pin = ctx.device.type == "cuda"
        self.draw_ahead = can_draw_ahead(c.sampler)

    def __call__(self, micro: int, rows: np.ndarray, key: StepKey) -> PreparedBatch:
        cfg, c, ctx = self.cfg, self.c, self.ctx
        b = c.micro_batch // ctx.world_size
        mine = rows[ctx.rank * b:(ctx.rank + 1) * b]
        inputs = c.train.inputs(mine)
        indptr, indices = c.train.labels(rows)
        positives = draw_positives(indptr, indices, cfg.sampler.k_pos, c.layout.padded_labels,
                                   key.generator(POSITIVE_STREAM))
        cand = draw_candidates(cfg.sampler, c, ctx, rows, key, positives) if self.draw_ahead else None
        if self.pin:
            inputs = _pin(inputs)
            if cand is not None or c.sampler is None:  # positives go to the device before the step
                _pin(positives)
            if cand is not None:
                _pin(cand)
        return PreparedBatch(micro, key, rows, mine, inputs, positives, cand)


def to_device_prepared(batch: PreparedBatch, device: torch.device, sampled: bool) -> dict[str, torch.Tensor]:
    """Issue the host-to-device copies of a prepared batch (non-blocking from pinned memory); returns the
    inputs on `device`. Positives move now only where nothing on the host needs them any more (drawn-ahead
    candidates, or full BCE); otherwise the sampler reads them on the host first."""
    inputs = {k: v.to(device, non_blocking=True) for k, v in batch.inputs.items()}
    if device.type != "cpu":
        if batch.cand is not None:
            to_device(batch.cand, device)
        if batch.cand is not None or not sampled:
            to_device(batch.positives, device)
    return inputs


class Prefetcher:
    """Prepares micro-steps `micros` in order on one background thread, at most PREFETCH_DEPTH ahead."""

    def __init__(self, prepare: Callable[[int], PreparedBatch], micros: range, depth: int = PREFETCH_DEPTH):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(prepare, micros), name="xc-prefetch", daemon=True)
        self._thread.start()

    def _run(self, prepare: Callable[[int], PreparedBatch], micros: range) -> None:
        for micro in micros:
            if self._stop.is_set():
                return
            try:
                item = (prepare(micro), None)
            except BaseException as exc:  # handed to the trainer, which re-raises it
                item = (None, exc)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[1] is not None:
                return

    def get(self) -> PreparedBatch:
        """The next prepared micro-step (blocks until it is ready); re-raises the thread's exception."""
        while True:
            try:
                batch, exc = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch thread ended without preparing the next batch") from None
        if exc is not None:
            raise exc
        return batch

    def close(self) -> None:
        """Stop the thread (batches prepared beyond the last step used are dropped)."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)
