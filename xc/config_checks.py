"""Turning a plain dict into the typed config: key and type checking, allowed choices, cross-field rules.

Kept apart from the dataclasses in xc/config.py so that each file has one concern; it does not import
them (the target class is passed in), so xc.config can import this module without a cycle.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from xc.errors import ConfigError

# Samplers that can draw one negative pool per batch (`sampler.shared_pool`).
POOL_SAMPLERS = ("astra", "uniform", "curriculum")

_CHOICES = {
    "data.kind": ("synthetic", "xc_sparse", "lf_raw", "npz", "arff", "libsvm", "jsonl", "csv", "tsv", "synthetic_lf"),
    "model.mode": ("classifier", "dual"),
    "model.tower": ("tokenbag", "transformer"),
    "sampler.corrector_loss": ("softmax", "mse"),
    "model.encoder": ("bow", "transformer", "dense"),
    "model.pooling": ("mean", "cls"),
    "model.feature_weighting": ("auto", "none", "idf"),
    "model.classifier_dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.classifier_rounding": ("auto", "nearest", "stochastic"),
    "model.classifier_init": ("auto", "centroid", "random"),
    "model.lexical_init": ("auto", "centroid", "explained", "zero"),
    "sampler.name": ("astra", "uniform", "hard", "full", "popularity", "inbatch", "snm", "ehard", "curriculum",
                     "midx_pq", "midx_rq", "lsh_embedding", "lsh_label",
                     # label-embedding cache sources (model.mode=dual only; xc.sampling.cache_registry)
                     "lf_stale", "lf_exhaustive", "lf_partial", "corrector", "dynamic_tree"),
    "sampler.loss": ("bce", "softmax"),
    "sampler.random_proposal": ("uniform", "popularity"),
    "sampler.hard_source": ("classifier", "label_text"),
    "sampler.lsh_family": ("simhash", "dwta"),
    "miner.mode": ("auto", "sync", "pool", "external", "ray"),
    "miner.query_source": ("encode", "train_pass"),
    "miner.late_policy": ("bounded", "wait", "reuse"),
    "train.optimizer_encoder": ("adam", "adamw"),
    "train.optimizer_classifier": ("sgd", "rowadagrad"),
    "train.resume": ("auto", "never", "must"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.nonfinite": ("stop", "skip"),
    "train.ensemble_split": ("crossfit", "shared"),
    "train.amp": ("none", "bf16", "fp16"),
    "train.static_shapes": ("auto", "on", "off"),
    "parallel.backend": ("auto", "gloo", "nccl"),
    "logger.wandb": ("offline", "online", "disabled"),
}

# Choices whose null means "derived from the data" (xc/defaults/)
_NULL_BY_RULE = ("sampler.random_proposal",)


def convert(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(prefix.rstrip(".") or "<root>", f"expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in names]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, names, n=1)
        hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
        raise ConfigError(prefix + key, f"unknown key{hint}")
    kwargs = {name: _coerce(hints[name], raw[name], prefix + name) for name in names if name in raw}
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return convert(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(key, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(key, f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(key, f"expected a string, got {value!r}")
    return value


def validate(cfg) -> None:
    from xc.ann.base import AUTO_BACKEND, BACKENDS  # lazy: xc.ann loads torch; config_checks imports without it

    if cfg.data.kind in ("csv", "tsv") and not cfg.data.records.label_delimiter:
        raise ConfigError("data.records.label_delimiter", "empty: give the character between label names "
                          "within the labels field (',' by default)")

    if cfg.miner.ann.backend == AUTO_BACKEND:
        if cfg.miner.mode not in ("sync", "auto"):
            raise ConfigError("miner.ann.backend", f"auto is chosen by the trainer's own (sync) miner; miner="
                              f"{cfg.miner.mode} needs a named backend: one of {', '.join(BACKENDS)}")
    elif cfg.miner.ann.backend not in BACKENDS:
        raise ConfigError("miner.ann.backend", f"{cfg.miner.ann.backend!r} is not one of {', '.join(BACKENDS)}")
    for key, allowed in _CHOICES.items():
        group, name = key.split(".")
        value = getattr(getattr(cfg, group), name)
        if value is None and key in _NULL_BY_RULE:
            continue
        if value not in allowed:
            raise ConfigError(key, f"{value!r} is not one of {', '.join(allowed)}")
    positive = {
        "train.batch_size": cfg.train.batch_size,
        "train.grad_accum": cfg.train.grad_accum,
        "sampler.k_pos": cfg.sampler.k_pos,
        "sampler.refresh_every": cfg.sampler.refresh_every,
        "eval.topk": cfg.eval.topk,
        "parallel.shard_multiple": cfg.parallel.shard_multiple,
        "miner.snapshot_finish_steps": cfg.miner.snapshot_finish_steps,
    }
    for key, value in positive.items():
        if value is not None and value < 1:
            raise ConfigError(key, f"must be >= 1, got {value}")
    for key, value in {"sampler.k_hard": cfg.sampler.k_hard, "sampler.k_random": cfg.sampler.k_random,
                       "train.epochs": cfg.train.epochs, "sampler.start_epoch": cfg.sampler.start_epoch,
                       "train.warmup_steps": cfg.train.warmup_steps,
                       "sampler.shared_pool": cfg.sampler.shared_pool}.items():
        if value is not None and value < 0:
            raise ConfigError(key, f"must be >= 0, got {value}")
    if cfg.miner.refresh_share is not None and not 0.0 < cfg.miner.refresh_share <= 1.0:
        raise ConfigError("miner.refresh_share", f"must be in (0, 1] (a share of the training queries) or null "
                          f"(the rule), got {cfg.miner.refresh_share}")
    if cfg.miner.first_snapshot_at is not None and not 0.0 <= cfg.miner.first_snapshot_at < 1.0:
        raise ConfigError("miner.first_snapshot_at", f"must be in [0, 1) (a share of an epoch), got "
                          f"{cfg.miner.first_snapshot_at}")
    _check_rerank(cfg)
    if cfg.sampler.name == "ehard" and cfg.sampler.hard_source != "label_text":
        raise ConfigError("sampler.hard_source", "sampler=ehard indexes label texts: hard_source must be label_text")
    if cfg.sampler.name == "dynamic_tree":
        cfg.sampler.tree.validate()
    if cfg.sampler.name == "astra" and cfg.sampler.k_random < 1:
        raise ConfigError("sampler.k_random", "astra needs at least one uniform negative per query")
    if cfg.sampler.random_proposal not in (None, "uniform") and (cfg.model.mode == "dual"
                                                    or cfg.sampler.name not in ("astra", "curriculum")):
        raise ConfigError("sampler.random_proposal", f"the random part of a mixture is drawn by sampler=astra/curriculum "
                          f"in the classifier mode (sampler=popularity draws from that q alone); got sampler="
                          f"{cfg.sampler.name}, model.mode={cfg.model.mode}")
    if cfg.sampler.shared_pool and (cfg.model.mode == "dual" or cfg.sampler.name not in POOL_SAMPLERS):
        raise ConfigError("sampler.shared_pool", f"a batch-shared pool is drawn by sampler={'/'.join(POOL_SAMPLERS)} "
                          f"in the classifier mode (model.mode=dual has sampler.shared_uniform); got sampler="
                          f"{cfg.sampler.name}, model.mode={cfg.model.mode}")
    _validate_numbers(cfg)
    if max(cfg.eval.ks) > cfg.eval.topk:
        raise ConfigError("eval.ks", f"largest k {max(cfg.eval.ks)} exceeds eval.topk={cfg.eval.topk}")
    if not 0.0 <= cfg.model.input_dropout < 1.0:
        raise ConfigError("model.input_dropout", f"must be in [0, 1), got {cfg.model.input_dropout}")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ConfigError("model.dropout", f"must be in [0, 1), got {cfg.model.dropout}")
    _validate_dual(cfg)
    if cfg.model.feature_weighting == "idf" and (cfg.model.encoder == "transformer" or cfg.model.mode == "dual"):
        # else the weights would be dropped without a word: a text encoder and the dual towers read tokens
        raise ConfigError("model.feature_weighting", f"idf weights a bag of words' features; model.encoder="
                          f"{cfg.model.encoder} in model.mode={cfg.model.mode} reads the texts' tokens: use none "
                          "(or auto)")
    _validate_epochs_by_validation(cfg)
    _validate_fusion(cfg)
    _validate_row_precision(cfg.model)
    if cfg.data.kind not in ("synthetic", "synthetic_lf") and not cfg.data.path:
        raise ConfigError("data.path", f"data.kind={cfg.data.kind} needs a path to the dataset directory")


def _validate_row_precision(model) -> None:
    """float16 rows need masters; stochastic rounding is for bfloat16 rows without them (xc/models/rounding.py)."""
    dtype, master = model.classifier_dtype, model.classifier_master_fp32
    if dtype == "float16" and not master:
        raise ConfigError("model.classifier_master_fp32", "float16 rows without fp32 masters round small updates "
                          "away and stochastic rounding is implemented for bfloat16 only: use bfloat16 or keep masters")
    if model.classifier_rounding == "stochastic" and (dtype in ("float32", "float16") or dtype == "bfloat16" and master):
        raise ConfigError("model.classifier_rounding", f"stochastic rounding stores bfloat16 rows without fp32 masters "
                          f"(model.classifier_dtype=bfloat16 or auto, classifier_master_fp32=false); got "
                          f"classifier_dtype={dtype}, classifier_master_fp32={str(master).lower()}")


def _validate_fusion(cfg) -> None:
    """The validation split and kNN fusion (xc/fitting/fusion.py)."""
    if not 0.0 <= cfg.data.valid_fraction < 1.0:
        raise ConfigError("data.valid_fraction", f"must be in [0, 1), got {cfg.data.valid_fraction}")
    if cfg.data.valid_fold < 0:
        raise ConfigError("data.valid_fold", f"must be >= 0, got {cfg.data.valid_fold}")
    if cfg.data.valid_max_points < 0:
        raise ConfigError("data.valid_max_points", f"must be >= 0 (0 = no cap), got {cfg.data.valid_max_points}")
    fc, key = cfg.eval.knn_fusion, "eval.knn_fusion"
    for space in fc.spaces + ([fc.space] if fc.space else []):
        if space not in ("input", "embedding", "both"):
            raise ConfigError(f"{key}.spaces", f"{space!r} is not one of input, embedding, both")
    if not fc.spaces:
        raise ConfigError(f"{key}.spaces", "needs at least one space (input, embedding)")
    if not fc.ks or min(fc.ks + [fc.k or 1]) < 1:
        raise ConfigError(f"{key}.ks", f"needs neighbour counts >= 1, got {fc.ks}")
    if not fc.lambdas or any(not 0.0 <= lam <= 1.0 for lam in fc.lambdas + [fc.lam or 0.0]):
        raise ConfigError(f"{key}.lambdas", f"needs weights in [0, 1], got {fc.lambdas} (lam {fc.lam})")
    if not fc.temperatures or any(not t > 0 for t in fc.temperatures + [fc.temperature or 1.0]):
        raise ConfigError(f"{key}.temperatures", f"needs temperatures > 0, got {fc.temperatures} "
                          f"(temperature {fc.temperature})")
    if fc.max_train_points < 0:
        raise ConfigError(f"{key}.max_train_points", f"must be >= 0 (0 = no cap), got {fc.max_train_points}")
    if fc.candidates < 1:
        raise ConfigError(f"{key}.candidates", f"must be >= 1, got {fc.candidates}")
    rc = cfg.eval.ranker
    if any(not 0.0 <= g <= 10.0 for g in rc.gammas + [rc.gamma or 0.0]) or not rc.gammas:
        raise ConfigError("eval.ranker.gammas", f"needs exponents in [0, 10], got {rc.gammas} (gamma {rc.gamma})")
    for name in ("iterations", "neighbours", "negatives", "block_labels"):
        if getattr(rc, name) < 1:
            raise ConfigError(f"eval.ranker.{name}", f"must be >= 1, got {getattr(rc, name)}")
    if not rc.reg > 0:
        raise ConfigError("eval.ranker.reg", f"must be > 0, got {rc.reg}")
    if rc.max_pair_features < 0:
        raise ConfigError("eval.ranker.max_pair_features", f"must be >= 0 (0 = no cap), got {rc.max_pair_features}")
    if rc.search_products < 0:
        raise ConfigError("eval.ranker.search_products",
                          f"must be >= 0 (0 = the exact search), got {rc.search_products}")
    lp = cfg.eval.label_prior
    if lp.enabled and lp.beta is None and not lp.betas:
        raise ConfigError("eval.label_prior.betas", "needs at least one beta (0 = the plain model), or a fixed "
                          "eval.label_prior.beta, or eval.label_prior.enabled=false")
    if any(not math.isfinite(b) for b in lp.betas + [lp.beta or 0.0]):
        raise ConfigError("eval.label_prior.betas", f"needs finite betas, got {lp.betas} (beta {lp.beta})")


CACHE_SAMPLERS = ("lf_stale", "lf_exhaustive", "lf_partial", "corrector", "dynamic_tree")


def _validate_epochs_by_validation(cfg) -> None:
    """train.epochs_by_validation stops on the validation split's figures: given true, there must be some."""
    if not cfg.train.epochs_by_validation:
        return
    if cfg.model.mode == "dual":
        raise ConfigError("train.epochs_by_validation", "classifier mode only: model.mode=dual trains train.epochs "
                          "epochs (set train.epochs_by_validation=false)")
    if not cfg.eval.select_epoch:
        raise ConfigError("train.epochs_by_validation", "stops on the figures eval.select_epoch ranks every epoch: "
                          "set eval.select_epoch=true, or train.epochs_by_validation=false")
    if cfg.data.valid_fraction <= 0:
        raise ConfigError("train.epochs_by_validation", "needs a validation split: data.valid_fraction > 0, or "
                          "train.epochs_by_validation=false")


def _validate_dual(cfg) -> None:
    """Cache-mining samplers exist only in the dual mode, and the dual mode mines only through them."""
    dual, cached = cfg.model.mode == "dual", cfg.sampler.name in CACHE_SAMPLERS
    if cached and not dual:
        raise ConfigError("sampler.name", f"{cfg.sampler.name} mines a label-embedding cache: it needs model.mode=dual")
    if dual and not cached:
        raise ConfigError("sampler.name", f"model.mode=dual mines negatives from a label-embedding cache: use one of "
                          f"{', '.join(CACHE_SAMPLERS)}, not {cfg.sampler.name!r}")
    if dual and cfg.sampler.cache_refresh_every < 1:
        raise ConfigError("sampler.cache_refresh_every", f"must be >= 1, got {cfg.sampler.cache_refresh_every}")
    if dual and not 0.0 < cfg.sampler.cache_partial_fraction <= 1.0:
        raise ConfigError("sampler.cache_partial_fraction", f"must be in (0, 1], got {cfg.sampler.cache_partial_fraction}")
    if dual and cfg.sampler.corrector_hidden < 1:
        raise ConfigError("sampler.corrector_hidden", f"must be >= 1, got {cfg.sampler.corrector_hidden}")
    if dual and cfg.model.label_bias:
        raise ConfigError("model.label_bias", "not supported with model.mode=dual (use model.free_vectors)")


# Numeric keys and their lower bounds: (minimum, inclusive). Checked before any work starts, so a bad
# value stops the run with its dotted key instead of a traceback (or a silent no-op) hours later.
_AT_LEAST = {
    "model.embed_dim": 1, "data.max_len": 1, "train.log_every": 1, "eval.batch_size": 1,
    "sampler.mining_batch_size": 1, "sampler.snm_pool": 1, "sampler.midx_codewords": 1, "sampler.lsh_bits": 1,
    "sampler.lsh_tables": 1, "sampler.lsh_dwta_bin": 1, "miner.threads_per_worker": 1, "miner.keep_generations": 1,
    "train.warmup_steps": 0, "train.checkpoint_every_steps": 0, "train.keep_checkpoints": 0,
    "train.weight_decay_encoder": 0, "train.weight_decay_classifier": 0, "train.checkpoint_every_minutes": 0,
    "train.max_steps": -1, "train.time_budget": 0, "train.plateau_epochs": 1, "eval.every_epochs": 0, "eval.max_points": 0, "parallel.num_label_shards": 0,
    "parallel.heartbeat_s": 0, "miner.workers": 0, "miner.wait_timeout_s": 0, "miner.max_lag": 0,
    "miner.max_rotation": 1, "miner.recall_sample": 0,
    "miner.staleness_sample": 0, "miner.max_retries": 0, "miner.max_restarts": 0, "model.classifier_init_std": 0,
    "sampler.lsh_window": 0, "sampler.midx_kmeans_iters": 0, "sampler.midx_learn_steps": 0, "seed": 0,
    "model.lexical_features": 0,
}
_POSITIVE = ("train.lr_classifier", "train.lr_lexical", "train.lr_encoder", "model.lr_encoder", "parallel.timeout_s",
             "miner.poll_seconds", "model.classifier_init_scale", "model.lexical_init_scale")


def _value(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _validate_numbers(cfg) -> None:
    for key, low in _AT_LEAST.items():
        value = _value(cfg, key)
        if value is not None and value < low:  # None: derived from the data (xc/defaults/)
            raise ConfigError(key, f"must be >= {low}, got {value}")
    for key in _POSITIVE:
        value = _value(cfg, key)
        if value is not None and not value > 0:
            raise ConfigError(key, f"must be > 0, got {value}")
    for key in ("model.classifier_init_scale", "model.lexical_init_scale"):
        if _value(cfg, key) is not None and not math.isfinite(_value(cfg, key)):
            raise ConfigError(key, f"must be a finite number, got {_value(cfg, key)}")
    if not math.isfinite(cfg.train.time_budget):
        raise ConfigError("train.time_budget", f"must be a finite number of seconds, got {cfg.train.time_budget}")
    if not 0.0 <= cfg.train.min_lr_ratio <= 1.0:
        raise ConfigError("train.min_lr_ratio", f"must be in [0, 1], got {cfg.train.min_lr_ratio}")
    if not cfg.eval.ks:
        raise ConfigError("eval.ks", "needs at least one k (e.g. [1,3,5])")
    for i, k in enumerate(cfg.eval.ks):
        if k < 1:
            raise ConfigError(f"eval.ks[{i}]", f"must be >= 1, got {k}")
    for i, width in enumerate(cfg.model.hidden_dims or []):
        if width < 1:
            raise ConfigError(f"model.hidden_dims[{i}]", f"must be >= 1, got {width}")
    if cfg.model.bottleneck_dim is not None and cfg.model.bottleneck_dim < 1:
        raise ConfigError("model.bottleneck_dim", f"must be >= 1 or null, got {cfg.model.bottleneck_dim}")
    if cfg.miner.mode == "pool" and cfg.miner.workers < 1:
        raise ConfigError("miner.workers", f"miner=pool needs at least one worker process, got {cfg.miner.workers}")
    if cfg.miner.ray_query_blocks < 1:
        raise ConfigError("miner.ray_query_blocks", f"must be >= 1 (search tasks per shard), got {cfg.miner.ray_query_blocks}")
    if cfg.miner.ray_object_store_mb < 80:
        raise ConfigError("miner.ray_object_store_mb", f"must be >= 80 (Ray's minimum), got {cfg.miner.ray_object_store_mb}")
    if cfg.miner.mode == "ray" and not cfg.miner.ray_address and cfg.miner.workers < 1:
        raise ConfigError("miner.workers", f"miner=ray on a local Ray instance needs at least one worker (its CPUs are "
                          f"workers x threads_per_worker), got {cfg.miner.workers}")


def check_against_data(cfg, dataset) -> None:
    """Checks that need the loaded data (its number of labels); the entry point runs them after loading
    and before any component is built or any step is taken."""
    labels = int(dataset.num_labels)
    # in the classifier mode the exact-loss rule (xc/defaults/) takes over where the negatives cover the labels
    if cfg.model.mode == "dual" and cfg.sampler.name != "full" and cfg.sampler.k_hard + cfg.sampler.k_random > labels:
        raise ConfigError("sampler.k_random", f"sampler.k_hard + sampler.k_random = "
                          f"{cfg.sampler.k_hard + cfg.sampler.k_random} negatives per query exceed the data's "
                          f"{labels} labels")


def _check_rerank(cfg) -> None:
    """miner.rerank_candidates: null (the rule), 0 or k_hard (off), or more than k_hard where an asynchronous
    miner mines the classifier rows (the rows the trainer re-scores them with)."""
    value, k_hard = cfg.miner.rerank_candidates, cfg.sampler.k_hard
    if value is None or value == 0 or value == k_hard:
        return
    if value < k_hard:
        raise ConfigError("miner.rerank_candidates", f"must be 0 or >= sampler.k_hard ({k_hard}): the trainer keeps "
                          f"k_hard of the candidates, got {value}")
    if cfg.miner.mode in ("sync", "auto"):
        raise ConfigError("miner.rerank_candidates", f"re-ranking is for the asynchronous miners (pool, external, "
                          f"ray); miner={cfg.miner.mode} mines the current rows (auto: wherever it picks sync)")
    if cfg.sampler.hard_source != "classifier":
        raise ConfigError("miner.rerank_candidates", f"re-ranking scores the candidates with the classifier rows; "
                          f"sampler.hard_source={cfg.sampler.hard_source} mines other vectors")
