"""`model.feature_weighting: auto` (xc/defaults/model.py): idf where the model has lexical weights and the stored
feature values are counts, none elsewhere, each answer with its reason; a given value stands, and a resumed run keeps
its checkpoint's weighting, including a run from before the rule."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp

from xc.config import build_config
from xc.data.sparse import SparseMatrix
from xc.defaults import auto_feature_weighting, resolve_feature_weighting, whole_number_values
from xc.errors import ConfigError
from xc.run.identity import config_identity, differences
from xc.train.plan import _auto_row_keys, _checkpoint_rows


def _data(values: list[float] | None):
    """A dataset whose training split holds one row of these feature values (None: binary, no values stored)."""
    row = sp.csr_matrix(np.array([values or [1.0, 1.0, 1.0]], dtype=np.float32))
    return SimpleNamespace(train=SimpleNamespace(features=SparseMatrix.from_scipy(row, binary=values is None)))


def test_the_rule_answers_with_its_reason():
    assert auto_feature_weighting("bow", 32, True)[0] == "idf"
    choice, why = auto_feature_weighting("bow", 0, True)
    assert choice == "none" and "model.lexical_features=0" in why
    choice, why = auto_feature_weighting("bow", 32, False)
    assert choice == "none" and "not whole numbers" in why
    assert auto_feature_weighting("transformer", 32, True)[0] == "none"


@pytest.mark.parametrize("values, counts", [(None, True), ([1.0, 3.0, 7.0], True), ([0.2, 0.5, 0.1], False),
                                            ([1.0, 2.5, 1.0], False), ([-1.0, 2.0, 1.0], False)])
def test_counts_are_binary_or_whole_non_negative_values(values, counts):
    assert whole_number_values(_data(values)) is counts


def test_no_features_are_not_counts():
    assert whole_number_values(SimpleNamespace(train=SimpleNamespace(features=None))) is False
    empty = SparseMatrix.from_scipy(sp.csr_matrix((2, 3), dtype=np.float32))
    assert whole_number_values(SimpleNamespace(train=SimpleNamespace(features=empty))) is False


def test_resolve_reads_the_lexical_answer_logs_it_and_a_given_value_stands(caplog):
    lexical = build_config({"model": {"lexical_features": 32}})
    assert lexical.model.feature_weighting == "auto"
    with caplog.at_level(logging.INFO, logger="xc.defaults"):
        chosen = resolve_feature_weighting(lexical, _data([2.0, 1.0, 4.0]))
    assert chosen.model.feature_weighting == "idf" and "model.feature_weighting=idf" in caplog.text
    assert resolve_feature_weighting(chosen, _data([0.5, 0.1, 0.2])) == chosen  # a fixed point
    assert resolve_feature_weighting(lexical, _data([0.5, 0.1, 0.2])).model.feature_weighting == "none"  # tf-idf
    dense = build_config({"model": {"lexical_features": 0}})
    assert resolve_feature_weighting(dense, _data(None)).model.feature_weighting == "none"
    given = build_config({"model": {"lexical_features": 0, "feature_weighting": "idf"}})
    assert resolve_feature_weighting(given, _data(None)).model.feature_weighting == "idf"


def test_a_bad_value_names_the_key():
    with pytest.raises(ConfigError, match="model.feature_weighting"):
        build_config({"model": {"feature_weighting": "tfidf"}})


@pytest.mark.parametrize("model, sampler", [({"encoder": "transformer"}, {}),
                                            ({"mode": "dual"}, {"name": "lf_stale"})])
def test_idf_where_the_encoder_reads_tokens_is_refused_naming_the_key(model, sampler):
    with pytest.raises(ConfigError, match="model.feature_weighting.*reads the texts' tokens"):
        build_config({"model": {**model, "feature_weighting": "idf"}, "sampler": sampler})
    build_config({"model": {**model, "feature_weighting": "none"}, "sampler": sampler})  # as before


def test_a_resumed_run_keeps_its_checkpoints_weighting_and_runs_from_before_the_rule_resume():
    requested = build_config({})
    keys = _auto_row_keys(requested)
    assert "feature_weighting" in keys
    assert _checkpoint_rows(requested, {"config": {"model": {"feature_weighting": "idf"}}},
                            keys).model.feature_weighting == "idf"
    assert _checkpoint_rows(requested, {"config": {"model": {}}}, keys).model.feature_weighting == "none"
    assert "feature_weighting" not in _auto_row_keys(build_config({"model": {"feature_weighting": "none"}}))
    # a run directory from before the rule (none stored) resumes under it: auto is not part of a run's identity
    old = {"config": config_identity(build_config({"model": {"feature_weighting": "none"}}))}
    assert differences(old, {"config": config_identity(requested)}) == []
    # while a given value is
    assert differences(old, {"config": config_identity(build_config({"model": {"feature_weighting": "idf"}}))})


def test_a_long_values_array_is_read_in_runs_not_whole():
    counts = np.random.default_rng(0).integers(1, 9, 3_000_000).astype(np.float32)
    matrix = SimpleNamespace(nnz=len(counts), values=counts)
    assert whole_number_values(SimpleNamespace(train=SimpleNamespace(features=matrix))) is True
    tfidf = counts / 7.0  # weighted already: every run shows it
    matrix = SimpleNamespace(nnz=len(tfidf), values=tfidf)
    assert whole_number_values(SimpleNamespace(train=SimpleNamespace(features=matrix))) is False
