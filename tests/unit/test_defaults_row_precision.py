"""`model.classifier_dtype: auto` (xc/defaults.py): float32 rows while they fit in half the free memory, bfloat16
with stochastic rounding beyond; `miner.async_snapshot: null`: a background copy of the rows only where it fits
beside them; the byte figures both read (xc/models/row_memory.py), checked by hand."""

from __future__ import annotations

import logging

import pytest

from xc import defaults
from xc.config import build_config
from xc.errors import ConfigError
from xc.models import row_memory
from xc.models.row_memory import classifier_bytes, training_bytes
from xc.train.plan import _checkpoint_row_precision

GIB = 1 << 30


def _free(monkeypatch, free: int) -> list[str]:
    seen = []
    monkeypatch.setattr(row_memory, "available_memory",
                        lambda device: seen.append(device) or row_memory.FreeMemory(free, "MemAvailable"))
    return seen


def test_bytes_per_component_by_hand():
    # 10^8 rows of 64: float32 25.6 GB; bf16 12.8 GB (+ 25.6 GB of masters); 0.4 GB of accumulators; the miner's
    # float32 snapshot 25.6 GB whatever the rows' precision
    fp32 = classifier_bytes(10**8, 64, "float32")
    assert fp32 == {"rows": 25_600_000_000, "masters": 0, "row_sq": 400_000_000, "snapshot": 25_600_000_000,
                    "checkpoint": 26_000_000_000}
    master = classifier_bytes(10**8, 64, "bfloat16+master")
    assert (master["rows"], master["masters"], master["checkpoint"]) == (12_800_000_000, 25_600_000_000, 38_800_000_000)
    sr = classifier_bytes(10**8, 64, "bfloat16+SR", rowadagrad=False)
    assert (sr["rows"], sr["masters"], sr["row_sq"], sr["checkpoint"]) == (12_800_000_000, 0, 0, 12_800_000_000)
    assert training_bytes(10**8, 64, "float32", True, snapshot_here=True) == 51_600_000_000
    assert training_bytes(10**8, 64, "float32", True, snapshot_here=False) == 26_000_000_000


def test_the_rule_is_half_the_free_memory():
    assert row_memory.auto_classifier_dtype(12 * GIB, 24 * GIB) == "float32"
    assert row_memory.auto_classifier_dtype(12 * GIB + 1, 24 * GIB) == "bfloat16"
    assert row_memory.auto_rounding("bfloat16", False) == "stochastic"
    assert row_memory.auto_rounding("bfloat16", True) == row_memory.auto_rounding("float32", False) == "nearest"


def test_10_8_labels_on_a_24_gib_host_get_bfloat16_with_stochastic_rounding(monkeypatch, caplog):
    # 10^8 labels: rows projected to 64 (the floor of the bottleneck rule); float32 rows + accumulators + snapshot
    # = 10^8 x (256 + 4 + 256) B = 51.6 GB = 48.06 GiB, over half of 24 GiB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    seen = _free(monkeypatch, 24 * GIB)
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        cfg = defaults.resolve(build_config({}), 1_000_000, 100_000_000, 500)
    assert seen == ["cpu"] and cfg.model.bottleneck_dim == 64
    assert (cfg.model.classifier_dtype, cfg.model.classifier_master_fp32, cfg.model.classifier_rounding) == (
        "bfloat16", False, "stochastic")
    assert ("classifier rows: bfloat16 + stochastic rounding (float32 would need 48.1 GiB of the 24 GiB available "
            "on the host (MemAvailable); the rule allows 50%); bfloat16 needs 24.2 GiB") in caplog.text  # 10^8 x (128 + 4 + 128) B
    assert defaults.resolve(cfg, 1_000_000, 100_000_000, 500) == cfg  # a fixed point: no second probe
    assert seen == ["cpu"]


@pytest.mark.parametrize("labels, features, points", [(159, 1836, 4880), (983, 500, 12920), (37_960, 41_000, 41_000),
                                                       (10_000, 20_000, 20_000)],
                         ids=["bibtex", "delicious", "debian-deps", "main-job"])
def test_every_shipped_set_keeps_float32(monkeypatch, labels, features, points):
    # debian-deps, the largest: 37,960 rows of 1024 -> 37,960 x (4096 + 4 + 4096) B = 0.31 GB, far under half of 2 GiB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    _free(monkeypatch, 2 * GIB)
    cfg = defaults.resolve(build_config({}), points, labels, features)
    assert (cfg.model.classifier_dtype, cfg.model.classifier_rounding) == ("float32", "nearest")


def test_gpu_ranks_count_their_own_rows_and_no_snapshot(monkeypatch):
    # 8 GPU ranks, 10^8 labels: 1.25·10^7 rows a GPU x (256 + 4) B = 3.25 GB = 3.03 GiB; the snapshot is on the host
    seen = _free(monkeypatch, 8 * GIB)
    on_8 = defaults.resolve(build_config({}), 1_000_000, 100_000_000, 500, device_type="cuda", world_size=8)
    assert seen == ["cuda"] and on_8.model.classifier_dtype == "float32"
    _free(monkeypatch, 6 * GIB)
    assert defaults.resolve(build_config({}), 1_000_000, 100_000_000, 500, device_type="cuda",
                            world_size=8).model.classifier_dtype == "bfloat16"


def test_cpu_ranks_on_one_host_share_its_memory(monkeypatch):
    # 2 ranks on a host: 2 x 5·10^5 rows of 1024 x (4096 + 4 + 4096) B = 8.2 GB = 7.6 GiB in all, over half of 12 GiB
    _free(monkeypatch, 12 * GIB)
    cfg = build_config({"model": {"bottleneck_dim": 1024}})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert defaults.resolve(cfg, 50_000, 1_000_000, 50_000, world_size=2).model.classifier_dtype == "float32"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert defaults.resolve(cfg, 50_000, 1_000_000, 50_000, world_size=2).model.classifier_dtype == "bfloat16"


def test_an_explicit_dtype_stands_and_measures_nothing(monkeypatch):
    monkeypatch.setattr(row_memory, "available_memory", lambda device: pytest.fail("probed an explicit dtype"))
    fp32 = defaults.resolve(build_config({"model": {"classifier_dtype": "float32"}}), 1_000_000, 100_000_000, 500)
    assert (fp32.model.classifier_dtype, fp32.model.classifier_rounding) == ("float32", "nearest")
    master = defaults.resolve(build_config({"model": {"classifier_dtype": "bfloat16"}}), 4880, 159, 1836)
    assert (master.model.classifier_master_fp32, master.model.classifier_rounding) == (True, "nearest")
    nearest = build_config({"model": {"classifier_dtype": "bfloat16", "classifier_master_fp32": False,
                                      "classifier_rounding": "nearest"}})
    assert defaults.resolve(nearest, 4880, 159, 1836).model.classifier_rounding == "nearest"


def _host_free(monkeypatch, free: int) -> list[int]:
    seen = []
    monkeypatch.setattr(row_memory, "host_memory", lambda: seen.append(free) or row_memory.FreeMemory(free, "MemAvailable"))
    return seen


def test_the_snapshot_writer_copies_the_rows_only_where_the_copy_fits(monkeypatch, caplog):
    # 10^8 labels in bfloat16 on a 24 GiB host: rows + accumulators + the writer's copy = 10^8 x (128 + 4 + 128) B
    # = 24.2 GiB, over half of 24 GiB: the trainer writes the snapshot from the rows and waits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    _free(monkeypatch, 24 * GIB)
    _host_free(monkeypatch, 24 * GIB)
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        pool = defaults.resolve(build_config({"miner": {"mode": "pool"}}), 1_000_000, 100_000_000, 500)
    assert pool.model.classifier_dtype == "bfloat16" and pool.miner.async_snapshot is False
    assert ("miner.async_snapshot=false (bfloat16+SR rows with a copy for the background writer need 24.2 GiB of the "
            "24 GiB available on the host (MemAvailable); the rule allows 50%)") in caplog.text
    # 10^7 labels (float32, 4.8 GiB with the copy) keep the background writer, and say nothing of it
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        small = defaults.resolve(build_config({"miner": {"mode": "pool"}}), 1_000_000, 10_000_000, 500)
    assert small.model.classifier_dtype == "float32" and small.miner.async_snapshot is True
    assert "miner.async_snapshot" not in caplog.text


def test_gpu_ranks_count_only_the_host_copy_and_a_given_setting_stands(monkeypatch):
    # 8 GPU ranks of 1.25·10^7 float32 rows of 64 (3.2 GB each, on the GPUs); the host holds 8 copies = 25.6 GB
    _free(monkeypatch, 8 * GIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    _host_free(monkeypatch, 64 * GIB)
    on_8 = defaults.resolve(build_config({}), 1_000_000, 100_000_000, 500, device_type="cuda", world_size=8)
    assert on_8.model.classifier_dtype == "float32" and on_8.miner.async_snapshot is True  # 23.8 GiB <= 32
    _host_free(monkeypatch, 40 * GIB)
    assert defaults.resolve(build_config({}), 1_000_000, 100_000_000, 500, device_type="cuda",
                            world_size=8).miner.async_snapshot is False  # 23.8 GiB > 20
    seen = _host_free(monkeypatch, 1 * GIB)
    given = defaults.resolve(build_config({"miner": {"async_snapshot": True}}), 1_000_000, 100_000_000, 500)
    assert given.miner.async_snapshot is True and seen == []


def test_float16_needs_masters_and_stochastic_rounding_needs_bfloat16_without_them():
    with pytest.raises(ConfigError, match="float16 rows without fp32 masters"):
        build_config({"model": {"classifier_dtype": "float16", "classifier_master_fp32": False}})
    for model in ({"classifier_dtype": "float32"}, {"classifier_dtype": "bfloat16"}):
        with pytest.raises(ConfigError, match="model.classifier_rounding"):
            build_config({"model": {**model, "classifier_rounding": "stochastic"}})
    build_config({"model": {"classifier_dtype": "bfloat16", "classifier_master_fp32": False,
                            "classifier_rounding": "stochastic"}})


def test_a_resumed_auto_run_keeps_its_checkpoints_precision():
    cfg = build_config({"model": {"classifier_dtype": "float32", "classifier_rounding": "nearest"}})
    meta = {"config": {"model": {"classifier_dtype": "bfloat16", "classifier_master_fp32": False,
                                 "classifier_rounding": "stochastic"}}}
    kept = _checkpoint_row_precision(cfg, meta)
    assert (kept.model.classifier_dtype, kept.model.classifier_master_fp32, kept.model.classifier_rounding) == (
        "bfloat16", False, "stochastic")
    old = {"config": {"model": {"classifier_dtype": "float32", "classifier_master_fp32": True}}}  # before the rule
    assert _checkpoint_row_precision(cfg, old) == cfg


def test_a_run_directory_of_float32_rows_resumes_under_auto():
    """Runs from before the rule recorded model.classifier_dtype=float32: the guard lets `auto` resume them (the
    rows' precision is not part of a run's identity; a checkpoint's rows load into any precision)."""
    from xc.run.identity import config_identity, differences

    old = config_identity(build_config({"model": {"classifier_dtype": "float32", "classifier_rounding": "nearest"}}))
    new = config_identity(build_config({}))
    assert "model.classifier_dtype" not in new
    assert differences({"config": old}, {"config": new}) == []


def _cgroup_v2(tmp_path, limit: str, current: int, inactive_file: int = 0):
    """A fake cgroup v2 tree with the process in /job/step (the limit on /job, as Slurm sets it) and a host whose
    MemAvailable is 64 GiB: the paths `row_memory.host_memory` reads."""
    tmp_path.mkdir(parents=True)
    (tmp_path / "meminfo").write_text(f"MemTotal: {128 << 20} kB\nMemAvailable: {64 << 20} kB\n")
    (tmp_path / "self_cgroup").write_text("0::/job/step\n")
    step = tmp_path / "cgroup" / "job" / "step"
    step.mkdir(parents=True)
    (step / "memory.max").write_text("max\n")
    (step / "memory.current").write_text(f"{current}\n")
    job = step.parent
    (job / "memory.max").write_text(f"{limit}\n")
    (job / "memory.current").write_text(f"{current}\n")
    (job / "memory.stat").write_text(f"anon {current - inactive_file}\ninactive_file {inactive_file}\n")
    return dict(meminfo=tmp_path / "meminfo", proc_cgroup=tmp_path / "self_cgroup", cgroup_root=tmp_path / "cgroup")


def test_a_cgroup_limit_under_the_hosts_memory_sets_the_rule(monkeypatch, tmp_path, caplog):
    """10^7 labels of 256: float32 rows + accumulators + snapshot = 10^7 x (1024 + 4 + 1024) B = 19.1 GiB, within half
    of the host's 64 GiB MemAvailable (float32), over half of the 30 GiB a 32 GiB cgroup limit leaves with 4 GiB
    charged, 2 GiB of it reclaimable page cache (bfloat16)."""
    from functools import partial

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = build_config({"model": {"bottleneck_dim": 256}})
    unlimited = _cgroup_v2(tmp_path / "a", "max", 2 * GIB)
    monkeypatch.setattr(row_memory, "host_memory", partial(row_memory.host_memory, **unlimited))
    assert defaults.resolve(cfg, 1_000_000, 10_000_000, 50_000).model.classifier_dtype == "float32"
    limited = _cgroup_v2(tmp_path / "b", str(32 * GIB), 4 * GIB, inactive_file=2 * GIB)
    monkeypatch.setattr(row_memory, "host_memory", partial(row_memory.host_memory, **limited))
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        assert defaults.resolve(cfg, 1_000_000, 10_000_000, 50_000).model.classifier_dtype == "bfloat16"
    assert "of the 30 GiB available on the host (cgroup v2 limit 32 GiB)" in caplog.text
