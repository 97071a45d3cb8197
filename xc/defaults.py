"""Defaults that adapt to the data: what a config leaves as null is derived, when the data is loaded, by
the documented rules below (README, "Defaults that adapt to the data"), and logged.

* ``train.lr_classifier``: the row optimiser's own rate: 0.1 for row-wise Adagrad (the default), whose
  step does not depend on the scale of the gradient (and so not on L, k_r or the batch size), and 32 for
  plain SGD, which was tuned at 10^4 labels and does not carry over to other L.
* ``train.epochs``: enough passes for about ``TARGET_STEPS`` optimiser steps, at least ``MIN_EPOCHS`` and
  at most ``MAX_EPOCHS``: ceil(TARGET_STEPS / steps per epoch), clipped. Small sets get many short
  epochs, sets of millions of points a few long ones.
* ``train.warmup_steps``: ``WARMUP_SHARE`` of all steps, at most ``MAX_WARMUP`` and at least 1.
* ``model.hidden_dims`` (bag-of-words and dense encoders): one ReLU layer of ``HIDDEN_WIDTH`` when the data
  has fewer than ``FEW_FEATURES`` features, none otherwise. A bag over few features is a low-rank linear
  map that cannot tell many label combinations apart (Delicious: 500 features, 19 labels a point); over
  tens of thousands of sparse features the bag itself is wide enough and a hidden layer only overfits.

A rule reads only the config and the dataset's sizes, so a resumed run derives the same values.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from xc.config import XCConfig

log = logging.getLogger(__name__)

LR_CLASSIFIER = {"rowadagrad": 0.1, "sgd": 32.0}
TARGET_STEPS = 1000
MIN_EPOCHS, MAX_EPOCHS = 3, 30
WARMUP_SHARE, MAX_WARMUP = 0.05, 100
FEW_FEATURES, HIDDEN_WIDTH = 1000, 512


def training_rows(cfg: XCConfig, num_points: int, num_labels: int) -> int:
    """Rows one epoch visits: the training points less the validation split, plus one row per label
    text under label-text augmentation (as `xc.components` builds them)."""
    from xc.data.inputs import validation_split

    kept = len(validation_split(cfg.data, num_points, cfg.seed)[0])
    return kept + (num_labels if cfg.data.label_text_augmentation else 0)


def auto_epochs(steps_per_epoch: int) -> int:
    return int(min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(TARGET_STEPS / max(1, steps_per_epoch)))))


def auto_warmup(total_steps: int) -> int:
    return int(max(1, min(MAX_WARMUP, round(WARMUP_SHARE * total_steps))))


def auto_hidden_dims(encoder: str, num_features: int) -> list[int]:
    if encoder == "transformer":
        return []
    return [HIDDEN_WIDTH] if num_features < FEW_FEATURES else []


def resolve(cfg: XCConfig, num_points: int, num_labels: int, num_features: int = 0) -> XCConfig:
    """`cfg` with every null adaptive key filled in by its rule (each derived value logged once)."""
    train, model, notes = cfg.train, cfg.model, []
    if model.hidden_dims is None:
        model = replace(model, hidden_dims=auto_hidden_dims(model.encoder, num_features))
        notes.append(f"model.hidden_dims={model.hidden_dims} ({num_features} features)")
    if train.lr_classifier is None:
        train = replace(train, lr_classifier=LR_CLASSIFIER[train.optimizer_classifier])
        notes.append(f"train.lr_classifier={train.lr_classifier:g} ({train.optimizer_classifier})")
    steps_per_epoch = max(1, training_rows(cfg, num_points, num_labels) // train.batch_size)
    if train.epochs is None:
        train = replace(train, epochs=auto_epochs(steps_per_epoch))
        notes.append(f"train.epochs={train.epochs} ({steps_per_epoch} steps/epoch, ~{TARGET_STEPS} steps)")
    if train.warmup_steps is None:
        total = steps_per_epoch * train.epochs
        if train.max_steps >= 0:
            total = min(total, train.max_steps)
        train = replace(train, warmup_steps=auto_warmup(total))
        notes.append(f"train.warmup_steps={train.warmup_steps} ({WARMUP_SHARE:.0%} of {total} steps)")
    if notes:
        log.info("defaults derived from the data (%d points, %d labels): %s", num_points, num_labels, ", ".join(notes))
    return replace(cfg, train=train, model=model)
