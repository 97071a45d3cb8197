"""Ensembles (xc/ensemble.py): the averaging against a dense brute force, the member count rule at a small
and a large set, members' configs (own seeds, one shared validation split), and the run-directory guard."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from xc.config import XCConfig
from xc.data.inputs import split_validation
from xc.ensemble import (SMALL_DATA_MEMBERS, SMALL_DATA_POINTS, average_predictions, check_run_layout,
                         member_config, resolve_members)
from xc.errors import CheckpointError, ConfigError


def _member_lists(rng, n: int, num_labels: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, scores) (n, width): distinct labels per row, a few -1 pads, scores in (0, 1) (pads -inf)."""
    ids = np.stack([rng.choice(num_labels, size=width, replace=False) for _ in range(n)])
    ids[rng.random(ids.shape) < 0.2] = -1
    scores = np.where(ids >= 0, rng.random(ids.shape), -np.inf).astype(np.float32)
    return ids, scores


def test_average_equals_dense_mean():
    rng = np.random.default_rng(0)
    n, L = 50, 30
    parts = [_member_lists(rng, n, L, w) for w in (8, 12, 5)]
    dense = np.zeros((n, L))
    proposed = np.zeros((n, L), bool)
    for ids, scores in parts:
        for i in range(n):
            keep = ids[i] >= 0
            dense[i, ids[i][keep]] += scores[i][keep] / len(parts)
            proposed[i, ids[i][keep]] = True
    ids, scores = average_predictions(parts, L)
    for i in range(n):
        keep = ids[i] >= 0
        assert set(ids[i][keep].tolist()) == set(np.nonzero(proposed[i])[0].tolist())  # every proposed label, once
        np.testing.assert_allclose(scores[i][keep], dense[i, ids[i][keep]], rtol=1e-6)
        assert np.all(np.diff(scores[i][keep]) <= 0)  # best first
        assert np.all(np.isneginf(scores[i][~keep]))


def test_one_member_keeps_its_ranking():
    rng = np.random.default_rng(1)
    ids, scores = _member_lists(rng, 20, 40, 10)
    order = np.argsort(-scores, axis=1, kind="stable")
    ids, scores = np.take_along_axis(ids, order, 1), np.take_along_axis(scores, order, 1)
    got_ids, got_scores = average_predictions([(ids, scores)], 40)
    for i in range(20):
        keep = ids[i] >= 0
        np.testing.assert_array_equal(got_ids[i][:keep.sum()], ids[i][keep])
        np.testing.assert_allclose(got_scores[i][:keep.sum()], scores[i][keep])


@pytest.mark.parametrize("points, expected", [(4_880, SMALL_DATA_MEMBERS), (1_000_000, 1)])
def test_member_rule_small_and_large(points, expected):
    members, why = resolve_members(XCConfig(), points)
    assert members == expected, why
    # the boundary counts the points that train, after the validation split is carved out
    kept = len(split_validation(points, 0.1, 5000, 0)[0])
    assert (kept <= SMALL_DATA_POINTS) == (expected > 1)


def test_member_rule_one_model_without_validation_or_in_dual_mode():
    cfg = XCConfig()
    assert resolve_members(replace(cfg, data=replace(cfg.data, valid_fraction=0.0)), 4_000)[0] == 1
    assert resolve_members(replace(cfg, model=replace(cfg.model, mode="dual")), 4_000)[0] == 1
    assert resolve_members(replace(cfg, train=replace(cfg.train, ensemble=5)), 10**6)[0] == 5


@pytest.mark.parametrize("change, message", [
    (lambda c: replace(c, train=replace(c.train, ensemble=0)), "must be >= 1"),
    (lambda c: replace(c, train=replace(c.train, ensemble=2), data=replace(c.data, valid_fraction=0.0)),
     "needs a validation split"),
    (lambda c: replace(c, train=replace(c.train, ensemble=2), model=replace(c.model, mode="dual")), "classifier"),
])
def test_member_rule_refuses(change, message):
    with pytest.raises(ConfigError, match=message):
        resolve_members(change(XCConfig()), 4_000)


def test_members_share_the_validation_split_not_the_seed(tmp_path):
    cfg = replace(XCConfig(), seed=7, run_dir=str(tmp_path))
    members = [member_config(cfg, m) for m in range(3)]
    assert [m.seed for m in members] == [7, 8, 9]
    assert len({m.run_dir for m in members}) == 3 and all(m.run_dir.startswith(str(tmp_path)) for m in members)
    splits = [split_validation(4_880, m.data.valid_fraction, m.data.valid_max_points, m.data.valid_seed(m.seed))
              for m in members]
    for train_ids, valid_ids in splits[1:]:
        np.testing.assert_array_equal(valid_ids, splits[0][1])
    # member 0 is the single model: only where it lives and that it keeps its candidates differ
    first = members[0]
    assert first.seed == cfg.seed and first.train.ensemble == 1 and first.eval.save_predictions
    assert replace(first, name=cfg.name, run_dir=cfg.run_dir, train=cfg.train, eval=cfg.eval,
                   data=replace(first.data, split_seed=None)) == cfg
    # with fusion switched off, members still save candidates: the plain model's, at lambda 0
    off = replace(cfg, eval=replace(cfg.eval, knn_fusion=replace(cfg.eval.knn_fusion, enabled=False)))
    fusion = member_config(off, 1).eval.knn_fusion
    assert fusion.enabled and fusion.lam == 0.0


def test_a_run_directory_holds_one_model_or_one_ensemble(tmp_path):
    single = tmp_path / "single"
    (single / "checkpoints" / "step-00000010").mkdir(parents=True)
    cfg = replace(XCConfig(), run_dir=str(single))
    with pytest.raises(CheckpointError, match="train.ensemble=1"):
        check_run_layout(cfg, 3)
    check_run_layout(cfg, 1)
    ensemble = tmp_path / "ensemble"
    (ensemble / "members" / "m0").mkdir(parents=True)
    cfg = replace(cfg, run_dir=str(ensemble))
    with pytest.raises(CheckpointError, match="train.ensemble=N"):
        check_run_layout(cfg, 1)
    check_run_layout(cfg, 3)
    # train.resume=never: the ensemble moves the previous run to archive/ instead
    never = replace(cfg, run_dir=str(single), train=replace(cfg.train, resume="never"))
    check_run_layout(never, 3)
    assert not (single / "checkpoints").exists() and list((single / "archive").iterdir())
