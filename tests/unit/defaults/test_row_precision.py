"""`model.bottleneck_dim: null` and `model.classifier_dtype: auto` (xc/defaults/, resolve_rows): the widest rows
that fit, with their state, the miner's snapshot and (where the miner builds a graph without trying its clustered
search first) the graph's working set, in 60% of the free memory, float32 where they fit,
bfloat16 with stochastic rounding beyond; `miner.async_snapshot: null`: a background copy of the rows only where it fits
beside them; the byte figures both read (xc/models/row_memory.py), checked by hand."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from xc import defaults
from xc.config import build_config
from xc.errors import ConfigError
from xc.models import row_memory
from xc.models.row_memory import (classifier_bytes, layout_bytes, lexical_bytes, miner_bytes, row_widths,
                                  training_bytes)
from xc.train.plan import _checkpoint_rows

GIB = 1 << 30
GRAPH_FIRST = {"miner": {"ann": {"backend": "diskann", "clustered_recall": 0}}}  # a graph without the clustered trial
AUTO = {"miner": {"ann": {"backend": "auto"}}}  # xc-train's miner (conf/miner/sync.yaml): a graph past exact search's size


def _free(monkeypatch, free: int, gpu: int | None = None) -> list[str]:
    """Fake free memory: `free` bytes on the host, `gpu` (default `free`) on a CUDA device; the devices asked."""
    seen = []
    monkeypatch.setattr(row_memory, "available_memory", lambda device: seen.append(device) or row_memory.FreeMemory(
        gpu if device == "cuda" and gpu is not None else free, "MemAvailable"))
    return seen


def _rows(cfg, num_labels, **where):
    """The run's plan's two steps: the rows' width and precision (resolve_rows), then the other defaults."""
    return defaults.resolve_rows(cfg, num_labels, **where)


def test_bytes_per_component_by_hand():
    # 10^8 rows of 64: float32 25.6 GB; bf16 12.8 GB (+ 25.6 GB of masters); 0.4 GB of accumulators; the miner's
    # snapshot in the rows' precision
    fp32 = classifier_bytes(10**8, 64, "float32")
    assert fp32 == {"rows": 25_600_000_000, "masters": 0, "row_sq": 400_000_000, "snapshot": 25_600_000_000,
                    "checkpoint": 26_000_000_000}
    master = classifier_bytes(10**8, 64, "bfloat16+master")
    assert (master["rows"], master["masters"], master["checkpoint"]) == (12_800_000_000, 25_600_000_000, 38_800_000_000)
    sr = classifier_bytes(10**8, 64, "bfloat16+SR", rowadagrad=False)
    assert (sr["rows"], sr["masters"], sr["row_sq"], sr["checkpoint"]) == (12_800_000_000, 0, 0, 12_800_000_000)
    assert training_bytes(10**8, 64, "float32", True, snapshot_here=True) == 51_600_000_000
    assert training_bytes(10**8, 64, "float32", True, snapshot_here=False) == 26_000_000_000
    # the miner over 10^6 rows of 128: the rows as float32, their centred copy and the graph's float32 vectors,
    # 3 x 512 B, and ceil(32 x 1.3) + 1 = 43 edges of 4 B a row
    assert miner_bytes(10**6, 128, 32) == 10**6 * (1536 + 172)
    # CPU ranks hold it all on the host; GPU ranks their rows and state on the GPU, snapshot and miner on the host
    assert layout_bytes(10**6, 128, "bfloat16+SR", True, 32, on_gpu=False) == (0, 10**6 * (256 + 4 + 256 + 1708))
    assert layout_bytes(10**6, 128, "bfloat16+SR", True, 32, on_gpu=True) == (10**6 * 260, 10**6 * (256 + 1708))
    # a miner whose clustered search comes first reads the snapshot as stored: no graph counted
    assert layout_bytes(10**6, 128, "bfloat16+SR", True, 32, on_gpu=False, graph=False) == (0, 10**6 * (256 + 4 + 256))
    assert row_memory.graph_first(build_config(GRAPH_FIRST).miner.ann)
    assert not row_memory.graph_first(build_config(AUTO).miner.ann)  # the default: clustered_recall 0.9
    assert not row_memory.graph_first(build_config({"miner": {"ann": {"backend": "clustered"}}}).miner.ann)
    assert not row_memory.graph_first(build_config({"miner": {"ann": {"backend": "exact", "clustered_recall": 0}}}).miner.ann)


def test_the_widths_tried():
    assert row_widths(1024, None, True) == [1024, 512, 256, 128, 64]
    assert row_widths(384, None, True) == [384, 256, 128, 64]  # a width that is no power of two, then powers of two
    assert row_widths(64, None, True) == [64] and row_widths(48, None, True) == [48]  # at or under the floor
    assert row_widths(1024, 300, True) == [300]  # given
    assert row_widths(384, None, False) == [384]  # a text encoder keeps its width


def test_the_widest_rows_that_fit_in_the_share_of_free_memory(monkeypatch, caplog):
    """The defaults (the miner tries its clustered search first): 10^6 labels, width 1024 (bag of words over 200k
    features), 22 GiB free, 60% = 13.2 GiB: rows, accumulators and snapshot need 10^6 x (4096 + 4 + 4096) B = 7.63
    GiB in float32: the encoder's width, no projection. 10^7 labels on 22 GiB: 512 in bfloat16 would be 10^7 x
    (1024 + 4 + 1024) B = 19.1 GiB, as would 256 in float32; 256 in bfloat16 10^7 x (512 + 4 + 512) B = 9.57: 256 in
    bfloat16. The graph a miner may build would add 12 B a row element; it is counted where the miner builds one first
    (the next test)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = build_config(AUTO)
    _free(monkeypatch, 22 * GIB)
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        wide = _rows(cfg, 10**6)
    assert (wide.model.bottleneck_dim, wide.model.classifier_dtype) == (None, "float32")
    assert ("classifier rows: 1024 wide in float32 (rows, their state, the miner's snapshot need 7.63 GiB of the 22 "
            "GiB available on the host (MemAvailable); the rule allows 60%; widths 1024, 512, 256, 128, 64); the "
            "miner's clustered search reads the snapshot as stored, and builds a graph index (11.6 GiB more) only "
            "where that fits when it would") in caplog.text
    many = _rows(cfg, 10**7)
    assert (many.model.bottleneck_dim, many.model.classifier_dtype, many.model.classifier_rounding) == (
        256, "bfloat16", "stochastic")
    # what resolve_rows chose, resolve keeps: a fixed point that measures nothing again
    monkeypatch.setattr(row_memory, "available_memory", lambda device: pytest.fail("measured a resolved config"))
    resolved = defaults.resolve(many, 1_000_000, 10**7, 200_000)
    assert (resolved.model.bottleneck_dim, resolved.model.classifier_dtype) == (256, "bfloat16")
    assert defaults.resolve_rows(resolved, 10**7) == resolved


def test_a_miner_that_builds_its_graph_first_counts_it(monkeypatch, caplog):
    """`miner.ann.clustered_recall=0`: the graph's working set counts. 10^6 labels on 22 GiB (13.2 allowed): 10^6 x
    (4096 + 4 + 4096 + 12460) B = 19.2 GiB at 1024 in float32, 15.4 in bfloat16; at 512 in float32 10^6 x (2048 + 4
    + 2048 + 6316) B = 9.70 GiB: 512 in float32. With 16 GiB free (9.6): 512 in bfloat16 (7.79 GiB). 10^7 labels on
    22 GiB: 64 in float32 would be 13.6 GiB, in bfloat16 11.2: 64 in bfloat16."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = build_config(GRAPH_FIRST)
    _free(monkeypatch, 22 * GIB)
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        wide = _rows(cfg, 10**6)
    assert (wide.model.bottleneck_dim, wide.model.classifier_dtype, wide.model.classifier_rounding) == (
        512, "float32", "nearest")
    assert ("classifier rows: 512 wide in float32 (rows, their state, the miner's snapshot and index need 9.7 GiB "
            "of the 22 GiB available on the host (MemAvailable); the rule allows 60%; widths 1024, 512, 256, 128, 64)"
            ) in caplog.text
    _free(monkeypatch, 16 * GIB)
    half = _rows(cfg, 10**6)
    assert (half.model.bottleneck_dim, half.model.classifier_dtype, half.model.classifier_master_fp32,
            half.model.classifier_rounding) == (512, "bfloat16", False, "stochastic")
    _free(monkeypatch, 64 * GIB)  # 38.4 GiB allowed: 1024 in float32 (19.2), no projection
    assert _rows(cfg, 10**6).model.bottleneck_dim is None
    _free(monkeypatch, 22 * GIB)
    many = _rows(cfg, 10**7)
    assert (many.model.bottleneck_dim, many.model.classifier_dtype) == (64, "bfloat16")
    # what resolve_rows chose, resolve keeps: a fixed point that measures nothing again


def test_lexical_weights_count_beside_the_rows(monkeypatch, caplog):
    """model.lexical_features=32: 10^6 labels x (32 x (4 B feature id + 4 B weight) + 4 B accumulator) = 260 MB,
    where the rows live. With 12.9 GiB free (7.74 GiB allowed) the dense rows' 7.63 GiB fit in float32, and with the
    lexical weights' 0.24 GiB beside them (7.88) they do not: 1024 wide in bfloat16 (3.82 + 0.24 GiB)."""
    assert lexical_bytes(10**6, 32) == 260_000_000 and lexical_bytes(10**6, 0) == 0
    assert layout_bytes(10**6, 128, "float32", True, 32, on_gpu=True, graph=False, lexical_features=32) == (
        10**6 * (512 + 4 + 260), 10**6 * 512)
    assert layout_bytes(10**6, 128, "float32", True, 32, on_gpu=False, graph=False, lexical_features=32) == (
        0, 10**6 * (512 + 4 + 260 + 512))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    _free(monkeypatch, int(12.9 * GIB))
    dense = _rows(build_config(AUTO), 10**6)
    assert (dense.model.bottleneck_dim, dense.model.classifier_dtype) == (None, "float32")
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        lexical = _rows(build_config({**AUTO, "model": {"lexical_features": 32}}), 10**6)
    assert (lexical.model.bottleneck_dim, lexical.model.classifier_dtype) == (None, "bfloat16")
    assert "classifier rows: 1024 wide in bfloat16 + stochastic rounding (rows, their state, the lexical weights, " \
           "the miner's snapshot need 4.06 GiB" in caplog.text


def test_a_stored_config_is_never_projected_on_a_smaller_machine(monkeypatch):
    """A model whose rows kept the encoder's width (bottleneck_dim null) loads as trained where memory is short:
    serving and xc-eval resolve the stored config (xc/train/components.py), and resolve never projects."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    _free(monkeypatch, 22 * GIB)  # 10^5 labels at 1024 in float32: 1.92 GiB
    trained = defaults.resolve(_rows(build_config({}), 10**5), 100_000, 10**5, 200_000)
    assert trained.model.bottleneck_dim is None
    _free(monkeypatch, 1 * GIB)
    assert defaults.resolve(trained, 100_000, 10**5, 200_000).model == trained.model


def test_10_8_labels_on_a_24_gib_host_warn_that_nothing_fits(monkeypatch, caplog):
    # 10^8 labels: even 64 in bfloat16 is 10^8 x (128 + 4 + 128) B = 24.2 GiB, over 60% of 24 GiB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    seen = _free(monkeypatch, 24 * GIB)
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        cfg = _rows(build_config({}), 100_000_000)
    assert seen == ["cpu"] and cfg.model.bottleneck_dim == 64
    assert (cfg.model.classifier_dtype, cfg.model.classifier_master_fp32, cfg.model.classifier_rounding) == (
        "bfloat16", False, "stochastic")
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "24.2 GiB of the 24 GiB" in warned[0].getMessage()
    assert "nothing fits" in warned[0].getMessage()


@pytest.mark.parametrize("labels, features, points", [(159, 1836, 4880), (983, 500, 12920), (37_960, 41_000, 41_000),
                                                       (10_000, 20_000, 20_000)],
                         ids=["bibtex", "delicious", "debian-deps", "main-job"])
def test_every_shipped_set_keeps_float32_at_the_encoders_width(monkeypatch, labels, features, points):
    # debian-deps, the largest: 37,960 rows of 1024 -> 37,960 x (4096 + 4 + 4096 + 12460) B = 0.73 GiB, under 60% of 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    _free(monkeypatch, 2 * GIB)
    cfg = defaults.resolve(_rows(build_config({}), labels), points, labels, features)
    assert (cfg.model.bottleneck_dim, cfg.model.classifier_dtype, cfg.model.classifier_rounding) == (
        None, "float32", "nearest")


def test_gpu_ranks_count_their_own_rows_on_the_gpu_and_the_snapshots_on_the_host(monkeypatch):
    # 8 GPU ranks, 10^8 labels at 64: 1.25·10^7 rows a GPU x (256 + 4) B = 3.03 GiB on each GPU; the host holds the
    # 8 ranks' snapshots and the working set of a miner that builds its graph first, 10^8 x (256 + 940) B = 111 GiB
    # in float32, 99.5 in bfloat16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = build_config({"model": {"bottleneck_dim": 64}, **GRAPH_FIRST})
    seen = _free(monkeypatch, 256 * GIB, gpu=8 * GIB)
    on_8 = defaults.resolve(cfg, 1_000_000, 100_000_000, 500, device_type="cuda", world_size=8)
    assert seen == ["cuda", "cpu"] and on_8.model.classifier_dtype == "float32"
    _free(monkeypatch, 256 * GIB, gpu=4 * GIB)  # 3.03 > 2.4; bfloat16 1.54 GiB
    assert defaults.resolve(cfg, 1_000_000, 100_000_000, 500, device_type="cuda",
                            world_size=8).model.classifier_dtype == "bfloat16"
    _free(monkeypatch, 170 * GIB, gpu=8 * GIB)  # the host's 102 GiB: float32's 111 no, bfloat16's 99.5 yes
    assert defaults.resolve(cfg, 1_000_000, 100_000_000, 500, device_type="cuda",
                            world_size=8).model.classifier_dtype == "bfloat16"


def test_cpu_ranks_on_one_host_share_its_memory(monkeypatch):
    # 2 ranks of 5·10^5 rows of 1024: one rank's 5·10^5 x (4096 + 4 + 4096 + 12460) B = 9.6 GiB, under 60% of 28 GiB;
    # both ranks on one host 19.2 GiB in float32, over it; 15.4 in bfloat16 (a miner that builds its graph first)
    _free(monkeypatch, 28 * GIB)
    cfg = build_config({"model": {"bottleneck_dim": 1024}, **GRAPH_FIRST})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert defaults.resolve(cfg, 50_000, 1_000_000, 50_000, world_size=2).model.classifier_dtype == "float32"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert defaults.resolve(cfg, 50_000, 1_000_000, 50_000, world_size=2).model.classifier_dtype == "bfloat16"


def test_an_explicit_dtype_and_width_stand_and_measure_nothing(monkeypatch):
    monkeypatch.setattr(row_memory, "available_memory", lambda device: pytest.fail("probed an explicit dtype"))
    fp32 = defaults.resolve(build_config({"model": {"classifier_dtype": "float32"}}), 1_000_000, 100_000_000, 500)
    assert (fp32.model.classifier_dtype, fp32.model.classifier_rounding) == ("float32", "nearest")
    master = defaults.resolve(build_config({"model": {"classifier_dtype": "bfloat16"}}), 4880, 159, 1836)
    assert (master.model.classifier_master_fp32, master.model.classifier_rounding) == (True, "nearest")
    nearest = build_config({"model": {"classifier_dtype": "bfloat16", "classifier_master_fp32": False,
                                      "classifier_rounding": "nearest"}})
    assert defaults.resolve(nearest, 4880, 159, 1836).model.classifier_rounding == "nearest"
    both = build_config({"model": {"classifier_dtype": "float32", "bottleneck_dim": 256}})
    assert defaults.resolve_rows(both, 10**7) == both
    text = build_config({"model": {"encoder": "transformer", "classifier_dtype": "float32"}})
    kept = defaults.resolve_rows(text, 10**7).model  # a text encoder's width, a given precision: nothing to choose
    assert (kept.bottleneck_dim, kept.classifier_dtype) == (None, "float32")


def test_a_given_precision_still_chooses_the_width(monkeypatch):
    # float32 given, 10^7 labels on 24 GiB (14.4 GiB allowed): 256 would be 10^7 x (1024 + 4 + 1024) B = 19.1 GiB,
    # 128 is 9.57: 128; where the miner builds its graph first, 128 would be 25.5 GiB, 64 is 13.6: 64
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    _free(monkeypatch, 24 * GIB)
    cfg = _rows(build_config({"model": {"classifier_dtype": "float32"}}), 10**7)
    assert (cfg.model.bottleneck_dim, cfg.model.classifier_dtype) == (128, "float32")
    cfg = _rows(build_config({"model": {"classifier_dtype": "float32"}, **GRAPH_FIRST}), 10**7)
    assert (cfg.model.bottleneck_dim, cfg.model.classifier_dtype) == (64, "float32")


def _host_free(monkeypatch, free: int) -> list[int]:
    seen = []
    monkeypatch.setattr(row_memory, "host_memory", lambda: seen.append(free) or row_memory.FreeMemory(free, "MemAvailable"))
    return seen


def test_the_snapshot_writer_copies_the_rows_only_where_the_copy_fits(monkeypatch, caplog):
    # 10^8 labels of 64 in bfloat16 on a 24 GiB host: rows + accumulators + the writer's copy = 10^8 x (128 + 4 + 128) B
    # = 24.2 GiB, over 60% of 24 GiB: the trainer writes the snapshot from the rows and waits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    _free(monkeypatch, 24 * GIB)
    _host_free(monkeypatch, 24 * GIB)
    cfg = build_config({"miner": {"mode": "pool"}, "model": {"bottleneck_dim": 64}})
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        pool = defaults.resolve(cfg, 1_000_000, 100_000_000, 500)
    assert pool.model.classifier_dtype == "bfloat16" and pool.miner.async_snapshot is False
    assert ("miner.async_snapshot=false (bfloat16+SR rows with a copy for the background writer need 24.2 GiB of the "
            "24 GiB available on the host (MemAvailable); the rule allows 60%)") in caplog.text
    # 10^7 labels (float32, 4.8 GiB with the copy) keep the background writer, and say nothing of it
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        small = defaults.resolve(cfg, 1_000_000, 10_000_000, 500)
    assert small.model.classifier_dtype == "float32" and small.miner.async_snapshot is True
    assert "miner.async_snapshot" not in caplog.text


def test_a_cpu_rank_writes_from_its_rows_where_the_copy_alone_is_large(monkeypatch, caplog):
    """10^7 labels of 256 in bfloat16 on a 22.8 GiB host (the 10^7 benchmark): rows, accumulators and the copy fit in
    60%, but the copy alone (4.77 GiB) is over 12.5% of the host: the trainer writes from its rows, and says why.
    On a GPU rank the host copy is the transfer itself and stays."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    free = int(22.8 * GIB)
    _free(monkeypatch, free)
    _host_free(monkeypatch, free)
    cfg = build_config({"miner": {"mode": "pool"}, "model": {"bottleneck_dim": 256, "classifier_dtype": "bfloat16",
                                                             "classifier_master_fp32": False}})
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        cpu = defaults.resolve(cfg, 1_000_000, 10_000_000, 200_000)
    assert cpu.miner.async_snapshot is False
    assert ("miner.async_snapshot=false (the background writer's copy of the rows would be 4.77 GiB, over 12.5% of "
            "the 22.8 GiB available on the host (MemAvailable)") in caplog.text
    assert defaults.resolve(cfg, 1_000_000, 2_000_000, 200_000).miner.async_snapshot is True  # a 0.95 GiB copy
    _free(monkeypatch, free, gpu=80 * GIB)
    assert defaults.resolve(cfg, 1_000_000, 10_000_000, 200_000, device_type="cuda").miner.async_snapshot is True


def test_gpu_ranks_count_only_the_host_copy_and_a_given_setting_stands(monkeypatch):
    # 8 GPU ranks of 1.25·10^7 float32 rows of 64 (3.2 GB each, on the GPUs); the host holds 8 copies = 25.6 GB
    _free(monkeypatch, 256 * GIB, gpu=8 * GIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    _host_free(monkeypatch, 64 * GIB)
    cfg = build_config({"model": {"bottleneck_dim": 64}})
    on_8 = defaults.resolve(cfg, 1_000_000, 100_000_000, 500, device_type="cuda", world_size=8)
    assert on_8.model.classifier_dtype == "float32" and on_8.miner.async_snapshot is True  # 23.8 GiB <= 38.4
    _host_free(monkeypatch, 36 * GIB)
    assert defaults.resolve(cfg, 1_000_000, 100_000_000, 500, device_type="cuda",
                            world_size=8).miner.async_snapshot is False  # 23.8 GiB > 21.6
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


def test_a_resumed_auto_run_keeps_its_checkpoints_width_and_precision():
    requested = build_config({})  # width and precision left to the rule
    keys = ("classifier_dtype", "classifier_master_fp32", "classifier_rounding", "bottleneck_dim")
    meta = {"config": {"model": {"classifier_dtype": "bfloat16", "classifier_master_fp32": False,
                                 "classifier_rounding": "stochastic", "bottleneck_dim": 256}}}
    kept = _checkpoint_rows(requested, meta, keys)
    assert (kept.model.classifier_dtype, kept.model.classifier_master_fp32, kept.model.classifier_rounding,
            kept.model.bottleneck_dim) == ("bfloat16", False, "stochastic", 256)
    # a checkpoint at the encoder's width (null) keeps it: resolve never projects it again
    unprojected = _checkpoint_rows(requested, {"config": {"model": {**meta["config"]["model"],
                                                                   "bottleneck_dim": None}}}, keys)
    assert unprojected.model.bottleneck_dim is None
    # before the precision rule: no resolved precision in the checkpoint, the rule's stays
    old = {"config": {"model": {"classifier_dtype": "float32", "classifier_master_fp32": True, "bottleneck_dim": 128}}}
    assert _checkpoint_rows(requested, old, keys).model == replace(requested.model, bottleneck_dim=128)
    # a given width or precision is not the rule's to keep
    assert _checkpoint_rows(requested, meta, ("bottleneck_dim",)).model.classifier_dtype == "auto"


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
    """10^7 labels of 128: rows, accumulators, snapshot and the working set of a miner that builds its graph first =
    10^7 x (512 + 4 + 512 + 1708) B = 25.5 GiB in float32, within 60% of the host's 64 GiB MemAvailable (float32), over 60% of the 30 GiB a 32 GiB
    cgroup limit leaves with 4 GiB charged, 2 GiB of it reclaimable page cache (bfloat16)."""
    from functools import partial

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = build_config({"model": {"bottleneck_dim": 128}, **GRAPH_FIRST})
    unlimited = _cgroup_v2(tmp_path / "a", "max", 2 * GIB)
    monkeypatch.setattr(row_memory, "host_memory", partial(row_memory.host_memory, **unlimited))
    assert defaults.resolve(cfg, 1_000_000, 10_000_000, 50_000).model.classifier_dtype == "float32"
    limited = _cgroup_v2(tmp_path / "b", str(32 * GIB), 4 * GIB, inactive_file=2 * GIB)
    monkeypatch.setattr(row_memory, "host_memory", partial(row_memory.host_memory, **limited))
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        assert defaults.resolve(cfg, 1_000_000, 10_000_000, 50_000).model.classifier_dtype == "bfloat16"
    assert "of the 30 GiB available on the host (cgroup v2 limit 32 GiB)" in caplog.text
