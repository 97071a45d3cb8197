"""The data-derived defaults (xc/defaults/) give the documented values at a small and a large L."""

from __future__ import annotations

import pytest

from xc.config import build_config
from xc.defaults import auto_epochs, auto_hidden_dims, auto_sparse_features, auto_warmup, resolve


def _cfg(**train):
    return build_config({"train": train} if train else {})


def test_rules_at_small_and_large_sizes():
    # Bibtex-sized: 4,880 points, 10% validation -> 4,392 rows, 17 steps of 256 -> 30 epochs (the cap)
    small = resolve(_cfg(), 4880, 159, 1836)
    assert (small.train.epochs, small.train.warmup_steps) == (30, 26)
    assert small.train.lr_classifier == 0.1 and small.model.hidden_dims == []
    # 10^6 points, 10^7 labels: 5,000 validation points (the cap), 3,886 steps an epoch: the step rule's fewest
    # epochs (3), so validation decides them, within a cap of 12
    large = resolve(_cfg(), 1_000_000, 10_000_000, 500)
    assert (large.train.epochs, large.train.epochs_by_validation, large.train.warmup_steps) == (12, True, 100)
    assert small.train.epochs_by_validation is False
    assert large.model.hidden_dims == [512]  # few features: one hidden layer
    assert large.train.lr_classifier == 0.1  # row-wise Adagrad: the same rate whatever L is
    # the rows' width is chosen before, from the free memory (xc.defaults.resolve_rows): resolve never projects
    assert large.model.bottleneck_dim is None and small.model.bottleneck_dim is None
    assert not small.model.sparse_features
    # 10^6 labels over 200k features: a sparse feature table
    big = resolve(_cfg(), 2_000_000, 1_000_000, 200_000)
    assert big.model.sparse_features is True
    # debian-deps-sized: 256 x 10 non-zeros per batch of 41k feature rows -> gathered; Bibtex's 68 -> the dense table
    assert resolve(_cfg(), 45_644, 37_960, 41_375, features_per_row=10.2).model.sparse_features is True
    assert resolve(_cfg(), 4880, 159, 1836, features_per_row=68.7).model.sparse_features is False
    assert resolve(_cfg(optimizer_classifier="sgd"), 1000, 10, 5).train.lr_classifier == 32.0


def test_validation_decides_the_epochs_where_the_step_rule_gives_the_fewest():
    from xc.defaults import auto_epochs_by_validation

    # the fewest epochs (3) in the classifier mode with validation rows: on; anything else: off
    assert auto_epochs_by_validation(3, "classifier", True, 5000)
    assert not auto_epochs_by_validation(4, "classifier", True, 5000)  # a set of under ~85k rows: the step rule
    assert not auto_epochs_by_validation(3, "dual", True, 5000)
    assert not auto_epochs_by_validation(3, "classifier", False, 5000)  # eval.select_epoch off: no validation
    assert not auto_epochs_by_validation(3, "classifier", True, 0)  # data.valid_fraction=0
    # 100k points: 95,000 rows, 371 steps of 256 -> on; a given train.epochs stands and turns it off
    assert resolve(_cfg(), 100_000, 10**6, 200_000).train.epochs == 12
    given = resolve(_cfg(epochs=3), 100_000, 10**6, 200_000).train
    assert (given.epochs, given.epochs_by_validation) == (3, False)
    # given explicitly with no epochs: the cap; on a small set too
    assert resolve(_cfg(epochs_by_validation=True), 4880, 159, 1836).train.epochs == 12
    assert resolve(_cfg(epochs_by_validation=False), 100_000, 10**6, 200_000).train.epochs == 3


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


def test_sparse_table_rule():  # the rows' width and precision: tests/unit/defaults/test_row_precision.py
    # a batch touching at most a quarter of the table's rows trains them gathered: debian-deps, 256 x 10.2 of 41,375
    assert auto_sparse_features("bow", 41_375, 1024, 256, 10.2)
    assert not auto_sparse_features("bow", 1_836, 1024, 256, 68.7)  # Bibtex: a batch touches most of the table
    assert not auto_sparse_features("bow", 20_000, 1024, 256, 48.6)  # the main job's synthetic data
    assert auto_sparse_features("bow", 1_000, 1024, 1, 250.0)  # the bound: exactly a quarter
    assert not auto_sparse_features("bow", 1_000, 1024, 1, 251.0)
    assert not auto_sparse_features("bow", 41_375, 1024)  # no statistics: the table's size alone (42M floats)
    assert auto_sparse_features("bow", 200_000, 1024, 256, 900.0)  # 2·10^8 floats: always, whatever a batch touches
    assert not auto_sparse_features("dense", 200_000, 1024, 256, 10.0)


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


def test_random_proposal_rule():
    """ASTRA's random part by popularity where a query's k_hard + k_random draws would be under 1% of the labels, for
    astra and curriculum in the classifier mode; uniform (eq. 2) below, for the other samplers, and where given."""
    assert resolve(build_config({}), 2_000_000, 1_000_000, 200_000).sampler.random_proposal == "popularity"
    assert resolve(build_config({}), 45_644, 37_960, 41_375).sampler.random_proposal == "popularity"  # debian-deps
    assert resolve(build_config({}), 200_000, 8_001, 200_000).sampler.random_proposal == "popularity"
    assert resolve(build_config({}), 200_000, 8_000, 200_000).sampler.random_proposal == "uniform"
    assert resolve(build_config({}), 20_000, 983, 500).sampler.random_proposal == "uniform"  # Delicious
    curriculum = build_config({"sampler": {"name": "curriculum"}})
    assert resolve(curriculum, 2_000_000, 10**6, 10**5).sampler.random_proposal == "popularity"
    for name in ("uniform", "popularity", "hard"):
        named = build_config({"sampler": {"name": name}})
        assert resolve(named, 2_000_000, 10**6, 10**5).sampler.random_proposal == "uniform"
    given = build_config({"sampler": {"random_proposal": "uniform"}})
    assert resolve(given, 2_000_000, 10**6, 10**5).sampler.random_proposal == "uniform"


def test_shared_pool_rule():
    """One negative pool per batch where a query's own k_hard + k_random draws would be under 1% of the labels
    (8,000 labels with the default 80), for the samplers that draw one, in the classifier mode; per-query draws
    below (Bibtex, Delicious) and for the others; the share follows the draws; a given value wins."""
    from xc.defaults import POOL_SIZE

    assert resolve(build_config({}), 2_000_000, 1_000_000, 200_000).sampler.shared_pool == POOL_SIZE
    assert resolve(build_config({}), 45_644, 37_960, 41_375).sampler.shared_pool == POOL_SIZE  # debian-deps
    assert resolve(build_config({}), 200_000, 8_001, 200_000).sampler.shared_pool == POOL_SIZE
    assert resolve(build_config({}), 200_000, 8_000, 200_000).sampler.shared_pool == 0
    assert resolve(build_config({}), 20_000, 983, 500).sampler.shared_pool == 0  # Delicious
    wide = build_config({"sampler": {"k_random": 184}})  # 200 draws: the pool from 20,000 labels on
    assert resolve(wide, 200_000, 19_999, 200_000).sampler.shared_pool == 0
    assert resolve(wide, 200_000, 20_001, 200_000).sampler.shared_pool == POOL_SIZE
    for name in ("uniform", "curriculum"):
        named = build_config({"sampler": {"name": name}})
        assert resolve(named, 2_000_000, 10**6, 10**5).sampler.shared_pool == POOL_SIZE
    assert resolve(build_config({"sampler": {"name": "popularity"}}), 2_000_000, 10**6, 10**5).sampler.shared_pool == 0
    given = build_config({"sampler": {"shared_pool": 0}})
    assert resolve(given, 2_000_000, 1_000_000, 200_000).sampler.shared_pool == 0


def test_sync_miner_backend_rule():
    """miner.ann.backend=auto (conf/miner/sync.yaml): exact search up to 4 x miner.ann.cluster_candidates labels
    (32,768 by default), diskann above (whose miner tries the query-clustered search first); the bound follows
    the candidates; a named backend is kept; build_index refuses an unresolved auto."""
    from xc.ann import build_index
    from xc.errors import ConfigError

    auto = build_config({"miner": {"mode": "sync", "ann": {"backend": "auto"}}})
    assert auto.miner.ann.cluster_candidates == 8192
    assert resolve(auto, 20_000, 10_000, 20_000).miner.ann.backend == "exact"
    assert resolve(auto, 200_000, 32_768, 20_000).miner.ann.backend == "exact"
    assert resolve(auto, 200_000, 32_769, 20_000).miner.ann.backend == "diskann"
    assert resolve(auto, 45_644, 37_960, 41_375).miner.ann.backend == "diskann"  # debian-deps
    wide = build_config({"miner": {"mode": "sync", "ann": {"backend": "auto", "cluster_candidates": 16_384}}})
    assert resolve(wide, 200_000, 60_000, 20_000).miner.ann.backend == "exact"
    assert resolve(wide, 200_000, 70_000, 20_000).miner.ann.backend == "diskann"
    named = build_config({"miner": {"mode": "sync", "ann": {"backend": "exact"}}})
    assert resolve(named, 2_000_000, 10**6, 20_000).miner.ann.backend == "exact"
    with pytest.raises(ConfigError, match="resolved by the trainer"):
        build_index("auto", auto.miner.ann)


def test_exact_loss_rule_where_the_negatives_cover_the_labels():
    """The exact loss over all labels where a query's k_hard + k_random negatives (80 by default) reach the number
    of labels; sampling above it (Bibtex's 159 labels sample as before); the loss and a dual model are kept."""
    for num_labels in (2, 45, 80):
        given = build_config({"sampler": {"loss": "softmax"}})
        cfg = resolve(given, 400, num_labels, 300)
        assert (cfg.sampler.name, cfg.sampler.shared_pool, cfg.sampler.loss) == ("full", 0, "softmax")
    assert resolve(build_config({}), 400, 81, 300).sampler.name == "astra"
    assert resolve(build_config({}), 4880, 159, 1836).sampler.name == "astra"
    few = build_config({"sampler": {"k_hard": 4, "k_random": 8}})
    assert resolve(few, 400, 45, 300).sampler.name == "astra"  # smaller draws still sample 45 labels
    once = resolve(build_config({}), 400, 10, 300)
    assert resolve(once, 400, 10, 300) == once


def test_auto_miner_is_the_pool_on_a_gpu_host_with_spare_cores_and_sync_elsewhere(monkeypatch, caplog):
    """`miner.mode: auto` (xc-train's default): sync on every CPU host (this one included), the pool with one worker
    per spare core where the ranks train on GPUs (a faked CUDA host of 16 cores), sync where too few are spare."""
    import logging

    import xc.distributed.host_threads as host_threads
    from xc.defaults import auto_miner

    assert auto_miner("cpu", 64, 1)[:2] == ("sync", 0)
    assert auto_miner("cuda", 16, 1)[:2] == ("pool", 14)
    assert auto_miner("cuda", 16, 8)[:2] == ("sync", 0)  # 8 GPU ranks take every core
    assert auto_miner("cuda", 5, 1)[:2] == ("sync", 0)  # 3 spare: under 4
    assert auto_miner("cuda", 16, 1, exact_macs=1e13)[:2] == ("sync", 0)  # exact on the GPU: seconds
    assert auto_miner("cuda", 16, 1, exact_macs=1.1e13)[:2] == ("pool", 14)
    auto = build_config({"miner": {"mode": "auto", "ann": {"backend": "auto"}}})
    big = (2_000_000, 1_000_000, 200_000)  # points, labels, features: 1.8M x 10^6 x 128 = 2.3e14 multiply-adds
    assert resolve(auto, *big).miner.mode == "sync"  # device_type defaults to the CPU
    monkeypatch.setattr(host_threads, "host_cores", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        gpu = resolve(auto, *big, device_type="cuda")
    assert (gpu.miner.mode, gpu.miner.workers, gpu.miner.threads_per_worker) == ("pool", 12, 1)
    assert "miner.mode=pool, miner.workers=12" in caplog.text
    # the pool's own rules follow from the resolved mode: a named backend, the half-epoch snapshot, re-ranking
    assert gpu.miner.ann.backend == "diskann" and gpu.miner.first_snapshot_at == 0.5
    assert gpu.miner.rerank_candidates == 8 * gpu.sampler.k_hard
    assert resolve(auto, *big, device_type="cpu").miner.mode == "sync"
    assert resolve(gpu, *big, device_type="cuda") == gpu
    # debian-deps' size (45.6k points, 38k labels, width 1024: 1.6e12): the GPU rank mines exactly, itself
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        small = resolve(auto, 45_644, 37_960, 41_000, device_type="cuda")
    assert (small.miner.mode, small.miner.ann.backend) == ("sync", "torch")
    assert small.miner.first_snapshot_at == 0 and small.miner.rerank_candidates == small.sampler.k_hard
    assert "miner.ann.backend=torch (exact on the rank's GPU" in caplog.text
    assert resolve(auto, 45_644, 37_960, 41_000, device_type="cpu").miner.ann.backend == "diskann"
    # the cost is a rank's share of the rows: 8 ranks take 10^5 labels x 200k points (2e13) under the bound
    mid = (200_000, 100_000, 200_000)
    assert resolve(auto, *mid, device_type="cuda").miner.mode == "pool"
    assert resolve(auto, *mid, device_type="cuda", world_size=8).miner.ann.backend == "torch"


def test_auto_backend_is_faiss_ivf_on_the_gpu_past_the_exact_bound_where_faiss_sees_one(monkeypatch, caplog):
    import logging

    import xc.ann.faiss_backend as faiss_backend

    auto = build_config({"miner": {"mode": "auto", "ann": {"backend": "auto"}}})
    big = (2_000_000, 1_000_000, 200_000)
    monkeypatch.setattr(faiss_backend, "gpu_status", lambda: (1, ""))
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        gpu = resolve(auto, *big, device_type="cuda")
    assert (gpu.miner.ann.backend, gpu.miner.ann.gpu_index) == ("faiss_gpu", "ivf")
    assert "miner.ann.backend=faiss_gpu, miner.ann.gpu_index=ivf" in caplog.text
    assert resolve(auto, *big, device_type="cpu").miner.ann.backend == "diskann"  # a CPU host: the graph
    assert resolve(auto, 45_644, 37_960, 41_000, device_type="cuda").miner.ann.backend == "torch"  # exact fits
    monkeypatch.setattr(faiss_backend, "gpu_status", lambda: (0, "faiss-cpu"))
    assert resolve(auto, *big, device_type="cuda").miner.ann.backend == "diskann"  # no faiss-gpu installed


def test_xc_train_defaults_to_the_auto_miner(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from xc.cli.entry import CONF_DIR, register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        raw = OmegaConf.to_container(compose("config", overrides=[]), resolve=True)
    cfg = build_config(raw)
    assert cfg.miner.mode == "auto" and cfg.miner.ann.backend == "auto"
    assert resolve(cfg, 20_000, 10_000, 20_000).miner.mode == "sync"


def test_a_run_of_a_billion_epochs_is_warned_about(caplog):
    """train.epochs=1e9 was accepted as 7e9 steps in silence; an ordinary long run (300 epochs) is not warned about."""
    import logging

    from xc.defaults import warn_long_run

    with caplog.at_level(logging.WARNING, logger="xc.defaults"):
        assert not warn_long_run(300, 38, -1)
        assert not caplog.records
        resolve(_cfg(epochs=10**9), 1000, 50, 500)
    (record,) = [r for r in caplog.records if "plans" in r.getMessage()]
    assert "train.epochs=1000000000 plans" in record.getMessage() and "optimizer steps" in record.getMessage()


def test_batch_size_rule_gives_small_data_steps_and_splits_over_the_ranks():
    """A few hundred points used to get one step an epoch at batch 256 (30 steps in all under the epoch cap)."""
    from xc.defaults import auto_batch_size

    assert [auto_batch_size(n) for n in (100, 300, 450, 900, 2000, 4095, 4096, 10**6)] == [16, 16, 16, 32, 64, 128,
                                                                                           256, 256]
    assert auto_batch_size(300, multiple=3) == 18 and auto_batch_size(10**6, multiple=6) == 258
    small = resolve(_cfg(), 333, 45, 1449)  # a MULAN-sized set: 300 training rows after the validation carve-out
    assert small.train.batch_size == 16 and small.train.epochs == 30  # 18 steps an epoch: 540 steps, not 30
    assert resolve(_cfg(), 4880, 159, 1836).train.batch_size == 256  # Bibtex and every larger set: as before
    assert resolve(_cfg(), 333, 45, 1449, world_size=3).train.batch_size % 3 == 0
    assert resolve(_cfg(batch_size=64), 333, 45, 1449).train.batch_size == 64  # a given value wins
