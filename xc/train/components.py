"""Build every training component from the typed config: layout, shard, encoder, optimisers, sampler, data views."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from xc.config import XCConfig
from xc.data.tokens import tokenize_to_cache
from xc.defaults import features_per_row, resolve
from xc.data.inputs import InputFn, TrainingView, dense_inputs, idf_weights, sparse_inputs, validation_split
from xc.distributed import DistContext, wrap_data_parallel
from xc.errors import ConfigError
from xc.eval.metrics import inverse_propensities
from xc.models import ClassifierShard, QueryEncoder, build_encoder
from xc.models.encoders import row_tables
from xc.models.lexical import LexicalRows, centroid_weights, csr_of_inputs, explained_inputs, label_supports
from xc.models.text_encoder import default_minilm_path
from xc.train.optim import SparseRowSGD, build_encoder_optimizer
from xc.train.row_init import centroid_rows, centroid_scale, rows_start_at_centroids
from xc.train.precision import autocast_dtype
from xc.sampling import Sampler, build_sampler
from xc.shards import ShardLayout

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Components:
    layout: ShardLayout
    my_shards: range
    shard: ClassifierShard
    encoder: QueryEncoder  # the module itself (for eval, state dicts)
    ddp: torch.nn.Module  # the encoder as trained (DDP-wrapped when world_size > 1)
    enc_opt: torch.optim.Optimizer | None  # or an EncoderOptimizer (model.sparse_features); None: built to serve
    clf_opt: SparseRowSGD | None
    sampler: Sampler | None  # None = full BCE over every label
    train: TrainingView
    test: object  # XCSplit
    test_inputs: InputFn
    label_inputs: InputFn | None  # label texts, where the data has them and something needs them
    inv_propensity: np.ndarray | None  # (L,) on the main rank only (metrics are computed there)
    micro_batch: int  # global rows per micro-step
    micro_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    lexical: LexicalRows | None = None  # model.lexical_features: the labels' weights on their own input features
    lexical_opt: SparseRowSGD | None = None


def text_inputs(cfg: XCConfig, texts_path: str, tag: str) -> InputFn:
    tokenizer = cfg.model.path or default_minilm_path()
    cache_dir = os.path.join(cfg.data.cache_dir, cfg.data.name, f"tokens-{tag}-{cfg.data.max_len}")
    return tokenize_to_cache(texts_path, tokenizer, cfg.data.max_len, cache_dir).gather


def _split_inputs(cfg: XCConfig, split, tag: str, weights: np.ndarray | None = None) -> InputFn:
    if cfg.model.encoder == "transformer":
        if not split.texts_path:
            raise ConfigError("model.encoder", f"transformer needs raw text; data '{cfg.data.name}' has none")
        return text_inputs(cfg, split.texts_path, tag)
    if split.features is None:
        hint = " (raw text: model=minilm)" if split.texts_path else ""
        raise ConfigError("model.encoder", f"{cfg.model.encoder} needs features; data '{cfg.data.name}' has none{hint}")
    make = dense_inputs if cfg.model.encoder == "dense" else sparse_inputs
    return make(split.features, weights)


def build_components(cfg: XCConfig, ctx: DistContext, dataset, optimizers: bool = True) -> Components:
    """Every component of a run. `optimizers=False` (serving, evaluation): no optimiser state, which for a feature
    table trained by gathered rows is two moments of its size (1.6 GB for 200k x 1024): a served model loaded beside
    a finished trainer (the score calibration) ran a 24 GiB host out of memory with them."""
    # a no-op for a resolved config: a training run's (xc.train.plan.resolve_run) or a stored one (serving, xc-eval)
    cfg = resolve(cfg, dataset.train.num_points, dataset.num_labels, dataset.num_features, ctx.device.type,
                  ctx.world_size, features_per_row(dataset))
    num_shards = cfg.parallel.num_label_shards or ctx.world_size
    layout = ShardLayout.build(dataset.num_labels, num_shards, cfg.parallel.shard_multiple)
    my_shards = layout.shards_of_rank(ctx.rank, ctx.world_size)
    lo, hi = layout.rank_range(ctx.rank, ctx.world_size)

    amp = autocast_dtype(cfg.train.amp, ctx.device)  # refuses fp16 off CUDA before anything is built
    # The O(L) host arrays (label counts, inverse propensities) are made before the classifier rows: their
    # float64 temporaries (about 50 B per label) then never add to the peak on top of the rows (256 B per
    # label at d = 64). Inverse propensities serve only the metrics, which rank 0 computes, so other ranks
    # keep none and their memory stays the rows of their L / G labels (tools/bench/bench_memory.py).
    counts = dataset.train.labels.column_counts()
    inv_prop = (inverse_propensities(dataset.train, cfg.eval.propensity_a, cfg.eval.propensity_b)
                if ctx.is_main else None)
    torch.manual_seed(cfg.seed)  # identical encoder initialisation on every rank
    encoder = build_encoder(cfg.model, dataset.num_features).to(ctx.device)
    encoder.autocast = amp
    shard = ClassifierShard(lo, hi, layout.num_labels, encoder.out_dim, cfg.model.classifier_init_std, cfg.seed,
                            ctx.device, _DTYPES[cfg.model.classifier_dtype], cfg.model.classifier_master_fp32,
                            cfg.model.classifier_rounding)
    ddp = wrap_data_parallel(encoder, ctx)
    # model.sparse_features: the feature table trains by gathered rows (RowTableAdam), outside DDP and AdamW
    enc_opt = clf_opt = None
    if optimizers:
        enc_opt = build_encoder_optimizer(encoder.parameters(), cfg.train, row_tables(encoder), ctx)
        clf_opt = SparseRowSGD(shard, cfg.train.lr_classifier, cfg.train.weight_decay_classifier,
                               cfg.train.optimizer_classifier)
    sampler = build_sampler(cfg.sampler, layout, cfg.seed, counts)

    label_inputs = None
    needs_label_text = cfg.sampler.hard_source == "label_text" and sampler is not None and sampler.wants_hard_negatives
    for key, wanted in (("data.label_text_augmentation", cfg.data.label_text_augmentation),
                        ("sampler.hard_source", needs_label_text)):
        if not wanted:
            continue
        if not dataset.label_texts_path:
            raise ConfigError(key, f"data '{cfg.data.name}' has no label texts")
        if cfg.model.encoder == "transformer":
            label_inputs = text_inputs(cfg, dataset.label_texts_path, "labels")
        elif key == "data.label_text_augmentation" and dataset.label_features is not None:
            label_inputs = None  # made below, with the feature weights
        else:
            raise ConfigError(key, f"label texts are encoded by a text encoder; model.encoder={cfg.model.encoder} "
                              "cannot read them (use model=minilm)")
    weights = None
    if cfg.model.feature_weighting == "idf" and cfg.model.encoder != "transformer":
        weights = idf_weights(dataset.train.features)
    if cfg.data.label_text_augmentation and cfg.model.encoder != "transformer":
        # tf-idf of the label texts (xc/data/text_features.py): each label's text is one more training row
        label_inputs = (dense_inputs if cfg.model.encoder == "dense" else sparse_inputs)(dataset.label_features, weights)
    train_ids, valid_ids = (validation_split(cfg.data, dataset.train.num_points, cfg.seed)
                            if cfg.model.mode == "classifier" else (None, None))
    if cfg.data.label_text_augmentation:
        log.info("label-text augmentation: %d training points + %d label texts = %d training rows "
                 "(data.label_text_augmentation=false trains on the points alone)",
                 dataset.train.num_points, dataset.num_labels, dataset.train.num_points + dataset.num_labels)
    train = TrainingView(dataset.train, _split_inputs(cfg, dataset.train, "train", weights),
                         label_inputs if cfg.data.label_text_augmentation else None,
                         dataset.num_labels, train_ids if valid_ids is not None and len(valid_ids) else None,
                         valid_ids)
    test_inputs = _split_inputs(cfg, dataset.test, "test", weights)
    # the rows from the encoder as initialised, before any step (a resumed run loads its checkpoint's over them)
    rows_centroid = (optimizers and cfg.model.mode == "classifier"
                     and rows_start_at_centroids(cfg.model.classifier_init, counts))
    scale = cfg.model.classifier_init_scale or centroid_scale(candidates_per_query(cfg, sampler, dataset.num_labels))
    if rows_centroid:
        centroid_rows(encoder, train, shard, scale, ctx, cfg.model.label_bias, cfg.sampler.mining_batch_size)

    if cfg.train.batch_size % cfg.train.grad_accum:
        raise ConfigError("train.grad_accum", f"must divide train.batch_size={cfg.train.batch_size}")
    micro_batch = cfg.train.batch_size // cfg.train.grad_accum
    if micro_batch % ctx.world_size:
        raise ConfigError("train.batch_size", f"micro-batch {micro_batch} must be a multiple of the world size {ctx.world_size}")
    micro_per_epoch = (train.num_rows // micro_batch) // cfg.train.grad_accum * cfg.train.grad_accum
    if micro_per_epoch == 0:
        raise ConfigError("train.batch_size", f"{cfg.train.batch_size} exceeds the {train.num_rows} training rows")
    steps_per_epoch = micro_per_epoch // cfg.train.grad_accum
    total_steps = steps_per_epoch * cfg.train.epochs
    if cfg.train.max_steps >= 0:
        total_steps = min(total_steps, cfg.train.max_steps)

    lexical = lexical_opt = None
    if cfg.model.lexical_features:
        lexical_supported(cfg, ctx, sampler)
        start = lexical_start(cfg.model.lexical_init, rows_centroid)
        lexical = build_lexical(cfg.model.lexical_features, train, lo, hi, layout.num_labels, dataset.num_labels,
                                dataset.num_features, cfg.seed, ctx.device,
                                (cfg.model.lexical_init_scale or LEXICAL_START_OVER_ROWS * scale)
                                if start != "zero" and optimizers else None,
                                explained=start == "explained", explained_required=cfg.model.lexical_init == "explained")
        shard.lexical = lexical  # scored with the rows wherever the model ranks (xc.eval.inference.predict)
        if optimizers:
            lexical_opt = SparseRowSGD(lexical.values, cfg.train.lr_lexical or 1.0, 0.0, "rowadagrad")
    return Components(layout, my_shards, shard, encoder, ddp, enc_opt, clf_opt, sampler, train, dataset.test,
                      test_inputs, label_inputs, inv_prop, micro_batch, micro_per_epoch, steps_per_epoch, total_steps,
                      lexical, lexical_opt)


# model.lexical_init_scale: None = this times the rows' centroid scale. At 10^6 labels (0.44 positives a label, rows
# 256 wide in bfloat16, one epoch) validation mean P@k 71.80 at 2x, 71.22 at 1x, 69.86 from zero (docs/lexical_weights.md)
LEXICAL_START_OVER_ROWS = 2.0


def explained_start(features: sp.csr_matrix, labels: sp.csr_matrix, required: bool = True) -> sp.csr_matrix | None:
    """xc.models.lexical.explained_inputs; inputs with negative values: the config's one-line error where the run
    asked for it (`required`), else None (auto: the plain centroids, logged)."""
    try:
        return explained_inputs(features, labels)
    except ValueError:
        if not required:
            log.info("lexical weights: the training inputs hold negative values, so they start at their labels' "
                     "centroids, not their shares (model.lexical_init=auto)")
            return None
        raise ConfigError("model.lexical_init", "explained needs non-negative input values and the training "
                          "inputs hold negative ones: use centroid") from None


def lexical_start(choice: str, rows_at_centroids: bool) -> str:
    """`model.lexical_init` resolved to zero, centroid or explained: auto is explained where the classifier rows
    start at their centroids, else zero."""
    if choice == "auto":
        return "explained" if rows_at_centroids else "zero"
    return choice


def candidates_per_query(cfg: XCConfig, sampler, num_labels: int) -> int:
    """How many labels a query's loss scores: the sampler's positives, hard and random negatives; every label
    under the full loss."""
    if sampler is None:
        return num_labels
    hard = cfg.sampler.k_hard if sampler.wants_hard_negatives else 0
    return min(num_labels, cfg.sampler.k_pos + hard + cfg.sampler.k_random)


def lexical_supported(cfg: XCConfig, ctx: DistContext, sampler) -> None:
    """One line where lexical weights (model.lexical_features) cannot train: what they need is missing."""
    key = "model.lexical_features"
    if cfg.model.encoder != "bow" or cfg.model.mode != "classifier":
        raise ConfigError(key, f"weights the bag-of-words inputs of the classifier mode; model.encoder="
                          f"{cfg.model.encoder}, model.mode={cfg.model.mode} has none")
    if ctx.world_size > 1:
        raise ConfigError(key, f"trains on one rank; this run has {ctx.world_size} (set it to 0 under torchrun)")
    if sampler is None:
        raise ConfigError(key, "trains on sampled candidates; sampler.name=full scores every label")


def build_lexical(width: int, train: TrainingView, lo: int, hi: int, padded_labels: int, num_labels: int,
                  num_features: int, seed: int, device: torch.device, start_scale: float | None = None,
                  explained: bool = False, explained_required: bool = True) -> LexicalRows:
    """The lexical weights of labels [lo, hi): supports from the training points (never the validation ones); with
    `start_scale` the weights start at their labels' centroids of that norm (xc.models.lexical.centroid_weights),
    else at 0. `explained`: supports and start from each label's share of its points' features
    (xc.models.lexical.explained_inputs) instead of their sums; where the inputs hold negative values that is a
    ConfigError if `explained_required`, else the plain sums."""
    rows = np.arange(train.num_points, dtype=np.int64)
    block = 8192
    features = csr_of_inputs((train.inputs(rows[s:s + block]), num_features) for s in range(0, rows.size, block))
    indptr, indices = train.labels(rows)
    labels = sp.csr_matrix((np.ones(indices.size, np.float32), indices, indptr), shape=(rows.size, num_labels))
    real_hi = min(hi, num_labels)
    sums = np.zeros((max(0, real_hi - lo), width), np.float32) if start_scale else None
    shares = (explained_start(features, labels, explained_required) if explained and start_scale and real_hi > lo
              else None)
    explained = shares is not None
    support = (label_supports(features, labels, lo, real_hi, width, sums, shares) if real_hi > lo
               else np.zeros((0, width), np.int32))
    start = centroid_weights(sums, start_scale) if sums is not None else None  # scales `sums` in place
    log.info("lexical weights: %d a label on its own features, labels [%d, %d), from %d training points, starting %s",
             width, lo, real_hi, rows.size,
             f"at their labels' {'shares of their points' if explained else 'centroids'} (norm {start_scale:.2f}; "
             "model.lexical_init)" if start_scale else "at 0")
    return LexicalRows.build(support, lo, hi, padded_labels, num_features, seed, device, start)
