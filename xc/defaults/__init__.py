"""Defaults that adapt to the data: what a config leaves as null is derived, when the data is loaded, by the
documented rules of this package (docs/training.md, "Defaults that adapt to the data"), and logged.

* xc/defaults/schedule.py: the row optimiser's rate, the epochs (or validation deciding them), the batch, the warm-up.
* xc/defaults/model.py: a hidden layer, the lexical weights and the inputs' weighting, the classifier rows' width,
  precision and rounding from the memory the run has, the sparse feature table.
* xc/defaults/negatives.py: the miner's mode, backend, first snapshot and re-ranking; the sampler's first hard
  epoch, shared pool, random part and exact loss.
* xc/defaults/resolve.py: `resolve`, which applies them all to a config, and the fixed-shape rule.

The run's plan (xc/train/plan.py) calls `resolve_lexical`, `resolve_feature_weighting` and `resolve_rows` once, then
`resolve`; serving and exports call `resolve` on a stored config, which measures nothing again.
"""

from xc.defaults.model import (FEW_FEATURES, HIDDEN_WIDTH, LEXICAL_BELOW_POSITIVES, LEXICAL_FEATURES,
                               LEXICAL_MEMORY_SHARE, LEXICAL_MIN_POINTS, SPARSE_TABLE_FLOATS, SPARSE_TOUCH_SHARE,
                               auto_feature_weighting, auto_hidden_dims, auto_lexical_features, auto_sparse_features,
                               features_per_row, resolve_feature_weighting, resolve_lexical, resolve_rows,
                               whole_number_values)
from xc.defaults.negatives import (CLUSTERED_COST_RATIO, FIRST_SNAPSHOT_AT, GPU_EXACT_MACS, POOL_MAX_DRAW_SHARE,
                                   POOL_MIN_SPARE_CORES, POOL_SIZE, RERANK_FACTOR, auto_first_snapshot_at, auto_miner,
                                   auto_miner_backend, auto_random_proposal, auto_rerank_candidates, auto_shared_pool,
                                   auto_start_epoch, exact_loss_rule, exact_search_macs, faiss_sees_a_gpu)
from xc.defaults.resolve import STATIC_SAMPLERS, resolve, static_shapes_rule
from xc.defaults.schedule import (BATCH_SIZE, LONG_RUN_FACTOR, LR_CLASSIFIER, MAX_EPOCHS, MAX_WARMUP, MIN_BATCH,
                                  MIN_EPOCHS, MIN_STEPS_PER_EPOCH, OPEN_EPOCHS_CAP, TARGET_STEPS, WARMUP_SHARE,
                                  auto_batch_size, auto_epochs, auto_epochs_by_validation, auto_warmup, training_rows,
                                  warn_long_run)

__all__ = ["BATCH_SIZE", "CLUSTERED_COST_RATIO", "FEW_FEATURES", "FIRST_SNAPSHOT_AT", "GPU_EXACT_MACS", "HIDDEN_WIDTH",
           "LEXICAL_BELOW_POSITIVES", "LEXICAL_FEATURES", "LEXICAL_MEMORY_SHARE", "LEXICAL_MIN_POINTS", "LONG_RUN_FACTOR", "LR_CLASSIFIER", "MAX_EPOCHS", "MAX_WARMUP", "MIN_BATCH", "MIN_EPOCHS",
           "MIN_STEPS_PER_EPOCH", "OPEN_EPOCHS_CAP", "POOL_MAX_DRAW_SHARE", "POOL_MIN_SPARE_CORES", "POOL_SIZE",
           "RERANK_FACTOR", "SPARSE_TABLE_FLOATS", "SPARSE_TOUCH_SHARE", "STATIC_SAMPLERS", "TARGET_STEPS",
           "WARMUP_SHARE", "auto_batch_size", "auto_epochs", "auto_epochs_by_validation", "auto_feature_weighting",
           "auto_first_snapshot_at", "auto_hidden_dims", "auto_lexical_features", "auto_miner", "auto_miner_backend", "auto_random_proposal", "auto_rerank_candidates",
           "auto_shared_pool", "auto_sparse_features", "auto_start_epoch", "auto_warmup", "exact_loss_rule",
           "exact_search_macs", "faiss_sees_a_gpu", "features_per_row", "resolve", "resolve_feature_weighting",
           "resolve_lexical", "resolve_rows", "static_shapes_rule", "training_rows", "warn_long_run",
           "whole_number_values"]
