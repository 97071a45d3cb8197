"""What the Trainer does around the steps of either mode: checkpoints by step count and by
time, graceful stops on SIGTERM/SIGINT, fault injection, the non-finite check of each micro-step
(`nonfinite_parts`, which both modes call) and the `train.nonfinite` policy, the finiteness check before a
checkpoint is written, the attempt marker in log.jsonl, and what a finished run no longer needs (`prune_when_done`).

Kept out of xc/train/trainer.py (the one loop of both modes) so that the loop reads as a loop; one implementation of
the rule "every rank takes the same decision after the same optimizer step".
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from pathlib import Path

import torch

from xc.distributed import DistContext, all_reduce, barrier
from xc.handoff import drop_generations, gen_name, handoff_root, list_generations
from xc.run import checkpoint as ckpt
from xc.errors import XCError
from xc.models.encoders import touched_row_grads
from xc.run.signals import StopControl, StopRequested, stop_message

log = logging.getLogger(__name__)
SUM_BLOCK = 1 << 22  # elements summed at a time by `blocked_sum`: 32 MiB of float64


def blocked_sum(t: torch.Tensor) -> torch.Tensor:
    """The float64 sum of `t`'s elements, SUM_BLOCK at a time: `t.sum(dtype=torch.float64)` converts the whole
    tensor first, a float64 copy (10^7 bfloat16 rows of 256: 20 GB) that killed a 10^7-label run at its checkpoint."""
    if t.numel() <= SUM_BLOCK or t.dim() == 0:
        return t.sum(dtype=torch.float64)
    rows = max(1, SUM_BLOCK // max(1, t[0].numel()))
    return sum((t[a:a + rows].sum(dtype=torch.float64) for a in range(0, t.shape[0], rows)),
               torch.zeros((), dtype=torch.float64, device=t.device))


def check_finite_state(trainer, parts: dict[str, list[torch.Tensor]]) -> None:
    """Never write a checkpoint from a poisoned state: every tensor of `parts` ({what it is: its tensors}, e.g.
    the encoder parameters and the classifier rows) must be finite on every rank. (A NaN/inf loss or gradient is
    caught before it is applied; this catches what slips past, e.g. an update that overflows.) Always stops: a
    poisoned model cannot be skipped past. Both modes call it before every checkpoint."""
    ctx = trainer.ctx
    sums = {name: sum((blocked_sum(t.detach()) for t in tensors), torch.zeros((), dtype=torch.float64))
            for name, tensors in parts.items()}
    flags = all_reduce(torch.tensor([0.0 if torch.isfinite(v) else 1.0 for v in sums.values()], device=ctx.device),
                       ctx)
    bad = [name for name, flag in zip(parts, flags.tolist()) if flag]
    if bad:
        raise XCError(f"non-finite values in the {' and '.join(bad)} at epoch {trainer.epoch} global step "
                      f"{trainer.global_step}; refusing to write a checkpoint from this state. The newest "
                      f"checkpoint in {trainer.cfg.run_dir}/checkpoints predates it; lower the learning rates")


def nonfinite_parts(value: torch.Tensor, encoder: torch.nn.Module, row_grad: torch.Tensor | None,
                    ctx: DistContext) -> str:
    """'' if the loss, the encoder gradient and the classifier row gradient are finite on every rank, else
    what is not (all ranks get the same answer, so they skip or stop together).

    Cheap: one sum per gradient tensor in its own dtype, and one all-reduce of three flags per micro-step. A sum
    is NaN or inf whenever an element is; a sum of finite values overflows only when they are astronomically large
    (|sum| > 3.4e38 in float32), and skipping such a step is what one would want anyway. (A float64 sum, exact
    about overflow, cost 34 ms per step on a 10^4 x 1024 gathered table gradient against 1 ms: docs/scaling.md.)"""
    # a gathered-row feature table's gradients live on its gathered rows, not on .grad
    grads = [g.sum().double() for g in [p.grad for p in encoder.parameters()] + touched_row_grads(encoder)
             if g is not None]
    zero = value.new_zeros((), dtype=torch.float64)
    sums = torch.stack([value.double().reshape(()), torch.stack(grads).sum() if grads else zero,
                        row_grad.sum().double() if row_grad is not None else zero])
    flags = all_reduce((~torch.isfinite(sums)).float(), ctx)
    names = ("loss", "encoder gradient", "classifier row gradient")
    return " and ".join(name for name, flag in zip(names, flags.tolist()) if flag)


def skip_or_stop_nonfinite(trainer, key, what: str, log) -> None:
    """`train.nonfinite` after a NaN/inf `what` (every rank agrees, nonfinite_parts), once the trainer
    has dropped the step's gradients: raise (exit code 2, no checkpoint from this state) under `stop`; under
    `skip` count it in `trainer.skipped_steps`, warn on `log` (the trainer's logger) and log a `nonfinite` event."""
    if trainer.cfg.train.nonfinite == "stop":
        raise XCError(f"non-finite {what} at epoch {key.epoch} micro-step {key.step} (global step "
                      f"{trainer.global_step}); stopping without writing a checkpoint from this state. "
                      "Lower the learning rates, or set train.nonfinite=skip to skip such steps")
    trainer.skipped_steps += 1
    log.warning("non-finite %s at epoch %d micro-step %d: step skipped, nothing applied (%d so far)",
                what, key.epoch, key.step, trainer.skipped_steps)
    trainer.logger.event("nonfinite", epoch=key.epoch, micro=key.step, global_step=trainer.global_step, what=what,
                         skipped_steps=trainer.skipped_steps)


def stop_control(trainer) -> StopControl:
    """The trainer's StopControl: the one the entry point installed, else the passive one the Trainer made (no
    handlers: a Trainer built by a test or a library caller keeps the process's own signal handling)."""
    return trainer.stop


def after_optimizer_step(trainer) -> None:
    """Call on every rank after each optimizer step: checkpoint when `train.checkpoint_every_steps` or
    `train.checkpoint_every_minutes` says so, and stop (after a checkpoint at this step on every rank)
    when any rank received SIGTERM/SIGINT."""
    cfg, ctx, step = trainer.cfg, trainer.ctx, trainer.global_step
    if trainer.heartbeat is not None:
        trainer.heartbeat.step = step
    trainer.faults.maybe_signal(step, ctx.rank)
    stop = stop_control(trainer)
    poll = stop.poll(ctx)
    every = cfg.train.checkpoint_every_steps
    if (every and step % every == 0) or poll.checkpoint_due or poll.stop_signal:
        trainer.save_checkpoint()
        stop.checkpointed()
    if poll.stop_signal:
        _stop(trainer, poll.stop_signal)
    trainer.faults.maybe_kill(step, ctx.rank, cfg.run_dir)


def after_epoch_checkpoint(trainer) -> None:
    """Call on every rank right after the checkpoint that ends an epoch: stop there when any rank received
    SIGTERM/SIGINT since the last step (during the epoch's evaluation, say). Why here and not only after the
    next step: the next epoch begins with the hard-negative refresh, and a synchronous miner (the default) mines
    for minutes at 10^6 labels (about 155 s on 2 cores) before any step would honour the signal, longer than many
    schedulers' grace period. The checkpoint of this step is already written, so none is written again."""
    stop = stop_control(trainer)
    poll = stop.poll(trainer.ctx)
    stop.checkpointed()
    if poll.stop_signal:
        _stop(trainer, poll.stop_signal)


def after_refresh(trainer) -> None:
    """Call on every rank right after an epoch's hard-negative refresh, before its first step: stop there when any
    rank received SIGTERM/SIGINT. Rank 0 gives up waiting for the miner at a signal (xc/refresh/negatives.py
    `_decide`: a miner at 10^6 labels may take minutes, longer than a scheduler's grace), and keeps the negatives it
    had (older ones, or uniform draws at the first refresh). Training even one step with them and checkpointing it
    would record a step no uninterrupted run takes: the resumed run, mid-epoch, keeps those negatives for the
    rest of the epoch and ends elsewhere (the kill-anywhere soak, tools/probes/soak.py, found a max difference of 30 in
    the classifier rows). Stopped here, the run resumes at this epoch's start and waits for its generation again.
    The checkpoint of this step is the previous epoch's last; at step 0 nothing was trained and there is none."""
    stop = stop_control(trainer)
    poll = stop.poll(trainer.ctx)
    if poll.stop_signal:
        _stop(trainer, poll.stop_signal)


def _stop(trainer, signum: int) -> None:
    """Every rank, after a checkpoint at this step (or before any step): log the stop, close the miner, raise
    StopRequested."""
    step = trainer.global_step
    path = ckpt.checkpoint_root(trainer.cfg.run_dir) / f"step-{step:08d}"
    if step == 0 and trainer.resume_from is None:  # stopped at the first refresh: nothing trained, nothing written
        path, message = None, (f"stopped by {signal.Signals(signum).name} before the first optimizer step; nothing "
                               "was trained and no checkpoint written. Run the same command again to start the run")
    else:
        message = stop_message(signum, step, path)  # printed once, by the entry point
    trainer.logger.event("stopped", signal=signal.Signals(signum).name, epoch=trainer.epoch,
                         micro=trainer.micro, global_step=step, path=None if path is None else str(path))
    refresher = getattr(trainer, "refresher", None)
    if refresher is not None:  # the miner thread and its worker processes must not outlive the stop
        refresher.close(step)
    trainer.logger.close()
    raise StopRequested(signum, message)


def log_attempt(trainer, resumed_from) -> None:
    """One `attempt` event at the start of every attempt (fresh, resumed, restarted by torchrun).

    log.jsonl is appended to across attempts; an attempt that was killed leaves events for steps that
    a resume from an earlier checkpoint repeats. This marker says from which step on the earlier
    events are superseded, so a reader keeps, per step, the events of the last attempt only."""
    trainer.logger.event(
        "attempt", global_step=trainer.global_step, epoch=trainer.epoch, micro=trainer.micro,
        resumed_from=None if resumed_from is None else str(resumed_from.path),
        superseded_after_step=trainer.global_step, pid=os.getpid(), host=socket.gethostname(),
        world_size=trainer.ctx.world_size, restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))


def _bytes_under(paths: list[Path]) -> int:
    return sum(f.stat().st_size for p in paths for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def prune_when_done(trainer) -> None:
    """`train.prune_when_done`: a finished run drops its checkpoints other than the one it serves and the newest
    (`ckpt.prune_finished`), and its own miner's snapshots and negatives (`drop_generations`), said in one line. An
    external miner's hand-off is its own (it may still be reading it), and keep_checkpoints=0 keeps every checkpoint.
    Every rank has closed its part of the run first (a barrier), so nothing is reading what goes."""
    cfg, ctx = trainer.cfg, trainer.ctx
    if not cfg.train.prune_when_done:
        return
    barrier(ctx)
    if not ctx.is_main:
        return
    checkpoints = ckpt.list_checkpoints(cfg.run_dir) if cfg.train.keep_checkpoints > 0 else []
    own_miner = cfg.miner.mode != "external"
    root = handoff_root(cfg.run_dir)
    generations = [root / part / gen_name(g) for part in ("snapshots", "negatives")
                   for g in list_generations(root / part)] if own_miner else []
    try:
        before = _bytes_under(checkpoints + generations)
        removed = ckpt.prune_finished(cfg.run_dir) if checkpoints else []
        dropped = drop_generations(cfg.run_dir) if own_miner else 0
    except OSError as exc:  # the run itself is done and written: a folder that cannot be tidied is only said
        log.warning("finished, but could not remove what the run no longer needs (%s); its files are whole", exc)
        return
    if not removed and not dropped:
        return
    freed = before - _bytes_under([p for p in checkpoints if p.exists()])
    log.info(
        "finished: removed %d checkpoint%s neither served nor newest and %d hand-off generation%s the miner used "
        "(%s freed; train.prune_when_done=false keeps them)", len(removed), "" if len(removed) == 1 else "s",
        dropped, "" if dropped == 1 else "s", f"{freed / 1e9:.1f} GB" if freed >= 1e8 else f"{freed / 1e6:.1f} MB")
    trainer.logger.event("pruned", global_step=trainer.global_step, checkpoints=[p.name for p in removed],
                         generations=dropped, freed_bytes=int(freed))
