"""`model.lexical_features: null` (xc/defaults/model.py): 32 weights a label where they can train, one model trains on
over 50,000 points and those carry under 32 positives a label; 0 elsewhere, each answer with its reason; an explicit
value stands, an ensemble's members get none, and a resumed run keeps its checkpoint's."""

from __future__ import annotations

import logging

from xc.config import build_config
from xc.defaults import (LEXICAL_BELOW_POSITIVES, LEXICAL_FEATURES, LEXICAL_MEMORY_SHARE, LEXICAL_MIN_POINTS,
                         auto_lexical_features, resolve_lexical)
from xc.models import row_memory
from xc.models.row_memory import FreeMemory
from xc.ensemble.members import SMALL_DATA_POINTS, member_config
from xc.run.identity import config_identity, differences
from xc.train.plan import _auto_row_keys, _checkpoint_rows

BOW = build_config({}).model


def test_the_rule_at_its_bounds():
    assert auto_lexical_features(BOW, 0.44, 995_000, 1, False)[0] == LEXICAL_FEATURES == 32  # the 10^7 benchmark
    assert auto_lexical_features(BOW, 31.9, LEXICAL_MIN_POINTS + 1, 1, False)[0] == 32
    width, why = auto_lexical_features(BOW, LEXICAL_BELOW_POSITIVES, 10**6, 1, False)
    assert width == 0 and "32 positives" in why  # Delicious-like: 250 a label
    width, why = auto_lexical_features(BOW, 9.0, LEXICAL_MIN_POINTS, 1, False)
    assert width == 0 and "ensemble" in why  # the main job's size: the defaults train three models there
    assert auto_lexical_features(BOW, 0.5, 10**6, 2, False) == (0, "they train on one rank, this run has 2")
    assert auto_lexical_features(BOW, 0.5, 10**6, 1, True)[0] == 0  # every label scored: nothing sampled
    dense = build_config({"model": {"encoder": "dense"}}).model
    assert auto_lexical_features(dense, 0.5, 10**6, 1, False)[0] == 0
    # the memory: at most a quarter of what the rows may use
    assert auto_lexical_features(BOW, 0.5, 10**6, 1, False, (LEXICAL_MEMORY_SHARE, "x"))[0] == 32
    width, why = auto_lexical_features(BOW, 0.5, 10**6, 1, False, (LEXICAL_MEMORY_SHARE + 0.01, "they take 9 GiB"))
    assert width == 0 and why.startswith("they take 9 GiB: over 25%")


def test_the_memory_share_counts_8_bytes_a_slot_and_4_a_label(monkeypatch):
    monkeypatch.setattr(row_memory, "host_memory", lambda: FreeMemory(22 * 2**30, "MemAvailable"))
    share, what = row_memory.lexical_memory_share(10**7, 32, "cpu", 1)
    assert share == (10**7 * (8 * 32 + 4)) / (0.6 * 22 * 2**30) and "2.42 GiB" in what  # 10^7 labels: 18%
    assert row_memory.lexical_memory_share(10**8, 32, "cpu", 1)[0] > 1  # 10^8 labels: more than the rows may use


def test_the_point_bound_is_the_ensemble_rules():
    assert LEXICAL_MIN_POINTS == SMALL_DATA_POINTS


def test_resolve_counts_the_points_left_after_validation_and_a_given_value_stands(caplog, monkeypatch):
    monkeypatch.setattr(row_memory, "host_memory", lambda: FreeMemory(22 * 2**30, "MemAvailable"))
    cfg = build_config({})
    assert cfg.model.lexical_features is None
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        big = resolve_lexical(cfg, 1_000_000, 444_000, 1_000_000)
    assert big.model.lexical_features == 32 and "model.lexical_features=32" in caplog.text
    assert resolve_lexical(cfg, 1_000_000, 4_400_000, 100_000_000).model.lexical_features == 0  # 10^8 labels
    # 50,000 points: the validation split leaves fewer to train on, where the defaults train an ensemble
    assert resolve_lexical(cfg, 50_000, 1_000, 100_000).model.lexical_features == 0
    given = build_config({"model": {"lexical_features": 8}})
    assert resolve_lexical(given, 50, 10**6, 10).model.lexical_features == 8
    assert resolve_lexical(big, 50, 10**6, 10) == big  # a fixed point
    # few labels: the exact loss scores them all (sampler.name=full by its rule), nothing to sample for the weights
    assert resolve_lexical(cfg, 10**6, 10**5, 20).model.lexical_features == 0


def test_an_ensembles_members_get_none_and_a_given_value_reaches_them():
    assert member_config(build_config({}), 1).model.lexical_features == 0
    assert member_config(build_config({"model": {"lexical_features": 0}}), 0).model.lexical_features == 0


def test_a_resumed_run_keeps_its_checkpoints_weights_and_the_rule_resumes_older_runs():
    requested = build_config({})
    keys = _auto_row_keys(requested)
    assert "lexical_features" in keys
    assert _checkpoint_rows(requested, {"config": {"model": {"lexical_features": 32}}}, keys).model.lexical_features == 32
    assert _checkpoint_rows(requested, {"config": {"model": {}}}, keys).model.lexical_features == 0
    assert "lexical_features" not in _auto_row_keys(build_config({"model": {"lexical_features": 0}}))
    # a run directory from before the rule (0 given) resumes under it: null is not part of a run's identity
    old = {"config": config_identity(build_config({"model": {"lexical_features": 0}}))}
    assert differences(old, {"config": config_identity(requested)}) == []
    # while a given value is
    assert differences(old, {"config": config_identity(build_config({"model": {"lexical_features": 8}}))})
