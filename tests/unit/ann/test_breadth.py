"""The search breadth of ANN serving tuned on a probe of the served queries (xc/ann/breadth.py, xc/serve/ann.py):
doubled from the setting until recall@k against exact search reaches `ann.serve_recall`."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from xc.ann.base import AnnParams, recall_at_k
from xc.ann.breadth import BREADTH_STEPS, BreadthTuning, breadth_field, set_breadth, tune_breadth
from xc.ann.centering import build_for_mips
from xc.config import AnnConfig
from xc.errors import ConfigError
from xc.models.classifier import ClassifierShard
from xc.serve import ann as serve_ann
from xc.serve.ann import AnnSearcher, SavedIndexes
from xc.shards import ShardLayout


def _recall_by_breadth(table: dict[int, float], k: int = 10, m: int = 100):
    """A fake index whose recall@k at breadth b is table[b] (rows hit exactly that share of the exact ids)."""
    exact = np.arange(m * k).reshape(m, k)
    calls = []

    def search_ids(breadth: int) -> np.ndarray:
        calls.append(breadth)
        hits = int(round(table[breadth] * k))
        return np.where(np.arange(k) < hits, exact, -1)

    return search_ids, exact, calls


def test_tuning_doubles_until_the_target_and_stops_there():
    search_ids, exact, calls = _recall_by_breadth({8: 0.5, 16: 0.8, 32: 1.0, 64: 1.0})
    tuning = tune_breadth(search_ids, exact, "diskann_search_complexity", 8, target=0.95)
    assert calls == [8, 16, 32] and tuning.chosen == 32 and tuning.reached
    assert tuning.tried == pytest.approx({8: 0.5, 16: 0.8, 32: 1.0})
    assert "diskann_search_complexity=32" in tuning.summary() and "50.0%" in tuning.summary()


def test_tuning_keeps_the_setting_where_it_already_reaches_the_target():
    search_ids, exact, calls = _recall_by_breadth({64: 0.97})
    tuning = tune_breadth(search_ids, exact, "hnsw_ef_search", 64, target=0.95)
    assert calls == [64] and tuning.chosen == 64 and tuning.reached


def test_tuning_stops_at_the_widest_breadth_and_says_the_target_was_not_reached():
    table = {4 << j: 0.1 for j in range(BREADTH_STEPS + 1)}
    search_ids, exact, calls = _recall_by_breadth(table)
    tuning = tune_breadth(search_ids, exact, "ivf_nprobe", 4, target=0.95)
    assert calls == [4 << j for j in range(BREADTH_STEPS + 1)] and tuning.chosen == 4 << BREADTH_STEPS
    assert not tuning.reached and "NOT reached" in tuning.summary()


def test_set_breadth_reaches_the_index_under_its_wrappers():
    index = build_for_mips("faiss_hnsw", AnnParams(backend="faiss_hnsw", num_threads=1), center=True)
    set_breadth(index, "hnsw_ef_search", 999)
    seen = []
    while index is not None:
        seen.append(index.params.hnsw_ef_search)
        index = getattr(index, "inner", None)
    assert len(seen) == 3 and set(seen) == {999}  # exact head, mean-centring, HNSW
    assert breadth_field("exact") is None and breadth_field("diskann") == "diskann_search_complexity"


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "high"])
def test_a_bad_serve_recall_is_refused_naming_the_key(bad):
    with pytest.raises(ConfigError, match="ann.serve_recall"):
        AnnParams(serve_recall=bad).validate()


def _wide_shard(n: int = 6000, dim: int = 256, shards: int = 2):
    """Rows whose directions spread in many dimensions: a graph searched narrowly misses much of the exact top-k."""
    rng = np.random.default_rng(0)
    layout = ShardLayout.build(n, shards, 16)
    shard = ClassifierShard(0, layout.padded_labels, n, dim, 0.0, 0, torch.device("cpu"))
    shard.weight[:n] = torch.from_numpy(rng.standard_normal((n, dim)).astype(np.float32))
    queries = torch.from_numpy(rng.standard_normal((600, dim)).astype(np.float32))
    exact = (queries @ shard.weight[:n].T).topk(10, dim=1).indices.numpy()
    return shard, layout, queries, exact


def _ann(**kw) -> AnnConfig:
    settings = dict(backend="diskann", num_threads=2, exact_head=0, diskann_graph_degree=16,
                    diskann_build_complexity=24, diskann_search_complexity=16)
    return AnnConfig(**{**settings, **kw})


def test_exact_search_is_faster_only_where_it_took_no_longer_a_query():
    tuning = BreadthTuning("diskann_search_complexity", 5, 256, 0.97, tried={64: 0.9, 128: 0.98}, chosen=128,
                           query_seconds={64: 0.001, 128: 0.002})
    assert not tuning.exact_is_faster  # not measured
    tuning.exact_query_seconds = 0.003
    assert not tuning.exact_is_faster and "2.00 ms a query against 3.00 ms for exact search" in tuning.summary()
    tuning.exact_query_seconds = 0.002
    assert tuning.exact_is_faster


def test_serving_widens_a_narrow_search_until_it_finds_what_exact_search_finds(caplog):
    shard, layout, queries, exact = _wide_shard()
    fixed = AnnSearcher(shard, layout, range(2), _ann(serve_recall=0.0), threads=2)
    _, ids_fixed = fixed.search(queries, 10)
    assert fixed.tuning is None and recall_at_k(ids_fixed.numpy(), exact) < 0.8

    with caplog.at_level(logging.INFO, logger=serve_ann.__name__):
        tuned = AnnSearcher(shard, layout, range(2), _ann(serve_recall=0.95), threads=2)
        _, ids = tuned.search(queries, 10)
    # tuned on the first 256 queries; the other 344 are served at the breadth chosen there
    assert tuned.tuning.probe == 256 and tuned.tuning.chosen > 16 and tuned.tuning.reached
    assert recall_at_k(ids.numpy()[256:], exact[256:]) >= 0.93
    assert any("ANN serving searches at diskann_search_complexity=" in r.getMessage() for r in caplog.records)
    _, again = tuned.search(queries[256:], 10)  # tuned once: later calls keep the breadth
    assert torch.equal(again, ids[256:]) and len(tuned.tuning.tried) >= 2


def test_serving_says_where_exact_search_was_no_slower_and_keeps_the_index(caplog, monkeypatch):
    monkeypatch.setattr(BreadthTuning, "exact_is_faster", property(lambda self: True))
    shard, layout, queries, exact = _wide_shard(n=2000, dim=64, shards=2)
    with caplog.at_level(logging.WARNING, logger=serve_ann.__name__):
        searcher = AnnSearcher(shard, layout, range(2), _ann(), threads=2)
        _, ids = searcher.search(queries, 10)
    assert any("exact search (serving without --ann) was no slower" in r.getMessage() for r in caplog.records)
    # the index still serves, at the tuned breadth: no exact search after the probe, the same answer again
    monkeypatch.setattr(serve_ann, "exact_topk", lambda *a, **k: pytest.fail("exact search after the probe"))
    assert torch.equal(searcher.search(queries, 10)[1], ids)


def test_a_saved_index_is_reused_whatever_the_search_breadth(tmp_path):
    shard, layout, queries, _ = _wide_shard(n=800, dim=16, shards=1)
    store = SavedIndexes(tmp_path, "diskann", {"checkpoint": "step-1", "global_step": 1})
    AnnSearcher(shard, layout, range(1), _ann(), threads=1, store=store, save=True)
    again = AnnSearcher(shard, layout, range(1), _ann(serve_recall=0.5, diskann_search_complexity=200), threads=1,
                        store=store)
    assert again.reused
    rebuilt = AnnSearcher(shard, layout, range(1), _ann(diskann_graph_degree=8), threads=1, store=store)
    assert not rebuilt.reused
