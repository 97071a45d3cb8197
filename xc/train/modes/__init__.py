"""The two training modes the one Trainer (xc/train/trainer.py) conducts: `classifier` (an encoder and one
classifier row per label, ASTRA's negatives) and `dual` (query and label towers over texts, negatives from a
label-embedding cache). Each mode owns its model, optimisers, batches and evaluation ranking; the Trainer owns
the loop, logging, the non-finite policy, counters, checkpoints and resume. The protocol a mode implements:

    plan(cfg, ctx, dataset) -> ModePlan          the resolved config and the checkpoint to resume from
    start(logger); describe() -> str
    begin_epoch(epoch, micro, global_step); start_pass(epoch, micro); end_pass(); after_epoch(epoch, global_step)
    micro_step(micro, key, last_of_step, global_step) -> StepOutcome; after_optimizer_step(global_step)
    timer; log_fields(global_step) -> dict; postfix(fields) -> dict
    rank_test(rows, bar, global_step) -> (n, topk) ids; test; inv_propensity
    epochs_since_best() -> int; keep_selected_epoch(micro) -> bool
    final_metrics(epoch, global_step, last) -> dict | None; close; abandon
    before_checkpoint; finite_state; state_dict; negative_tables; checkpoint_meta; protected_step
    restore(source) -> state; describe_resume(source); resumed(source, global_step)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModePlan:
    """What a mode is built from: the config with its data-derived defaults, the checkpoint to resume from
    (None: a fresh run) and how it is resumed (xc.run.resume's SAME / RESPLIT / ... for the classifier mode)."""

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
