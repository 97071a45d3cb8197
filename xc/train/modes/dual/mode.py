"""The dual-encoder (label-feature) mode, model.mode=dual, under the one Trainer (xc/train/trainer.py).

Per optimizer step: each label shard's TargetCacheSource refreshes what its policy says is due (every
label it encodes is counted), each rank encodes its slice of the batch with the query tower f, the
embeddings are all-gathered with autograd, each rank mines hard negatives for its own shards from their
caches, scores its candidates with FRESH label-tower encodings (xc.train.modes.dual.step), the towers'
gradients are summed over ranks and Adam steps them; learning sources (the corrector) then train on the step's
fresh encodings. Evaluation re-encodes every label exactly (caches and correctors play no part in it).

Counted and logged (event "train"): cache_encodings (builds + refreshes, all shards), fresh_encodings (the
labels of S encoded per step for the loss); at the end (event "encodings") the totals and eval_encodings.
Checkpoints hold towers, optimiser, free vectors and every source's state (cache rows, corrector weights and
optimiser, cursors, counters); a resume keeps the label shards, on any world size that divides their number.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from xc.ann.exact import exact_topk
from xc.data.inputs import validation_split
from xc.distributed import DistContext, all_gather_object, all_gather_with_grad
from xc.errors import ConfigError
from xc.eval.epoch_select import EpochSelector
from xc.eval.inference import encode_rows, merge_topk, sharded_topk
from xc.eval.metrics import inverse_propensities, true_labels
from xc.faults import NO_FAULTS, Faults
from xc.fitting.label_prior import per_point_precision
from xc.models.classifier import ClassifierShard
from xc.models.towers import DualTowers
from xc.run import resume
from xc.run.runlog import RunLogger
from xc.sampling import POSITIVE_STREAM, StepKey, draw_positives, mix_seed
from xc.sampling.cache_registry import CacheSpec, build_cache_source
from xc.shards import ShardLayout
from xc.train.components import text_inputs
from xc.train.lifecycle import nonfinite_parts
from xc.train.modes import ModePlan, StepOutcome
from xc.train.modes.dual.checkpoint import load_dual_weights, restore_dual
from xc.train.modes.dual.memory import fused_dual_metrics
from xc.train.modes.dual.step import all_reduce_grads, draw_dual_candidates, dual_loss, split_by_shard
from xc.train.optim import SparseRowSGD, build_encoder_optimizer, set_lr
from xc.train.schedule import EpochSchedule
from xc.train.phases import DUAL_PHASES, make_timer
from xc.train.precision import autocast_dtype

log = logging.getLogger("xc.train.trainer")


class _TableSearcher:
    """Exact top-k over this rank's freshly encoded label table (n, d) (global ids from `lo`)."""

    def __init__(self, tables: list[tuple[int, torch.Tensor]]):
        self.tables = tables

    def search(self, emb: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [exact_topk(emb, table, k) for _, table in self.tables]
        scores = torch.cat([s for s, _ in parts], 1)
        ids = torch.cat([torch.where(i >= 0, i + lo, -1) for (lo, _), (_, i) in zip(self.tables, parts)], 1)
        return merge_topk(scores, ids, k)


class DualMode:
    """Query and label towers over texts, per-shard label-embedding caches; built from the run's resolved plan
    (xc.train.plan.resolve_run)."""

    def __init__(self, plan: ModePlan, ctx: DistContext, dataset, faults: Faults = NO_FAULTS):
        cfg = plan.cfg
        self.faults = faults  # the tests' fault injection (xc/faults.py): the NaN fault
        self.resume_from = plan.source
        self.cfg, self.ctx = cfg, ctx
        shards = cfg.parallel.num_label_shards or ctx.world_size
        self.layout = ShardLayout.build(dataset.num_labels, shards, cfg.parallel.shard_multiple)
        self.my_shards = self.layout.shards_of_rank(ctx.rank, ctx.world_size)
        self.lo, self.hi = self.layout.rank_range(ctx.rank, ctx.world_size)
        self.k_hard = self.layout.split_count(cfg.sampler.k_hard, "sampler.k_hard")
        self.k_random = self.layout.split_count(cfg.sampler.k_random, "sampler.k_random")
        torch.manual_seed(cfg.seed)  # identical towers on every rank
        self.towers = DualTowers(cfg.model).to(ctx.device)
        # train.amp=bf16: both towers run their forward (training, cache and evaluation encodings) under autocast
        # and hand back float32 embeddings, so scores, losses, caches and the corrector stay float32
        amp = autocast_dtype(cfg.train.amp, ctx.device)
        self.towers.query.autocast = self.towers.label.autocast = amp
        self.params = list(self.towers.parameters())
        self.opt = build_encoder_optimizer(self.params, cfg.train)
        dim = self.towers.out_dim
        self.free = (ClassifierShard(self.lo, self.hi, dataset.num_labels, dim, 0.0, cfg.seed, ctx.device)
                     if cfg.model.free_vectors else None)
        self.free_opt = None if self.free is None else SparseRowSGD(self.free, cfg.train.lr_classifier,
                                                                     cfg.train.weight_decay_classifier)
        self.train_inputs = text_inputs(cfg, dataset.train.texts_path, "train")
        self.test_inputs = text_inputs(cfg, dataset.test.texts_path, "test")
        self.label_inputs = text_inputs(cfg, dataset.label_texts_path, "labels")
        self.train_labels, self.test, self.dataset = dataset.train.labels, dataset.test, dataset
        self.served_scores = None  # final_metrics: the fused ranking the score calibration is fitted on
        # the validation split (data.valid_fraction) is held out of training, for the kNN fusion's choice
        self.train_ids, self.valid_ids = validation_split(cfg.data, dataset.train.num_points, cfg.seed)
        self.num_train = len(self.train_ids)
        self.sources = {s: build_cache_source(cfg.sampler.name, CacheSpec(
            cfg.sampler, s, self.layout.shard_range(s)[0], self.layout.real_count(s), dim,
            os.path.join(cfg.run_dir, "label_cache", f"shard{s}.npy"), cfg.seed, ctx.device)) for s in self.my_shards}
        self.micro_batch = cfg.train.batch_size // cfg.train.grad_accum
        if cfg.train.batch_size % cfg.train.grad_accum or self.micro_batch % ctx.world_size:
            raise ConfigError("train.batch_size", f"{cfg.train.batch_size} must split into grad_accum micro-batches "
                              f"that are multiples of the world size {ctx.world_size}")
        self.micro_per_epoch = (self.num_train // self.micro_batch) // cfg.train.grad_accum * cfg.train.grad_accum
        if self.micro_per_epoch == 0:
            raise ConfigError("train.batch_size", f"{cfg.train.batch_size} exceeds the {self.num_train} training rows")
        self.total_steps = self.micro_per_epoch // cfg.train.grad_accum * cfg.train.epochs
        if cfg.train.max_steps >= 0:
            self.total_steps = min(self.total_steps, cfg.train.max_steps)
        self.schedule = EpochSchedule(cfg.train.epochs, self.micro_per_epoch // cfg.train.grad_accum,
                                      self.total_steps, cfg.train.warmup_steps, cfg.train.min_lr_ratio, False)
        self.inv_prop = inverse_propensities(dataset.train, cfg.eval.propensity_a, cfg.eval.propensity_b)
        self.inv_propensity = self.inv_prop
        self.fresh_encodings, self.eval_encodings = 0, 0
        self.timer = make_timer(cfg.train.profile_phases, ctx.device, DUAL_PHASES)
        self._nan_fault_step = faults.nan_at_step  # the fault-injection hook of the tests; fires once
        self._skip_step = False  # a micro-step of this optimizer step was non-finite: apply nothing
        self.source_metrics: dict[str, float] = {}
        self.eval_tables: tuple[int, list] | None = None  # (global step, label_tables()) of the last evaluation
        self._order = self.train_ids

    def start(self, logger: RunLogger) -> None:
        self.logger = logger
        valid = self.valid_ids
        self.selector = EpochSelector(self.cfg.eval.select_epoch and valid is not None and len(valid) > 0,
                                      self.validation_per_point, self.ctx, logger)

    def describe(self) -> str:
        cfg = self.cfg
        return (f"dual training {cfg.name}: {self.num_train} train rows, {self.layout.num_labels} labels in "
                f"{self.layout.num_shards} shards over {self.ctx.world_size} rank(s), {cfg.model.tower} tower"
                f"{' (shared)' if cfg.model.share_towers else 's'}, {cfg.sampler.name} source")

    def encoding_counts(self) -> dict[str, int]:
        """Label encodings over the run, summed over ranks: cache (builds + refreshes), fresh (S per step), eval."""
        mine = [sum(s.encodings for s in self.sources.values()), self.fresh_encodings, self.eval_encodings]
        total = np.sum(all_gather_object(mine, self.ctx), axis=0)
        return {"cache_encodings": int(total[0]), "fresh_encodings": int(total[1]), "eval_encodings": int(total[2])}

    def _encode_fn(self, shard: int):
        lo = self.layout.shard_range(shard)[0]
        tower = self.towers.label

        @torch.no_grad()
        def encode(local_ids: np.ndarray) -> torch.Tensor:
            was = tower.training
            tower.eval()  # cache rows are inference-time encodings (no dropout)
            out = tower({k: v.to(self.ctx.device) for k, v in self.label_inputs(local_ids + lo).items()}).float().cpu()
            tower.train(was)
            return out

        return encode

    # ------------------------------------------------------------------ epochs
    def begin_epoch(self, epoch: int, micro: int, global_step: int) -> None:
        """Nothing at the boundary: the sources refresh on their own schedule, step by step."""

    def start_pass(self, epoch: int, micro: int) -> None:
        self.eval_tables = None  # stale once the towers move; not held in memory while training
        gen = torch.Generator().manual_seed(mix_seed(self.cfg.seed, epoch, 0x0D))
        self._order = self.train_ids[torch.randperm(self.num_train, generator=gen).numpy()]
        self.towers.train()

    def end_pass(self) -> None:
        pass

    def after_epoch(self, epoch: int, global_step: int) -> None:
        self.selector.after_epoch(epoch, global_step)

    # ------------------------------------------------------------------ one step
    def micro_step(self, micro: int, key: StepKey, last_of_step: bool, global_step: int) -> StepOutcome:
        cfg, ctx = self.cfg, self.ctx
        rows = self._order[micro * self.micro_batch:(micro + 1) * self.micro_batch]
        if micro % cfg.train.grad_accum == 0:
            for s, source in self.sources.items():
                source.refresh(global_step, self._encode_fn(s))
        b = self.micro_batch // ctx.world_size
        mine = rows[ctx.rank * b:(ctx.rank + 1) * b]
        timer = self.timer
        flat, offsets, _ = self.train_labels.gather(rows)
        positives = draw_positives(np.append(offsets, len(flat)).astype(np.int64), np.asarray(flat, dtype=np.int64),
                                   cfg.sampler.k_pos, self.layout.padded_labels, key.generator(POSITIVE_STREAM))
        inputs = {k: v.to(ctx.device) for k, v in self.train_inputs(mine).items()}
        timer.mark("data")
        emb = all_gather_with_grad(self.towers.query(inputs).float(), ctx)  # (B, d)
        timer.mark("encoder_forward")
        cand = draw_dual_candidates(self.layout, self.my_shards, self.sources, emb.detach(), key, positives,
                                    self.k_hard, self.k_random, self.lo, self.hi, cfg.sampler.shared_uniform,
                                    cfg.sampler.inbatch_negatives)
        timer.mark("negatives")
        normalizer = float(self.micro_batch * cfg.train.grad_accum)
        res = dual_loss(self.towers.label, self.label_inputs, self.free, emb, cand, positives, cfg.sampler.loss,
                        normalizer, ctx, self.lo)
        timer.mark("label_forward_loss")
        res.loss.backward()
        timer.mark("backward")
        self.fresh_encodings += int(res.unique.numel())
        bad = self._nonfinite(res, global_step)
        if bad:  # train.nonfinite=skip: nothing of this optimizer step is applied
            self._skip_step = not last_of_step
            if last_of_step:
                self.opt.zero_grad(set_to_none=True)
                if self.free_opt is not None:
                    self.free_opt.zero_grad()
            timer.mark("optimizer")
            return StepOutcome(None, False, bad)
        if self.free_opt is not None:
            self.free_opt.accumulate(res.unique.to(ctx.device), res.free_leaf.grad, res.free_leaf)
        timer.mark("optimizer")  # the non-finite check and the free rows' gradient, as in the classifier mode
        q, fresh = emb.detach(), res.fresh.detach()  # on the device: the corrector trains there
        logged = last_of_step and (global_step + 1) % cfg.train.log_every == 0  # this step's metrics get logged
        for s, pos in split_by_shard(self.layout, self.my_shards, res.unique, self.lo).items():
            s_lo, s_hi = self.layout.shard_range(s)
            positive_local = positives.ids[(positives.ids >= s_lo) & (positives.ids < s_hi)] - s_lo
            metrics = self.sources[s].observe(q, res.unique[pos] + self.lo - s_lo, fresh[pos], diagnostics=logged,
                                              keep_ids=positive_local)
            if metrics and s == self.my_shards.start:
                self.source_metrics = metrics
        timer.mark("cache_update")
        stepped = False
        if last_of_step and self._skip_step:  # an earlier micro-step of this step was non-finite
            self._skip_step = False
            self.opt.zero_grad(set_to_none=True)
            if self.free_opt is not None:
                self.free_opt.zero_grad()
        elif last_of_step:
            factor = self.schedule.factor(global_step)
            all_reduce_grads(self.params, ctx)
            set_lr(self.opt, cfg.train.lr_encoder * factor)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if self.free_opt is not None:
                self.free_opt.step(factor, global_step)
            stepped = True
        timer.mark("optimizer")
        return StepOutcome(float(res.loss.detach()), stepped, None)

    def _nonfinite(self, res, global_step: int) -> str | None:
        """What of this micro-step's loss, tower ("encoder") or free-vector ("classifier row") gradient is NaN or
        inf on any rank (xc.train.lifecycle.nonfinite_parts: all ranks agree), or None."""
        value = res.loss.detach()
        if global_step == self._nan_fault_step:
            self._nan_fault_step = -1
            if self.faults.poisons(self.ctx.rank):
                if self.faults.nan_kind == "grad":
                    next(p for p in self.params if p.grad is not None).grad.view(-1)[0] = float("inf")
                else:
                    value = value * float("nan")
        return nonfinite_parts(value, self.towers, res.free_leaf.grad if res.free_leaf is not None else None,
                               self.ctx) or None

    def after_optimizer_step(self, global_step: int) -> None:
        pass

    def log_fields(self, global_step: int) -> dict:
        return {**self.encoding_counts(), **self.source_metrics}

    @staticmethod
    def postfix(fields: dict) -> dict:
        return {"enc": fields["cache_encodings"]}

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def label_tables(self) -> list[tuple[int, torch.Tensor]]:
        """(global lo, (n_s, d) exact g(text) [+ w]) of every shard of this rank: all labels re-encoded."""
        tables = []
        for s in self.my_shards:
            lo, n = self.layout.shard_range(s)[0], self.layout.real_count(s)
            encode = self._encode_fn(s)
            table = torch.cat([encode(np.arange(a, min(a + 4096, n))) for a in range(0, n, 4096)])
            if self.free is not None:
                table = table + self.free.weight[lo - self.lo:lo - self.lo + n].float().cpu()
            self.eval_encodings += n
            tables.append((lo, table))
        return tables

    def rank_test(self, rows: np.ndarray, bar, global_step: int) -> np.ndarray:
        """(n, topk) label ids of the test rows against every label re-encoded exactly (valid on rank 0)."""
        cfg, ctx = self.cfg, self.ctx
        # kept for the kNN fusion that follows the final evaluation (xc/train/modes/dual/memory.py): no second
        # re-encoding
        self.eval_tables = (global_step, self.label_tables())
        searcher = _TableSearcher(self.eval_tables[1])
        emb = encode_rows(self.towers.query, self.test_inputs, rows, cfg.eval.batch_size, ctx)
        _, ids = sharded_topk(emb, searcher, cfg.eval.topk, ctx)
        return ids.numpy()

    def validation_per_point(self) -> np.ndarray:
        """(V,) each validation row's mean P@k over `eval.ks` against every label re-encoded (every rank)."""
        cfg, ctx, rows = self.cfg, self.ctx, self.valid_ids
        ks = tuple(cfg.eval.ks)
        searcher = _TableSearcher(self.label_tables())
        emb = encode_rows(self.towers.query, self.train_inputs, rows, cfg.eval.batch_size, ctx)
        _, ids = sharded_topk(emb, searcher, max(ks), ctx)
        return per_point_precision(ids.numpy(), *true_labels(self.train_labels, rows), ks)

    def epochs_since_best(self) -> int:
        return self.selector.epochs_since_best()

    def validation_gain(self) -> tuple[float, float] | None:
        return self.selector.gain_over_best

    def keep_selected_epoch(self, micro: int) -> bool:
        """Keep the epoch chosen on validation (xc/eval/epoch_select.py), as the classifier mode does; True when
        its weights replaced the last epoch's. A run stopped mid-epoch keeps what it trained."""
        choice = self.selector.finish(self.cfg.run_dir, self._load_weights) if micro == 0 else None
        return choice is not None and choice["kept"]["global_step"] != choice["last"]["global_step"]

    def _load_weights(self, path) -> None:
        """The towers and free vectors of the checkpoint at `path` (sources and optimiser left alone)."""
        load_dual_weights(self, resume.source_at(path))

    def final_metrics(self, epoch: int, global_step: int, last: dict[str, float]) -> dict[str, float] | None:
        metrics, self.served_scores = fused_dual_metrics(self, self.dataset, epoch, global_step)
        return metrics

    def end_training(self) -> None:
        """The towers' and free vectors' optimizer state: freed before the final phase."""
        self.opt = self.free_opt = None

    def close(self, global_step: int) -> None:
        self.logger.event("encodings", global_step=global_step, **self.encoding_counts())

    def abandon(self) -> None:
        pass

    # ------------------------------------------------------------------ checkpoints
    def before_checkpoint(self, global_step: int) -> None:
        pass

    def finite_state(self) -> dict[str, list[torch.Tensor]]:
        return {"towers": list(self.towers.parameters()), "free vectors": [] if self.free is None else [self.free.weight]}

    def state_dict(self) -> dict:
        return {"mode": "dual", "towers": self.towers.state_dict(), "opt": self.opt.state_dict(),
                "free": None if self.free is None else self.free.state_dict(),
                "sources": {str(s): src.state_dict() for s, src in self.sources.items()},
                "fresh_encodings": self.fresh_encodings, "eval_encodings": self.eval_encodings,
                "selector": self.selector.state_dict()}

    def negative_tables(self):
        return None

    def checkpoint_meta(self) -> dict:
        return {"mode": "dual", "num_label_shards": self.layout.num_shards, "layout": vars(self.layout),
                "dim": self.towers.out_dim}

    def protected_step(self) -> int | None:
        return self.selector.protected_step()

    def restore(self, source) -> dict:
        """Load the checkpoint `source` (any world size dividing its label shards); the state dict back."""
        return restore_dual(self, source)

    def describe_resume(self, source) -> str:
        if source.world_size == self.ctx.world_size:
            return "same world size and shards"
        return f"{source.num_shards} label shards from {source.world_size} rank(s) onto {self.ctx.world_size}"

    def resumed(self, source, global_step: int) -> None:
        pass
