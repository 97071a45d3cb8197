"""The epochs a run trains and each step's learning-rate factor (xc/train/schedule.py): a fixed run's cosine; under
`train.epochs_by_validation` a constant rate until validation stops gaining more than its standard error, then one
decaying epoch; the cap, the time budget and the fewest epochs; the decision carried by checkpoints."""

from __future__ import annotations

import math

import pytest

from xc.train.optim import lr_factor
from xc.train.schedule import MIN_EPOCHS, EpochSchedule


def _open(cap=12, steps=10, warmup=5, budget=0.0, plateau=1):
    return EpochSchedule(cap, steps, cap * steps, warmup, 0.1, True, budget, plateau)


def test_a_fixed_schedule_is_the_planned_cosine_and_never_stops_early():
    fixed = EpochSchedule(3, 10, 30, 5, 0.1, False)
    assert [fixed.factor(s) for s in range(30)] == [lr_factor(s, 5, 30, 0.1) for s in range(30)]
    for done in (1, 2):
        assert fixed.after_epoch(done, 1.0, 0.0, 1.0) is None  # no gain at all: still every epoch
    assert fixed.epochs == 3


def test_the_rate_stays_up_while_validation_gains_then_one_epoch_decays_it():
    s = _open()
    assert [s.factor(k) for k in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]  # warm-up
    assert s.after_epoch(1, 1.0, None, None) is None  # nothing before epoch 1 to compare with
    assert s.after_epoch(2, 1.0, 0.8, 0.3) is None  # gained more than its SE
    assert s.factor(35) == 1.0 and s.epochs == 12
    why = s.after_epoch(3, 1.0, 0.2, 0.3)  # within its SE: epoch 4 (0-based 3) is the last
    assert "gained 0.20" in why and "standard error 0.30" in why and "epoch 3 did not beat" in why
    assert s.epochs == 4 and s.last_epoch == 3
    assert s.factor(29) == 1.0 and s.factor(30) == 1.0  # the decay starts with the last epoch's first step ...
    assert s.factor(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.factor(39) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.9)))  # ... to min_lr_ratio
    assert s.after_epoch(4, 1.0, -5.0, 0.1) is None and s.epochs == 4  # decided once


def test_at_least_the_fewest_epochs_train_and_the_cap_ends_it():
    s = _open()
    assert s.after_epoch(1, 1.0, -1.0, 0.1) is None  # a loss on epoch 1 ...
    assert MIN_EPOCHS == 3 and s.after_epoch(2, 1.0, -1.0, 0.1) is not None  # ... stops after 2 + the decaying one
    assert s.epochs == MIN_EPOCHS
    capped = _open(cap=4)
    assert capped.after_epoch(1, 1.0, None, None) is None and capped.after_epoch(2, 1.0, 5.0, 0.1) is None
    assert "cap" in capped.after_epoch(3, 1.0, 5.0, 0.1) and capped.epochs == 4


def test_the_time_budget_ends_it_where_two_more_epochs_would_not_fit():
    s = _open(budget=100.0)
    assert s.after_epoch(1, 30.0, None, None) is None  # 30 + 2 x 30 = 90 <= 100
    why = s.after_epoch(2, 30.0, 5.0, 0.1)  # 60 + 60 > 100: the next (the third) is the last
    assert "train.time_budget=100" in why and s.epochs == 3


def test_the_decision_is_part_of_the_checkpoint_and_the_clock_only_under_a_budget():
    s = _open()
    s.after_epoch(1, 2.0, None, None)
    s.after_epoch(2, 2.0, 1.0, 0.2)
    s.after_epoch(3, 2.0, 0.1, 0.2)
    assert s.state_dict() == {"last_epoch": 3, "flat_epochs": 1}  # no seconds: two runs' checkpoints are equal bit for bit
    resumed = _open()
    resumed.load_state_dict(s.state_dict())
    assert (resumed.epochs, resumed.last_epoch, resumed.train_seconds) == (4, 3, 0.0)
    assert [resumed.factor(k) for k in range(40)] == [s.factor(k) for k in range(40)]
    budget = _open(budget=1000.0)
    budget.after_epoch(1, 2.5, None, None)
    again = _open(budget=1000.0)
    again.load_state_dict(budget.state_dict())
    assert again.train_seconds == 2.5 and budget.state_dict() == {"last_epoch": None, "flat_epochs": 0,
                                                                 "train_seconds": 2.5}
    before = _open()
    before.load_state_dict(None)  # a checkpoint from before the schedule was kept: undecided
    assert before.epochs == 12


def test_two_flat_epochs_in_a_row_call_the_decay_and_a_gain_between_them_resets_the_count():
    """train.plateau_epochs=2: one flat epoch (no gain over the best before it beyond its SE) is not
    enough; a gain beyond its SE starts the count again; the count is part of the checkpoint."""
    s = _open(plateau=2)
    assert s.after_epoch(1, 1.0, None, None) is None
    assert s.after_epoch(2, 1.0, -0.42, 0.15) is None and s.flat_epochs == 1  # a dip: one flat epoch, not enough
    assert s.after_epoch(3, 1.0, 0.50, 0.15) is None and s.flat_epochs == 0  # beat the best: the count restarts
    assert s.after_epoch(4, 1.0, 0.10, 0.15) is None and s.flat_epochs == 1
    resumed = _open(plateau=2)
    resumed.load_state_dict(s.state_dict())  # a resume between the two flat epochs keeps the count
    for schedule in (s, resumed):
        why = schedule.after_epoch(5, 1.0, -0.05, 0.15)
        assert "epochs 4 to 5 did not beat" in why and "train.plateau_epochs=2" in why
        assert schedule.epochs == 6 and schedule.last_epoch == 5
    older = _open(plateau=2)
    older.load_state_dict({"last_epoch": None})  # a checkpoint from before the count was kept: none counted
    assert older.flat_epochs == 0 and older.epochs == 12
