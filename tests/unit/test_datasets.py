"""What the trainer says about the data it loaded: test labels that never occur in training."""

from __future__ import annotations

import json
import logging

from xc.data import load_dataset
from xc.datasets import log_unseen_test_labels, unseen_test_labels


def _jsonl(path, rows):
    path.write_text("".join(json.dumps({"text": f"item {i}", "labels": r}) + "\n" for i, r in enumerate(rows)),
                    encoding="utf-8")


def test_test_labels_never_seen_in_training_are_counted_and_logged(tmp_path, caplog):
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(src / "train.jsonl", [["a"], ["b"], ["a", "b"]])
    _jsonl(src / "test.jsonl", [["a", "new"], ["newer"], ["new"], ["b"]])  # 5 positives, 3 on unseen labels
    ds = load_dataset("jsonl", str(src), str(tmp_path / "cache"))
    assert unseen_test_labels(ds) == (2, 60.0)
    with caplog.at_level(logging.INFO, logger="xc"):
        log_unseen_test_labels(ds)
    assert "test: 2 labels (60.0% of test positives) never occur in training; no model can rank them" in caplog.text
    _jsonl(src / "test.jsonl", [["a"], ["b"]])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="xc"):
        log_unseen_test_labels(load_dataset("jsonl", str(src), str(tmp_path / "cache")))
    assert "never occur in training" not in caplog.text  # said only where there are some
