"""The two training modes the one Trainer (xc/train/trainer.py) conducts: `classifier` (an encoder and one
classifier row per label, ASTRA's negatives) and `dual` (query and label towers over texts, negatives from a
label-embedding cache). Each mode owns its model, optimisers, batches and evaluation ranking; the Trainer owns
the loop, logging, the non-finite policy, counters, checkpoints and resume. The protocol a mode implements, in
three groups (stepping, evaluation, checkpoint state), is `xc.train.modes.protocol.Mode`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModePlan:
    """What the Trainer and its mode are built from, made once per run by xc.train.plan.resolve_run: the config with
    every rule applied, the checkpoint to resume from (None: a fresh run) and how it is resumed (xc.run.resume's
    SAME / RESPLIT / ... for the classifier mode)."""

    cfg: Any  # XCConfig
    source: Any = None  # xc.run.resume's checkpoint record, or None
    how: str | None = None


@dataclass(frozen=True)
class StepOutcome:
    """One micro-step: `loss` this rank's share (None: dropped), `stepped` an optimizer step was applied,
    `nonfinite` what was NaN/inf on some rank (the Trainer skips or stops, by train.nonfinite)."""

    loss: float | None
    stepped: bool
    nonfinite: str | None = None
