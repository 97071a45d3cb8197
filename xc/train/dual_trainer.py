"""The dual-encoder (label-feature) conductor: model.mode=dual.

Per optimizer step: each label shard's TargetCacheSource refreshes what its policy says is due (every
label it encodes is counted), each rank encodes its slice of the batch with the query tower f, the
embeddings are all-gathered with autograd, each rank mines hard negatives for its own shards from their
caches, scores its candidates with FRESH label-tower encodings (xc.train.dual_step), the towers' gradients are
summed over ranks and Adam steps them; learning sources (the corrector) then train on the step's fresh
encodings. Evaluation re-encodes every label exactly (caches and correctors play no part in it).

Counted and logged (event "train"): cache_encodings (builds + refreshes, all shards), fresh_encodings (the
labels of S encoded per step for the loss), steps_per_sec; at the end (event "encodings") the totals and
eval_encodings. Checkpoints hold towers, optimiser, free vectors and every source's state (cache rows,
corrector weights and optimiser, cursors, counters); a resume needs the same world size and shards.
"""

from __future__ import annotations

from dataclasses import replace

import logging
import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from xc.run import checkpoint as ckpt
from xc.train import lifecycle
from xc.run import faults, resume
from xc.train.components import text_inputs
from xc.defaults import resolve as resolve_defaults
from xc.config import XCConfig, to_dict
from xc.distributed import (DistContext, all_gather_object, all_gather_with_grad, all_reduce, barrier,
                            broadcast_object)
from xc.data.inputs import validation_split
from xc.train.dual_memory import fused_dual_metrics
from xc.train.dual_step import all_reduce_grads, draw_dual_candidates, dual_loss, split_by_shard
from xc.errors import CheckpointError, ConfigError
from xc.eval.inference import merge_topk, encode_rows, sharded_topk
from xc.ann.exact import exact_topk
from xc.eval.metrics import evaluate as evaluate_metrics, inverse_propensities, true_labels
from xc.models.classifier import ClassifierShard
from xc.models.towers import DualTowers
from xc.train.optim import SparseRowSGD, build_encoder_optimizer, lr_factor, set_lr
from xc.train.phases import DUAL_PHASES, make_timer
from xc.train.precision import autocast_dtype
from xc.run.runlog import RunLogger
from xc.sampling import POSITIVE_STREAM, StepKey, draw_positives, mix_seed
from xc.sampling.cache_registry import CacheSpec, build_cache_source
from xc.shards import ShardLayout
from xc.train.step import nonfinite_parts

log = logging.getLogger("xc.dual")


class _TableSearcher:
    """Exact top-k over this rank's freshly encoded label table (n, d) (global ids from `lo`)."""

    def __init__(self, tables: list[tuple[int, torch.Tensor]]):
        self.tables = tables

    def search(self, emb: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [exact_topk(emb, table, k) for _, table in self.tables]
        scores = torch.cat([s for s, _ in parts], 1)
        ids = torch.cat([torch.where(i >= 0, i + lo, -1) for (lo, _), (_, i) in zip(self.tables, parts)], 1)
        return merge_topk(scores, ids, k)


class DualTrainer:
    def __init__(self, cfg: XCConfig, ctx: DistContext, dataset):
        if cfg.train.amp == "fp16":  # fp16 needs loss scaling, which only the classifier mode's step has
            raise ConfigError("train.amp", "model.mode=dual supports train.amp=bf16 or none (fp16 needs loss "
                              "scaling, not wired into the dual step)")
        if not dataset.label_texts_path or not dataset.train.texts_path or not dataset.test.texts_path:
            raise ConfigError("model.mode", f"dual mode needs query and label texts; data '{cfg.data.name}' lacks them")
        # nulls -> data-derived values (xc/defaults.py); free vectors keep plain SGD, as they were tuned
        cfg = resolve_defaults(replace(cfg, train=replace(cfg.train, optimizer_classifier="sgd")),
                               dataset.train.num_points, dataset.num_labels,
                               dataset.num_features, world_size=ctx.world_size)
        self.cfg, self.ctx = cfg, ctx
        self.resume_from = resume.find_checkpoint(cfg, ctx)
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
        self.inv_prop = inverse_propensities(dataset.train, cfg.eval.propensity_a, cfg.eval.propensity_b)
        self.logger = RunLogger(cfg.logger, cfg.run_dir, cfg.name, ctx.rank, to_dict(cfg))
        self.epoch, self.micro, self.global_step = 0, 0, 0
        self.fresh_encodings, self.eval_encodings = 0, 0
        self.timer = make_timer(cfg.train.profile_phases, ctx.device, DUAL_PHASES)
        self.skipped_steps = 0  # optimizer steps dropped for a non-finite loss or gradient (train.nonfinite=skip)
        self._nan_fault_step = faults.NAN_AT_STEP  # the fault-injection hook of the tests; fires once
        self._skip_step = False  # a micro-step of this optimizer step was non-finite: apply nothing
        self._cpu_tick = time.process_time()  # CPU seconds of this process (all threads) since the last log
        self.last_metrics: dict[str, float] = {}
        self.eval_tables: tuple[int, list] | None = None  # (global step, label_tables()) of the last evaluation
        self.source_metrics: dict[str, float] = {}
        # Set by the entry point (xc/cli/train.py); None when a Trainer is built directly (tests, libraries).
        self.identity: dict | None = None  # the run identity, recorded in every checkpoint
        self.stop = None  # xc.run.signals.StopControl: SIGTERM/SIGINT and timed checkpoints
        self.heartbeat = None  # xc.run.heartbeat.Heartbeat: told the step after each optimizer step

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        cfg = self.cfg
        self._maybe_resume()
        lifecycle.log_attempt(self, self.resume_from)
        log.info("dual training %s: %d train rows, %d labels in %d shards over %d rank(s), %s tower%s, %s source",
                 cfg.name, self.num_train, self.layout.num_labels, self.layout.num_shards, self.ctx.world_size,
                 cfg.model.tower, " (shared)" if cfg.model.share_towers else "s", cfg.sampler.name)
        while self.epoch < cfg.train.epochs and not self._done():
            started = time.perf_counter()
            self._train_epoch()
            self.logger.event("epoch", epoch=self.epoch, global_step=self.global_step,
                              train_seconds=time.perf_counter() - started)
            if self._done() and self.micro != 0:
                break
            self.epoch, self.micro = self.epoch + 1, 0
            every = cfg.eval.every_epochs
            if (every and self.epoch % every == 0) or self.epoch == cfg.train.epochs:
                self.evaluate()
            faults.maybe_signal(self.epoch, self.ctx.rank, at="epoch_end")  # tests: a signal in the evaluation
            self.save_checkpoint()
            lifecycle.after_epoch_checkpoint(self)  # a SIGTERM during the evaluation stops here
        if self._done() and self.micro != 0:
            self.save_checkpoint()
        if not self.last_metrics:
            self.evaluate()
        fused = fused_dual_metrics(self, self.dataset)
        if fused is not None:
            self.last_metrics = fused
        self.logger.event("encodings", global_step=self.global_step, **self.encoding_counts())
        self.logger.close()
        return self.last_metrics

    def _done(self) -> bool:
        return 0 <= self.cfg.train.max_steps <= self.global_step

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

    def _train_epoch(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.eval_tables = None  # stale once the towers move; not held in memory while training
        gen = torch.Generator().manual_seed(mix_seed(cfg.seed, self.epoch, 0x0D))
        order = self.train_ids[torch.randperm(self.num_train, generator=gen).numpy()]
        show = ctx.is_main and cfg.logger.progress
        bar = tqdm(total=self.micro_per_epoch, initial=self.micro, desc=f"epoch {self.epoch}", disable=not show,
                   mininterval=0.5 if sys.stderr.isatty() else 10.0, leave=False, dynamic_ncols=True)
        self.towers.train()
        window = {"loss": 0.0, "n": 0, "t": time.perf_counter(), "steps": 0}
        while self.micro < self.micro_per_epoch and not self._done():
            rows = order[self.micro * self.micro_batch:(self.micro + 1) * self.micro_batch]
            last = (self.micro + 1) % cfg.train.grad_accum == 0
            self.timer.start()
            loss = self._micro_step(rows, StepKey(cfg.seed, self.epoch, self.micro), last)
            self.timer.end_step()
            self.micro += 1
            bar.update(1)
            if loss is not None:  # None: a skipped non-finite micro-step (train.nonfinite=skip)
                window["loss"] += loss
                window["n"] += 1
            if last:
                window["steps"] += 1
                if self.global_step % cfg.train.log_every == 0:
                    self._log_train(window, bar)
                lifecycle.after_optimizer_step(self)  # checkpoints by steps and minutes; graceful stops
        if window["n"]:
            self._log_train(window, bar)
        bar.close()

    def _micro_step(self, rows: np.ndarray, key: StepKey, last: bool) -> float | None:
        cfg, ctx = self.cfg, self.ctx
        if self.micro % cfg.train.grad_accum == 0:
            for s, source in self.sources.items():
                source.refresh(self.global_step, self._encode_fn(s))
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
        cand = draw_dual_candidates(self.layout, self.my_shards, self.sources, emb.detach().cpu(), key, positives,
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
        if self._nonfinite(res, key):  # train.nonfinite=skip: nothing of this optimizer step is applied
            self._skip_step = not last
            if last:
                self.opt.zero_grad(set_to_none=True)
                if self.free_opt is not None:
                    self.free_opt.zero_grad()
            timer.mark("optimizer")
            return None
        if self.free_opt is not None:
            self.free_opt.accumulate(res.unique.to(ctx.device), res.free_leaf.grad, res.free_leaf)
        timer.mark("optimizer")  # the non-finite check and the free rows' gradient, as in the classifier mode
        q, fresh = emb.detach().cpu(), res.fresh.detach().cpu()
        logged = last and (self.global_step + 1) % cfg.train.log_every == 0  # this step's metrics get logged
        for s, pos in split_by_shard(self.layout, self.my_shards, res.unique, self.lo).items():
            s_lo, s_hi = self.layout.shard_range(s)
            positive_local = positives.ids[(positives.ids >= s_lo) & (positives.ids < s_hi)] - s_lo
            metrics = self.sources[s].observe(q, res.unique[pos] + self.lo - s_lo, fresh[pos], diagnostics=logged,
                                              keep_ids=positive_local)
            if metrics and s == self.my_shards.start:
                self.source_metrics = metrics
        timer.mark("cache_update")
        if last and self._skip_step:  # an earlier micro-step of this step was non-finite
            self._skip_step = False
            self.opt.zero_grad(set_to_none=True)
            if self.free_opt is not None:
                self.free_opt.zero_grad()
        elif last:
            factor = lr_factor(self.global_step, cfg.train.warmup_steps, self.total_steps, cfg.train.min_lr_ratio)
            all_reduce_grads(self.params, ctx)
            set_lr(self.opt, cfg.train.lr_encoder * factor)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if self.free_opt is not None:
                self.free_opt.step(factor)
            self.global_step += 1
        timer.mark("optimizer")
        return float(res.loss.detach())

    def _nonfinite(self, res, key: StepKey) -> bool:
        """True when this micro-step's loss, tower ("encoder") or free-vector ("classifier row") gradient is NaN or
        inf on any rank (xc.train.step.nonfinite_parts: all ranks agree) and train.nonfinite=skip; raises under stop."""
        value = res.loss.detach()
        if self.global_step == self._nan_fault_step:
            self._nan_fault_step = -1
            if faults.NAN_RANK in (-1, self.ctx.rank):
                if faults.NAN_KIND == "grad":
                    next(p for p in self.params if p.grad is not None).grad.view(-1)[0] = float("inf")
                else:
                    value = value * float("nan")
        what = nonfinite_parts(value, self.towers, res.free_leaf.grad if res.free_leaf is not None else None,
                               self.ctx)
        if not what:
            return False
        lifecycle.skip_or_stop_nonfinite(self, key, what, log)
        return True

    def _log_train(self, window: dict, bar) -> None:
        total = all_reduce(torch.tensor([window["loss"]], dtype=torch.float64, device=self.ctx.device), self.ctx)
        seconds = time.perf_counter() - window["t"]
        # CPU seconds of this process beside the wall time: how many host cores the rank keeps busy
        cpu, self._cpu_tick = time.process_time() - self._cpu_tick, time.process_time()
        steps = max(1, window["steps"])
        fields = dict(epoch=self.epoch, global_step=self.global_step, loss=float(total.item()) / max(1, window["n"]),
                      steps_per_sec=window["steps"] / max(seconds, 1e-9), sec_per_step=seconds / steps,
                      cpu_sec_per_step=cpu / steps, skipped_steps=self.skipped_steps, **self.encoding_counts(),
                      **self.source_metrics)
        phases = self.timer.window()
        if phases is not None:  # train.profile_phases: mean seconds per micro-step over this window
            fields["phase_seconds"] = phases
        self.logger.event("train", **fields)
        bar.set_postfix(loss=f"{fields['loss']:.4f}", enc=fields["cache_encodings"],
                        cpu=f"{cpu / max(seconds, 1e-9):.1f}x")
        window.update(loss=0.0, n=0, t=time.perf_counter(), steps=0)

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

    def evaluate(self) -> dict[str, float]:
        cfg, ctx = self.cfg, self.ctx
        n = self.test.num_points if not cfg.eval.max_points else min(cfg.eval.max_points, self.test.num_points)
        start = time.perf_counter()
        # kept for the kNN fusion that follows the final evaluation (xc/train/dual_memory.py): no second re-encoding
        self.eval_tables = (self.global_step, self.label_tables())
        searcher = _TableSearcher(self.eval_tables[1])
        rows = np.arange(n, dtype=np.int64)
        emb = encode_rows(self.towers.query, self.test_inputs, rows, cfg.eval.batch_size, ctx)
        _, ids = sharded_topk(emb, searcher, cfg.eval.topk, ctx)
        metrics: dict[str, float] = {}
        if ctx.is_main:
            indptr, indices = true_labels(self.test.labels, first=n)
            metrics = evaluate_metrics(ids.numpy(), indptr, indices, self.inv_prop, ks=tuple(cfg.eval.ks))
            log.info("eval epoch %d step %d (%d test points, %.1fs): %s", self.epoch, self.global_step, n,
                     time.perf_counter() - start, "  ".join(f"{k} {v:.2f}" for k, v in metrics.items() if "@" in k))
            self.logger.event("eval", epoch=self.epoch, global_step=self.global_step, **metrics)
        self.last_metrics = broadcast_object(metrics, ctx)
        return self.last_metrics

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict:
        return {"version": 1, "mode": "dual", "epoch": self.epoch, "micro": self.micro, "global_step": self.global_step,
                "towers": self.towers.state_dict(), "opt": self.opt.state_dict(), "rng_cpu": torch.get_rng_state(),
                "free": None if self.free is None else self.free.state_dict(),
                "sources": {str(s): src.state_dict() for s, src in self.sources.items()},
                "fresh_encodings": self.fresh_encodings, "eval_encodings": self.eval_encodings,
                "skipped_steps": self.skipped_steps}

    def save_checkpoint(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        lifecycle.check_finite_state(self, {"towers": list(self.towers.parameters()),
                                            "free vectors": [] if self.free is None else [self.free.weight]})
        digests = ckpt.write_rank_files(cfg.run_dir, self.global_step, ctx.rank, self._state(), None)
        digests = {k: v for part in all_gather_object(digests, ctx) for k, v in part.items()}
        if ctx.is_main:
            meta = {"epoch": self.epoch, "micro": self.micro, "config": to_dict(cfg), "mode": "dual",
                    "num_label_shards": self.layout.num_shards, "layout": vars(self.layout),
                    "dim": self.towers.out_dim, "metrics": self.last_metrics, "identity": self.identity}
            path = ckpt.publish(cfg.run_dir, self.global_step, ctx.world_size, meta, cfg.train.keep_checkpoints,
                                sha256=digests)
            self.logger.event("checkpoint", epoch=self.epoch, global_step=self.global_step, path=str(path))
        barrier(ctx)

    def _maybe_resume(self) -> None:
        source = self.resume_from
        if source is None:
            return
        if source.meta.get("mode") != "dual":
            raise CheckpointError(f"{source.path} was written by a classifier-mode run; pass another run_dir= or "
                                  "train.resume=never (which archives the old run)")
        if source.world_size != self.ctx.world_size or source.layout != self.layout:
            raise CheckpointError(f"{source.path} was written by {source.world_size} rank(s) with {source.num_shards} "
                                  f"label shards; a dual-mode run resumes only on the same world size and shards: "
                                  f"run it on {source.world_size} rank(s), or pass another run_dir= or "
                                  "train.resume=never (which archives the old run)")
        state, _ = ckpt.load_rank(source.path, self.ctx.rank)
        try:
            self.towers.load_state_dict(state["towers"])
            self.opt.load_state_dict(state["opt"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"the checkpoint's towers do not fit this run's model.* settings: {str(exc)[:400]}")
        if self.free is not None:
            if state["free"] is None:
                raise CheckpointError(f"{source.path} has no free vectors but model.free_vectors=true")
            self.free.load_state_dict(state["free"])
        for s, src in self.sources.items():
            src.load_state_dict(state["sources"][str(s)])
        torch.set_rng_state(state["rng_cpu"])
        self.epoch, self.micro, self.global_step = state["epoch"], state["micro"], state["global_step"]
        self.fresh_encodings, self.eval_encodings = state["fresh_encodings"], state["eval_encodings"]
        self.skipped_steps = state.get("skipped_steps", 0)  # absent from checkpoints written before it was kept
        log.info("resumed from %s: epoch %d, micro-step %d, global step %d", source.path, self.epoch, self.micro,
                 self.global_step)
