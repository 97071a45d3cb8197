"""How long a run trains and its learning-rate factor at each step: `EpochSchedule`.

Fixed (`train.epochs_by_validation: false`): `train.epochs` epochs, linear warm-up then cosine decay to
`train.min_lr_ratio` over every planned step (xc/train/optim.py's `lr_factor`).

By validation (`train.epochs_by_validation: true`; the rule turns it on where the data's step rule gives the fewest
epochs, sets of about 85,000 training points and more: xc/defaults/): `train.epochs` is a cap. After the warm-up
the factor stays at 1 while the model keeps learning; after each epoch the validation split's per-point mean P@k is
compared with the best epoch before it (paired over the same points, xc/eval/epoch_select.py). Once
`train.plateau_epochs` epochs in a row (1 by default) have not beaten that best by more than one standard error, the
next epoch is the last, and its factor decays by a half cosine from 1 to `train.min_lr_ratio` over its steps: a
warm-up, constant, decay schedule, whose end can be decided while training ("MiniCPM", 2024; Hägele et al.,
"Scaling Laws and Compute-Optimal Training beyond Fixed Training Durations", NeurIPS 2024: a short final decay
matches a cosine planned for the same length). One flat epoch is enough by default: at 10^7 labels, where the first
epoch on mined negatives fell 0.42 below the one before (SE 0.15), waiting for a second flat epoch trained one more
epoch at the full rate (70.81, flat again) and the decay after it ended at 71.43 against 71.54 for the decay after
one (docs/scale_1e7.md, "The schedule"). The last epoch is also the decaying one where the cap's last epoch
comes, and where `train.time_budget` seconds of training would not hold two more epochs at the pace measured so far.
At least `MIN_EPOCHS` epochs train, the decaying one included.

The decision (which epoch decays; with a time budget, the seconds so far) is part of every checkpoint, so a run
resumed after it decays the same steps; without a time budget nothing here reads the clock, and a resumed run ends
bit-identical to an uninterrupted one; a run that stops on patience or `train.max_steps` ends as it does under a fixed schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xc.train.optim import lr_factor

MIN_EPOCHS = 3


@dataclass
class EpochSchedule:
    """`cap` epochs of `steps_per_epoch` optimizer steps at most (`train.epochs`); `by_validation` as in the module
    docstring, else a cosine over `total_steps`. `last_epoch` (0-based) is the epoch that decays once decided."""

    cap: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    min_ratio: float
    by_validation: bool
    time_budget: float = 0.0
    plateau_epochs: int = 1
    last_epoch: int | None = None
    train_seconds: float = 0.0
    flat_epochs: int = 0  # epochs in a row, the newest included, not above the best before them by more than an SE

    @property
    def epochs(self) -> int:
        """The epochs the run trains as decided so far (the cap until the last one is chosen)."""
        return self.cap if self.last_epoch is None else self.last_epoch + 1

    def factor(self, step: int) -> float:
        """The learning-rate factor of optimizer step `step` (0-based)."""
        if not self.by_validation:
            return lr_factor(step, self.warmup_steps, self.total_steps, self.min_ratio)
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.last_epoch is None or step < self.last_epoch * self.steps_per_epoch:
            return 1.0
        progress = min(1.0, (step - self.last_epoch * self.steps_per_epoch) / max(1, self.steps_per_epoch))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def after_epoch(self, done: int, epoch_seconds: float, gain: float | None, gain_se: float | None) -> str | None:
        """Record epoch `done` (1-based count of finished epochs) that trained for `epoch_seconds`, whose
        validation figure gained `gain` over the best epoch before it with standard error `gain_se` (None: no figure
        before it). Returns why the next epoch is the last, where this decided it; else None."""
        if self.time_budget > 0:  # the only reader of the clock: a run without a budget stays bit-reproducible
            self.train_seconds += epoch_seconds
        if not self.by_validation or self.last_epoch is not None or done >= self.cap:
            return None
        if gain is not None:
            self.flat_epochs = self.flat_epochs + 1 if gain <= gain_se else 0
        why = None
        if done + 1 >= self.cap:
            why = f"the next is epoch {done + 1} of the cap train.epochs={self.cap}"
        elif done + 1 >= MIN_EPOCHS and gain is not None and self.flat_epochs >= self.plateau_epochs:
            flat = f"epoch {done}" if self.flat_epochs == 1 else f"epochs {done - self.flat_epochs + 1} to {done}"
            why = (f"{flat} did not beat the best epoch before by more than a standard error (train.plateau_epochs="
                   f"{self.plateau_epochs}): epoch {done} gained {gain:.2f} on validation (mean P@k) over it, "
                   f"standard error {gain_se:.2f}")
        elif self.time_budget > 0 and self.train_seconds + 2 * epoch_seconds > self.time_budget:
            why = (f"{self.train_seconds:.0f} s trained of train.time_budget={self.time_budget:g}: two more epochs "
                   f"of {epoch_seconds:.0f} s would not fit")
        if why is not None:
            self.last_epoch = done
        return why

    def state_dict(self) -> dict:
        """The decision, and the seconds trained where a time budget reads them (else nothing of the clock: a
        checkpoint of a resumed run equals the uninterrupted run's)."""
        state = {"last_epoch": self.last_epoch, "flat_epochs": self.flat_epochs}
        if self.time_budget > 0:
            state["train_seconds"] = self.train_seconds
        return state

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's decision; none in checkpoints from before the schedule was kept (a fixed schedule's)."""
        if state:
            self.last_epoch, self.train_seconds = state["last_epoch"], float(state.get("train_seconds", 0.0))
            self.flat_epochs = int(state.get("flat_epochs", 0))
