"""The classifier mode (model.mode=classifier): ASTRA's Algorithm 1 under the one Trainer (xc/train/trainer.py).

Per micro-step: each rank encodes its slice of the global batch, embeddings are all-gathered with
autograd, each rank scores the batch against its own label range only (positives + per-shard
negatives), and the encoder (DDP, sum-reduced) and the touched classifier rows are updated. At epoch
boundaries the refresher hands over the next generation of hard negatives; after each epoch the
selector scores the model on the validation split, and the run keeps the best epoch.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import numpy as np
import torch

from xc.distributed import DistContext, all_gather_object, all_gather_with_grad
from xc.errors import CheckpointError, ConfigError
from xc.eval.epoch_select import EpochSelector
from xc.eval.inference import predict
from xc.faults import NO_FAULTS, Faults
from xc.fitting.label_prior import PriorChoice, calibrated_validation, final_prior_metrics, validation_ranking
from xc.fitting.final_eval import final_fused_metrics, fusion_applies, pairs_hard_negatives
from xc.fitting.model_memory import KnownTops, ModelMemory
from xc.models.encoders import touched_row_grads
from xc.refresh.schedule import Refresher
from xc.run import resume
from xc.run.runlog import RunLogger
from xc.sampling import HardNegativeSet, StepKey, mix_seed
from xc.train.components import Components, build_components
from xc.train.lifecycle import nonfinite_parts
from xc.train.modes import ModePlan, StepOutcome
from xc.train.modes.classifier.batches import BatchPreparer, PreparedBatch, Prefetcher, to_device_prepared
from xc.train.modes.classifier.device_batches import DeviceBatchPreparer, StaticBatchPreparer, device_batches_rule
from xc.train.modes.classifier.step import batch_loss, shard_rows
from xc.train.optim import replanned_schedule, set_lr
from xc.train.schedule import EpochSchedule
from xc.train.phases import make_timer
from xc.train.precision import LossScaler

log = logging.getLogger("xc.train.trainer")


class ClassifierMode:
    """Encoder + sharded classifier rows; built from the run's resolved plan (xc.train.plan.resolve_run), started
    with the run's logger."""

    def __init__(self, plan: ModePlan, ctx: DistContext, dataset, faults: Faults = NO_FAULTS):
        cfg = plan.cfg
        self.faults = faults  # the tests' fault injection (xc/faults.py): the NaN fault here, ENOSPC in snapshots
        self.cfg, self.ctx, self.dataset, self.resume_from, self.resume_mode = cfg, ctx, dataset, plan.source, plan.how
        try:
            self.c: Components = build_components(cfg, ctx, dataset)
        except ConfigError as exc:
            if self.resume_mode != resume.RESPLIT:
                raise
            raise CheckpointError(
                f"{self.resume_from.path} has {self.resume_from.num_shards} label shards, which do not split over "
                f"{ctx.world_size} ranks, and re-splitting them into {cfg.parallel.num_label_shards} is impossible: "
                f"{exc}. Resume on a world size that divides {self.resume_from.num_shards}") from exc
        c = self.c
        self.micro_per_epoch, self.micro_batch, self.total_steps = c.micro_per_epoch, c.micro_batch, c.total_steps
        self.schedule = EpochSchedule(cfg.train.epochs, c.steps_per_epoch, c.total_steps, cfg.train.warmup_steps,
                                      cfg.train.min_lr_ratio, bool(cfg.train.epochs_by_validation),
                                      cfg.train.time_budget, cfg.train.plateau_epochs)
        self.test, self.inv_propensity = c.test, c.inv_propensity
        self.served_scores = None  # final_metrics: the fused ranking the score calibration is fitted on
        # the test and validation rankings of the model as it is now, as deep as the final fusion reads them: the last
        # epoch's are its final phase's (xc/fitting/model_memory.py); cleared whenever the scores change
        self._known = KnownTops()
        fc = cfg.eval.knn_fusion
        self._ranking_width = max(cfg.eval.topk, max(cfg.eval.ks), fc.candidates if fc.enabled else 0)
        self._validation_width = 0  # the epoch's validation ranking: that deep on the last epoch only (after_epoch)
        self.hard: HardNegativeSet | None = None
        self._kept_hard: dict[int, np.ndarray] | None = None  # the kept epoch's tables (keep_selected_epoch)
        self._record_train_pass = False
        self._sampler_restored = False
        self._nan_fault_step = faults.nan_at_step  # fires once
        # "auto" resolved by xc/defaults/; fixed shapes need a sampled draw, made on the device path
        static = cfg.train.static_shapes == "on" and c.sampler is not None
        on_device, why = device_batches_rule(cfg.train.device_batches, ctx.device, c.sampler, static)
        preparer = (StaticBatchPreparer if static else DeviceBatchPreparer) if on_device else BatchPreparer
        self.preparer = preparer(cfg, c, ctx)
        self.device_batches = f"{'on' if on_device else 'off'} ({why})" + (", static shapes" if static else "")
        prefetch = cfg.train.prefetch  # a thread to overlap host work with the step; the device path has none
        self.prefetch = ctx.device.type == "cuda" and not on_device if prefetch is None else prefetch
        # the encoder's training forward, compiled on request (parameters and state dicts stay the module's own)
        self.forward = torch.compile(c.ddp) if cfg.train.compile else c.ddp
        self.scaler = LossScaler(enabled=c.encoder.autocast == torch.float16)
        self.timer = make_timer(cfg.train.profile_phases, ctx.device)
        self._ahead: Prefetcher | None = None
        self._prepare = None

    def start(self, logger: RunLogger) -> None:
        """What needs the run's logger: the refresh path and the epoch selector."""
        self.logger = logger
        self.refresher = Refresher(self.cfg, self.ctx, self.c, logger, faults=self.faults,
                                   planned_epochs=lambda: self.schedule.epochs)
        valid = self.c.train.valid_ids
        self.selector = EpochSelector(
            self.cfg.eval.select_epoch and valid is not None and len(valid) > 0,
            self._validation_points, self.ctx, logger)

    def describe(self) -> str:
        cfg, c, ctx = self.cfg, self.c, self.ctx
        return (f"training {cfg.name}: {c.train.num_rows} train rows, {c.layout.num_labels} labels in "
                f"{c.layout.num_shards} shards over {ctx.world_size} rank(s) on {ctx.device} "
                f"({ctx.backend or 'no process group'}), {c.steps_per_epoch} steps/epoch, {cfg.sampler.name} sampler, "
                f"amp {cfg.train.amp}, prefetch {'on' if self.prefetch else 'off'}, device batches "
                f"{self.device_batches}")

    # ------------------------------------------------------------------ epochs
    def begin_epoch(self, epoch: int, micro: int, global_step: int) -> None:
        c = self.c
        self._known.clear()  # the model trains from here
        if micro == 0:  # a resume mid-epoch keeps the negatives its checkpoint recorded
            self.hard = self.refresher.at_epoch_start(epoch, global_step, self.hard, self.epoch_order)
            self.refresher.staleness(self.hard, epoch, global_step)
        else:
            self.refresher.resume_mid_epoch(epoch, global_step - micro // self.cfg.train.grad_accum, global_step,
                                            self.epoch_order)
        if c.sampler is not None:
            if self._sampler_restored and micro != 0:
                c.sampler.resume(epoch, self.hard, shard_rows(c), global_step)
            else:
                c.sampler.update(epoch, self.hard, shard_rows(c), global_step)
            self._sampler_restored = False

    def start_pass(self, epoch: int, micro: int) -> None:
        """Before the epoch's micro-steps: the encoder in train mode, batches prepared ahead on a thread if asked."""
        c, cfg = self.c, self.cfg
        order = self.epoch_order(epoch)
        c.encoder.train()
        self._record_train_pass = self.refresher.wants_train_pass(epoch) and micro == 0
        self._epoch = epoch

        def prepare(m: int) -> PreparedBatch:
            return self.preparer(m, order[m * c.micro_batch:(m + 1) * c.micro_batch], StepKey(cfg.seed, epoch, m))

        # The sampler's state is fixed within an epoch (update() ran in begin_epoch), so the thread may
        # draw ahead until the epoch's end; batches it prepared beyond a max_steps stop are dropped.
        self._prepare = prepare
        self._ahead = Prefetcher(prepare, range(micro, c.micro_per_epoch)) if self.prefetch else None

    def end_pass(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def after_epoch(self, epoch: int, global_step: int) -> None:
        # the last planned epoch's validation ranking is the final phase's: as deep as the fusion reads it (deeper costs:
        # at 10^7 labels with lexical weights 20 deep took 582 s against 463 s for the top 5)
        self._validation_width = self._ranking_width if epoch >= self.schedule.epochs else 0
        self.selector.after_epoch(epoch, global_step)

    def epoch_order(self, epoch: int) -> np.ndarray:
        gen = torch.Generator().manual_seed(mix_seed(self.cfg.seed, epoch, 0x0D))
        return torch.randperm(self.c.train.num_rows, generator=gen).numpy()

    # ------------------------------------------------------------------ one step
    def micro_step(self, micro: int, key: StepKey, last_of_step: bool, global_step: int) -> StepOutcome:
        batch = self._ahead.get() if self._ahead is not None else self._prepare(micro)
        self.timer.mark("data")
        return self.step_batch(batch, last_of_step, global_step)

    def step_batch(self, batch: PreparedBatch, last_of_step: bool, global_step: int) -> StepOutcome:
        """One micro-step on a prepared batch; an optimizer step (global_step -> global_step + 1) when last_of_step."""
        cfg, c, ctx, timer, scaler = self.cfg, self.c, self.ctx, self.timer, self.scaler
        key, rows = batch.key, batch.rows
        inputs = to_device_prepared(batch, ctx.device, c.sampler is not None)
        timer.mark("h2d")
        normalizer = float(c.micro_batch * cfg.train.grad_accum)
        no_sync = getattr(c.ddp, "no_sync", None)
        sync_ctx = no_sync() if (no_sync and not last_of_step) else nullcontext()
        with sync_ctx:
            local = self.forward(inputs)  # (b, d) float32 (autocast inside the encoder with train.amp)
            if self._record_train_pass:
                self.refresher.record(self._epoch, batch.mine, local)
            emb = all_gather_with_grad(local, ctx)  # (B, d) on every rank
            timer.mark("encoder_forward")
            loss, unique, rows_leaf, lexical_leaf = batch_loss(cfg.sampler, c, ctx, emb, rows, key, batch.positives,
                                                               normalizer, batch.cand, timer, inputs)
            scaler.scaled(loss).backward()
            timer.mark("backward")
        value = loss.detach()
        if global_step == self._nan_fault_step:
            self._nan_fault_step = -1
            if self.faults.poisons(ctx.rank):
                value = self.faults.poison(value, rows_leaf, c.shard)
        row_grad = rows_leaf.grad
        if lexical_leaf is not None and row_grad is not None:  # the lexical gradient is checked with the rows'
            row_grad = torch.stack([row_grad.sum(), lexical_leaf.grad.sum()])
        bad = nonfinite_parts(value, c.encoder, row_grad, ctx)
        if bad:  # drop this micro-step's gradients; the conductor skips or stops (fp16 overflow: neither)
            c.enc_opt.zero_grad(set_to_none=True)
            c.clf_opt.zero_grad()
            if c.lexical_opt is not None:
                c.lexical_opt.zero_grad()
            overflow = scaler.enabled and "loss" not in bad and scaler.scale > scaler.min_scale
            if overflow:
                scaler.overflow()
            timer.mark("optimizer")
            return StepOutcome(None, False, None if overflow else bad)
        scaler.unscale_([rows_leaf.grad])
        c.clf_opt.accumulate(unique, rows_leaf.grad, rows_leaf)
        if lexical_leaf is not None:
            scaler.unscale_([lexical_leaf.grad])
            c.lexical_opt.accumulate(unique, lexical_leaf.grad, lexical_leaf)
        if last_of_step:
            factor = self.schedule.factor(global_step)
            set_lr(c.enc_opt, cfg.train.lr_encoder * factor)
            scaler.unscale_params_(c.encoder.parameters())
            scaler.unscale_(touched_row_grads(c.encoder))  # a gathered-row feature table (model.sparse_features)
            c.enc_opt.step()
            c.enc_opt.zero_grad(set_to_none=True)
            c.clf_opt.step(factor, global_step)
            if c.lexical_opt is not None:
                c.lexical_opt.step(factor, global_step)
            scaler.step_done()
            if c.sampler is not None:
                c.sampler.after_step(global_step + 1, shard_rows(c))
        timer.mark("optimizer")
        return StepOutcome(float(value), last_of_step, None)

    def after_optimizer_step(self, global_step: int) -> None:
        """Publishes a snapshot being written in the background, at the same step on all ranks."""
        self.refresher.poll(global_step)

    def log_fields(self, global_step: int) -> dict:
        hard = self.hard
        age = None if hard is None else global_step - hard.made_at_step
        # re-ranked negatives: mined from the snapshot's rows (age), ordered by the rows of the switch (ranked)
        ranked = None if hard is None or hard.ranked_at_step is None else global_step - hard.ranked_at_step
        fields = dict(hard_generation=None if hard is None else hard.generation, hard_age_steps=age,
                      hard_ranked_age_steps=ranked)
        if self.scaler.enabled:
            fields.update(loss_scale=self.scaler.scale, overflow_steps=self.scaler.overflows)
        return fields

    @staticmethod
    def postfix(fields: dict) -> dict:
        age, ranked = fields["hard_age_steps"], fields["hard_ranked_age_steps"]
        return {"neg_age": age if age is not None else "-"} | ({} if ranked is None else {"ranked_age": ranked})

    # ------------------------------------------------------------------ evaluation
    def rank_test(self, rows: np.ndarray, bar, global_step: int) -> np.ndarray:
        """(n, topk) label ids of the test rows, exact over every shard (valid on rank 0); ranked as deep as the final
        fusion reads them, and kept for it."""
        cfg, c = self.cfg, self.c
        scores, ids = predict(c.encoder, c.shard, c.test_inputs, rows, self._ranking_width, cfg.eval.batch_size,
                              self.ctx, bar)
        self._known.add(c.test_inputs, rows, scores, ids)
        return ids[:, :cfg.eval.topk]

    def _validation_points(self) -> np.ndarray:
        """(V,) the validation rows' mean P@k under the model as it is now, for the epoch selection; the ranking
        kept for the final phase."""
        c = self.c
        points, scores, ids = validation_ranking(self.cfg, c, self.dataset, self.ctx, self._validation_width)
        self._known.add(c.train.split_inputs, c.train.valid_ids, scores, ids)
        return points

    def epochs_since_best(self) -> int:
        return self.selector.epochs_since_best()

    def validation_gain(self) -> tuple[float, float] | None:
        return self.selector.gain_over_best

    def keep_selected_epoch(self, micro: int) -> bool:
        """Keep the epoch chosen on validation (xc/eval/epoch_select.py); True when its weights replaced the last
        epoch's (the test metrics must then be taken again). A run stopped mid-epoch keeps what it trained."""
        c, ctx = self.c, self.ctx

        def load(path) -> None:  # the kept epoch's weights, and its hard negatives for the lexical ranker's pairs
            self._known.clear()
            self._kept_hard = resume.load_model_weights(path, c.encoder, c.shard, c.layout, ctx.rank, ctx.world_size,
                                                        self.refresher.k)
        served = lambda: calibrated_validation(self.cfg, c, self.dataset, ctx)  # noqa: E731
        choice = self.selector.finish(self.cfg.run_dir, load, served) if micro == 0 else None
        return choice is not None and choice["kept"]["global_step"] != choice["last"]["global_step"]

    def final_metrics(self, epoch: int, global_step: int, last: dict[str, float]) -> dict[str, float] | None:
        """Under the label prior chosen on validation (xc/fitting/label_prior.py), then with kNN fusion
        (xc/fitting/memory.py) over that model where fusion is on; None: the last metrics stand."""
        c = self.c
        fuses = fusion_applies(self.cfg.eval, c.train.valid_ids, self.dataset.train.num_points, quiet=True)
        prior = final_prior_metrics(self.cfg, c, self.dataset, self.ctx, self.logger, epoch, global_step, last,
                                    self.selector.kept_prior, rank_test=not fuses, known=self._known,
                                    width=self._ranking_width)
        hard_tables = self._every_hard_table() if fuses and pairs_hard_negatives(self.cfg.eval.ranker) else None
        memory = ModelMemory.of(self.cfg, c, self.dataset, self.ctx, hard_tables=hard_tables, known=self._known)
        fused, self.served_scores = final_fused_metrics(self.cfg, memory, self.dataset, self.logger, epoch, global_step)
        if fused is not None and c.shard.score_bias is not None and self.ctx.is_main:
            # the model under its prior, as the fused ranking scored it (its exact top is among the candidates)
            self.logger.event("eval_prior", epoch=epoch, global_step=global_step,
                              beta=PriorChoice.read_beta(self.cfg.run_dir),
                              **{k[len("model/"):]: v for k, v in fused.items() if k.startswith("model/")})
        return fused if fused is not None else prior

    def _every_hard_table(self) -> dict[int, np.ndarray] | None:
        """{shard: (training rows, k) label ids}: the hard negatives in use on every rank (collective), for the
        lexical ranker's training pairs; None where the run has none (uniform negatives, or none mined yet)."""
        kept = self._kept_hard  # an earlier epoch kept: the negatives stored with its weights
        source = kept if kept is not None else ({} if self.hard is None else self.hard.tables)
        mine = {s: np.asarray(t) for s, t in source.items()}
        tables = {s: t for part in all_gather_object(mine, self.ctx) for s, t in part.items()}
        return tables or None

    def end_training(self) -> None:
        """The encoder's optimizer moments (a 200k x 1024 feature table's: 1.6 GB), the rows' fp32 masters and
        Adagrad accumulators: freed before the final phase (at 10^7 labels a run that kept them was killed for
        memory in it). Its checkpoints hold them for a resume."""
        c = self.c
        c.enc_opt = c.clf_opt = c.lexical_opt = None
        c.shard.drop_training_state()
        if c.lexical is not None:
            c.lexical.values.drop_training_state()

    def close(self, global_step: int) -> None:
        self.refresher.close(global_step)

    def abandon(self) -> None:
        """An error or a stop: no miner outlives the run."""
        self.refresher.abandon()

    # ------------------------------------------------------------------ checkpoints
    def before_checkpoint(self, global_step: int) -> None:
        self.refresher.finish_snapshot(global_step)  # a resume must find it published, as with sync writes

    def finite_state(self) -> dict[str, list[torch.Tensor]]:
        state = {"encoder parameters": list(self.c.encoder.parameters()), "classifier rows": [self.c.shard.weight]}
        if self.c.lexical is not None:
            state["lexical weights"] = [self.c.lexical.values.weight]
        return state

    def state_dict(self) -> dict:
        c, hard = self.c, self.hard
        return {"encoder": c.encoder.state_dict(), "encoder_opt": c.enc_opt.state_dict(),
                "classifier": c.shard.state_dict(),
                "lexical": None if c.lexical is None else c.lexical.state_dict(), "loss_scaler": self.scaler.state_dict(),
                "sampler": {} if c.sampler is None else c.sampler.state_dict(),
                "selector": self.selector.state_dict(), "schedule": self.schedule.state_dict(),
                "hard": None if hard is None else {
                    "generation": hard.generation, "made_at_epoch": hard.made_at_epoch,
                    "made_at_step": hard.made_at_step, "ranked_at_step": hard.ranked_at_step,
                    "row_steps": None if hard.row_steps is None else torch.from_numpy(hard.row_steps)}}

    def negative_tables(self):
        return None if self.hard is None else self.hard.tables

    def checkpoint_meta(self) -> dict:
        c = self.c
        return {"num_label_shards": c.layout.num_shards, "layout": vars(c.layout), "dim": c.shard.dim}

    def protected_step(self) -> int | None:
        return self.selector.protected_step()

    def restore(self, source) -> dict:
        """Load this rank's part of the checkpoint `source` into the model; the whole state dict back."""
        c, ctx = self.c, self.ctx
        state, tables = resume.restore_rank(source, c.layout, ctx.rank, ctx.world_size, self.refresher.k)
        dim = int(state["classifier"]["weight"].shape[1])
        if dim != c.shard.dim:
            raise CheckpointError(f"{source.path}: its classifier vectors have dimension {dim}, this run's model makes "
                                  f"{c.shard.dim} (model.embed_dim, hidden_dims, bottleneck_dim or label_bias differ)")
        try:
            c.encoder.load_state_dict(state["encoder"])
            c.enc_opt.load_state_dict(state["encoder_opt"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"the checkpoint's encoder does not fit this run's model.* settings: "
                                  f"{str(exc)[:500]}") from exc
        c.shard.load_state_dict(state["classifier"])
        if c.lexical is not None:
            if state.get("lexical") is None:
                raise CheckpointError(f"{source.path} has no lexical weights and this run trains them "
                                      "(model.lexical_features): resume it without the override (null keeps the "
                                      "checkpoint's) or with model.lexical_features=0")
            c.lexical.load_state_dict(state["lexical"])
        self.scaler.load_state_dict(state.get("loss_scaler", {}))
        self.selector.load_state_dict(state.get("selector"))
        self.schedule.load_state_dict(state.get("schedule"))
        if c.sampler is not None and state.get("sampler"):
            c.sampler.load_state_dict(state["sampler"])
            self._sampler_restored = True
        hard = state.get("hard")
        row_steps = None if hard is None or hard.get("row_steps") is None else hard["row_steps"].numpy()
        self.hard = None if hard is None or tables is None else HardNegativeSet(
            tables, hard["generation"], hard["made_at_epoch"], hard["made_at_step"], hard.get("ranked_at_step"),
            row_steps)
        return state

    def describe_resume(self, source) -> str:
        return resume.describe(source, self.resume_mode, self.c.layout, self.ctx.world_size)

    def resumed(self, source, global_step: int) -> None:
        """After the counters are back: a changed schedule and a changed layout are announced."""
        c, ctx = self.c, self.ctx
        change = replanned_schedule(source.meta, self.cfg, c.steps_per_epoch, c.total_steps, global_step)
        if change is not None:  # train.epochs raised on a finished run, say: never an unannounced jump of the rate
            log.warning("%s", change.pop("message"))
            if ctx.is_main:
                self.logger.event("schedule", global_step=global_step, **change)
        if ctx.is_main and self.resume_mode != resume.SAME:
            self.logger.event("resume", path=str(source.path), mode=self.resume_mode, from_world_size=source.world_size,
                              world_size=ctx.world_size, from_label_shards=source.num_shards,
                              label_shards=c.layout.num_shards, global_step=global_step)
