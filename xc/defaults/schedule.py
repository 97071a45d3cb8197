"""The training schedule's rules (xc/defaults/__init__.py): the row optimiser's rate, the epochs, the batch and
the warm-up.

* ``train.lr_classifier``: the row optimiser's own rate: 0.1 for row-wise Adagrad (the default), whose
  step does not depend on the scale of the gradient (and so not on L, k_r or the batch size), and 32 for
  plain SGD, which was tuned at 10^4 labels and does not carry over to other L.
* ``train.epochs``: enough passes for about ``TARGET_STEPS`` optimiser steps, at least ``MIN_EPOCHS`` and
  at most ``MAX_EPOCHS``: ceil(TARGET_STEPS / steps per epoch), clipped. Small sets get many short
  epochs. Where that gives ``MIN_EPOCHS`` (at batch 256, about 85,000 training rows and more) the steps are not
  what a model lacks but passes over its labels' few points (at 10^6 labels and 0.1 points a label, 10 epochs took
  the 128-wide model from 80.12 to 86.66 P@1): ``train.epochs_by_validation`` (classifier mode, validation rows
  ranked every epoch) makes ``train.epochs`` a cap, ``OPEN_EPOCHS_CAP`` (12), and validation decides where the
  run ends (xc/train/schedule.py: a constant rate while an epoch gains more than its standard error over the best
  epoch before it, then one decaying epoch).
* ``train.batch_size``: ``BATCH_SIZE`` (256), halved while an epoch would have fewer than ``MIN_STEPS_PER_EPOCH``
  (16) steps, down to ``MIN_BATCH`` (16); then rounded up to a multiple of world size x grad_accum. Only sets of
  under 4,096 training points get a smaller batch (every shipped set keeps 256). At batch 256 a set of 300 points
  had one step an epoch, so the 30-epoch cap left it 30 steps where the epoch rule means about 1000; at batch 16 it
  gets 540. On validation (3-model ensembles, 300-900 training points drawn from Bibtex and Delicious) the
  smaller batch gained 0.8 to 2.5 points (docs/accuracy.md, "Small data").
* ``train.warmup_steps``: ``WARMUP_SHARE`` of all steps, at most ``MAX_WARMUP`` and at least 1.
"""

from __future__ import annotations

import logging
import math

from xc.config import XCConfig
from xc.data.inputs import validation_split

log = logging.getLogger("xc.defaults")  # one name for every rule's log line

LR_CLASSIFIER = {"rowadagrad": 0.1, "sgd": 32.0}
TARGET_STEPS = 1000
MIN_EPOCHS, MAX_EPOCHS = 3, 30
OPEN_EPOCHS_CAP = 12  # train.epochs under train.epochs_by_validation's rule
BATCH_SIZE, MIN_BATCH, MIN_STEPS_PER_EPOCH = 256, 16, 16
LONG_RUN_FACTOR = 1000  # a given train.epochs planning more than this many times the rule's steps is warned about
WARMUP_SHARE, MAX_WARMUP = 0.05, 100


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
