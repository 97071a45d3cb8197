"""The one conductor: the training loop of both modes (xc/train/modes/: classifier, dual).

The Trainer owns what a run does whatever its model: the epoch and micro-step loop, the progress bar and the
`train` / `epoch` / `eval` events, the non-finite policy (train.nonfinite), the counters (epoch, micro-step,
global step, skipped steps), evaluation on the test split, checkpoints (finite state checked first, rank files,
publication) and resume. The mode owns its model, optimisers, batches, negatives and the ranking of the test
rows; it is called through the small protocol documented in xc/train/modes/__init__.py.
"""

from __future__ import annotations

import logging
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from xc.config import XCConfig, to_dict
from xc.distributed import DistContext, all_gather_object, all_reduce, barrier, broadcast_object
from xc.distributed.host_threads import final_phase_threads
from xc.eval.metrics import evaluate as evaluate_metrics
from xc.eval.metrics import true_labels
from xc.faults import NO_FAULTS, Faults
from xc.run import checkpoint as ckpt
from xc.run.heartbeat import Heartbeat
from xc.run.identity import run_id
from xc.run.runlog import RunLogger
from xc.run.signals import StopControl
from xc.sampling import StepKey
from xc.train import lifecycle
from xc.train.modes import ModePlan
from xc.train.modes.classifier import ClassifierMode

log = logging.getLogger("xc.train.trainer")


def _mode_class(cfg: XCConfig):
    if cfg.model.mode == "dual":
        from xc.train.modes.dual import DualMode  # lazy: the dual mode's towers and label texts load for dual runs only

        return DualMode
    return ClassifierMode


class Trainer:
    """The loop over a mode (see the module docstring). `plan` is the run's config resolved once, by
    xc.train.plan.resolve_run before the Trainer is built, with the checkpoint to resume from; `identity`
    (xc/run/identity.py) is recorded in every checkpoint; `stop` is the entry point's StopControl with its signal
    handlers installed (None: a passive one, and the process keeps its own signal handling: tests, library
    callers); `heartbeat`: run this rank's heartbeat thread (xc/run/heartbeat.py), started last, once the model is
    built, so a refused configuration writes nothing; `faults`: the tests' fault injection (xc/faults.py), which the
    entry point builds from its environment, for the loop, its lifecycle helpers and the mode (NO_FAULTS: none)."""

    def __init__(self, plan: ModePlan, ctx: DistContext, dataset, *, identity: dict | None = None,
                 stop: StopControl | None = None, heartbeat: bool = False, faults: Faults = NO_FAULTS):
        if not isinstance(plan, ModePlan):  # a bare config would train without its rules and resume decision
            raise TypeError(f"Trainer takes the plan xc.train.plan.resolve_run(cfg, ctx, dataset) returns, not a "
                            f"{type(plan).__name__}")
        self.faults = faults
        self.mode = _mode_class(plan.cfg)(plan, ctx, dataset, faults=faults)
        self.cfg, self.ctx, self.dataset, self.resume_from = plan.cfg, ctx, dataset, plan.source
        # only once the model is built: a refused configuration leaves the run directory untouched
        self.logger = RunLogger(self.cfg.logger, self.cfg.run_dir, self.cfg.name, ctx.rank, to_dict(self.cfg))
        self.mode.start(self.logger)
        self.epoch, self.micro, self.global_step = 0, 0, 0
        self.skipped_steps = 0  # optimizer steps dropped for a non-finite loss or gradient (train.nonfinite=skip)
        self.last_metrics: dict[str, float] = {}
        self.identity = identity
        self.stop = stop if stop is not None else StopControl(self.cfg.train.checkpoint_every_minutes)
        self.heartbeat = Heartbeat(self.cfg.run_dir, ctx.rank, ctx.world_size, self.cfg.parallel.heartbeat_s,
                                   self.cfg.parallel.timeout_s).start() if heartbeat else None

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        try:
            return self._fit()
        except BaseException:  # SIGTERM's StopRequested (after its checkpoint), an error: no miner outlives us
            self.mode.abandon()
            raise

    def _fit(self) -> dict[str, float]:
        cfg, mode = self.cfg, self.mode
        self.stop.finish_steps_first()  # an ensemble's member after one whose final phase set `leave_at_once`
        self._maybe_resume()
        lifecycle.log_attempt(self, self.resume_from)
        if self.micro == 0 and self.epoch >= mode.schedule.epochs or self._reached_max_steps():
            log.info("run in %s is already complete (epoch %d, step %d); evaluating only",
                     cfg.run_dir, self.epoch, self.global_step)
            mode.close(self.global_step)
            return self._finish(complete=True)
        log.info("%s", mode.describe())
        while self.epoch < mode.schedule.epochs and not self._reached_max_steps() and not self._out_of_patience():
            boundary = time.perf_counter()
            mode.begin_epoch(self.epoch, self.micro, self.global_step)
            lifecycle.after_refresh(self)  # a signal during the refresh's wait for the miner stops here
            started = time.perf_counter()
            self._train_epoch()
            train_seconds = time.perf_counter() - started
            self.logger.event("epoch", epoch=self.epoch, global_step=self.global_step,
                              boundary_seconds=started - boundary, train_seconds=train_seconds)
            if self._reached_max_steps() and self.micro != 0:
                break
            self.epoch, self.micro = self.epoch + 1, 0
            every = cfg.eval.every_epochs
            if (every and self.epoch % every == 0) or self.epoch == mode.schedule.epochs:
                self.evaluate()
            mode.after_epoch(self.epoch, self.global_step)
            self._decide_last_epoch(time.perf_counter() - boundary)
            self.faults.maybe_signal(self.epoch, self.ctx.rank, at="epoch_end")  # tests: a signal in the evaluation
            self.save_checkpoint()
            lifecycle.after_epoch_checkpoint(self)  # a SIGTERM during the evaluation stops here, before a refresh
        if self._reached_max_steps() and self.micro != 0:
            self.save_checkpoint()
        return self._finish(complete=False)

    def _finish(self, complete: bool) -> dict[str, float]:
        """The kept epoch's (or the last) test metrics, then the mode's final ones (label prior, kNN fusion).
        `complete`: the run was already finished when this process started (the mode is closed already)."""
        # no step is left to finish: a signal from here on stops the run where it is (xc/run/signals.py)
        self.stop.leave_at_once(f"in the final evaluation, after global step {self.global_step}: training is complete "
                                "and checkpointed; the same command evaluates it again")
        self.faults.maybe_signal(self.global_step, self.ctx.rank, at="final")  # tests: a signal in the final phase
        self._threads_for_final_phase()
        self.mode.end_training()
        kept = self.mode.keep_selected_epoch(self.micro)
        if complete or (not kept and not self.last_metrics):
            self.evaluate()
        elif kept:
            self.evaluate(event="eval_kept")
        final = self.mode.final_metrics(self.epoch, self.global_step, self.last_metrics)
        if final is not None:
            self.last_metrics = final
        if not complete:
            self.mode.close(self.global_step)
        lifecycle.prune_when_done(self)
        self.logger.close()
        return self.last_metrics

    def _threads_for_final_phase(self) -> None:
        chosen = final_phase_threads(self.cfg, self.ctx.device.type)
        if chosen is not None and chosen[0] != torch.get_num_threads():
            torch.set_num_threads(chosen[0])
            if self.ctx.is_main:
                log.info("host threads per rank: %d (%s)", *chosen)

    def _out_of_patience(self) -> bool:
        """Validation has not improved for eval.select_epoch_patience epochs (rank 0's record decides): stop
        training; the kept epoch is chosen as for a run that trained every epoch (xc/eval/epoch_select.py)."""
        patience = self.cfg.eval.select_epoch_patience
        if patience <= 0 or self.micro != 0:
            return False
        stale = broadcast_object(self.mode.epochs_since_best(), self.ctx)
        if stale < patience:
            return False
        if self.ctx.is_main:
            log.info("stopping after epoch %d of %d: validation has not improved for %d epochs "
                     "(eval.select_epoch_patience=%d; 0 trains every epoch)", self.epoch, self.mode.schedule.epochs,
                     stale, patience)
            self.logger.event("patience_stop", epoch=self.epoch, global_step=self.global_step,
                              epochs_since_best=stale)
        return True

    def _decide_last_epoch(self, epoch_seconds: float) -> None:
        """Under `train.epochs_by_validation`, whether the next epoch is the last, decaying one (xc/train/schedule.py):
        rank 0's seconds and validation figures decide for every rank."""
        schedule = self.mode.schedule
        if not schedule.by_validation or schedule.last_epoch is not None:
            return  # a fixed schedule, or the last epoch already chosen: nothing left to decide
        seconds, gain = broadcast_object((epoch_seconds, self.mode.validation_gain()), self.ctx)
        why = schedule.after_epoch(self.epoch, seconds, *(gain or (None, None)))
        if why is not None and self.ctx.is_main:
            log.info("epoch %d is the last, its learning rate decaying to train.min_lr_ratio: %s", self.epoch + 1, why)
            self.logger.event("last_epoch", epoch=self.epoch, global_step=self.global_step, why=why,
                              gain=None if gain is None else round(gain[0], 4),
                              gain_se=None if gain is None else round(gain[1], 4))

    def _reached_max_steps(self) -> bool:
        return 0 <= self.cfg.train.max_steps <= self.global_step

    def _train_epoch(self) -> None:
        cfg, ctx, mode = self.cfg, self.ctx, self.mode
        show = ctx.is_main and cfg.logger.progress
        bar = tqdm(total=mode.micro_per_epoch, initial=self.micro, desc=f"epoch {self.epoch}", disable=not show,
                   mininterval=0.5 if sys.stderr.isatty() else 10.0, leave=False, dynamic_ncols=True)
        window = {"loss": 0.0, "n": 0, "steps": 0, "t": time.perf_counter()}
        self._cpu_tick = time.process_time()
        timer = mode.timer
        mode.start_pass(self.epoch, self.micro)
        try:
            while self.micro < mode.micro_per_epoch and not self._reached_max_steps():
                last_of_step = (self.micro + 1) % cfg.train.grad_accum == 0
                key = StepKey(cfg.seed, self.epoch, self.micro)
                timer.start()
                out = mode.micro_step(self.micro, key, last_of_step, self.global_step)
                timer.end_step()
                if out.nonfinite:  # every rank agrees; the mode has dropped the step's gradients
                    lifecycle.skip_or_stop_nonfinite(self, key, out.nonfinite, log)
                self.micro += 1
                bar.update(1)
                if out.loss is not None:
                    window["loss"] += out.loss
                    window["n"] += 1
                if out.stepped:
                    self.global_step += 1
                if not last_of_step:
                    continue
                window["steps"] += 1
                mode.after_optimizer_step(self.global_step)
                if self.global_step % cfg.train.log_every == 0:
                    self._log_train(window, bar)
                lifecycle.after_optimizer_step(self)  # checkpoints by steps and minutes; SIGTERM/SIGINT stop here
        finally:
            mode.end_pass()
        if window["n"]:  # the epoch's last, partial logging window
            self._log_train(window, bar)
        bar.close()

    def step_batch(self, batch, last_of_step: bool):
        """One micro-step of the classifier mode on a batch its preparer made (benchmarks and tests drive the
        step this way, outside the epoch loop); the counters and the non-finite policy as in the loop."""
        out = self.mode.step_batch(batch, last_of_step, self.global_step)
        if out.nonfinite:
            lifecycle.skip_or_stop_nonfinite(self, batch.key, out.nonfinite, log)
        self.global_step += int(out.stepped)
        return out

    def _log_train(self, window: dict, bar) -> None:
        cfg, ctx = self.cfg, self.ctx
        # each rank holds its shard's part of the loss; the batch loss is their sum
        total = all_reduce(torch.tensor([window["loss"]], dtype=torch.float64, device=ctx.device), ctx)
        seconds = time.perf_counter() - window["t"]
        steps = max(1, window["steps"])
        # CPU seconds of this process (all its threads, the prefetch thread included; pool miners are other
        # processes): beside the wall time it says how many host cores a rank keeps busy
        cpu, self._cpu_tick = time.process_time() - self._cpu_tick, time.process_time()
        factor = self.mode.schedule.factor(self.global_step)
        fields = dict(epoch=self.epoch, global_step=self.global_step, loss=float(total.item()) / max(1, window["n"]),
                      lr_factor=factor, steps_per_sec=window["steps"] / max(seconds, 1e-9), sec_per_step=seconds / steps,
                      cpu_sec_per_step=cpu / steps, skipped_steps=self.skipped_steps,
                      **self.mode.log_fields(self.global_step))
        phases = self.mode.timer.window()
        if phases is not None:  # train.profile_phases: mean seconds per micro-step over this window
            fields["phase_seconds"] = phases
        self.logger.event("train", **fields)
        bar.set_postfix(loss=f"{fields['loss']:.4f}", **self.mode.postfix(fields),
                        cpu=f"{cpu / max(seconds, 1e-9):.1f}x")
        window.update(loss=0.0, n=0, steps=0, t=time.perf_counter())

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, event: str = "eval") -> dict[str, float]:
        """Test metrics of the model as it is (rank 0 computes, every rank returns them), logged as `event`."""
        cfg, ctx, test = self.cfg, self.ctx, self.mode.test
        n = test.num_points if not cfg.eval.max_points else min(cfg.eval.max_points, test.num_points)
        rows = np.arange(n, dtype=np.int64)
        start = time.perf_counter()
        show = ctx.is_main and cfg.logger.progress
        with tqdm(total=n, desc="evaluating", disable=not show, leave=False,
                  mininterval=0.5 if sys.stderr.isatty() else 10.0) as bar:
            ids = self.mode.rank_test(rows, bar, self.global_step)
        metrics: dict[str, float] = {}
        if ctx.is_main:
            indptr, indices = true_labels(test.labels, first=n)
            metrics = evaluate_metrics(ids, indptr, indices, self.mode.inv_propensity, ks=tuple(cfg.eval.ks))
            shown = "  ".join(f"{k} {v:.2f}" for k, v in metrics.items() if k.startswith(("P@", "nDCG@", "PSP@")))
            log.info("%s epoch %d step %d (%d test points, %.1fs): %s", event, self.epoch, self.global_step, n,
                     time.perf_counter() - start, shown)
            self.logger.event(event, epoch=self.epoch, global_step=self.global_step, **metrics)
        self.last_metrics = broadcast_object(metrics, ctx)
        return self.last_metrics

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> None:
        cfg, ctx, mode = self.cfg, self.ctx, self.mode
        mode.before_checkpoint(self.global_step)
        lifecycle.check_finite_state(self, mode.finite_state())
        state = {"version": 1, "epoch": self.epoch, "micro": self.micro, "global_step": self.global_step,
                 "rng_cpu": torch.get_rng_state(), "skipped_steps": self.skipped_steps, **mode.state_dict()}
        if torch.cuda.is_available() and ctx.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(ctx.device)
        digests = ckpt.write_rank_files(cfg.run_dir, self.global_step, ctx.rank, state, mode.negative_tables())
        digests = {k: v for part in all_gather_object(digests, ctx) for k, v in part.items()}  # also a barrier
        if ctx.is_main:
            meta = {"epoch": self.epoch, "micro": self.micro, "config": to_dict(cfg), **mode.checkpoint_meta(),
                    "metrics": self.last_metrics, "identity": self.identity,
                    # the run directory marker's id: a reader knows a checkpoint copied in from another run
                    "run_id": run_id(cfg.run_dir)}
            path = ckpt.publish(cfg.run_dir, self.global_step, ctx.world_size, meta, cfg.train.keep_checkpoints,
                                crc32=digests, protect=mode.protected_step())
            self.logger.event("checkpoint", epoch=self.epoch, global_step=self.global_step, path=str(path))
        barrier(ctx)

    def _maybe_resume(self) -> None:
        source, ctx = self.resume_from, self.ctx
        if source is None:
            return
        state = self.mode.restore(source)
        torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state and ctx.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"], ctx.device)
        self.epoch, self.micro, self.global_step = state["epoch"], state["micro"], state["global_step"]
        self.skipped_steps = state.get("skipped_steps", 0)  # absent from checkpoints written before it was kept
        log.info("resumed from %s (%s): epoch %d, micro-step %d, global step %d", source.path,
                 self.mode.describe_resume(source), self.epoch, self.micro, self.global_step)
        self.mode.resumed(source, self.global_step)
