"""`--ann --save-index` where the index cannot be saved (a read-only export or run, a full disk, a file size limit):
one warning line, and the ANN index still serves, built in memory (xc/serve/ann.py)."""

from __future__ import annotations

import errno
import logging

import numpy as np
import pytest
import torch

from xc.config import AnnConfig
from xc.models.classifier import ClassifierShard
from xc.serve import ann as serve_ann
from xc.serve.ann import AnnSearcher, SavedIndexes
from xc.shards import ShardLayout


def _shard():
    layout = ShardLayout.build(64, 1, 16)
    shard = ClassifierShard(0, layout.padded_labels, 64, 8, 0.0, 0, torch.device("cpu"))
    shard.weight[:64] = torch.from_numpy(np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32))
    return shard, layout


@pytest.mark.parametrize("where", ["staging", "publish"])
@pytest.mark.parametrize("code", [errno.EROFS, errno.EFBIG])
def test_an_index_that_cannot_be_saved_is_one_warning_and_still_serves(tmp_path, monkeypatch, caplog, where, code):
    shard, layout = _shard()
    store = SavedIndexes(tmp_path, "faiss_hnsw", {"checkpoint": "step-1", "global_step": 1})

    def failing(*a, **k):
        raise OSError(code, "storage failure", str(tmp_path / "serving"))

    monkeypatch.setattr(SavedIndexes, where, failing)
    with caplog.at_level(logging.WARNING, logger=serve_ann.__name__):
        searcher = AnnSearcher(shard, layout, range(1), AnnConfig(backend="faiss_hnsw"), threads=1, store=store, save=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not save the faiss_hnsw index" in warnings[0] and "built in memory" in warnings[0]
    queries = shard.weight[:3].clone()
    scores, ids = searcher.search(queries, 5)
    assert ids.shape == (3, 5) and (ids[:, 0] == (queries @ shard.weight[:64].T).argmax(1)).all()  # the exact top 1
    leftovers = list((tmp_path / "serving").glob(".tmp-*")) if (tmp_path / "serving").exists() else []
    assert leftovers == []
