"""Ensembles (xc/ensemble/members.py): the member count rule at a small and a large set, members' configs (own seeds,
disjoint validation folds when cross-fitted, one shared split otherwise), and the run-directory guard. The averaging and its fusion are tested end to end
in tests/integration/test_ensemble.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from xc.config import XCConfig
from xc.data.inputs import split_validation, validation_split
from xc.ensemble.members import SMALL_DATA_MEMBERS, SMALL_DATA_POINTS, check_run_layout, member_config, resolve_members
from xc.errors import CheckpointError, ConfigError


# Bibtex (4,880 points), debian-deps (45,644: 41,080 train), the 10^6-label benchmark (100,000), 10^7 labels
@pytest.mark.parametrize("points, expected", [(4_880, SMALL_DATA_MEMBERS), (45_644, SMALL_DATA_MEMBERS), (100_000, 1),
                                             (1_000_000, 1)])
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
    assert resolve_members(replace(cfg, model=replace(cfg.model, lexical_features=16)), 4_000)[0] == 1


def test_the_rules_reason_reads_inside_the_logged_sentence():
    """xc-train logs "one model (WHY; train.ensemble=N ...)": a reason is the bare why, never "one model (...)" again."""
    cfg = XCConfig()
    for changed in (replace(cfg, data=replace(cfg.data, valid_fraction=0.0)),
                    replace(cfg, model=replace(cfg.model, lexical_features=16)), cfg):
        for points in (4_000, 10**6):
            _, why = resolve_members(changed, points)
            assert not why.startswith("one model"), why


@pytest.mark.parametrize("change, message", [
    (lambda c: replace(c, train=replace(c.train, ensemble=0)), "must be >= 1"),
    (lambda c: replace(c, train=replace(c.train, ensemble=2), data=replace(c.data, valid_fraction=0.0)),
     "needs a validation split"),
    (lambda c: replace(c, train=replace(c.train, ensemble=2), model=replace(c.model, mode="dual")), "classifier"),
    (lambda c: replace(c, train=replace(c.train, ensemble=3), model=replace(c.model, lexical_features=8)),
     "train.ensemble=1"),
])
def test_member_rule_refuses(change, message):
    with pytest.raises(ConfigError, match=message):
        resolve_members(change(XCConfig()), 4_000)


@pytest.mark.parametrize("split", ["crossfit", "shared"])
def test_members_validation_folds_and_seeds(tmp_path, split):
    cfg = replace(XCConfig(), seed=7, run_dir=str(tmp_path))
    cfg = replace(cfg, train=replace(cfg.train, ensemble_split=split))
    members = [member_config(cfg, m) for m in range(3)]
    assert [m.seed for m in members] == [7, 8, 9]
    assert len({m.run_dir for m in members}) == 3 and all(m.run_dir.startswith(str(tmp_path)) for m in members)
    splits = [validation_split(m.data, 4_880, m.seed) for m in members]
    # member 0 holds out the split of the ensemble's seed, whatever the design
    np.testing.assert_array_equal(splits[0][1], split_validation(4_880, 0.1, 5000, 7)[1])
    for train_ids, valid_ids in splits:
        assert len(valid_ids) == 488 and len(train_ids) == 4_880 - 488
        assert not np.isin(valid_ids, train_ids).any()
    if split == "shared":
        for _, valid_ids in splits[1:]:
            np.testing.assert_array_equal(valid_ids, splits[0][1])
    else:  # disjoint folds: every point trains at least 2 of the 3 members, each is held out by at most one
        held = np.concatenate([v for _, v in splits])
        assert len(np.unique(held)) == 3 * 488
    # member 0 is the single model: only where it lives differs
    first = members[0]
    assert first.seed == cfg.seed and first.train.ensemble == 1 and first.data.valid_fold == 0
    assert first.model.lexical_features == 0  # the rule's null: an ensemble's members get no lexical weights
    assert replace(first, name=cfg.name, run_dir=cfg.run_dir, train=cfg.train, model=cfg.model,
                   data=replace(first.data, split_seed=None)) == cfg


def test_validation_folds_are_disjoint_and_refused_when_they_do_not_fit():
    folds = [split_validation(1_000, 0.2, 0, seed=3, fold=f)[1] for f in range(4)]
    assert len(np.unique(np.concatenate(folds))) == 4 * 200
    np.testing.assert_array_equal(folds[0], split_validation(1_000, 0.2, 0, seed=3)[1])
    with pytest.raises(ConfigError, match="data.valid_fold"):
        split_validation(1_000, 0.2, 0, seed=3, fold=4)  # 5 folds of 200 would leave no point to train on
    cfg = XCConfig()
    wide = replace(cfg, data=replace(cfg.data, valid_fraction=0.4))
    with pytest.raises(ConfigError, match="ensemble_split=shared"):
        resolve_members(replace(wide, train=replace(wide.train, ensemble=3)), 4_000)
    assert resolve_members(replace(wide, train=replace(wide.train, ensemble=3, ensemble_split="shared")), 4_000)[0] == 3
    assert resolve_members(wide, 4_000)[0] == 1  # the rule falls back to one model


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


def test_an_unfinished_ensemble_says_so_when_loaded(tmp_path):
    import xc
    from xc.errors import XCError

    (tmp_path / "members" / "m0").mkdir(parents=True)  # members training, no ensemble.json yet
    with pytest.raises(XCError, match="have not all finished"):
        xc.load(tmp_path)
