"""Host memory of the build: what is O(L) besides the classifier rows, and when it exists.

The label counts and inverse propensities are O(L) float64 work (about 50 B per label of temporaries).
Made after the rows, that transient stacks on top of them (measured: 305 B per label of peak RSS at
d = 64 against the rows' 256, tools/bench/bench_memory.py); made before, it does not. Inverse propensities are
for the metrics, which only rank 0 computes: a rank r > 0 that kept them would hold 8 B x L, which
does not shrink with the world size.
"""

from __future__ import annotations

import numpy as np

import xc.train.components as components
from xc.config import build_config, to_dict
from xc.distributed import DistContext


def _build(tmp_path, ctx, monkeypatch):
    from xc.data import load_dataset

    calls = []
    real_props, real_shard = components.inverse_propensities, components.ClassifierShard
    monkeypatch.setattr(components, "inverse_propensities", lambda *a, **k: calls.append("propensities") or real_props(*a, **k))
    monkeypatch.setattr(components, "ClassifierShard", lambda *a, **k: calls.append("rows") or real_shard(*a, **k))
    monkeypatch.setattr(components, "wrap_data_parallel", lambda module, ctx: module)  # no process group here
    cfg = build_config({
        "run_dir": str(tmp_path / "run"), "seed": 0,
        "data": {"cache_dir": str(tmp_path / "cache"), "synthetic": {
            "num_train": 200, "num_test": 20, "num_labels": 1000, "num_features": 100}},
        # rows started at random: the centroid start gathers embeddings over a process group this test has not
        "model": {"embed_dim": 8, "classifier_init": "random"}, "train": {"batch_size": 32, "device": "cpu"},
        "logger": {"wandb": "disabled", "progress": False, "jsonl": False},
    })
    dataset = load_dataset("synthetic", None, str(tmp_path / "cache" / "synthetic"), to_dict(cfg.data.synthetic))
    return components.build_components(cfg, ctx, dataset), calls


def test_label_statistics_are_made_before_the_rows(tmp_path, monkeypatch):
    c, calls = _build(tmp_path, DistContext(rank=0, world_size=1), monkeypatch)
    assert calls == ["propensities", "rows"]
    assert c.inv_propensity.shape == (1000,) and np.all(c.inv_propensity >= 1.0)


def test_only_the_main_rank_keeps_inverse_propensities(tmp_path, monkeypatch):
    c, calls = _build(tmp_path, DistContext(rank=1, world_size=2), monkeypatch)
    assert c.inv_propensity is None and calls == ["rows"]
    assert c.shard.num_rows == 512  # this rank's half of the 1000 labels, padded to a multiple of 16
