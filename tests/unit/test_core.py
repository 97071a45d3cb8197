"""Shard layout, config conversion, exact top-k, sparse-row SGD, schedule, checkpoint validation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from xc.run import checkpoint as ckpt
from xc.ann import exact_topk
from xc.config import build_config
from xc.errors import CheckpointError, ConfigError
from xc.models.classifier import ClassifierShard
from xc.train.optim import SparseRowSGD, lr_factor
from xc.shards import ShardLayout


def test_shard_layout_ranges_and_padding():
    layout = ShardLayout.build(1000, 4, multiple=16)
    assert layout.shard_size == 256 and layout.padded_labels == 1024
    assert [layout.real_count(s) for s in range(4)] == [256, 256, 256, 232]
    assert layout.rank_range(1, 2) == (512, 1024)
    assert list(layout.shards_of_rank(1, 2)) == [2, 3]
    with pytest.raises(ConfigError, match="split evenly over 3 ranks"):
        layout.shards_of_rank(0, 3)
    with pytest.raises(ConfigError, match="without real labels"):
        ShardLayout.build(20, 4, multiple=16)


def test_classifier_init_does_not_depend_on_sharding():
    whole = ClassifierShard(0, 300, 290, 4, 0.1, seed=5, device=torch.device("cpu"))
    part = ClassifierShard(150, 300, 290, 4, 0.1, seed=5, device=torch.device("cpu"))
    assert torch.equal(whole.weight[150:], part.weight)
    assert (whole.weight[290:] == 0).all()  # padding rows stay zero


def test_config_rejects_unknown_keys_and_bad_types():
    with pytest.raises(ConfigError, match=r"train\.epoch: unknown key \(did you mean 'train\.epochs'\?\)"):
        build_config({"train": {"epoch": 3}})
    with pytest.raises(ConfigError, match=r"train\.batch_size: expected an integer"):
        build_config({"train": {"batch_size": "big"}})
    with pytest.raises(ConfigError, match=r"sampler\.name: 'magic' is not one of"):
        build_config({"sampler": {"name": "magic"}})
    with pytest.raises(ConfigError, match=r"train\.prune_when_done: expected true/false, got 'maybe'"):
        build_config({"train": {"prune_when_done": "maybe"}})
    cfg = build_config({"model": {"hidden_dims": [64, 32], "bottleneck_dim": None}, "train": {"lr_encoder": 1}})
    assert cfg.model.hidden_dims == [64, 32] and cfg.train.lr_encoder == 1.0


def test_exact_topk_with_exclusions_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    queries, rows = torch.randn(7, 5, generator=gen), torch.randn(30, 5, generator=gen)
    indptr = np.array([0, 2, 2, 3, 3, 3, 30, 30])
    indices = np.concatenate([[4, 9], [0], np.arange(30) + 0])  # query 5 excludes everything
    indices[3:30] = np.arange(27)
    indptr[6] = 3 + 27
    scores, ids = exact_topk(queries, rows, 4, indptr, indices)
    full = queries @ rows.t()
    for q in range(7):
        banned = set(indices[indptr[q]:indptr[q + 1]].tolist())
        order = [i for i in torch.argsort(full[q], descending=True).tolist() if i not in banned][:4]
        got = [i for i in ids[q].tolist() if i >= 0]
        assert got == order
    assert ids[5].tolist()[-1] == -1 or len(set(range(30)) - set(indices[3:30].tolist())) >= 4


def test_sparse_row_sgd_equals_dense_sgd_and_accumulates():
    shard = ClassifierShard(0, 10, 10, 3, 0.1, seed=0, device=torch.device("cpu"))
    start = shard.weight.clone()
    opt = SparseRowSGD(shard, lr=0.5, weight_decay=0.1)
    g1, g2 = torch.ones(2, 3), torch.full((2, 3), 2.0)
    opt.accumulate(torch.tensor([1, 4]), g1)
    opt.accumulate(torch.tensor([4, 7]), g2)
    opt.step(factor=0.5)
    dense = torch.zeros(10, 3)
    dense[1] += 1
    dense[4] += 1 + 2
    dense[7] += 2
    expected = start.clone()
    touched = [1, 4, 7]
    expected[touched] = start[touched] - 0.25 * (dense[touched] + 0.1 * start[touched])
    assert torch.allclose(shard.weight, expected)
    untouched = [i for i in range(10) if i not in touched]
    assert torch.equal(shard.weight[untouched], start[untouched])  # no O(L) decay


def test_lr_schedule_warmup_then_cosine():
    assert lr_factor(0, 10, 110, 0.0) == pytest.approx(0.1)
    assert lr_factor(9, 10, 110, 0.0) == pytest.approx(1.0)
    assert lr_factor(60, 10, 110, 0.0) == pytest.approx(0.5)
    assert lr_factor(110, 10, 110, 0.1) == pytest.approx(0.1)


def test_checkpoint_publish_validate_and_fallback(tmp_path):
    for step in (5, 10):
        ckpt.write_rank_files(tmp_path, step, 0, {"x": torch.arange(step)}, {0: np.zeros((3, 2), np.int32)})
        ckpt.publish(tmp_path, step, 1, {"epoch": 0}, keep=5)
    # a half-written checkpoint (no rename) is invisible
    ckpt.write_rank_files(tmp_path, 15, 0, {"x": torch.arange(3)}, None)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000005", "step-00000010"]
    path, meta = ckpt.latest_valid(tmp_path)
    assert path.name == "step-00000010" and meta["global_step"] == 10
    state, tables = ckpt.load_rank(path, 0)
    assert torch.equal(state["x"], torch.arange(10)) and tables[0].shape == (3, 2)
    # truncate the newest: validation rejects it and the previous one is used
    victim = path / "rank0.pt"
    victim.write_bytes(victim.read_bytes()[:20])
    with pytest.raises(CheckpointError, match="truncated"):
        ckpt.validate(path)
    assert ckpt.latest_valid(tmp_path)[0].name == "step-00000005"
    assert json.loads((path / "meta.json").read_text())["files"]["rank0.pt"] > 20


def test_checkpoint_keeps_last_k(tmp_path):
    for step in range(1, 6):
        ckpt.write_rank_files(tmp_path, step, 0, {"s": step}, None)
        ckpt.publish(tmp_path, step, 1, {}, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]


def test_encoder_learning_rate_defaults_to_the_models_own_unless_train_sets_one():
    """MiniLM at the bag-of-words rate (1e-3) diverges: the model group carries its own default."""
    from hydra import compose, initialize_config_dir

    from xc.cli.train import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for overrides, expected in ((["model=minilm"], 2e-5), (["model=bow"], 1e-3),
                                    (["model=minilm", "train.lr_encoder=1e-4"], 1e-4),
                                    (["experiment=debian_deps_lf"], 2e-2)):
            raw = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
            assert build_config(raw).train.lr_encoder == pytest.approx(expected), overrides


def test_xc_threads_unset_empty_valid_and_bad(monkeypatch):
    import os
    from dataclasses import replace

    from xc.config import XCConfig
    from xc.distributed.host_threads import host_threads
    from xc.cli.train import _threads

    cfg = XCConfig()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("XC_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _threads(cfg, "cpu")[0] == 16  # one rank, miner in-process: every core
    monkeypatch.setenv("XC_THREADS", " ")  # `XC_THREADS= xc-train` means unset, not a crash
    assert _threads(cfg, "cpu")[0] == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun --nproc-per-node 4: the cores are shared
    assert _threads(cfg, "cpu")[0] == 4
    pool = replace(cfg, miner=replace(cfg.miner, mode="pool", workers=4, threads_per_worker=1))
    assert host_threads(pool, mining=True)[0] == 3  # (16 - 4 miner cores) / 4 ranks while the pool mines
    assert host_threads(pool, mining=False)[0] == _threads(pool, "cpu")[0] == 4  # all 16 while it is idle (the start)
    # a GPU rank launches kernels: a few threads, whatever its share of the cores
    assert host_threads(pool, mining=False, device_type="cuda") == (2, host_threads(pool, mining=False)[1]
                                                                    + ", at most 2 for a GPU rank")
    assert _threads(cfg, "cuda")[0] == 2
    remote = replace(pool, miner=replace(pool.miner, mode="ray", ray_address="auto"))
    assert host_threads(remote, mining=True)[0] == 4  # a ray cluster's workers are not this host's
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert host_threads(pool, mining=True)[0] == 1  # never below one
    monkeypatch.setenv("XC_THREADS", "3")
    assert host_threads(pool, mining=True)[0] == host_threads(pool, mining=False)[0] == 3  # fixed for the run
    for bad in ("abc", "0", "-2"):
        monkeypatch.setenv("XC_THREADS", bad)
        with pytest.raises(ConfigError, match="XC_THREADS"):
            _threads(cfg, "cpu")


def test_a_gpu_rank_takes_its_share_of_the_cores_for_the_final_evaluation(monkeypatch):
    """After the last step a GPU rank's work is the host's (label prior, lexical ranker, kNN fusion): its share of
    every core, not the 2 threads it launched kernels with; a CPU rank keeps what it has; XC_THREADS still rules."""
    import os
    from dataclasses import replace

    from xc.config import XCConfig
    from xc.distributed.host_threads import final_phase_threads

    cfg = XCConfig()
    pool = replace(cfg, miner=replace(cfg.miner, mode="pool", workers=14, threads_per_worker=1))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("XC_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert final_phase_threads(pool, "cpu") is None
    threads, why = final_phase_threads(pool, "cuda")
    assert threads == 16 and why.endswith("the final evaluation on the host")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 8 GPU ranks on the host share its cores
    assert final_phase_threads(pool, "cuda")[0] == 2
    monkeypatch.setenv("XC_THREADS", "3")
    assert final_phase_threads(pool, "cuda") == (3, "XC_THREADS")
