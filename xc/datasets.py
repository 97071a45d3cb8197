"""The dataset a typed config names, loaded through the convert-once cache (entry points share this)."""

from __future__ import annotations

import logging
import os

import numpy as np

from xc.config import XCConfig, to_dict
from xc.data import load_dataset
from xc.data.records import KINDS as RECORD_KINDS
from xc.data.records import RecordFields
from xc.data.synthetic_lf import ensure_synthetic_lf
from xc.models.text_encoder import default_minilm_path

log = logging.getLogger(__name__)


def load_configured_dataset(cfg: XCConfig):
    """`XCDataset` for `cfg.data` (synthetic data is generated, raw sources converted, on first use)."""
    cache_dir = os.path.join(cfg.data.cache_dir, cfg.data.name)
    if cfg.data.kind == "synthetic_lf":  # LF raw files with a known teacher, generated once
        vocab = os.path.join(cfg.model.path or default_minilm_path(), "vocab.txt")
        raw = ensure_synthetic_lf(to_dict(cfg.data.synthetic_lf), vocab, cache_dir)
        return load_dataset("lf_raw", raw, cache_dir)
    synthetic = to_dict(cfg.data.synthetic) if cfg.data.kind == "synthetic" else None
    fields = RecordFields(**to_dict(cfg.data.records)) if cfg.data.kind in RECORD_KINDS else None
    return load_dataset(cfg.data.kind, cfg.data.path, cache_dir, synthetic, fields)


def unseen_test_labels(dataset) -> tuple[int, float]:
    """``(n, share)``: the labels that hold test positives but no training one (their classifier rows never see a
    positive, so no model ranks them above chance), and their share of the test positives, in percent."""
    seen = np.zeros(dataset.num_labels, dtype=bool)
    seen[np.asarray(dataset.train.labels.indices)] = True
    test = np.bincount(np.asarray(dataset.test.labels.indices), minlength=dataset.num_labels)
    unseen = (test > 0) & ~seen
    return int(unseen.sum()), 100.0 * int(test[unseen].sum()) / max(int(test.sum()), 1)


def log_unseen_test_labels(dataset) -> None:
    """One log line where some test labels never occur in training: the test metrics cannot reach 100 there."""
    n, share = unseen_test_labels(dataset)
    if n:
        log.info("test: %d labels (%.1f%% of test positives) never occur in training; no model can rank them",
                 n, share)
