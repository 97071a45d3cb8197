"""A run's config, resolved once before anything trains: `resolve_run`.

The entry point (xc/cli/train.py: a single model, and each member of an ensemble) calls it once per model, after
the run directory is guarded and before the Trainer is built; the Trainer and its mode take the plan it returns
and derive no config value of their own, so config.json, the checkpoints and the run all hold the same config.
Three steps, in this order:

1. the mode's preconditions and pins (the dual mode: texts present, no fp16, plain SGD for its free vectors);
2. the classifier rows' width and precision from the memory the run has (xc.defaults.resolve_rows, rank 0's
   answer for every rank), then the data-derived defaults (xc/defaults/), every null filled in by its rule;
3. the checkpoint to resume from (xc/run/resume.py), chosen before anything is built because its label layout
   decides what each rank builds, and the config adapted to it (the label shards a resume on another world size
   adopts or re-splits into; the rows' width and precision it was trained with, where the rule chose them).

A resolved plan with no checkpoint to resume is a fixed point: resolving its config again gives the same plan.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from xc.config import XCConfig
from xc.defaults import features_per_row, resolve_feature_weighting, resolve_lexical, resolve_rows
from xc.defaults import resolve as resolve_defaults
from xc.distributed import DistContext, broadcast_object
from xc.errors import ConfigError
from xc.run import resume
from xc.train.modes import ModePlan

log = logging.getLogger(__name__)


def resolve_run(cfg: XCConfig, ctx: DistContext, dataset) -> ModePlan:
    """The plan a Trainer is built from (module docstring): the frozen config with every rule applied, the
    checkpoint to resume from (None: a fresh run) and how the classifier mode resumes it (xc.run.resume's SAME /
    ADOPT / RESPLIT; None for the dual mode). Raises ConfigError for a config the mode refuses, CheckpointError
    for a checkpoint this run cannot continue. Rank 0 sweeps half-written checkpoints on the way
    (xc.run.resume.find_checkpoint), so this runs once per run, after the run directory is guarded."""
    if cfg.model.mode == "dual":
        return _resolve_dual(cfg, ctx, dataset)
    return _resolve_classifier(cfg, ctx, dataset)


def _resolve_classifier(cfg: XCConfig, ctx: DistContext, dataset) -> ModePlan:
    """The classifier mode's plan: the rows' width and precision from the free memory, defaults by the data and the
    ranks' device, then the resume's layout."""
    auto_rows, auto_copy = _auto_row_keys(cfg), cfg.miner.async_snapshot is None
    requested = cfg
    # the lexical weights first: the rows' width counts their memory
    cfg = resolve_lexical(cfg, dataset.train.num_points, dataset.train.labels.nnz, dataset.num_labels,
                          ctx.device.type, ctx.world_size)
    cfg = resolve_feature_weighting(cfg, dataset)  # reads the lexical weights' answer
    cfg = resolve_rows(cfg, dataset.num_labels, ctx.device.type, ctx.world_size)
    if auto_rows:  # each rank measured its own free memory: every rank takes rank 0's answer
        cfg = replace(cfg, model=replace(cfg.model, **broadcast_object(
            {k: getattr(cfg.model, k) for k in auto_rows}, ctx)))
    cfg = _resolve(cfg, ctx, dataset)
    if auto_copy:  # the same for the snapshot writer, whose publish step every rank must share
        cfg = replace(cfg, miner=replace(cfg.miner, async_snapshot=broadcast_object(cfg.miner.async_snapshot, ctx)))
    source = resume.find_checkpoint(cfg, ctx)
    if auto_rows and source is not None:
        kept = _checkpoint_rows(requested, source.meta, auto_rows)
        if any(getattr(kept.model, k) != getattr(cfg.model, k) for k in auto_rows):
            kept = replace(kept, miner=replace(kept.miner, async_snapshot=cfg.miner.async_snapshot))
            chosen, cfg = cfg.model, _resolve(kept, ctx, dataset)  # the rules reading the width follow the checkpoint
            if ctx.is_main:
                log.info("resuming with the rows %s was trained with: %s wide in %s (the free memory now would "
                         "choose %s in %s)", source.path.name, cfg.model.bottleneck_dim or "the encoder's width",
                         cfg.model.classifier_dtype, chosen.bottleneck_dim or "the encoder's width",
                         chosen.classifier_dtype)
    cfg, how = resume.adapt_config(cfg, source, ctx.world_size, dataset.num_labels)
    return ModePlan(cfg, source, how)


def _resolve(cfg: XCConfig, ctx: DistContext, dataset) -> XCConfig:
    return resolve_defaults(cfg, dataset.train.num_points, dataset.num_labels, dataset.num_features,
                            ctx.device.type, ctx.world_size, features_per_row(dataset))


_ROW_PRECISION = ("classifier_dtype", "classifier_master_fp32", "classifier_rounding")


def _auto_row_keys(cfg: XCConfig) -> tuple[str, ...]:
    """The model keys the row rule (xc.defaults.resolve_rows) sets from the free memory in this run: the precision's
    where `model.classifier_dtype` is auto, the width where `model.bottleneck_dim` is null; and the lexical weights
    where `model.lexical_features` is null (a resumed run keeps its checkpoint's, whose rows were built beside them),
    and with them the inputs' weighting where `model.feature_weighting` is auto (the rows were trained on those inputs)."""
    return ((_ROW_PRECISION if cfg.model.classifier_dtype == "auto" else ())
            + (("bottleneck_dim",) if cfg.model.bottleneck_dim is None else ())
            + (("lexical_features",) if cfg.model.lexical_features is None else ())
            + (("feature_weighting",) if cfg.model.feature_weighting == "auto" else ()))


def _checkpoint_rows(cfg: XCConfig, meta: dict, keys: tuple[str, ...]) -> XCConfig:
    """`cfg` (the requested config) with the rows' width and precision its checkpoint was trained with, for the
    `keys` (`_auto_row_keys`) left to the rule, whatever memory is free now: the resumed rows continue bit for bit.
    A checkpoint's null width is an answer too (the encoder's width: `resolve` never projects); a checkpoint from
    before the precision rule holds no resolved precision, and keeps the rule's."""
    model = (meta.get("config") or {}).get("model") or {}
    kept = {}
    if "bottleneck_dim" in keys and "bottleneck_dim" in model:
        kept["bottleneck_dim"] = model["bottleneck_dim"]
    if "lexical_features" in keys:
        kept["lexical_features"] = model.get("lexical_features") or 0
    if "feature_weighting" in keys:  # a checkpoint's config always holds a resolved none / idf
        kept["feature_weighting"] = model.get("feature_weighting") or "none"
    if "classifier_dtype" in keys and not (any(model.get(k) is None for k in _ROW_PRECISION)
                                           or model["classifier_dtype"] == "auto"):
        kept.update({k: model[k] for k in _ROW_PRECISION})
    return replace(cfg, model=replace(cfg.model, **kept))


def _resolve_dual(cfg: XCConfig, ctx: DistContext, dataset) -> ModePlan:
    """The dual mode's plan: its preconditions and pins, defaults by the data, then the resume's label shards."""
    if cfg.train.amp == "fp16":  # fp16 needs loss scaling, which only the classifier mode's step has
        raise ConfigError("train.amp", "model.mode=dual supports train.amp=bf16 or none (fp16 needs loss "
                          "scaling, not wired into the dual step)")
    if not dataset.label_texts_path or not dataset.train.texts_path or not dataset.test.texts_path:
        raise ConfigError("model.mode", f"dual mode needs query and label texts; data '{cfg.data.name}' lacks them")
    # free vectors keep plain SGD, as they were tuned; the rules that read the ranks' device (the miner, static
    # shapes) serve the classifier mode's paths, so the dual mode's config keeps their answers for a CPU
    if cfg.model.feature_weighting == "auto":  # the towers read texts, never the weighted bag
        cfg = replace(cfg, model=replace(cfg.model, feature_weighting="none"))
    cfg = resolve_defaults(replace(cfg, train=replace(cfg.train, optimizer_classifier="sgd")),
                           dataset.train.num_points, dataset.num_labels,
                           dataset.num_features, world_size=ctx.world_size,
                           features_per_row=features_per_row(dataset))
    source = resume.find_checkpoint(cfg, ctx)
    if (source is not None and not cfg.parallel.num_label_shards and source.num_shards != ctx.world_size
            and source.num_shards % ctx.world_size == 0):
        # another world size: keep the checkpoint's label shards, each rank taking whole shards of it
        cfg = replace(cfg, parallel=replace(cfg.parallel, num_label_shards=source.num_shards))
    return ModePlan(cfg, source)
