"""What the one Trainer (xc/train/trainer.py) asks of a training mode, in three small groups.

Both modes (xc/train/modes/classifier/mode.py, xc/train/modes/dual/mode.py) implement `Mode`, the union of the groups;
tests/unit/train/test_mode_protocol.py checks every member and its parameters against both. A mode is built as
`Mode(plan, ctx, dataset, faults=...)` from the run's plan (xc.train.plan.resolve_run: the resolved config and the
checkpoint to resume from) and the tests' fault injection (xc/faults.py; NO_FAULTS by default), and derives no config
value of its own; beyond the groups the Trainer calls only the classifier mode's `step_batch`, for benchmarks and
tests that drive single steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from xc.run.runlog import RunLogger
    from xc.sampling import StepKey
    from xc.train.modes import StepOutcome


@runtime_checkable
class Stepping(Protocol):
    """The epoch loop: epochs of `micro_per_epoch` micro-steps, `total_steps` optimizer steps in the run at most,
    `schedule` (xc/train/schedule.py) the epochs it trains and each step's learning-rate factor."""

    micro_per_epoch: int
    total_steps: int
    schedule: object  # xc.train.schedule.EpochSchedule
    timer: object  # xc.train.phases: the phases timed per logging window

    def start(self, logger: RunLogger) -> None:
        """The run's logger is open: build what logs (the refresh path, the epoch selector)."""

    def describe(self) -> str:
        """One log line: what this mode trains."""

    def begin_epoch(self, epoch: int, micro: int, global_step: int) -> None:
        """Before the epoch's first micro-step (`micro` > 0 where a resumed run starts mid-epoch)."""

    def start_pass(self, epoch: int, micro: int) -> None:
        """The epoch's batches from micro-step `micro` on."""

    def micro_step(self, micro: int, key: StepKey, last_of_step: bool, global_step: int) -> StepOutcome:
        """One micro-batch's forward and backward; the optimizer step where `last_of_step`."""

    def after_optimizer_step(self, global_step: int) -> None:
        """After optimizer step `global_step` (the refresh schedule's clock)."""

    def end_pass(self) -> None:
        """The epoch's batches are done (a prefetch thread stopped)."""

    def after_epoch(self, epoch: int, global_step: int) -> None:
        """After the epoch's evaluation: its validation figures to the epoch selection."""

    def log_fields(self, global_step: int) -> dict:
        """The mode's fields of a `train` event."""

    @staticmethod
    def postfix(fields: dict) -> dict:
        """The progress bar's share of those fields."""

    def end_training(self) -> None:
        """Training is over and checkpointed: drop what only a step needs (optimizer state, master copies) before the
        final phase, whose transients are the run's peak; the model still evaluates, nothing trains again."""

    def close(self, global_step: int) -> None:
        """The run trained to its end: stop the miner, release what the mode holds."""

    def abandon(self) -> None:
        """The run stops on an error or a signal: nothing may outlive it (miner processes, threads)."""


@runtime_checkable
class Evaluation(Protocol):
    """Ranking the test rows each epoch, and the final phase's metrics."""

    test: object  # xc.data: the test split
    inv_propensity: np.ndarray | None  # (L,) on the main rank, for PSP@k
    # xc.fitting.final_eval.ServedScores of the fused final evaluation (None before it, or without fusion): the score
    # calibration (xc/cli/calibrate.py) is fitted on it rather than ranking the run's held-out and test rows again
    served_scores: object

    def rank_test(self, rows: np.ndarray, bar, global_step: int) -> np.ndarray:
        """(len(rows), max k) label ids of test rows, best first."""

    def epochs_since_best(self) -> int:
        """Epochs since validation last improved (train.patience)."""

    def validation_gain(self) -> tuple[float, float] | None:
        """The newest epoch's validation gain over the best epoch before it and its standard error (points of mean
        P@k), paired over the same rows; None where there is no epoch before or no validation."""

    def keep_selected_epoch(self, micro: int) -> bool:
        """Whether the run ends on the epoch selection kept (eval.select_epoch) rather than its last."""

    def final_metrics(self, epoch: int, global_step: int, last: dict[str, float]) -> dict[str, float] | None:
        """The served model's metrics (label prior, kNN fusion, ranker) after the last epoch's `last`; None: those
        stand."""


@runtime_checkable
class CheckpointState(Protocol):
    """What a checkpoint holds of the mode, and how a resume gives it back."""

    def before_checkpoint(self, global_step: int) -> None:
        """Settle what is in flight (a snapshot being written) so a resume finds it published."""

    def finite_state(self) -> dict[str, list[torch.Tensor]]:
        """Tensors checked finite before anything is written, by name."""

    def state_dict(self) -> dict:
        """This rank's state."""

    def negative_tables(self):
        """The hard-negative tables in use (written beside the state), or None."""

    def checkpoint_meta(self) -> dict:
        """The mode's fields of the checkpoint's meta.json."""

    def protected_step(self) -> int | None:
        """A checkpoint step pruning must keep (the selected epoch's), or None."""

    def restore(self, source) -> dict:
        """Load this rank's part of a checkpoint (xc.run.resume's record); returns the whole state dict (the
        Trainer takes its counters from it)."""

    def describe_resume(self, source) -> str:
        """One log line: how the checkpoint maps onto this run."""

    def resumed(self, source, global_step: int) -> None:
        """After the counters are restored: announce what changed (a re-planned schedule, another layout)."""


@runtime_checkable
class Mode(Stepping, Evaluation, CheckpointState, Protocol):
    """Everything the Trainer calls on a mode."""
