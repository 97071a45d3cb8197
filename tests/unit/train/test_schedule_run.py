"""`train.epochs_by_validation` through the Trainer (xc/train/schedule.py, xc/train/trainer.py): validation ends the
run before its cap with one decaying epoch, the refresh path plans no snapshot past it, and a run resumed from a
checkpoint written after the decision trains the same steps to the same weights as the run that went on."""

from __future__ import annotations

import shutil
from dataclasses import replace

import torch

from tests.unit.train.test_plan import _setup
from xc.run import checkpoint as ckpt
from xc.train import plan as plan_module
from xc.train.trainer import Trainer

OPEN = ("train.epochs=12", "train.epochs_by_validation=true", "train.keep_checkpoints=0", "eval.select_epoch_patience=0",
        "data.synthetic.num_train=1200", "model.embed_dim=16", "train.batch_size=64", "train.min_lr_ratio=0.05")


def _flat_epochs(trainer, epoch: int) -> list[bool]:
    """For epochs 2 to `epoch`: whether each gained no more than its standard error over the best epoch before it
    (paired, from the checkpoints' selector states)."""
    from xc.eval.metrics import paired_gain

    steps = trainer.mode.schedule.steps_per_epoch
    points = [ckpt.load_state_file(ckpt.step_dir(trainer.cfg.run_dir, e * steps) / "rank0.pt")["selector"]["last_points"]
              .numpy() for e in range(1, epoch + 1)]
    flat, best = [], points[0]
    for p in points[1:]:
        gain, se = paired_gain(p, best)
        flat.append(bool(gain <= se))
        best = p if p.mean() > best.mean() else best
    return flat


def _train(cfg, ctx, dataset) -> Trainer:
    trainer = Trainer(plan_module.resolve_run(cfg, ctx, dataset), ctx, dataset)
    trainer.fit()
    return trainer


def test_validation_ends_the_run_with_one_decaying_epoch_and_a_resume_after_the_decision_matches(tmp_path):
    cfg, ctx, dataset = _setup(tmp_path / "a", "classifier", *OPEN)
    went_on = _train(cfg, ctx, dataset)
    schedule = went_on.mode.schedule
    assert schedule.last_epoch is not None and 3 <= schedule.epochs < 12  # stopped by validation, not the cap
    assert went_on.epoch == schedule.epochs and went_on.global_step == schedule.epochs * schedule.steps_per_epoch
    assert schedule.factor(went_on.global_step - 1) < 0.06  # the last step at (about) train.min_lr_ratio
    flat = _flat_epochs(went_on, schedule.last_epoch)  # the epoch that decided gained within its SE over the best ...
    assert flat[-1] and schedule.flat_epochs == 1
    assert not any(flat[1:-1])  # ... and none before it that could have decided (from epoch MIN_EPOCHS - 1 on)

    # the checkpoint of the epoch that decided: its schedule state says which epoch decays
    decided = ckpt.step_dir(cfg.run_dir, schedule.last_epoch * schedule.steps_per_epoch)
    resumed_dir = tmp_path / "b" / "run"
    shutil.copytree(cfg.run_dir, resumed_dir)
    for path in ckpt.list_checkpoints(resumed_dir):
        if path.name > decided.name:
            shutil.rmtree(path)
    (resumed_dir / ckpt.SELECTION_FILE).unlink(missing_ok=True)
    resumed = _train(replace(cfg, run_dir=str(resumed_dir)), ctx, dataset)
    assert resumed.resume_from is not None and resumed.mode.schedule.epochs == schedule.epochs
    assert resumed.global_step == went_on.global_step
    assert torch.equal(resumed.mode.c.shard.weight, went_on.mode.c.shard.weight)
