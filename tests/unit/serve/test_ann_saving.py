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


@pytest.mark.parametrize("backend", ["diskann", "faiss_hnsw", "faiss_ivf"])
def test_an_index_that_does_not_fit_in_the_free_memory_is_refused_in_one_line(tmp_path, monkeypatch, backend):
    """Past the memory free the kernel would kill the build with no word of why (DiskANN over 10^7 rows of 256: 32
    GB on a 24 GiB host): the float32 rows, then the index beside them, are checked first; nothing is left under
    serving/, and with the memory there the same searcher builds and serves."""
    from xc.errors import XCError
    from xc.free_memory import FreeMemory

    shard, layout = _shard()
    ann = AnnConfig(backend=backend)
    rows_bytes = 64 * 8 * 4
    extra = serve_ann.index_build_bytes(backend, 64, 8, ann)
    assert extra >= rows_bytes  # every backend holds at least its own copy of the vectors
    if backend == "diskann":  # the miner's rule for the same graph, less the float32 rows counted apart
        assert extra == serve_ann.graph_build_bytes(64, 8, ann.diskann_graph_degree) - rows_bytes
    # the free memory each check reads, in turn: the rows' check fails; then it passes and the index's fails
    for frees, what in (([rows_bytes - 1], "reading the 64 x 8 rows as float32"),
                        ([rows_bytes, extra - 1], "an index over 64 rows of 8")):
        reads = iter(frees)
        monkeypatch.setattr(serve_ann, "host_memory", lambda: FreeMemory(next(reads), "MemAvailable"))
        store = SavedIndexes(tmp_path, backend, {"checkpoint": "step-1", "global_step": 1})
        with pytest.raises(XCError, match=f"--ann {backend}: {what} needs about .* GiB free \\(MemAvailable\\): "
                                          "serve without --ann"):
            AnnSearcher(shard, layout, range(1), ann, threads=1, store=store, save=True)
        left = list((tmp_path / "serving").rglob("*")) if (tmp_path / "serving").exists() else []
        assert left == []
    monkeypatch.setattr(serve_ann, "host_memory", lambda: FreeMemory(1 << 40, "MemAvailable"))
    searcher = AnnSearcher(shard, layout, range(1), ann, threads=1)
    assert searcher.search(shard.weight[:2].clone(), 3)[1].shape == (2, 3)
