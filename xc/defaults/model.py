"""The model's rules (xc/defaults/__init__.py): a hidden layer, the classifier rows' width, precision and rounding,
and the sparse feature table.

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
  the data, the encoder and its optimiser, a step's buffers and the evaluation: the 10^6-label defaults run at 1024
  counted 7.63 GiB and its trainer peaked at 13.8 GB (an epoch boundary), on a host with 22.8 GiB free.
  The width is the model's capacity where labels are many: at 10^6 labels and 0.1 training points a label, the
  model alone after the same 3 epochs gave 80.12 / 84.10 / 86.56 / 87.64 P@1 with rows 128 / 256 / 512 / 1024 wide
  (validation 54.62 / 59.60 / 63.43 / 66.14; docs/negatives_that_pay.md, "How wide the rows are"), where a fixed
  budget of 2^27 floats had kept them at 128; at 10^7 labels 256 wide in bfloat16 gave 86.32 / 67.39 / 47.09 after
  one epoch against 84.80 / 59.91 / 40.57 for 64 in float32 after three (docs/scale_1e7.md). On this 24 GiB host
  (22 GiB free) that is the encoder's 1024 in float32 at 10^6 labels (7.6 GiB counted) and 256 in bfloat16 at 10^7
  (9.6 GiB); every shipped set keeps float32 at the encoder's width (debian-deps: 0.3 GiB); a text encoder keeps
  its own width. Chosen once, by the run's plan, and logged; a stored config is never measured again (a model
  whose rows kept the encoder's width loads as trained on any machine) and a resumed run keeps its checkpoint's
  width and precision (xc/train/plan.py). A given width or precision stands; the other is still chosen.
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
* ``model.classifier_rounding: auto``: stochastic for bfloat16 rows without masters, nearest otherwise.
* ``model.lexical_features: null`` (`resolve_lexical`): ``LEXICAL_FEATURES`` (32) weights a label on its own input
  features where they can train (the bag-of-words encoder in the classifier mode, one rank, sampled candidates), the
  run trains one model on over ``LEXICAL_MIN_POINTS`` (50,000) training points (the ensemble rule's bound: below it
  the defaults train three models, whose members get none, and the weights were measured against one model only)
  and the training points carry under ``LEXICAL_BELOW_POSITIVES`` (32) positives a label on average, where the weights
  (8 B a label and slot, 2.4 GiB at 10^7 labels) take at most ``LEXICAL_MEMORY_SHARE`` (a quarter) of the memory the
  rows may use, so the rows keep their width (10^8 labels on a 24 GiB host: none); 0 otherwise. Measured one model each, paired (docs/lexical_weights.md): they lift
  the model alone by 5.5 P@3 on the main job's data (9 positives a label), 2.6 at 10^6 labels (0.5) and the validation
  mean P@k by 2.7 after an epoch at 10^7 (0.44); on Bibtex (73) they are level, on Delicious (250) they cost 2.1 P@1,
  where a label's dense row already has its training points to learn from. 32 lies between 9 and 73.
* ``model.feature_weighting: auto`` (`resolve_feature_weighting`): ``idf`` where the model has lexical weights (the
  rule above) and the stored feature values are counts (binary or whole term counts: `whole_number_values`), ``none``
  otherwise. There most labels have a few training points and barely move from where they start, the lexical weights
  and rows at their training points' inputs, so a label is found by how much its query's inputs look like its
  points'; in raw counts the frequent features dominate that likeness. At 10^6 labels (0.1 points a label) the
  query's own one training point is its nearest by the inputs' cosine for 35.9% of the test points whose label has
  one, by the tf-idf cosine 53.8%; with idf inputs the model ranks such a label first for 12.8% of them against
  7.7%, and validation mean P@k is 73.32 against 72.44 (docs/rare_labels.md). At 10^7 labels (0.44 positives a
  label) validation as served is 74.18 against 73.22, the test points paired −0.16 (SE 0.26) / +0.79 (0.16) / +1.40
  (0.11) P@1/3/5 as served (docs/scale_1e7.md). Values that are not whole numbers are
  taken as weighted already (the XC repository's tf-idf, xc's own raw-text features); a text encoder reads tokens.
  A resumed run keeps its checkpoint's weighting.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from xc.config import AnnConfig, ModelConfig, XCConfig
from xc.data.inputs import validation_split
from xc.defaults.negatives import exact_loss_rule
from xc.models.row_memory import auto_rounding, lexical_memory_share, row_layout

log = logging.getLogger("xc.defaults")  # one name for every rule's log line

FEW_FEATURES, HIDDEN_WIDTH = 1000, 512
LEXICAL_FEATURES, LEXICAL_BELOW_POSITIVES = 32, 32.0
LEXICAL_MIN_POINTS = 50_000  # = xc/ensemble/members.py SMALL_DATA_POINTS (a test holds them equal)
LEXICAL_MEMORY_SHARE = 0.25  # the most of the memory the rows may use that the weights take
SPARSE_TABLE_FLOATS, SPARSE_TOUCH_SHARE = 1 << 26, 0.25


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
    return replace(cfg, model=resolve_model_rows(model, num_labels, device_type, world_size,
                                                 cfg.train.optimizer_classifier, cfg.miner.ann,
                                                 projectable=model.encoder != "transformer"))


def resolve_model_rows(model: ModelConfig, num_labels: int, device_type: str, world_size: int, optimizer: str,
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


def auto_lexical_features(model: ModelConfig, positives_per_label: float, num_points: int, world_size: int,
                          exact_loss: bool, memory: tuple[float, str] = (0.0, "")) -> tuple[int, str]:
    """(S, why) for `model.lexical_features: null` (module docstring); `num_points`: the points the model trains on
    (the validation split left out); `exact_loss`: every label is scored (`sampler.name=full`, asked for or chosen
    by `exact_loss_rule`); `memory`: (share, what) of the memory the rows may use that LEXICAL_FEATURES weights a
    label take (xc.models.row_memory.lexical_memory_share)."""
    if model.encoder != "bow" or model.mode != "classifier":
        return 0, f"they weight the bag-of-words inputs of the classifier mode (model.encoder={model.encoder})"
    if world_size > 1:
        return 0, f"they train on one rank, this run has {world_size}"
    if exact_loss:
        return 0, "every label is scored (sampler.name=full): they train on sampled candidates"
    if num_points <= LEXICAL_MIN_POINTS:
        return 0, (f"{num_points} training points, at most {LEXICAL_MIN_POINTS}: the defaults train an ensemble "
                   "there, measured without them")
    if positives_per_label >= LEXICAL_BELOW_POSITIVES:
        return 0, (f"{positives_per_label:.3g} positives a label on average, at least {LEXICAL_BELOW_POSITIVES:g}: "
                   "a dense row has its training points to learn from")
    share, what = memory
    if share > LEXICAL_MEMORY_SHARE:
        return 0, f"{what}: over {LEXICAL_MEMORY_SHARE:.0%}, the rows' width comes first"
    return LEXICAL_FEATURES, (f"{positives_per_label:.3g} positives a label on average, under "
                              f"{LEXICAL_BELOW_POSITIVES:g}" + (f"; {what}" if what else ""))


def resolve_lexical(cfg: XCConfig, num_points: int, num_positives: int, num_labels: int,
                    device_type: str = "cpu", world_size: int = 1) -> XCConfig:
    """`cfg` with `model.lexical_features: null` resolved by `auto_lexical_features` and logged (`num_points`: the
    training split's points, `num_positives`: their stored labels); an explicit value stands. Called by the run's
    plan before the rows' width is chosen, which counts the weights' memory."""
    if cfg.model.lexical_features is not None:
        return cfg
    kept, _ = validation_split(cfg.data, num_points, cfg.seed)
    exact = cfg.sampler.name == "full" or exact_loss_rule(cfg.sampler.name, cfg.sampler.k_hard, cfg.sampler.k_random,
                                                          cfg.model.mode, num_labels)
    memory = lexical_memory_share(num_labels, LEXICAL_FEATURES, device_type, world_size)
    width, why = auto_lexical_features(cfg.model, num_positives / max(1, num_labels), len(kept), world_size, exact,
                                       memory)
    log.info("model.lexical_features=%d (%s; model.lexical_features=S sets it)", width, why)
    return replace(cfg, model=replace(cfg.model, lexical_features=width))


def auto_feature_weighting(encoder: str, lexical_features: int, whole_values: bool) -> tuple[str, str]:
    """("idf" | "none", why) for `model.feature_weighting: auto` (module docstring)."""
    if encoder == "transformer":
        return "none", "a text encoder reads its own tokens"
    if not lexical_features:
        return "none", "no lexical weights (model.lexical_features=0): the rows learn the features' weights"
    if not whole_values:
        return "none", "the stored feature values are not whole numbers: weighted already"
    return "idf", "lexical weights on counts: rare labels are found by their points' inputs, idf-weighted"


def resolve_feature_weighting(cfg: XCConfig, dataset) -> XCConfig:
    """`cfg` with `model.feature_weighting: auto` resolved by `auto_feature_weighting` and logged; called by the
    run's plan after `resolve_lexical`, whose answer it reads. An explicit none / idf stands."""
    if cfg.model.feature_weighting != "auto":
        return cfg
    choice, why = auto_feature_weighting(cfg.model.encoder, cfg.model.lexical_features or 0,
                                         whole_number_values(dataset))
    log.info("model.feature_weighting=%s (%s; model.feature_weighting=none|idf sets it)", choice, why)
    return replace(cfg, model=replace(cfg.model, feature_weighting=choice))


def whole_number_values(dataset, sample: int = 1 << 20) -> bool:
    """Whether the training split's stored feature values are counts: binary (no values stored) or non-negative
    whole numbers in 16 evenly spaced runs of `sample` / 16 entries (a memmap read of at most 4 MB)."""
    features = getattr(dataset.train, "features", None)
    if features is None or getattr(features, "nnz", 0) == 0:
        return False
    values = features.values
    if values is None:
        return True
    run = max(1, sample // 16)
    starts = np.unique(np.linspace(0, max(0, len(values) - run), 16).astype(np.int64))
    seen = np.concatenate([np.asarray(values[a:a + run], dtype=np.float64) for a in starts])
    return bool(np.all(seen >= 0) and np.all(seen == np.round(seen)))


def auto_sparse_features(encoder: str, num_features: int, embed_dim: int, batch_size: int = 0,
                         features_per_row: float = 0.0) -> bool:
    """Gathered rows where a batch touches at most SPARSE_TOUCH_SHARE of the table (batch_size x features_per_row,
    an upper bound) or the table exceeds SPARSE_TABLE_FLOATS; 0 for either statistic: the table-size bound alone."""
    if encoder != "bow":
        return False
    touched = batch_size * features_per_row
    return num_features * embed_dim > SPARSE_TABLE_FLOATS or 0 < touched <= SPARSE_TOUCH_SHARE * num_features


def features_per_row(dataset) -> float:
    """The training split's mean stored features per row (sparse features; 0 for dense or none)."""
    features = getattr(dataset.train, "features", None)
    nnz, rows = getattr(features, "nnz", None), getattr(features, "num_rows", 0)
    return float(nnz) / rows if nnz is not None and rows else 0.0
