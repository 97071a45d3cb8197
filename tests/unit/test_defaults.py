"""The data-derived defaults (xc/defaults.py) give the documented values at a small and a large L."""

from __future__ import annotations

import pytest

from xc.config import build_config
from xc.defaults import auto_bottleneck, auto_epochs, auto_hidden_dims, auto_sparse_features, auto_warmup, resolve


def _cfg(**train):
    return build_config({"train": train} if train else {})


def test_rules_at_small_and_large_sizes():
    # Bibtex-sized: 4,880 points, 10% validation -> 4,392 rows, 17 steps of 256 -> 30 epochs (the cap)
    small = resolve(_cfg(), 4880, 159, 1836)
    assert (small.train.epochs, small.train.warmup_steps) == (30, 26)
    assert small.train.lr_classifier == 0.1 and small.model.hidden_dims == []
    # 10^6 points, 10^7 labels: 5,000 validation points (the cap), 3,886 steps an epoch -> 3 epochs
    large = resolve(_cfg(), 1_000_000, 10_000_000, 500)
    assert (large.train.epochs, large.train.warmup_steps) == (3, 100)
    assert large.model.hidden_dims == [512]  # few features: one hidden layer
    assert large.train.lr_classifier == 0.1  # row-wise Adagrad: the same rate whatever L is
    assert large.model.bottleneck_dim == 64  # 10^7 rows of width 512 would be 20 GB: the floor, 64
    assert small.model.bottleneck_dim is None and not small.model.sparse_features
    # 10^6 labels over 200k features: rows projected to 128, a sparse feature table
    big = resolve(_cfg(), 2_000_000, 1_000_000, 200_000)
    assert big.model.bottleneck_dim == 128 and big.model.sparse_features is True
    assert resolve(_cfg(optimizer_classifier="sgd"), 1000, 10, 5).train.lr_classifier == 32.0


def test_given_values_win_and_resolving_twice_changes_nothing():
    cfg = resolve(_cfg(epochs=2, warmup_steps=7, lr_classifier=0.5), 4880, 159, 1836)
    assert (cfg.train.epochs, cfg.train.warmup_steps, cfg.train.lr_classifier) == (2, 7, 0.5)
    once = resolve(_cfg(), 50_000, 40_000, 41_000)
    assert resolve(once, 50_000, 40_000, 41_000) == once


def test_rule_functions():
    assert [auto_epochs(s) for s in (1, 17, 160, 334, 4000)] == [30, 30, 7, 3, 3]
    assert [auto_warmup(t) for t in (1, 85, 1120, 100_000)] == [1, 4, 56, 100]
    assert auto_hidden_dims("bow", 999) == [512] and auto_hidden_dims("bow", 1000) == []
    assert auto_hidden_dims("transformer", 10) == []


def test_row_width_and_sparse_table_rules():
    # rows fit in 2^27 floats at the encoder's width: no projection (every shipped set, debian-deps: 38k x 1024)
    assert auto_bottleneck("bow", 1024, 37_960) is None and auto_bottleneck("bow", 1024, 131_072) is None
    assert [auto_bottleneck("bow", 1024, L) for L in (200_000, 10**6, 10**7, 10**8)] == [512, 128, 64, 64]
    assert auto_bottleneck("bow", 64, 10**7) is None  # already as narrow as the floor
    assert auto_bottleneck("transformer", 384, 10**7) is None  # a text encoder keeps its width
    assert not auto_sparse_features("bow", 41_375, 1024)  # debian-deps: 42M floats, dense AdamW
    assert auto_sparse_features("bow", 200_000, 1024) and not auto_sparse_features("dense", 200_000, 1024)


def test_start_epoch_rule():
    """An asynchronous miner on classifier rows would mine generation 1 from the untrained rows: tau_s = 2;
    the synchronous miner and label-text (E-hard) mining keep 1; a given value wins."""
    from xc.defaults import auto_start_epoch

    assert [auto_start_epoch(m, "classifier") for m in ("sync", "pool", "ray", "external")] == [1, 2, 2, 2]
    assert auto_start_epoch("pool", "label_text") == 1
    assert auto_start_epoch("pool", "classifier", first_snapshot_at=0.5) == 1  # trained rows, mid-epoch 0
    at_start = build_config({"miner": {"mode": "pool", "first_snapshot_at": 0}})
    assert resolve(at_start, 20_000, 10_000, 20_000).sampler.start_epoch == 2
    assert resolve(build_config({}), 20_000, 10_000, 20_000).sampler.start_epoch == 1  # miner=sync, the default
    given = build_config({"miner": {"mode": "pool"}, "sampler": {"start_epoch": 1}})
    assert resolve(given, 20_000, 10_000, 20_000).sampler.start_epoch == 1


def test_first_snapshot_rule():
    """An asynchronous miner on classifier rows, with re-ranking and start_epoch left to its rule: generation 1
    from the rows half-way into epoch 0 (so hard negatives start at epoch 1, as with sync); 0 otherwise (sync,
    label texts, a given start_epoch, re-ranking turned off); a given value wins."""
    from xc.defaults import FIRST_SNAPSHOT_AT

    def derived(raw):
        cfg = resolve(build_config(raw), 20_000, 10_000, 20_000)
        return cfg.miner.first_snapshot_at, cfg.sampler.start_epoch

    assert derived({"miner": {"mode": "pool"}}) == (FIRST_SNAPSHOT_AT, 1)
    assert derived({"miner": {"mode": "external"}}) == (FIRST_SNAPSHOT_AT, 1)
    assert derived({}) == (0.0, 1)  # miner=sync
    assert derived({"miner": {"mode": "pool"}, "sampler": {"start_epoch": 3}}) == (0.0, 3)
    assert derived({"miner": {"mode": "pool", "rerank_candidates": 0}}) == (0.0, 2)
    assert derived({"miner": {"mode": "pool", "ann": {"backend": "exact"}},
                    "sampler": {"hard_source": "label_text"}}) == (0.0, 1)
    assert derived({"miner": {"mode": "pool", "first_snapshot_at": 0.25}}) == (0.25, 1)


def test_shared_pool_rule():
    """One negative pool per batch from 2^16 labels on, for the samplers that draw one, in the classifier mode;
    per-query draws below (every shipped set) and for the others; a given value wins."""
    from xc.defaults import POOL_MIN_LABELS, POOL_SIZE

    assert resolve(build_config({}), 2_000_000, 1_000_000, 200_000).sampler.shared_pool == POOL_SIZE
    assert resolve(build_config({}), 200_000, POOL_MIN_LABELS, 200_000).sampler.shared_pool == POOL_SIZE
    assert resolve(build_config({}), 20_000, POOL_MIN_LABELS - 1, 20_000).sampler.shared_pool == 0
    for name in ("uniform", "curriculum"):
        named = build_config({"sampler": {"name": name}})
        assert resolve(named, 2_000_000, 10**6, 10**5).sampler.shared_pool == POOL_SIZE
    assert resolve(build_config({"sampler": {"name": "popularity"}}), 2_000_000, 10**6, 10**5).sampler.shared_pool == 0
    given = build_config({"sampler": {"shared_pool": 0}})
    assert resolve(given, 2_000_000, 1_000_000, 200_000).sampler.shared_pool == 0


def test_sync_miner_backend_rule():
    """miner.ann.backend=auto (conf/miner/sync.yaml): exact search up to 2^16 labels, diskann above (whose miner
    tries the query-clustered search first); a named backend is kept; build_index refuses an unresolved auto."""
    from xc.ann import build_index
    from xc.defaults import EXACT_MINER_MAX_LABELS
    from xc.errors import ConfigError

    auto = build_config({"miner": {"mode": "sync", "ann": {"backend": "auto"}}})
    assert resolve(auto, 20_000, 10_000, 20_000).miner.ann.backend == "exact"
    assert resolve(auto, 200_000, EXACT_MINER_MAX_LABELS, 20_000).miner.ann.backend == "exact"
    assert resolve(auto, 2_000_000, EXACT_MINER_MAX_LABELS + 1, 20_000).miner.ann.backend == "diskann"
    named = build_config({"miner": {"mode": "sync", "ann": {"backend": "exact"}}})
    assert resolve(named, 2_000_000, 10**6, 20_000).miner.ann.backend == "exact"
    with pytest.raises(ConfigError, match="resolved by the trainer"):
        build_index("auto", auto.miner.ann)
