"""Defaults that adapt to the data: what a config leaves as null is derived, when the data is loaded, by
the documented rules below (docs/training.md, "Defaults that adapt to the data"), and logged.

* ``train.lr_classifier``: the row optimiser's own rate: 0.1 for row-wise Adagrad (the default), whose
  step does not depend on the scale of the gradient (and so not on L, k_r or the batch size), and 32 for
  plain SGD, which was tuned at 10^4 labels and does not carry over to other L.
* ``train.epochs``: enough passes for about ``TARGET_STEPS`` optimiser steps, at least ``MIN_EPOCHS`` and
  at most ``MAX_EPOCHS``: ceil(TARGET_STEPS / steps per epoch), clipped. Small sets get many short
  epochs. Where that gives ``MIN_EPOCHS`` (at batch 256, about 85,000 training rows and more) the steps are not
  what a model lacks but passes over its labels' few points (at 10^6 labels and 0.1 points a label, 10 epochs took
  the 128-wide model from 80.12 to 86.66 P@1): ``train.epochs_by_validation`` (classifier mode, validation rows
  ranked every epoch) makes ``train.epochs`` a cap, ``OPEN_EPOCHS_CAP`` (12), and validation decides where the
  run ends (xc/train/schedule.py: a constant rate while an epoch gains more than its standard error, then one
  decaying epoch).
* ``train.batch_size``: ``BATCH_SIZE`` (256), halved while an epoch would have fewer than ``MIN_STEPS_PER_EPOCH``
  (16) steps, down to ``MIN_BATCH`` (16); then rounded up to a multiple of world size x grad_accum. Only sets of
  under 4,096 training points get a smaller batch (every shipped set keeps 256). At batch 256 a set of 300 points
  had one step an epoch, so the 30-epoch cap left it 30 steps where the epoch rule means about 1000; at batch 16 it
  gets 540. On validation (3-model ensembles, 300-900 training points drawn from Bibtex and Delicious) the
  smaller batch gained 0.8 to 2.5 points (docs/accuracy.md, "Small data").
* ``train.warmup_steps``: ``WARMUP_SHARE`` of all steps, at most ``MAX_WARMUP`` and at least 1.
* ``model.hidden_dims`` (bag-of-words and dense encoders): one ReLU layer of ``HIDDEN_WIDTH`` when the data
  has fewer than ``FEW_FEATURES`` features, none otherwise. A bag over few features is a low-rank linear
  map that cannot tell many label combinations apart (Delicious: 500 features, 19 labels a point); over
  tens of thousands of sparse features the bag itself is wide enough and a hidden layer only overfits.

* ``model.bottleneck_dim`` and ``model.classifier_dtype: auto`` (the classifier rows' width and precision, chosen
  together by `resolve_rows` from the memory the run has, xc/models/row_memory.py's `row_layout`): the widest of the
  encoder's width and each power of two below it, down to 64, whose rows fit, in float32 where they fit, else in
  bfloat16 without masters, stochastically rounded (half the bytes for twice the width; "ELMO", ICML 2025). "Fit":
  the rows, their Adagrad accumulators and the miner's snapshot (in the rows' precision) within
  ``ROW_MEMORY_SHARE`` (60%) of the memory free when the run starts: the lower of MemAvailable and what the process's
  cgroup limit leaves (a container, a Slurm job), the local ranks' rows together on a CPU host; on GPU ranks the rows
  and state against the GPU's free memory and the snapshot against the host's. The miner's query-clustered search
  reads the snapshot as stored; a graph index (the rows as float32, their centred copy, the graph's vectors and edges:
  12 B a row element, more than the rows at any width) is counted only where the miner builds one without trying
  that search first (``miner.ann.clustered_recall: 0``); otherwise the miner builds it only where the clustered
  search misses its recall target and the graph fits in the memory free then (xc/miner/task.py). The rest is for
  the data, the encoder and its optimiser, a step's buffers and the evaluation.
  The width is the model's capacity where labels are many: at 10^6 labels and 0.1 training points a label, the
  model alone after the same 3 epochs gave 80.12 / 84.10 / 86.56 / 87.64 P@1 with rows 128 / 256 / 512 / 1024 wide
  (validation 54.62 / 59.60 / 63.43 / 66.14; docs/negatives_that_pay.md, "How wide the rows are"), where a fixed
  budget of 2^27 floats had kept them at 128. On this 24 GiB host (22 GiB free) that is the encoder's 1024 in
  float32 at 10^6 labels (7.6 GiB counted) and 256 in bfloat16 at 10^7 (9.6 GiB); every shipped set keeps
  float32 at the encoder's width (debian-deps: 0.3 GiB); a text encoder keeps its own width. Chosen once, by the run's plan, and
  logged; a stored config is never measured again (a model whose rows kept the encoder's width loads as trained on
  any machine) and a resumed run keeps its checkpoint's width and precision (xc/train/plan.py). A given width or
  precision stands; the other is still chosen.
* ``model.sparse_features`` (bag-of-words): the feature table trained by gathered rows (each step reads and writes
  only the rows its batch touches, Adam's momentum for the others applied when they are next read, so the table
  moves as a dense Adam's would: xc/train/optim.py, RowTableAdam) where a batch touches a small part of it: at most
  ``SPARSE_TOUCH_SHARE`` (a quarter) of the table's rows by the bound batch size x non-zeros per row (repeats
  ignored), or always above ``SPARSE_TABLE_FLOATS`` floats (num_features · embed_dim), where a dense step's memory
  and time dominate (200k features at width 1024: 1.65 s a step on 2 cores). Else the dense table and AdamW. The
  quarter is where one step costs the same either way with features drawn uniformly, the worst case for the
  gathered rows (`tools/bench/bench_feature_table.py`, width 1024, 2 threads: at 20k features dense 58 ms against
  gathered 52 ms at 24 per row, a bound of 0.31, and 60 against 107 ms at 48 per row, 0.61; at debian-deps' 41k
  features and 10 per row, 0.06, 88-100 against 31-34 ms). Real features repeat within a batch (debian-deps'
  256 x 10 touch 1,656 rows, not 2,560), so the bound errs towards the dense table. Bibtex (256 x 68 over 1,836
  features) and the main job's synthetic data (256 x 49 over 20k) keep it; debian-deps trains 1.4-1.6x faster, to
  the same validation and test figures (docs/accuracy.md).

* ``sampler.start_epoch`` (tau_s, the first epoch trained with hard negatives): 1, except 2 where an asynchronous
  miner (pool, ray, external) mines the classifier rows. That miner's generation t is snapshotted at the start of
  epoch t - 1 (ASTRA Sec. 3.2), so generation 1 would be the untrained rows at step 0: random "hard" negatives,
  mined at the cost of an index build and N searches on the cores training needs (at 10^5 labels: 0.1% of them
  still in the rows' top-16 when they were used, docs/miner_quality.md). The synchronous miner mines trained rows at
  the epoch boundary itself, and label-text (E-hard) mining indexes pretrained embeddings, so both keep 1, as
  does an asynchronous miner whose first snapshot is taken partway into epoch 0 (``miner.first_snapshot_at``).
* ``miner.ann.backend: auto`` (the synchronous miner's default, conf/miner/sync.yaml): exact search up to
  ``CLUSTERED_COST_RATIO`` (4) x ``miner.ann.cluster_candidates`` labels (32,768 with the default 8,192), else
  ``diskann``, whose miner tries the query-clustered search first and keeps it where a probe block reaches
  ``miner.ann.clustered_recall`` against exact search (xc/miner/task.py). Exact search of N queries costs N·L·d;
  the clustered search about N·(K + L/cluster_size)·d with K = cluster_candidates, so above 4K labels it scans a
  quarter of what exact search does or less. On debian-deps (37,960 labels, 41k queries, d 1,024) a refresh took
  7.6 s against 21 s exact on 2 cores, recall@16 0.96; at 10^6 labels and 2M queries the factor is 100, and exact
  mining took over 25 minutes a refresh on 2 cores against 2.5 (docs/miner_quality.md).
* ``miner.first_snapshot_at`` (an asynchronous miner on classifier rows, re-ranking on, ``sampler.start_epoch``
  left to its rule): ``FIRST_SNAPSHOT_AT`` = 0.5, so generation 1 is the rows half-way into epoch 0 and hard
  negatives start at epoch 1, as with the synchronous miner; else 0. At 10^6 labels the first hard epoch is where
  hard negatives paid (P@3 after epoch 2: 73.73 against 73.09 with none yet), and without re-ranking the half-epoch
  snapshot was too stale to help (73.08; docs/miner_quality.md).
* ``miner.rerank_candidates`` (an asynchronous miner on classifier rows): ``RERANK_FACTOR`` x k_hard candidates
  per query, of which the trainer keeps the k_hard that score highest under its rows and encoder at the switch
  (xc/refresh/rerank.py); k_hard (no re-ranking) for the synchronous miner, whose rows are current. An asynchronous
  generation is an epoch old when used: at 10^6 labels 42% of its top-16 was still in the rows' top-16 at the
  switch, while its top-128 held 79% of it (top-32 56%, top-64 69%, top-256 88%; docs/miner_quality.md).
* ``sampler.shared_pool`` (astra, uniform, curriculum in the classifier mode): ``POOL_SIZE`` uniform draws in a
  pool shared by the batch (with ASTRA's hard union) where a query's own k_hard + k_random draws would be under
  ``POOL_MAX_DRAW_SHARE`` (1%) of the labels (8,000 labels with the default 80 draws), else 0 (each query draws its
  own). The sampled softmax's log of an estimate of the denominator from so few of the labels is biased low and
  noisy; one pool of thousands of columns for the batch costs one dense product, which is cheaper than gathering
  each query's own rows. At 10^6 labels it took P@1 after the first epoch from 78.8 to 87.4 and after 3 epochs
  from 85.7 to 89.0; on debian-deps (37,960 labels) the run took 6.6 minutes instead of 9.9 at equal or better
  P@1/3/5, and the 10^4 synthetic set is unchanged in quality and 20% faster (docs/miner_quality.md). Bibtex and
  Delicious (draws 50% and 8% of their labels) keep per-query draws.
* ``sampler.random_proposal`` (astra, curriculum in the classifier mode): ``popularity`` under the same condition
  (a query's k_hard + k_random draws under ``POOL_MAX_DRAW_SHARE`` of the labels), else ``uniform``. With so thin
  a share of the labels drawn, a step's uniform draws almost never hold the popular labels that compete with every
  query; drawn from q ∝ (count + 1)^alpha and weighted 1 / (k q), the random part holds them and stays unbiased.
  Chosen on validation (mean P@1/3/5 of the model alone, then as served): at 10^6 labels with 0.1 training points a
  label 54.62 against 40.74 after the default 3 epochs and 64.02 against 61.59 after 10 (docs/negatives_that_pay.md);
  level where the uniform draws already meet the popular labels: debian-deps 46.27 against 46.11 (served 48.36
  against 48.39), the 10^4-label synthetic set 78.57 against 78.48 (81.11 against 81.09), Bibtex and Delicious (per-query
  draws, outside the rule) within 0.4.

* ``miner.mode: auto`` (xc-train's default): ``pool``, with one single-threaded worker per spare core, where the
  ranks train on GPUs and the host's cores less ``GPU_RANK_THREADS`` (2) per local rank leave at least
  ``POOL_MIN_SPARE_CORES`` (4); ``sync`` otherwise (every CPU host, where the pool's cores are the ones training
  needs: on 2 cores a miner core-second costs 0.33 s of training, docs/miner_quality.md). On a GPU host the cores idle
  while the GPU trains, so mining there is free and the negatives come without stopping training; the pool's
  other rules (first snapshot, re-ranking) follow from the resolved mode. But where exact search of every training
  query against a rank's rows costs at most ``GPU_EXACT_MACS`` (10^13) multiply-adds, a GPU rank mines them itself:
  ``sync`` with ``miner.ann.backend: torch`` (exact top-k by matrix products on the rank's GPU). That is seconds
  at most (an H100 searched 100k queries against 10^6 rows of width 64, 6.4·10^12 multiply-adds, in 1.5 s), while
  the pool's index build and search took 10-15 s a generation for debian-deps' 38k rows, and the GPU trained an
  epoch in 1.6 s, so every epoch boundary waited for the pool (54 s of a 3-minute run, docs/accuracy.md). With
  10^5 labels and 200k points (2·10^13 at width 1024) and beyond, the pool mines beside training as before.
* ``miner.ann.backend: auto`` on a GPU host past that bound, where the installed faiss sees a GPU (faiss-gpu,
  ``bash tools/setup.sh --gpu``): ``faiss_gpu`` with ``miner.ann.gpu_index: ivf`` (faiss's IVF index built and searched
  on the GPU), its recall measured on the miner's sample as every backend's; without faiss-gpu, the CPU rule below.
* ``sampler.name`` (the classifier mode): ``full``, the exact loss over every label, where the data has no more
  labels than the negatives a query draws (k_hard + k_random, 80 by default): sampling could not draw that many
  distinct negatives, and the exact loss then scores no more columns per query than the sampled one. The loss
  (``sampler.loss``) is kept. Sets of 2 to 80 labels (MULAN/MEKA ARFF sets) train with the defaults; every
  shipped set has more labels and samples as before.
* ``train.static_shapes: auto``: ``on`` where the ranks train on CUDA with a sampler that draws on the device
  (uniform, hard, astra, curriculum) and ``train.device_batches`` is not false; ``off`` otherwise. On a GPU a
  batch-256 step is launch-bound (~150 small ops and a few host reads assemble it); fixed shapes let it be captured
  and replayed. On a CPU nothing waits on launches, and the host path's draws stay as they were.
* ``model.classifier_rounding: auto``: stochastic for bfloat16 rows without masters, nearest otherwise.
* ``miner.async_snapshot`` (pool, external, ray): snapshots written in the background from a host copy of the rows
  where the rows, their state and that copy fit in the same share of the free host memory; else the trainer writes
  them from the rows and waits (10^8 bfloat16 rows at d = 64: 12.8 GB, the copy as much again).

A rule reads only the config and the dataset's sizes, so a resumed run derives the same values; the exceptions,
the rows' width and precision, read the free memory, and a resumed run keeps its checkpoint's (xc/train/plan.py);
``miner.async_snapshot`` reads it too, and either answer writes the same files.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from xc.ann.base import AUTO_BACKEND
from xc.config import AnnConfig, ModelConfig, XCConfig
from xc.config_checks import POOL_SAMPLERS
from xc.data.inputs import validation_split
from xc.distributed import host_threads
from xc.distributed.host_threads import GPU_RANK_THREADS
from xc.models.row_memory import auto_rounding, row_layout, snapshot_copy_fits

log = logging.getLogger(__name__)

LR_CLASSIFIER = {"rowadagrad": 0.1, "sgd": 32.0}
TARGET_STEPS = 1000
MIN_EPOCHS, MAX_EPOCHS = 3, 30
OPEN_EPOCHS_CAP = 12  # train.epochs under train.epochs_by_validation's rule
BATCH_SIZE, MIN_BATCH, MIN_STEPS_PER_EPOCH = 256, 16, 16
LONG_RUN_FACTOR = 1000  # a given train.epochs planning more than this many times the rule's steps is warned about
WARMUP_SHARE, MAX_WARMUP = 0.05, 100
FEW_FEATURES, HIDDEN_WIDTH = 1000, 512
SPARSE_TABLE_FLOATS, SPARSE_TOUCH_SHARE = 1 << 26, 0.25
POOL_SIZE, POOL_MAX_DRAW_SHARE = 1024, 0.01
CLUSTERED_COST_RATIO = 4
RERANK_FACTOR = 8
POOL_MIN_SPARE_CORES = 4
GPU_EXACT_MACS = 1e13
FIRST_SNAPSHOT_AT = 0.5


def training_rows(cfg: XCConfig, num_points: int, num_labels: int) -> int:
    """Rows one epoch visits: the training points less the validation split, plus one row per label
    text under label-text augmentation (as `xc.train.components` builds them)."""
    kept = len(validation_split(cfg.data, num_points, cfg.seed)[0])
    return kept + (num_labels if cfg.data.label_text_augmentation else 0)


def auto_batch_size(rows: int, multiple: int = 1) -> int:
    """The global batch for an epoch of `rows` rows: see the module docstring; a multiple of `multiple`."""
    batch = BATCH_SIZE
    while batch > MIN_BATCH and rows // batch < MIN_STEPS_PER_EPOCH:
        batch //= 2
    return -(-batch // multiple) * multiple


def auto_epochs(steps_per_epoch: int) -> int:
    return int(min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(TARGET_STEPS / max(1, steps_per_epoch)))))


_WARNED_LONG_RUNS: set[tuple[int, int]] = set()


def warn_long_run(epochs: int, steps_per_epoch: int, max_steps: int) -> bool:
    """Warn (and return True) when a given train.epochs plans over LONG_RUN_FACTOR times the steps the epoch rule
    would: most likely a typo (train.epochs=1e9), and the learning-rate schedule is spread over every planned step."""
    planned = epochs * steps_per_epoch
    rule = auto_epochs(steps_per_epoch) * steps_per_epoch
    if planned <= LONG_RUN_FACTOR * rule:
        return False
    if (epochs, steps_per_epoch) in _WARNED_LONG_RUNS:  # resolve() runs more than once per process
        return True
    _WARNED_LONG_RUNS.add((epochs, steps_per_epoch))
    cap = f"; train.max_steps={max_steps} stops it early" if max_steps >= 0 else ""
    log.warning("train.epochs=%d plans %.3g optimizer steps (%d an epoch), over %dx the %d the data's rule gives; the "
                "learning-rate schedule is spread over all of them%s", epochs, planned, steps_per_epoch,
                LONG_RUN_FACTOR, rule, cap)
    return True


def auto_epochs_by_validation(rule_epochs: int, mode: str, select_epoch: bool, valid_rows: int) -> bool:
    """Validation decides the epochs (a cap of OPEN_EPOCHS_CAP) where the step rule gives the fewest, MIN_EPOCHS: a
    set large enough that its epochs, not its steps, are what the model lacks; the classifier mode, with validation
    rows ranked every epoch (eval.select_epoch)."""
    return rule_epochs == MIN_EPOCHS and mode == "classifier" and select_epoch and valid_rows > 0


def auto_warmup(total_steps: int) -> int:
    return int(max(1, min(MAX_WARMUP, round(WARMUP_SHARE * total_steps))))


def auto_hidden_dims(encoder: str, num_features: int) -> list[int]:
    if encoder == "transformer":
        return []
    return [HIDDEN_WIDTH] if num_features < FEW_FEATURES else []


def resolve_rows(cfg: XCConfig, num_labels: int, device_type: str = "cpu", world_size: int = 1) -> XCConfig:
    """`cfg` with the classifier rows' width (`model.bottleneck_dim: null`) and precision (`model.classifier_dtype:
    auto`) chosen together from the free memory (`xc.models.row_memory.row_layout`; module docstring), logged.
    Called once, by the run's plan (xc/train/plan.py), before `resolve`: a stored config is never measured again,
    so a model whose rows kept the encoder's width (bottleneck_dim null) loads as trained on any machine."""
    model = cfg.model
    if model.mode != "classifier" or model.bottleneck_dim is not None:
        return cfg
    return replace(cfg, model=_resolve_rows(model, num_labels, device_type, world_size, cfg.train.optimizer_classifier,
                                            cfg.miner.ann, projectable=model.encoder != "transformer"))


def _resolve_rows(model: ModelConfig, num_labels: int, device_type: str, world_size: int, optimizer: str,
                  ann: AnnConfig, projectable: bool) -> ModelConfig:
    """`model` with the rows' width (where `projectable`: a text encoder's rows are its own space), precision and
    rounding resolved by `row_layout`, its choice logged; a fixed point once resolved (nothing measured again)."""
    width = model.hidden_dims[-1] if model.hidden_dims else model.embed_dim
    layout = row_layout(model, width, num_labels, device_type, world_size, optimizer == "rowadagrad", ann, projectable)
    if layout.note:
        (log.info if layout.fits else log.warning)(layout.note)
    if model.classifier_dtype == "auto":
        model = replace(model, classifier_dtype=layout.dtype,
                        classifier_master_fp32=model.classifier_master_fp32 and layout.dtype == "float32")
    if model.bottleneck_dim is None and layout.dim is not None:
        model = replace(model, bottleneck_dim=layout.dim)
    if model.classifier_rounding == "auto":
        model = replace(model, classifier_rounding=auto_rounding(model.classifier_dtype, model.classifier_master_fp32))
    return model


def auto_sparse_features(encoder: str, num_features: int, embed_dim: int, batch_size: int = 0,
                         features_per_row: float = 0.0) -> bool:
    """Gathered rows where a batch touches at most SPARSE_TOUCH_SHARE of the table (batch_size x features_per_row,
    an upper bound) or the table exceeds SPARSE_TABLE_FLOATS; 0 for either statistic: the table-size bound alone."""
    if encoder != "bow":
        return False
    touched = batch_size * features_per_row
    return num_features * embed_dim > SPARSE_TABLE_FLOATS or 0 < touched <= SPARSE_TOUCH_SHARE * num_features


def auto_start_epoch(miner_mode: str, hard_source: str, first_snapshot_at: float = 0.0) -> int:
    untrained = miner_mode != "sync" and hard_source == "classifier" and first_snapshot_at == 0
    return 2 if untrained else 1


def auto_first_snapshot_at(miner_mode: str, hard_source: str, start_epoch_is_rule: bool, rerank_off: bool) -> float:
    on = miner_mode != "sync" and hard_source == "classifier" and start_epoch_is_rule and not rerank_off
    return FIRST_SNAPSHOT_AT if on else 0.0


def auto_rerank_candidates(miner_mode: str, hard_source: str, k_hard: int) -> int:
    return RERANK_FACTOR * k_hard if miner_mode != "sync" and hard_source == "classifier" else k_hard


def auto_miner_backend(num_labels: int, cluster_candidates: int, gpu_exact: bool = False,
                       gpu_index: bool = False) -> str:
    """`gpu_exact`: a synchronous miner on a GPU rank whose exact search is within GPU_EXACT_MACS; `gpu_index`: a
    GPU rank past that bound where faiss sees a GPU (faiss-gpu installed): faiss's IVF index on the GPU."""
    if gpu_exact:
        return "torch"
    if num_labels <= CLUSTERED_COST_RATIO * cluster_candidates:
        return "exact"
    return "faiss_gpu" if gpu_index else "diskann"


def faiss_sees_a_gpu() -> bool:
    """Does the installed faiss have GPU support and a CUDA device? (faiss-cpu: no.)"""
    from xc.ann.faiss_backend import gpu_status  # lazy: test_defaults.py monkeypatches faiss_backend.gpu_status

    return gpu_status()[0] > 0


def features_per_row(dataset) -> float:
    """The training split's mean stored features per row (sparse features; 0 for dense or none)."""
    features = getattr(dataset.train, "features", None)
    nnz, rows = getattr(features, "nnz", None), getattr(features, "num_rows", 0)
    return float(nnz) / rows if nnz is not None and rows else 0.0


def exact_search_macs(queries: int, num_labels: int, world_size: int, row_dim: int) -> float:
    """Multiply-adds of one exact search of `queries` against one rank's share of the label rows."""
    return float(queries) * -(-num_labels // max(1, world_size)) * row_dim


def auto_shared_pool(sampler: str, mode: str, num_labels: int, draws: int) -> int:
    """POOL_SIZE where a query's own `draws` (k_hard + k_random) would be under POOL_MAX_DRAW_SHARE of the labels."""
    thin = draws < POOL_MAX_DRAW_SHARE * num_labels
    return POOL_SIZE if sampler in POOL_SAMPLERS and mode == "classifier" and thin else 0


def auto_random_proposal(sampler: str, mode: str, num_labels: int, draws: int) -> str:
    """`sampler.random_proposal: null`: popularity for ASTRA's mixture (astra, curriculum; classifier mode) where a
    query's own `draws` (k_hard + k_random) would be under POOL_MAX_DRAW_SHARE of the labels, else uniform."""
    thin = draws < POOL_MAX_DRAW_SHARE * num_labels
    return "popularity" if sampler in ("astra", "curriculum") and mode == "classifier" and thin else "uniform"


def auto_miner(device_type: str, cores: int, local_ranks: int, exact_macs: float | None = None) -> tuple[str, int, str]:
    """(miner.mode, miner.workers, why) for `miner.mode: auto`: the CPU pool where this host's ranks train on GPUs
    and at least POOL_MIN_SPARE_CORES cores are left after GPU_RANK_THREADS per rank, with one single-threaded
    worker per spare core; else the synchronous miner, which is also a GPU rank's choice where its exact search
    (`exact_macs`, see exact_search_macs) is within GPU_EXACT_MACS."""
    if device_type != "cuda":
        return "sync", 0, "the ranks train on the CPU: a pool would take the cores training needs"
    if exact_macs is not None and exact_macs <= GPU_EXACT_MACS:
        return "sync", 0, (f"GPU ranks: exact search on the rank's GPU ({exact_macs:.2g} multiply-adds a refresh, "
                           f"<= {GPU_EXACT_MACS:.0e}) takes seconds, less than waiting for a CPU pool's index")
    spare = cores - local_ranks * GPU_RANK_THREADS
    if spare < POOL_MIN_SPARE_CORES:
        return "sync", 0, (f"{cores} cores less {GPU_RANK_THREADS} for each of {local_ranks} GPU rank(s) leave "
                           f"{spare}, under {POOL_MIN_SPARE_CORES}")
    return "pool", spare, (f"GPU ranks: {cores} cores less {GPU_RANK_THREADS} for each of {local_ranks} rank(s) "
                           f"leave {spare} to mine while they train")


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


def exact_loss_rule(sampler_name: str, k_hard: int, k_random: int, mode: str, num_labels: int) -> bool:
    """Whether the data has so few labels that every query's negatives would cover them all: then the exact loss
    over all labels replaces sampling (see the module docstring)."""
    return sampler_name != "full" and mode == "classifier" and k_hard + k_random >= num_labels


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
        model = _resolve_rows(model, num_labels, device_type, world_size, train.optimizer_classifier,
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
