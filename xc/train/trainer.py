"""The conductor: builds the components from the typed config and runs ASTRA's Algorithm 1.

Per micro-step: each rank encodes its slice of the global batch, embeddings are all-gathered with
autograd, each rank scores the batch against its own label range only (positives + per-shard
negatives), and the encoder (DDP, sum-reduced) and the touched classifier rows are updated.
"""

from __future__ import annotations

import logging
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from xc.run import checkpoint as ckpt
from xc.train.batches import BatchPreparer, PreparedBatch, Prefetcher, to_device_prepared
from xc.train.device_batches import DeviceBatchPreparer, device_batches_rule
from xc.train import lifecycle
from xc.run import faults, resume
from xc.train.components import Components, build_components
from xc.config import XCConfig, to_dict
from xc.defaults import resolve as resolve_defaults
from xc.distributed import (DistContext, all_gather_object, all_gather_with_grad, all_reduce, barrier,
                            broadcast_object)
from xc.eval.epoch_select import EpochSelector
from xc.errors import CheckpointError, ConfigError
from xc.eval.inference import predict
from xc.eval.metrics import evaluate as evaluate_metrics
from xc.eval.metrics import true_labels
from xc.train.optim import lr_factor, set_lr
from xc.train.phases import make_timer
from xc.train.precision import LossScaler
from xc.run.runlog import RunLogger
from xc.refresh.schedule import Refresher
from xc.sampling import HardNegativeSet, StepKey, mix_seed
from xc.models.encoders import touched_row_grads
from xc.train.step import batch_loss, nonfinite_parts, shard_rows

log = logging.getLogger("xc.train.trainer")

class Trainer:
    def __init__(self, cfg: XCConfig, ctx: DistContext, dataset):
        cfg = resolve_defaults(cfg, dataset.train.num_points, dataset.num_labels, dataset.num_features,
                               ctx.device.type, ctx.world_size)  # nulls -> data-derived values
        # The checkpoint to resume from is chosen first: its label layout decides what each rank builds.
        self.resume_from = resume.find_checkpoint(cfg, ctx)
        cfg, self.resume_mode = resume.adapt_config(cfg, self.resume_from, ctx.world_size, dataset.num_labels)
        self.cfg, self.ctx, self.dataset = cfg, ctx, dataset
        try:
            self.c: Components = build_components(cfg, ctx, dataset)
        except ConfigError as exc:
            if self.resume_mode != resume.RESPLIT:
                raise
            raise CheckpointError(
                f"{self.resume_from.path} has {self.resume_from.num_shards} label shards, which do not split over "
                f"{ctx.world_size} ranks, and re-splitting them into {cfg.parallel.num_label_shards} is impossible: "
                f"{exc}. Resume on a world size that divides {self.resume_from.num_shards}") from exc
        self.logger = RunLogger(cfg.logger, cfg.run_dir, cfg.name, ctx.rank, to_dict(cfg))
        self.refresher = Refresher(cfg, ctx, self.c, self.logger)
        self.selector = EpochSelector(cfg, self.c, dataset, ctx, self.logger)
        self.epoch, self.micro, self.global_step = 0, 0, 0
        self.hard: HardNegativeSet | None = None
        self.last_metrics: dict[str, float] = {}
        self.skipped_steps = 0
        self._record_train_pass = False
        self._sampler_restored = False
        self._nan_fault_step = faults.NAN_AT_STEP  # fires once
        on_device, why = device_batches_rule(cfg.train.device_batches, ctx.device, self.c.sampler)
        self.preparer = DeviceBatchPreparer(cfg, self.c, ctx) if on_device else BatchPreparer(cfg, self.c, ctx)
        self.device_batches = f"{'on' if on_device else 'off'} ({why})"
        prefetch = cfg.train.prefetch  # a thread to overlap host work with the step; the device path has none
        self.prefetch = ctx.device.type == "cuda" and not on_device if prefetch is None else prefetch
        # the encoder's training forward, compiled on request (parameters and state dicts stay the module's own)
        self.forward = torch.compile(self.c.ddp) if cfg.train.compile else self.c.ddp
        self.scaler = LossScaler(enabled=self.c.encoder.autocast == torch.float16)
        self.timer = make_timer(cfg.train.profile_phases, ctx.device)
        # Set by the entry point (xc/cli/train.py); None when a Trainer is built directly (tests, libraries).
        self.identity: dict | None = None  # the run identity, recorded in every checkpoint
        self.stop = None  # xc.run.signals.StopControl: SIGTERM/SIGINT and timed checkpoints
        self.heartbeat = None  # xc.run.heartbeat.Heartbeat: told the step after each optimizer step

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        try:
            return self._fit()
        except BaseException:  # SIGTERM's StopRequested (after its checkpoint), an error: no miner outlives us
            self.refresher.abandon()
            raise

    def _fit(self) -> dict[str, float]:
        cfg, c = self.cfg, self.c
        self._maybe_resume()
        lifecycle.log_attempt(self, self.resume_from)
        if self.micro == 0 and self.epoch >= cfg.train.epochs or self._reached_max_steps():
            log.info("run in %s is already complete (epoch %d, step %d); evaluating only",
                     cfg.run_dir, self.epoch, self.global_step)
            self.refresher.close(self.global_step)
            self._keep_selected_epoch()
            self.evaluate()
            return self.evaluate_with_memory()
        log.info("training %s: %d train rows, %d labels in %d shards over %d rank(s) on %s (%s), %d steps/epoch, "
                 "%s sampler, amp %s, prefetch %s, device batches %s", cfg.name, c.train.num_rows, c.layout.num_labels,
                 c.layout.num_shards, self.ctx.world_size, self.ctx.device, self.ctx.backend or "no process group",
                 c.steps_per_epoch, cfg.sampler.name, cfg.train.amp, "on" if self.prefetch else "off",
                 self.device_batches)
        while self.epoch < cfg.train.epochs and not self._reached_max_steps():
            boundary = time.perf_counter()
            self._begin_epoch()
            started = time.perf_counter()
            self._train_epoch()
            self.logger.event("epoch", epoch=self.epoch, global_step=self.global_step,
                              boundary_seconds=started - boundary, train_seconds=time.perf_counter() - started)
            if self._reached_max_steps() and self.micro != 0:
                break
            self.epoch, self.micro = self.epoch + 1, 0
            every = cfg.eval.every_epochs
            if (every and self.epoch % every == 0) or self.epoch == cfg.train.epochs:
                self.evaluate()
            self.selector.after_epoch(self.epoch, self.global_step)
            faults.maybe_signal(self.epoch, self.ctx.rank, at="epoch_end")  # tests: a signal in the evaluation
            self.save_checkpoint()
            lifecycle.after_epoch_checkpoint(self)  # a SIGTERM during the evaluation stops here, before a refresh
        if self._reached_max_steps() and self.micro != 0:
            self.save_checkpoint()
        if self._keep_selected_epoch():
            self.evaluate(event="eval_kept")
        elif not self.last_metrics:
            self.evaluate()
        self.evaluate_with_memory()
        self.refresher.close(self.global_step)
        self.logger.close()
        return self.last_metrics

    def _reached_max_steps(self) -> bool:
        return 0 <= self.cfg.train.max_steps <= self.global_step

    def _begin_epoch(self) -> None:
        c = self.c
        if self.micro == 0:  # a resume mid-epoch keeps the negatives its checkpoint recorded
            self.hard = self.refresher.at_epoch_start(self.epoch, self.global_step, self.hard, self._epoch_order)
            self.refresher.staleness(self.hard, self.epoch, self.global_step)
        else:
            self.refresher.resume_mid_epoch(self.epoch, self.global_step - self.micro // self.cfg.train.grad_accum,
                                            self.global_step, self._epoch_order)
        if c.sampler is not None:
            if self._sampler_restored and self.micro != 0:
                c.sampler.resume(self.epoch, self.hard, shard_rows(c), self.global_step)
            else:
                c.sampler.update(self.epoch, self.hard, shard_rows(c), self.global_step)
            self._sampler_restored = False

    def _train_epoch(self) -> None:
        cfg, c, ctx = self.cfg, self.c, self.ctx
        order = self._epoch_order(self.epoch)
        show = ctx.is_main and cfg.logger.progress
        bar = tqdm(total=c.micro_per_epoch, initial=self.micro, desc=f"epoch {self.epoch}", disable=not show,
                   mininterval=0.5 if sys.stderr.isatty() else 10.0, leave=False, dynamic_ncols=True)
        loss_sum, loss_count, tick = 0.0, 0, time.perf_counter()
        self._cpu_tick = time.process_time()
        c.encoder.train()
        self._record_train_pass = self.refresher.wants_train_pass(self.epoch) and self.micro == 0
        epoch = self.epoch

        def prepare(micro: int) -> PreparedBatch:
            rows = order[micro * c.micro_batch:(micro + 1) * c.micro_batch]
            return self.preparer(micro, rows, StepKey(cfg.seed, epoch, micro))

        # The sampler's state is fixed within an epoch (update() ran in _begin_epoch), so the thread may
        # draw ahead until the epoch's end; batches it prepared beyond a max_steps stop are dropped.
        ahead = Prefetcher(prepare, range(self.micro, c.micro_per_epoch)) if self.prefetch else None
        timer = self.timer
        try:
            while self.micro < c.micro_per_epoch and not self._reached_max_steps():
                last_of_step = (self.micro + 1) % cfg.train.grad_accum == 0
                timer.start()
                batch = ahead.get() if ahead is not None else prepare(self.micro)
                timer.mark("data")
                loss = self._micro_step(batch, last_of_step)
                timer.end_step()
                self.micro += 1
                bar.update(1)
                if loss is not None:
                    loss_sum, loss_count = loss_sum + loss, loss_count + 1
                if last_of_step:  # publishes a snapshot being written in the background, at the same step on all ranks
                    self.refresher.poll(self.global_step)
                if last_of_step and self.global_step % cfg.train.log_every == 0:
                    self._log_train(loss_sum, loss_count, time.perf_counter() - tick, bar)
                    loss_sum, loss_count, tick = 0.0, 0, time.perf_counter()
                if last_of_step:  # checkpoints by steps and by minutes; SIGTERM/SIGINT stop here, all ranks alike
                    lifecycle.after_optimizer_step(self)
        finally:
            if ahead is not None:
                ahead.close()
        if loss_count:  # the epoch's last, partial logging window
            self._log_train(loss_sum, loss_count, time.perf_counter() - tick, bar)
        bar.close()

    def _epoch_order(self, epoch: int) -> np.ndarray:
        gen = torch.Generator().manual_seed(mix_seed(self.cfg.seed, epoch, 0x0D))
        return torch.randperm(self.c.train.num_rows, generator=gen).numpy()

    # ------------------------------------------------------------------ one step
    def _micro_step(self, batch: PreparedBatch, last_of_step: bool) -> float | None:
        cfg, c, ctx, timer, scaler = self.cfg, self.c, self.ctx, self.timer, self.scaler
        key, rows = batch.key, batch.rows
        inputs = to_device_prepared(batch, ctx.device, c.sampler is not None)
        timer.mark("h2d")
        normalizer = float(c.micro_batch * cfg.train.grad_accum)
        no_sync = getattr(c.ddp, "no_sync", None)
        sync_ctx = no_sync() if (no_sync and not last_of_step) else _null()
        with sync_ctx:
            local = self.forward(inputs)  # (b, d) float32 (autocast inside the encoder with train.amp)
            if self._record_train_pass:
                self.refresher.record(self.epoch, batch.mine, local)
            emb = all_gather_with_grad(local, ctx)  # (B, d) on every rank
            timer.mark("encoder_forward")
            loss, unique, rows_leaf = batch_loss(cfg.sampler, c, ctx, emb, rows, key, batch.positives, normalizer,
                                                 batch.cand, timer)
            scaler.scaled(loss).backward()
            timer.mark("backward")
        value = loss.detach()
        if self.global_step == self._nan_fault_step:
            self._nan_fault_step = -1
            if faults.NAN_RANK in (-1, ctx.rank):
                value = faults.poison(value, rows_leaf, self.c.shard)
        bad = nonfinite_parts(value, c.encoder, rows_leaf.grad, ctx)
        if bad:
            if scaler.enabled and "loss" not in bad and scaler.scale > scaler.min_scale:  # fp16 overflow
                c.enc_opt.zero_grad(set_to_none=True)
                c.clf_opt.zero_grad()
                scaler.overflow()
                timer.mark("optimizer")
                return None
            return self._nonfinite(key, bad)
        scaler.unscale_([rows_leaf.grad])
        c.clf_opt.accumulate(unique, rows_leaf.grad, rows_leaf)
        if last_of_step:
            factor = lr_factor(self.global_step, cfg.train.warmup_steps, c.total_steps, cfg.train.min_lr_ratio)
            set_lr(c.enc_opt, cfg.train.lr_encoder * factor)
            scaler.unscale_params_(c.encoder.parameters())
            scaler.unscale_(touched_row_grads(c.encoder))  # a gathered-row feature table (model.sparse_features)
            c.enc_opt.step()
            c.enc_opt.zero_grad(set_to_none=True)
            c.clf_opt.step(factor)
            scaler.step_done()
            self.global_step += 1
            if c.sampler is not None:
                c.sampler.after_step(self.global_step, shard_rows(c))
        timer.mark("optimizer")
        return float(value)

    def _nonfinite(self, key: StepKey, what: str) -> None:
        """A NaN/inf loss or gradient on any rank (all ranks agree): drop the step's update, then stop or skip."""
        self.c.enc_opt.zero_grad(set_to_none=True)
        self.c.clf_opt.zero_grad()
        lifecycle.skip_or_stop_nonfinite(self, key, what, log)
        return None

    def _log_train(self, loss_sum: float, loss_count: int, seconds: float, bar) -> None:
        ctx = self.ctx
        # each rank holds its shard's part of the loss; the batch loss is their sum
        total = all_reduce(torch.tensor([loss_sum], dtype=torch.float64, device=ctx.device), ctx)
        loss = float(total.item()) / max(1, loss_count)
        age = None if self.hard is None else self.global_step - self.hard.made_at_step
        # re-ranked negatives: mined from the snapshot's rows (age), ordered by the rows of the switch (ranked)
        ranked = None if self.hard is None or self.hard.ranked_at_step is None else \
            self.global_step - self.hard.ranked_at_step
        factor = lr_factor(self.global_step, self.cfg.train.warmup_steps, self.c.total_steps, self.cfg.train.min_lr_ratio)
        steps = max(1, loss_count) / self.cfg.train.grad_accum
        # CPU seconds of this process (all its threads, the prefetch thread included; pool miners are other
        # processes): beside the wall time it says how many host cores a rank keeps busy
        cpu, self._cpu_tick = time.process_time() - self._cpu_tick, time.process_time()
        fields = dict(epoch=self.epoch, global_step=self.global_step, loss=loss, lr_factor=factor,
                      sec_per_step=seconds / steps, cpu_sec_per_step=cpu / steps,
                      hard_generation=None if self.hard is None else self.hard.generation,
                      hard_age_steps=age, hard_ranked_age_steps=ranked, skipped_steps=self.skipped_steps)
        phases = self.timer.window()
        if phases is not None:  # train.profile_phases: mean seconds per micro-step over this window
            fields["phase_seconds"] = phases
        if self.scaler.enabled:
            fields.update(loss_scale=self.scaler.scale, overflow_steps=self.scaler.overflows)
        self.logger.event("train", **fields)
        ages = {"neg_age": age if age is not None else "-"} | ({} if ranked is None else {"ranked_age": ranked})
        bar.set_postfix(loss=f"{loss:.4f}", **ages, cpu=f"{cpu / max(seconds, 1e-9):.1f}x")

    # ------------------------------------------------------------------ evaluation
    def _keep_selected_epoch(self) -> bool:
        """Keep the epoch chosen on validation (xc/eval/epoch_select.py); True when its weights replaced the last
        epoch's (the test metrics must then be taken again). A run stopped mid-epoch keeps what it trained."""
        c, ctx = self.c, self.ctx
        load = lambda path: resume.load_model_weights(path, c.encoder, c.shard, c.layout, ctx.rank,  # noqa: E731
                                                      ctx.world_size, self.refresher.k)
        from xc.eval.label_prior import calibrated_validation

        served = lambda: calibrated_validation(self.cfg, c, self.dataset, ctx)  # noqa: E731
        choice = self.selector.finish(self.cfg.run_dir, load, served) if self.micro == 0 else None
        return choice is not None and choice["kept"]["global_step"] != choice["last"]["global_step"]

    def evaluate(self, event: str = "eval") -> dict[str, float]:
        """Test metrics of the model as it is (rank 0 computes, every rank returns them), logged as `event`."""
        cfg, c, ctx = self.cfg, self.c, self.ctx
        test = c.test
        n = test.num_points if not cfg.eval.max_points else min(cfg.eval.max_points, test.num_points)
        rows = np.arange(n, dtype=np.int64)
        start = time.perf_counter()
        show = ctx.is_main and cfg.logger.progress
        with tqdm(total=n, desc="evaluating", disable=not show, leave=False,
                  mininterval=0.5 if sys.stderr.isatty() else 10.0) as bar:
            _, ids = predict(c.encoder, c.shard, c.test_inputs, rows, cfg.eval.topk, cfg.eval.batch_size, ctx, bar)
        metrics: dict[str, float] = {}
        if ctx.is_main:
            indptr, indices = true_labels(test.labels, first=n)
            metrics = evaluate_metrics(ids, indptr, indices, c.inv_propensity, ks=tuple(cfg.eval.ks))
            shown = "  ".join(f"{k} {v:.2f}" for k, v in metrics.items() if k.startswith(("P@", "nDCG@", "PSP@")))
            log.info("%s epoch %d step %d (%d test points, %.1fs): %s", event, self.epoch, self.global_step, n,
                     time.perf_counter() - start, shown)
            self.logger.event(event, epoch=self.epoch, global_step=self.global_step, **metrics)
        self.last_metrics = broadcast_object(metrics, ctx)
        return self.last_metrics

    def evaluate_with_memory(self) -> dict[str, float]:
        """The final metrics: under the label prior chosen on validation (xc/eval/label_prior.py), then with kNN
        fusion (xc/eval/memory.py) over that model where fusion is on; else the last metrics."""
        from xc.eval.label_prior import final_prior_metrics
        from xc.eval.memory import final_fused_metrics

        metrics = final_prior_metrics(self.cfg, self.c, self.dataset, self.ctx, self.logger, self.epoch,
                                      self.global_step, self.last_metrics, self.selector.kept_prior)
        if metrics is not None:
            self.last_metrics = metrics
        metrics = final_fused_metrics(self.cfg, self.c, self.dataset, self.ctx, self.logger, self.epoch,
                                      self.global_step)
        if metrics is not None:
            self.last_metrics = metrics
        return self.last_metrics

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict:
        c = self.c
        state = {
            "version": 1, "epoch": self.epoch, "micro": self.micro, "global_step": self.global_step,
            "encoder": c.encoder.state_dict(), "encoder_opt": c.enc_opt.state_dict(),
            "classifier": c.shard.state_dict(), "rng_cpu": torch.get_rng_state(),
            "skipped_steps": self.skipped_steps, "loss_scaler": self.scaler.state_dict(),
            "sampler": {} if c.sampler is None else c.sampler.state_dict(),
            "selector": self.selector.state_dict(),
            "hard": None if self.hard is None else {
                "generation": self.hard.generation, "made_at_epoch": self.hard.made_at_epoch,
                "made_at_step": self.hard.made_at_step, "ranked_at_step": self.hard.ranked_at_step},
        }
        if torch.cuda.is_available() and self.ctx.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.ctx.device)
        return state

    def save_checkpoint(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.refresher.finish_snapshot(self.global_step)  # a resume must find it published, as with sync writes
        lifecycle.check_finite_state(self, {"encoder parameters": list(self.c.encoder.parameters()),
                                            "classifier rows": [self.c.shard.weight]})
        digests = ckpt.write_rank_files(cfg.run_dir, self.global_step, ctx.rank, self._state(),
                                        None if self.hard is None else self.hard.tables)
        digests = {k: v for part in all_gather_object(digests, ctx) for k, v in part.items()}  # also a barrier
        if ctx.is_main:
            meta = {"epoch": self.epoch, "micro": self.micro, "config": to_dict(cfg),
                    "num_label_shards": self.c.layout.num_shards, "layout": vars(self.c.layout),
                    "dim": self.c.shard.dim, "metrics": self.last_metrics, "identity": self.identity}
            path = ckpt.publish(cfg.run_dir, self.global_step, ctx.world_size, meta, cfg.train.keep_checkpoints,
                                sha256=digests, protect=self.selector.protected_step())
            self.logger.event("checkpoint", epoch=self.epoch, global_step=self.global_step, path=str(path))
        barrier(ctx)

    def _maybe_resume(self) -> None:
        ctx, c, source = self.ctx, self.c, self.resume_from
        if source is None:
            return
        state, tables = resume.restore_rank(source, c.layout, ctx.rank, ctx.world_size, self.refresher.k)
        dim = int(state["classifier"]["weight"].shape[1])
        if dim != c.shard.dim:
            raise CheckpointError(f"{source.path}: its classifier vectors have dimension {dim}, this run's model makes "
                                  f"{c.shard.dim} (model.embed_dim, hidden_dims, bottleneck_dim or label_bias differ)")
        self._load_state(state, tables)
        log.info("resumed from %s (%s): epoch %d, micro-step %d, global step %d", source.path,
                 resume.describe(source, self.resume_mode, c.layout, ctx.world_size), self.epoch, self.micro,
                 self.global_step)
        change = resume.replanned_schedule(source.meta, self.cfg, c.steps_per_epoch, c.total_steps, self.global_step)
        if change is not None:  # train.epochs raised on a finished run, say: never an unannounced jump of the rate
            log.warning("%s", change.pop("message"))
            if ctx.is_main:
                self.logger.event("schedule", global_step=self.global_step, **change)
        if ctx.is_main and self.resume_mode != resume.SAME:
            self.logger.event("resume", path=str(source.path), mode=self.resume_mode, from_world_size=source.world_size,
                              world_size=ctx.world_size, from_label_shards=source.num_shards,
                              label_shards=c.layout.num_shards, global_step=self.global_step)

    def _load_state(self, state: dict, tables) -> None:
        c = self.c
        try:
            c.encoder.load_state_dict(state["encoder"])
            c.enc_opt.load_state_dict(state["encoder_opt"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"the checkpoint's encoder does not fit this run's model.* settings: "
                                  f"{str(exc)[:500]}") from exc
        c.shard.load_state_dict(state["classifier"])
        torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state and self.ctx.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"], self.ctx.device)
        self.epoch, self.micro, self.global_step = state["epoch"], state["micro"], state["global_step"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.scaler.load_state_dict(state.get("loss_scaler", {}))
        self.selector.load_state_dict(state.get("selector"))
        if c.sampler is not None and state.get("sampler"):
            c.sampler.load_state_dict(state["sampler"])
            self._sampler_restored = True
        hard = state.get("hard")
        self.hard = None if hard is None or tables is None else HardNegativeSet(
            tables, hard["generation"], hard["made_at_epoch"], hard["made_at_step"], hard.get("ranked_at_step"))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
