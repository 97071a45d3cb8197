"""`resolve`: every null adaptive key of a config filled in by its rule (xc/defaults/__init__.py), logged once; and the
`train.static_shapes` rule.

* ``train.static_shapes: auto``: ``on`` where the ranks train on CUDA with a sampler that draws on the device
  (uniform, hard, astra, curriculum) and ``train.device_batches`` is not false; ``off`` otherwise. On a GPU a
  batch-256 step is launch-bound (~150 small ops and a few host reads assemble it); fixed shapes let it be captured
  and replayed. On a CPU nothing waits on launches, and the host path's draws stay as they were.

A rule reads only the config and the dataset's sizes, so a resumed run derives the same values; the exceptions,
the rows' width and precision, read the free memory, and a resumed run keeps its checkpoint's (xc/train/plan.py);
``miner.async_snapshot`` reads it too, and either answer writes the same files.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from xc.ann.base import AUTO_BACKEND
from xc.config import XCConfig
from xc.data.inputs import validation_split
from xc.distributed import host_threads
from xc.defaults.model import SPARSE_TABLE_FLOATS, auto_hidden_dims, auto_sparse_features, resolve_model_rows
from xc.defaults.negatives import (CLUSTERED_COST_RATIO, GPU_EXACT_MACS, POOL_MAX_DRAW_SHARE, RERANK_FACTOR,
                                  auto_first_snapshot_at, auto_miner, auto_miner_backend, auto_random_proposal,
                                  auto_rerank_candidates, auto_shared_pool, auto_start_epoch, exact_loss_rule,
                                  exact_search_macs, faiss_sees_a_gpu)
from xc.defaults.schedule import (LR_CLASSIFIER, OPEN_EPOCHS_CAP, TARGET_STEPS, WARMUP_SHARE, auto_batch_size,
                                  auto_epochs, auto_epochs_by_validation, auto_warmup, training_rows, warn_long_run)
from xc.models.row_memory import snapshot_copy_fits

log = logging.getLogger("xc.defaults")  # one name for every rule's log line

STATIC_SAMPLERS = ("uniform", "hard", "astra", "curriculum")  # the samplers the fixed-shape assembly draws


def static_shapes_rule(setting: str, device_type: str, sampler: str, mode: str,
                       device_batches: bool | None) -> tuple[str, str]:
    """("on" | "off", why) for `train.static_shapes` (see the module docstring); an explicit on/off stands, except
    where nothing is sampled (the exact loss) or the sampler draws on the host, which have no fixed-shape path."""
    if mode != "classifier" or sampler not in STATIC_SAMPLERS:
        return "off", f"sampler {sampler}: no sampled assembly on the device to pad"
    if setting != "auto":
        return setting, "train.static_shapes"
    if device_type != "cuda":
        return "off", "the ranks train on the CPU"
    if device_batches is False:
        return "off", "train.device_batches=false: batches are assembled on the host"
    return "on", "CUDA: a fixed-shape batch assembly can be captured as a CUDA graph"


def resolve(cfg: XCConfig, num_points: int, num_labels: int, num_features: int = 0,
            device_type: str = "cpu", world_size: int = 1, features_per_row: float = 0.0) -> XCConfig:
    """`cfg` with every null adaptive key filled in by its rule (each derived value logged once); `device_type` is
    where the ranks train ("cuda" or "cpu"), read by the `miner.mode: auto` rule alone; `world_size` (ranks) by the
    batch-size rule, whose batch splits evenly over them; `features_per_row` (the training rows' mean non-zeros,
    `features_per_row(dataset)`) by the sparse-table rule."""
    train, model, sampler, miner, notes = cfg.train, cfg.model, cfg.sampler, cfg.miner, []
    if model.hidden_dims is None:
        model = replace(model, hidden_dims=auto_hidden_dims(model.encoder, num_features))
        notes.append(f"model.hidden_dims={model.hidden_dims} ({num_features} features)")
    if model.mode == "classifier":  # the precision alone: the width was chosen by `resolve_rows`, or was given
        model = resolve_model_rows(model, num_labels, device_type, world_size, train.optimizer_classifier,
                              miner.ann, projectable=False)
    width = model.hidden_dims[-1] if model.hidden_dims else model.embed_dim
    row_dim = model.bottleneck_dim or width  # the width of the rows the miner searches
    rows = training_rows(cfg, num_points, num_labels)
    macs = exact_search_macs(rows, num_labels, world_size, row_dim)
    if miner.mode == "auto":
        mode, workers, why = auto_miner(device_type, host_threads.host_cores(), host_threads.local_ranks(), macs)
        miner = replace(miner, mode=mode, workers=workers if mode == "pool" else miner.workers, threads_per_worker=1
                        if mode == "pool" else miner.threads_per_worker)
        notes.append(f"miner.mode={mode}" + (f", miner.workers={workers}" if mode == "pool" else "") + f" ({why})")
    if exact_loss_rule(sampler.name, sampler.k_hard, sampler.k_random, model.mode, num_labels):
        notes.append(f"sampler.name=full (the data's {num_labels} labels are no more than the "
                     f"{sampler.k_hard + sampler.k_random} negatives a query draws: the exact {sampler.loss} over "
                     f"all labels, which costs no more)")
        sampler = replace(sampler, name="full", shared_pool=0)
    if miner.first_snapshot_at is None:
        rerank_off = miner.rerank_candidates is not None and miner.rerank_candidates <= sampler.k_hard
        miner = replace(miner, first_snapshot_at=auto_first_snapshot_at(
            miner.mode, sampler.hard_source, sampler.start_epoch is None, rerank_off))
        if miner.first_snapshot_at:
            notes.append(f"miner.first_snapshot_at={miner.first_snapshot_at:g} (miner={miner.mode}: generation 1 "
                         f"from the rows half-way into epoch 0, its candidates re-ranked at the switch)")
    if sampler.start_epoch is None:
        sampler = replace(sampler, start_epoch=auto_start_epoch(miner.mode, sampler.hard_source,
                                                                miner.first_snapshot_at))
        if sampler.start_epoch != 1:
            notes.append(f"sampler.start_epoch={sampler.start_epoch} (miner={miner.mode} snapshots epoch t-1's "
                         f"start for epoch t: epoch 1's would be the untrained rows)")
    if miner.ann.backend == AUTO_BACKEND:
        gpu_exact = device_type == "cuda" and miner.mode == "sync" and macs <= GPU_EXACT_MACS
        gpu_index = device_type == "cuda" and not gpu_exact and faiss_sees_a_gpu()
        backend = auto_miner_backend(num_labels, miner.ann.cluster_candidates, gpu_exact, gpu_index)
        miner = replace(miner, ann=replace(miner.ann, backend=backend,
                                           gpu_index="ivf" if backend == "faiss_gpu" else miner.ann.gpu_index))
        if gpu_exact:
            notes.append(f"miner.ann.backend=torch (exact on the rank's GPU: {macs:.2g} multiply-adds a refresh)")
        elif backend == "faiss_gpu":
            notes.append(f"miner.ann.backend=faiss_gpu, miner.ann.gpu_index=ivf (a GPU host whose exact search, "
                         f"{macs:.2g} multiply-adds a refresh, is over {GPU_EXACT_MACS:g}: faiss's IVF on the GPU)")
        elif miner.ann.backend != "exact":
            notes.append(f"miner.ann.backend={miner.ann.backend} ({num_labels} labels > {CLUSTERED_COST_RATIO} x "
                         f"{miner.ann.cluster_candidates} clustered candidates: "
                         f"the query-clustered search where its probe reaches miner.ann.clustered_recall, else the "
                         f"graph)")
    if miner.rerank_candidates is None:
        miner = replace(miner, rerank_candidates=auto_rerank_candidates(miner.mode, sampler.hard_source,
                                                                        sampler.k_hard))
        if miner.rerank_candidates > sampler.k_hard:
            notes.append(f"miner.rerank_candidates={miner.rerank_candidates} (miner={miner.mode}: {RERANK_FACTOR} "
                         f"candidates per hard negative, re-ranked by the rows at the switch)")
    if sampler.shared_pool is None:
        draws = sampler.k_hard + sampler.k_random
        sampler = replace(sampler, shared_pool=auto_shared_pool(sampler.name, model.mode, num_labels, draws))
        if sampler.shared_pool:
            notes.append(f"sampler.shared_pool={sampler.shared_pool} (a query's own {draws} negatives would be under "
                         f"{POOL_MAX_DRAW_SHARE:.0%} of the {num_labels} labels: one negative pool per batch)")
    if sampler.random_proposal is None:
        draws = sampler.k_hard + sampler.k_random
        proposal = auto_random_proposal(sampler.name, model.mode, num_labels, draws)
        sampler = replace(sampler, random_proposal=proposal)
        if proposal != "uniform":
            notes.append(f"sampler.random_proposal={proposal} (a query's own {draws} negatives would be under "
                         f"{POOL_MAX_DRAW_SHARE:.0%} of the {num_labels} labels: the random part drawn by label "
                         f"frequency, where the competing labels are)")
    static, why = static_shapes_rule(train.static_shapes, device_type, sampler.name, model.mode, train.device_batches)
    if static != train.static_shapes:
        train = replace(train, static_shapes=static)
        notes.append(f"train.static_shapes={static} ({why})")
    if train.lr_classifier is None:
        train = replace(train, lr_classifier=LR_CLASSIFIER[train.optimizer_classifier])
        notes.append(f"train.lr_classifier={train.lr_classifier:g} ({train.optimizer_classifier})")
    if train.batch_size is None:
        train = replace(train, batch_size=auto_batch_size(rows, world_size * train.grad_accum))
        notes.append(f"train.batch_size={train.batch_size} ({rows} training rows)")
    if model.sparse_features is None:
        model = replace(model, sparse_features=auto_sparse_features(model.encoder, num_features, model.embed_dim,
                                                                    train.batch_size, features_per_row))
        if model.sparse_features:
            notes.append(f"model.sparse_features=true (a batch touches at most {train.batch_size} x "
                         f"{features_per_row:.1f} of the {num_features} feature rows, or the table exceeds "
                         f"{SPARSE_TABLE_FLOATS} floats)")
    steps_per_epoch = max(1, rows // train.batch_size)
    if train.epochs_by_validation is None:
        by_validation = train.epochs is None and auto_epochs_by_validation(
            auto_epochs(steps_per_epoch), model.mode, cfg.eval.select_epoch,
            num_points - len(validation_split(cfg.data, num_points, cfg.seed)[0]))
        train = replace(train, epochs_by_validation=by_validation)
    if train.epochs is None:
        train = replace(train, epochs=OPEN_EPOCHS_CAP if train.epochs_by_validation else auto_epochs(steps_per_epoch))
        notes.append(f"train.epochs={train.epochs} ({steps_per_epoch} steps/epoch, " + (
            f"train.epochs_by_validation=true: at most {OPEN_EPOCHS_CAP}, fewer where validation stops gaining)"
            if train.epochs_by_validation else f"~{TARGET_STEPS} steps)"))
    else:
        warn_long_run(train.epochs, steps_per_epoch, train.max_steps)
    if train.warmup_steps is None:
        total = steps_per_epoch * train.epochs
        if train.max_steps >= 0:
            total = min(total, train.max_steps)
        train = replace(train, warmup_steps=auto_warmup(total))
        notes.append(f"train.warmup_steps={train.warmup_steps} ({WARMUP_SHARE:.0%} of {total} steps)")
    if miner.async_snapshot is None:
        fits, why = (True, "") if model.mode != "classifier" else snapshot_copy_fits(
            model, num_labels, row_dim + int(model.label_bias), device_type, world_size,
            train.optimizer_classifier == "rowadagrad")
        miner = replace(miner, async_snapshot=fits)
        if not fits and miner.mode in ("pool", "external", "ray"):
            notes.append(why)
    if notes:
        log.info("defaults derived from the data (%d points, %d labels): %s", num_points, num_labels, ", ".join(notes))
    return replace(cfg, train=train, model=model, sampler=sampler, miner=miner)
