"""Optimisers and schedules: sparse-row SGD for classifier shards, Adam/AdamW for the encoder (a lazy
row-wise Adam for a large feature table trained by gathered rows beside it).

The classifier update touches only the rows a step scored, so its cost is O(rows touched * d) and
independent of L; weight decay is applied to those rows only (lazily), which is the usual choice for
sparse updates and keeps the step free of O(L) work. Low-precision shards with fp32 master rows are
updated in fp32 on the masters (`ClassifierShard.exact_rows` / `write_rows`); bfloat16 shards without masters
are updated in fp32 and stored by stochastic rounding keyed by the global step (xc/models/rounding.py).
"""

from __future__ import annotations

import math

import torch

from xc.config import TrainConfig, XCConfig
from xc.distributed.comm import sum_row_grads, sum_rows_by_id
from xc.models.classifier import ClassifierShard


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1 over `warmup_steps`, then cosine decay to `min_ratio` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))



def replanned_schedule(meta: dict, cfg: XCConfig, steps_per_epoch: int, total_steps: int, step: int) -> dict | None:
    """Where a resume has another planned length than the checkpoint's run (train.epochs or train.max_steps
    changed), the cosine schedule is re-planned over the new length: {"message", "planned_steps_before",
    "planned_steps", "lr_factor_before", "lr_factor"} with the factor at `step` under each plan; else None."""
    train = (meta.get("config") or {}).get("train") or {}
    before_epochs, before_max = train.get("epochs"), train.get("max_steps", -1)
    if before_epochs is None:
        return None
    before = steps_per_epoch * int(before_epochs)
    if before_max is not None and int(before_max) >= 0:
        before = min(before, int(before_max))
    if before == total_steps:
        return None
    warmup, floor = cfg.train.warmup_steps, cfg.train.min_lr_ratio
    old, new = lr_factor(step, warmup, before, floor), lr_factor(step, warmup, total_steps, floor)
    message = (f"the run was planned for {before} steps and now for {total_steps} (train.epochs {before_epochs} -> "
               f"{cfg.train.epochs}, train.max_steps {before_max} -> {cfg.train.max_steps}): the learning-rate "
               f"schedule is re-planned over {total_steps} steps; its factor at step {step} goes from {old:.3f} to "
               f"{new:.3f}")
    return {"message": message, "planned_steps_before": before, "planned_steps": total_steps,
            "lr_factor_before": old, "lr_factor": new}

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
        return sum_rows_by_id(self._ids, self._grads)

    def step(self, factor: float, global_step: int | None = None) -> None:
        """Apply the pending gradients at learning-rate factor `factor`; `global_step` (the optimiser step being
        taken, the same on every rank) keys the stochastic rounding of bfloat16 rows (ClassifierShard.write_rows)."""
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
            # the step size, and one learning rate serves L = 10^2 to 10^7 (docs/accuracy_defaults.md).
            # Two passes over the (U, d) rows, a read of the gradient for its row norms and one multiply-add, where
            # squaring, dividing and subtracting row by row took five (8 -> 4 ms for 3,100 rows of 1024 on 2 threads)
            sq = torch.linalg.vector_norm(grads, dim=1, keepdim=True).square_().div_(grads.shape[1])
            sq.add_(self.shard.row_sq.index_select(0, ids))
            self.shard.row_sq.index_copy_(0, ids, sq)
            step = sq.sqrt_().add_(self.eps).reciprocal_().mul_(-self.lr * factor)  # (U, 1): sq is spent
            self.shard.write_rows(ids, torch.addcmul(rows, grads, step), global_step)
        else:
            self.shard.write_rows(ids, rows - self.lr * factor * grads, global_step)
        self.zero_grad()

    def zero_grad(self) -> None:
        self._ids, self._grads, self._rows = [], [], []


def build_encoder_optimizer(params, cfg: TrainConfig, tables=(), ctx=None) -> "torch.optim.Optimizer | EncoderOptimizer":
    """Adam/AdamW over the encoder's trained parameters; with `tables` (BowEncoders whose feature table trains
    by gathered rows, model.sparse_features), an EncoderOptimizer that steps each table with RowTableAdam."""
    cls = torch.optim.AdamW if cfg.optimizer_encoder == "adamw" else torch.optim.Adam
    params = [p for p in params if p.requires_grad]
    # fused kernels exist on CPU and CUDA for float params; fall back where a device lacks them
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    dense = cls(params, lr=cfg.lr_encoder, weight_decay=cfg.weight_decay_encoder, fused=fused or None) if params else None
    if not tables:
        return dense
    return EncoderOptimizer(dense, [RowTableAdam(t, cfg.lr_encoder, ctx) for t in tables])


class RowTableAdam:
    """Adam on a feature table trained by gathered rows, computed lazily: a step costs O(touched rows * embed_dim),
    never O(num_features * embed_dim) (200k features of width 1024 step in tens of milliseconds instead of 1.65 s
    for a dense Adam, docs/scaling.md), and the table moves as torch's dense Adam would move it.

    Dense Adam keeps moving a row after the last step that gave it a gradient: its first moment decays by beta1 and
    its second by beta2 each step, so a row touched once moves on for about 1 / (1 - beta1) = 10 more steps, by
    lr_u * sqrt(1 - beta2^u) / (1 - beta1^u) * r^j * m / sqrt(v) at step u = last + j, r = beta1 / sqrt(beta2). A
    lazy Adam (torch's SparseAdam) drops those steps, which slows rare features about tenfold: on debian-deps it
    scored 0.2 P@1 below the dense table once fused (docs/accuracy.md). Here a row's missed steps are applied when
    it is next gathered, or when the table is read outside a training step (`catch_up`: validation, mining,
    checkpoints), as one update by K(last, t) = sum_{u=last+1..t} lr_u sqrt(1 - beta2^u) / (1 - beta1^u) r^(u-last),
    kept for every `last` in O(WINDOW) per step; the moments then decay by beta^(t - last). Equal to dense Adam but for
    eps (taken at the row's last step) and the terms beyond WINDOW steps (r^256 < 3e-12). No weight decay.

    `table` is a BowEncoder with gather_rows (its `touched` list of (row ids (U,), rows leaf (U, d))). State: the two
    (num_features, d) float32 moments and the step count, checkpointed with the run (always caught up first)."""

    WINDOW = 256  # steps of momentum carried forward; r^256 < 3e-12 at the default betas
    CHUNK = 4096  # rows caught up at once when the whole table is read: the scratch stays a step's size

    def __init__(self, table, lr: float, ctx=None, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.table, self.ctx, self.betas, self.eps = table, ctx, betas, eps
        weight = table.bag.weight
        self.exp_avg = torch.zeros_like(weight)
        self.exp_avg_sq = torch.zeros_like(weight)
        self.steps = 0
        self.last = torch.zeros(weight.shape[0], dtype=torch.int64, device=weight.device)  # the step each row is at
        self._carry = torch.zeros(1024, dtype=torch.float64, device=weight.device)  # [last] = K(last, steps), grown
        self._scratch: torch.Tensor | None = None  # (3, rows, d): see step
        self.param_groups = [{"lr": lr}]  # set_lr's view, as for a torch optimizer
        table.before_read = self.catch_up

    def pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row ids (U,), summed gradients (U, d)) of this rank's micro-steps since the last step."""
        weight = self.table.bag.weight
        parts = [(ids, rows.grad) for ids, rows in self.table.touched if rows.grad is not None]
        if not parts:
            return (torch.zeros(0, dtype=torch.int64, device=weight.device),
                    torch.zeros(0, weight.shape[1], dtype=weight.dtype, device=weight.device))
        return sum_rows_by_id([i for i, _ in parts], [g for _, g in parts])

    @torch.no_grad()
    def step(self) -> None:
        ids, grads = self.pending()
        self.table.touched = []
        b1, b2 = self.betas
        lr = self.param_groups[0]["lr"]
        if self.ctx is not None and self.ctx.active:
            ids, grads = sum_row_grads(ids, grads, self.ctx)
            if ids.numel():  # rows only another rank's batch gathered: the steps each missed, before this one
                self._catch_up(ids)
        self.steps += 1
        bias1, bias2 = 1 - b1 ** self.steps, 1 - b2 ** self.steps
        if ids.numel():
            # The touched rows' moments go through reused (U, d) buffers and every operation is in place: at
            # 10k rows x 1024 each temporary is 40 MB, above glibc's mmap threshold, so a fresh one costs a page
            # fault per 4 KB; allocating them every step made this step 2.7x slower (docs/scaling.md).
            m, v, _ = self._buffers(ids.numel(), grads)
            torch.index_select(self.exp_avg, 0, ids, out=m).mul_(b1).add_(grads, alpha=1 - b1)
            torch.index_select(self.exp_avg_sq, 0, ids, out=v).mul_(b2).addcmul_(grads, grads, value=1 - b2)
            self.exp_avg.index_copy_(0, ids, m)
            self.exp_avg_sq.index_copy_(0, ids, v)
            denom = v.div_(bias2).sqrt_().add_(self.eps)  # v and m are spent: the update is built in them
            self.table.bag.weight.index_add_(0, ids, m.div_(denom), alpha=-lr / bias1)
            self.last[ids] = self.steps
        # K(last, steps) gains this step's term for every `last` within WINDOW steps (the rows it did not touch)
        if self.steps >= len(self._carry):
            self._carry = torch.cat([self._carry, torch.zeros_like(self._carry)])
        lo = max(0, self.steps - self.WINDOW)
        lags = torch.arange(self.steps - lo, 0, -1, dtype=torch.float64, device=self._carry.device)
        self._carry[lo:self.steps] += lr * bias2 ** 0.5 / bias1 * (b1 / b2 ** 0.5) ** lags

    @torch.no_grad()
    def _catch_up(self, ids: torch.Tensor) -> None:
        """Bring rows `ids` (U,) to step `self.steps`: the updates of the steps each missed since its `last`, in one,
        and its moments decayed over them."""
        # rows already current are caught up by nothing (K(steps, steps) = 0, decay 1): no filter, so a GPU step
        # waits on no host-device sync here; the (U, d) work goes through the reused scratch buffers (see step)
        last = self.last[ids]
        b1, b2 = self.betas
        lag = (self.steps - last).to(torch.float64).unsqueeze(1)
        m, v, update = self._buffers(ids.numel(), self.exp_avg)
        torch.index_select(self.exp_avg, 0, ids, out=m)
        torch.index_select(self.exp_avg_sq, 0, ids, out=v)
        torch.sqrt(v, out=update).add_(self.eps)
        torch.div(m, update, out=update).mul_(self._carry[last].unsqueeze(1).to(m.dtype))
        self.table.bag.weight.index_add_(0, ids, update, alpha=-1.0)
        self.exp_avg.index_copy_(0, ids, m.mul_((b1 ** lag).to(m.dtype)))
        self.exp_avg_sq.index_copy_(0, ids, v.mul_((b2 ** lag).to(v.dtype)))
        self.last[ids] = self.steps

    def catch_up(self, ids: torch.Tensor | None = None) -> None:
        """Rows `ids` (U,), or every row (None), to the current step, as dense Adam would hold them: the table calls it
        before it reads them (`BowEncoder.before_read`). Every row costs O(num_features * d), once after each step."""
        if not self.steps:
            return
        if ids is None:
            behind = torch.nonzero(self.last < self.steps).squeeze(1)
            for start in range(0, behind.numel(), self.CHUNK):  # chunks bound the scratch buffers
                self._catch_up(behind[start:start + self.CHUNK])
        elif ids.device.type == "cpu":  # only the rows behind: on a GPU the filter would wait on the device
            behind = ids[self.last.index_select(0, ids) < self.steps]
            if behind.numel():
                self._catch_up(behind)
        else:
            self._catch_up(ids)

    def _buffers(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Three (rows, d) scratch tensors, views of buffers grown to the largest step so far."""
        if self._scratch is None or self._scratch.shape[1] < rows or self._scratch.device != like.device:
            self._scratch = torch.empty(3, max(rows, 1), like.shape[1], dtype=like.dtype, device=like.device)
        return self._scratch[0, :rows], self._scratch[1, :rows], self._scratch[2, :rows]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.table.touched = []

    def state_dict(self) -> dict:
        self.catch_up()  # a checkpoint holds the caught-up table and moments: every row current
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "steps": self.steps,
                "lr": self.param_groups[0]["lr"]}

    def load_state_dict(self, state: dict) -> None:
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.steps = int(state["steps"])
        self.param_groups[0]["lr"] = float(state["lr"])
        self.last.fill_(self.steps)
        self._carry = self._carry.new_zeros(max(1024, 2 * (self.steps + 1)))


class EncoderOptimizer:
    """Adam/AdamW for the encoder's trained parameters and a RowTableAdam per gathered-row feature table;
    looks like one torch optimizer to the trainer (step, zero_grad, param_groups for the schedule,
    state_dict). `dense` is None when the table is the whole encoder (no hidden layer, no projection)."""

    def __init__(self, dense: torch.optim.Optimizer | None, tables: list[RowTableAdam]):
        self.dense, self.tables = dense, tables
        self.parts = ([dense] if dense is not None else []) + list(tables)

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
        return {"dense": None if self.dense is None else self.dense.state_dict(),
                "tables": [t.state_dict() for t in self.tables]}

    def load_state_dict(self, state: dict) -> None:
        if self.dense is not None:
            self.dense.load_state_dict(state["dense"])
        for t, st in zip(self.tables, state["tables"]):
            t.load_state_dict(st)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
