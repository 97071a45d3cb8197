"""Optimisers and schedules: sparse-row SGD for classifier shards, Adam/AdamW for the encoder (a lazy
SparseAdam for a large feature table with sparse gradients beside it).

The classifier update touches only the rows a step scored, so its cost is O(rows touched * d) and
independent of L; weight decay is applied to those rows only (lazily), which is the usual choice for
sparse updates and keeps the step free of O(L) work. Low-precision shards with fp32 master rows are
updated in fp32 on the masters (`ClassifierShard.exact_rows` / `write_rows`).
"""

from __future__ import annotations

import math

import torch

from xc.config import TrainConfig
from xc.models.classifier import ClassifierShard


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1 over `warmup_steps`, then cosine decay to `min_ratio` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class SparseRowSGD:
    """SGD (`rule="sgd"`) or row-wise Adagrad (`rule="rowadagrad"`, one accumulator per row kept in
    `shard.row_sq` (n, 1) so that checkpoints carry it) on the rows of a ClassifierShard that received
    gradient since the last step.

    `accumulate(unique_ids, grad)` may be called once per micro-batch (gradient accumulation); the
    step sums gradients of rows hit in several micro-batches before applying them.
    """

    def __init__(self, shard: ClassifierShard, lr: float, weight_decay: float, rule: str = "sgd", eps: float = 1e-8):
        self.shard, self.lr, self.weight_decay, self.rule, self.eps = shard, lr, weight_decay, rule, eps
        if rule == "rowadagrad" and shard.row_sq is None:
            shard.row_sq = torch.zeros(shard.num_rows, 1, dtype=torch.float32, device=shard.weight.device)
        self._ids: list[torch.Tensor] = []
        self._grads: list[torch.Tensor] = []
        self._rows: list[torch.Tensor | None] = []

    def accumulate(self, unique_ids: torch.Tensor, grad: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """unique_ids (U,) local rows; grad (U, d); rows (U, d): their current values if the caller
        already gathered them (saves a second random read of the rows at step time)."""
        self._ids.append(unique_ids)
        self._grads.append(grad)
        self._rows.append(rows)

    def pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed (ids (U,), grads (U, d)) waiting for `step`."""
        if len(self._ids) == 1:
            return self._ids[0], self._grads[0]
        ids, inverse = torch.unique(torch.cat(self._ids), return_inverse=True)
        grads = torch.zeros(ids.numel(), self.shard.dim, dtype=self._grads[0].dtype, device=ids.device)
        grads.index_add_(0, inverse, torch.cat(self._grads))
        return ids, grads

    def step(self, factor: float) -> None:
        if not self._ids:
            return
        ids, grads = self.pending()
        # Rows cannot change between the gather and this step, so values gathered in the forward pass
        # are current; with several micro-batches, read the merged set once. With fp32 master rows the
        # forward read the rounded rows: the update starts from the masters instead.
        cached = self._rows[0] if len(self._ids) == 1 and self.shard.master is None else None
        rows = cached.detach() if cached is not None else self.shard.exact_rows(ids)
        if self.weight_decay:
            grads = grads + self.weight_decay * rows
        if self.rule == "rowadagrad":
            # Row-wise Adagrad: one accumulator per row (the mean squared gradient coordinate, summed over
            # the row's updates). A row's step is lr * g / sqrt(G): it does not depend on the scale of its
            # gradient, so ASTRA's eq.-2 uniform weights, (n - |H|) / k_r, which grow with L, no longer set
            # the step size, and one learning rate serves L = 10^2 to 10^7 (docs/accuracy.md).
            sq = self.shard.row_sq.index_select(0, ids) + grads.pow(2).mean(1, keepdim=True)
            self.shard.row_sq.index_copy_(0, ids, sq)
            grads = grads / (sq.sqrt() + self.eps)
        self.shard.write_rows(ids, rows - self.lr * factor * grads)
        self.zero_grad()

    def zero_grad(self) -> None:
        self._ids, self._grads, self._rows = [], [], []


def build_encoder_optimizer(params, cfg: TrainConfig, sparse_params=()) -> "torch.optim.Optimizer | EncoderOptimizer":
    """Adam/AdamW over the encoder's dense parameters; with `sparse_params` (tables taking sparse gradients,
    model.sparse_features), an EncoderOptimizer that steps those with a lazy SparseAdam beside it."""
    cls = torch.optim.AdamW if cfg.optimizer_encoder == "adamw" else torch.optim.Adam
    sparse_ids = {id(p) for p in sparse_params}
    params = [p for p in params if id(p) not in sparse_ids]
    # fused kernels exist on CPU and CUDA for float params; fall back where a device lacks them
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    dense = cls(params, lr=cfg.lr_encoder, weight_decay=cfg.weight_decay_encoder, fused=fused or None) if params else None
    if not sparse_ids:
        return dense
    return EncoderOptimizer(dense, torch.optim.SparseAdam(list(sparse_params), lr=cfg.lr_encoder))


class EncoderOptimizer:
    """Adam/AdamW for the dense encoder parameters and a lazy SparseAdam for a feature table with sparse
    gradients: a step moves, and keeps moments for, only the feature rows the step's batch touched, so
    its cost is O(batch features * embed_dim) instead of O(num_features * embed_dim), which at 10^5-10^6
    features is most of a dense step (an EmbeddingBag(200k, 1024) step: 1.65 s dense on 2 cores).

    The table's moments move only when its rows are touched (lazy Adam, no weight decay on the table):
    a rare feature's row does not decay between its appearances. Looks like one torch optimizer to the
    trainer (step, zero_grad, param_groups for the schedule, state_dict)."""

    def __init__(self, dense: torch.optim.Optimizer | None, sparse: torch.optim.Optimizer):
        # dense is None when the table is the whole encoder (no hidden layer, no projection)
        self.dense, self.sparse = dense, sparse
        self.parts = [o for o in (dense, sparse) if o is not None]

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.parts for g in o.param_groups]

    def step(self) -> None:
        for o in self.parts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"dense": None if self.dense is None else self.dense.state_dict(), "sparse": self.sparse.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.dense is not None:
            self.dense.load_state_dict(state["dense"])
        self.sparse.load_state_dict(state["sparse"])


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
