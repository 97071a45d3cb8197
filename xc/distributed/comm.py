"""Process-group set-up and the collectives the trainer needs.

Without torchrun's environment (WORLD_SIZE unset) everything runs as a world of one and every
collective is the identity, so `python -m xc.cli.train` and `torchrun --nproc-per-node 1` behave alike.
"""

from __future__ import annotations

import datetime
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from xc.errors import ConfigError, XCError

log = logging.getLogger(__name__)


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def init_distributed(backend: str = "auto", device: str = "auto", timeout_s: int = 1800) -> DistContext:
    """Join the torchrun process group (if any) and pick this rank's device.

    backend "auto" is nccl when CUDA is present and gloo otherwise; device "auto" is this rank's
    local GPU when CUDA is present, else the CPU.
    """
    cuda = torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise ConfigError("train.device", "cuda requested but torch.cuda.is_available() is False")
    use_cuda = cuda and device != "cpu"
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not use_cuda:
        raise ConfigError("parallel.backend", "nccl needs CUDA devices; use gloo on CPU")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs: dict[str, Any] = dict(backend=backend, timeout=timeout, device_id=dev if use_cuda else None)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None:
            # torchrun keeps one TCPStore across `--max-restarts` restarts (pytorch/pytorch#135712). Without
            # a key prefix per attempt, restarted ranks read the gloo/nccl addresses that the dead attempt
            # left there and fail with "connection refused". Single node: every rank restarts together, so
            # the count agrees; launch/multi_node.sh also turns store sharing off.
            store, rank, world_size = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
            kwargs.update(store=dist.PrefixStore(f"xc/attempt-{attempt}", store), rank=rank, world_size=world_size)
        dist.init_process_group(**kwargs)
    return DistContext(rank, world_size, local_rank, dev, backend if world_size > 1 else None)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    if ctx.active:
        dist.barrier()


def all_reduce(tensor: torch.Tensor, ctx: DistContext, op: str = "sum") -> torch.Tensor:
    """Reduce `tensor` in place over every rank ("sum" or "max") and return it; unchanged without a process group.
    The tensor must live on this rank's device (NCCL reduces device tensors only)."""
    if ctx.active:
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor


def broadcast_object(obj: Any, ctx: DistContext, src: int = 0) -> Any:
    """Rank `src`'s value of a picklable object on every rank (small control data only)."""
    if not ctx.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def on_rank0(ctx: DistContext, action):
    """Run `action()` on rank 0 only; every rank returns its result, or raises its XCError (rank 0 the
    original, the others an XCError with the same message), so no rank waits for a peer that failed."""
    result, error, raised = None, None, None
    if ctx.is_main:
        try:
            result = action()
        except XCError as exc:
            error, raised = str(exc), exc
    result, error = broadcast_object((result, error), ctx)
    if raised is not None:
        raise raised
    if error is not None:
        raise XCError(error)
    return result


def all_gather_object(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's value of a picklable object, in rank order (small control data only)."""
    if not ctx.active:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def all_gather_no_grad(x: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Concatenate equal-shaped `x` (b, ...) from every rank along dim 0 -> (G*b, ...)."""
    if not ctx.active:
        return x
    parts = [torch.empty_like(x) for _ in range(ctx.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)


class _AllGatherWithGrad(torch.autograd.Function):
    """Forward: all-gather (b, d) -> (G*b, d). Backward: each rank receives the SUM over ranks of
    the gradient w.r.t. its own slice, because every rank's loss depends on every query."""

    @staticmethod
    def forward(fctx, x: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
        fctx.world_size, fctx.rank, fctx.rows = world_size, rank, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(fctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if dist.get_backend() == "nccl":
            out = torch.empty((fctx.rows,) + grad.shape[1:], dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad)
        else:  # gloo has no reduce_scatter: all-reduce O(B*d) and keep our slice
            dist.all_reduce(grad)
            out = grad[fctx.rank * fctx.rows:(fctx.rank + 1) * fctx.rows].clone()
        return out, None, None


def all_gather_with_grad(x: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """All-gather query embeddings (b, d) -> (G*b, d) so that gradients flow back to their rank."""
    if not ctx.active:
        return x
    return _AllGatherWithGrad.apply(x, ctx.world_size, ctx.rank)


def _sum_allreduce_hook(state, bucket):  # no annotations: DDP rejects string-ified ones
    # The loss on each rank is its label shard's share of the *global* batch loss, and the gather's
    # backward already routes every shard's gradient to the rank that encoded the query; the encoder
    # gradient is therefore the SUM over ranks, not DDP's default mean.
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def wrap_data_parallel(module: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """DDP with sum-reduction across ranks (see `_sum_allreduce_hook`); identity for one process, or when no
    parameter takes a gradient (a feature table trained by gathered rows is the whole encoder: its rows are
    summed over ranks by `sum_row_grads`)."""
    if not ctx.active or not any(p.requires_grad for p in module.parameters()):
        return module
    with warnings.catch_warnings():
        # torch 2.11 deprecates broadcast_buffers but advises keeping broadcast_buffers=False until its replacement
        # can skip the sync at init; the warning would print once per rank on every run
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        ddp = torch.nn.parallel.DistributedDataParallel(
            module,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            broadcast_buffers=False,
        )
    ddp.register_comm_hook(None, _sum_allreduce_hook)
    return ddp


def sum_row_grads(ids: torch.Tensor, grads: torch.Tensor, ctx: DistContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique row ids (U,), gradients (U, d)) summed over the ranks from each rank's (ids (u,), grads (u, d)):
    every rank all-gathers the others' pairs, padded to the largest count, and sums rows by id. Costs
    O(G * touched rows * d), never O(table); dense collectives, so it works on gloo and NCCL alike (a
    feature table trained by gathered rows, model.sparse_features, stays out of DDP)."""
    if not ctx.active:
        return ids, grads
    count = torch.tensor([ids.numel()], dtype=torch.int64, device=grads.device)
    counts = [torch.zeros_like(count) for _ in range(ctx.world_size)]
    dist.all_gather(counts, count)
    sizes = [int(c.item()) for c in counts]
    pad = max(sizes) - ids.numel()
    ids_p = torch.cat([ids, ids.new_zeros(pad)])
    grads_p = torch.cat([grads, grads.new_zeros(pad, grads.shape[1])])
    all_ids = [torch.empty_like(ids_p) for _ in range(ctx.world_size)]
    all_grads = [torch.empty_like(grads_p) for _ in range(ctx.world_size)]
    dist.all_gather(all_ids, ids_p)
    dist.all_gather(all_grads, grads_p)
    return sum_rows_by_id([a[:n] for a, n in zip(all_ids, sizes)], [g[:n] for g, n in zip(all_grads, sizes)])


def sum_rows_by_id(ids: list[torch.Tensor], grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique ids (U,), summed rows (U, d)) of row gradients given in parts (ids (u_i,), grads (u_i, d)) that
    may name a row more than once (micro-steps, ranks); one part is returned as it is."""
    if len(ids) == 1:
        return ids[0], grads[0]
    unique, inverse = torch.unique(torch.cat(ids), return_inverse=True)
    summed = torch.zeros(unique.numel(), grads[0].shape[1], dtype=grads[0].dtype, device=grads[0].device)
    summed.index_add_(0, inverse, torch.cat(grads))
    return unique, summed
