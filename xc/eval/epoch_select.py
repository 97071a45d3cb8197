"""Keep the best epoch, chosen on the validation split (`eval.select_epoch`, on by default).

After every epoch the model ranks its validation rows (`c.train.valid_ids`, carved from the training data by
`data.valid_fraction`) and records their mean P@k over `eval.ks`. When training ends, the model the run keeps
is the best epoch's, but only where it beats the last epoch by more than one standard error of their paired
per-point difference (the rule `xc.fitting.label_prior.choose_from` applies to beta, with the fully trained model as
the simplest); else the last epoch's. The label prior and the kNN fusion are then chosen for the kept model.

Where the label prior is on and an earlier epoch leads, the two candidates are compared as they would be served:
each under the prior validation chooses for it (`xc.fitting.label_prior.calibrated_validation`), the same one-SE rule
on those figures. The plain figures alone misjudge a model whose ranking needs the prior more: at 10^6 labels
ASTRA's hard-negative epoch fell on plain validation (65.25 -> 64.41, gain 0.84 > SE 0.22), so the plain rule kept
the epoch before it, 86.78 P@1 on test under its prior, where the last epoch under its own prior is 87.40
(docs/hard_negatives.md). The cost is one more ranking pass, only when an earlier epoch leads.

Why: the epoch count is a rule of the data's size (xc/defaults/: about TARGET_STEPS optimiser steps), and on
a few thousand points a model peaks well before the rule's last epoch and then overfits. Bibtex's member 0
(4,392 points, 30 epochs): test P@1 64.6 at epoch 10, 63.2 at epoch 30. Which epoch is best is a property of
the data, so it is measured on held-out training points, never on test.

Where the choice lives: every checkpoint carries the selector's state (each epoch's validation figure, the best
so far and the per-point figures of the best and the last epoch), and the best epoch's checkpoint is kept past
`train.keep_checkpoints` (`protected_step`), so a killed run resumes to the same choice. At the end
RUN_DIR/selection.json names the kept checkpoint; `xc.run.checkpoint.final_checkpoint` reads it, so `xc.load`,
`xc-predict`, `xc-eval` and an ensemble load the kept model. A selection made before the run trained further
(its `last_step` is not the newest checkpoint's) is ignored.

Patience (`eval.select_epoch_patience`, 8): once validation has not improved for that many epochs the run stops
training and keeps its epoch as above; the selector's state is in every checkpoint, so a resumed run stops at the
same epoch. On 28 models' validation curves (Bibtex and its 333/1000-point subsets, two dense sets, Bibtex as dense
vectors, Delicious, debian-deps; 7 to 30 epochs) none set a new best after 8 epochs without one, and stopping there
trains 33% fewer epochs; with 3 or 5 the best epoch was missed in 7 and 2 of them.

Cost: one exact ranking of the validation rows per epoch (at most `data.valid_max_points`), as much as one test
evaluation of as many points (29 s for 5,000 points at 10^6 labels on 2 cores). The classifier mode
(xc/train/modes/classifier/mode.py) and the dual mode (xc/train/modes/dual/mode.py, which ranks its validation rows
against every label re-encoded) both keep an epoch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from xc.run import checkpoint as ckpt
from xc.distributed import broadcast_object
from xc.errors import CheckpointError
from xc.eval.metrics import paired_gain
from xc.fsutil import write_json_atomic

log = logging.getLogger("xc.eval.epoch_select")


class EpochSelector:
    """Each epoch's validation mean P@k, the best so far, and the end-of-run choice (module docstring).

    `score_validation()` (every rank) gives the model as it is now on the validation rows: (V,) per-point mean
    P@k over `eval.ks`, fractions in [0, 1] (`xc.fitting.label_prior.validation_ranking` for the classifier
    mode); `enabled`: the run selects (`eval.select_epoch`) and has validation rows."""

    def __init__(self, enabled: bool, score_validation: Callable[[], np.ndarray], ctx, logger):
        self.score_validation, self.ctx, self.logger = score_validation, ctx, logger
        self.enabled = bool(enabled)
        self.history: list[dict] = []  # {"epoch", "global_step", "valid"}: mean P@k in %
        self.best: dict | None = None
        self.best_points: np.ndarray | None = None  # (V,) per-point figures of the best epoch
        self.last_points: np.ndarray | None = None  # (V,) of the newest recorded epoch
        # the newest epoch's paired (gain, SE) in points over the best epoch before it: the epochs rule's evidence
        self.gain_over_best: tuple[float, float] | None = None
        self.kept_prior = None  # the kept model's PriorChoice where `finish` judged the candidates as served

    def after_epoch(self, epoch: int, global_step: int) -> None:
        """Rank the validation rows under the current model (every rank takes part) and record them."""
        if not self.enabled:
            return
        points = self.score_validation()
        row = {"epoch": epoch, "global_step": global_step, "valid": round(100.0 * float(points.mean()), 4)}
        self.history.append(row)
        self.gain_over_best = None if self.best_points is None or len(self.best_points) != len(points) else \
            paired_gain(points, self.best_points)
        self.last_points = points
        if self.best is None or row["valid"] > self.best["valid"]:  # ties keep the earlier: no better, trained less
            self.best, self.best_points = row, points
        if self.ctx.is_main:
            log.info("validation epoch %d: mean P@k %.2f (best so far: epoch %d, %.2f)", epoch, row["valid"],
                     self.best["epoch"], self.best["valid"])
            self.logger.event("valid", **row)

    def _judge_served(self, choice: dict, served_last, served_best) -> dict:
        """The plain choice of an earlier epoch, judged again with each candidate under its own prior."""
        (last_points, last_prior), (best_points, best_prior) = served_last, served_best
        gain, se = paired_gain(best_points, last_points)
        keep_best = bool(broadcast_object(gain > se, self.ctx))  # rank 0's figures decide, as everywhere
        served = {"rule": "the same, each candidate under the label prior validation chooses for it",
                  "best": round(100.0 * float(best_points.mean()), 4), "best_beta": best_prior.beta,
                  "last": round(100.0 * float(last_points.mean()), 4), "last_beta": last_prior.beta,
                  "gain": round(gain, 4), "gain_se": round(se, 4)}
        self.kept_prior = best_prior if keep_best else last_prior
        if self.ctx.is_main:
            log.info("as served (each under its own label prior): epoch %d %.2f (beta %g) against the last %.2f "
                     "(beta %g): gain %.2f, SE %.2f: keeping %s", choice["best"]["epoch"], served["best"],
                     best_prior.beta, served["last"], last_prior.beta, gain, se,
                     f"epoch {choice['best']['epoch']}" if keep_best else "the last epoch")
        return dict(choice, kept=choice["best"] if keep_best else choice["last"], served=served)

    def epochs_since_best(self) -> int:
        """Epochs recorded since the best one (0 while the newest is the best, or when nothing is recorded)."""
        if not self.enabled or self.best is None or not self.history:
            return 0
        return int(self.history[-1]["epoch"] - self.best["epoch"])

    def protected_step(self) -> int | None:
        """The best epoch's checkpoint step, which pruning must keep."""
        return self.best["global_step"] if self.enabled and self.best else None

    def state_dict(self) -> dict:
        as_tensor = lambda a: None if a is None else torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
        return {"history": list(self.history), "best": self.best, "best_points": as_tensor(self.best_points),
                "last_points": as_tensor(self.last_points)}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        as_array = lambda t: None if t is None else t.numpy()  # noqa: E731
        self.history, self.best = list(state["history"]), state["best"]
        self.best_points, self.last_points = as_array(state["best_points"]), as_array(state["last_points"])

    def choose(self) -> dict | None:
        """The kept epoch ({"epoch", "global_step", "valid"}) and why, or None when there is nothing to choose."""
        if not self.enabled or self.best is None or self.last_points is None:
            return None
        last = self.history[-1]
        gain, se = (0.0, 0.0) if self.best is last or self.best["global_step"] == last["global_step"] else \
            paired_gain(self.best_points, self.last_points)
        kept = self.best if gain > se else last
        return {"rule": "best validation epoch if it beats the last by more than one standard error, else the last",
                "kept": kept, "last": last, "best": self.best, "gain": round(gain, 4), "gain_se": round(se, 4),
                "valid_points": int(len(self.last_points)), "epochs": self.history}

    def finish(self, run_dir, load_weights, calibrate=None) -> dict | None:
        """Choose, load the kept epoch's weights where it is not the last (`load_weights(path)`, every rank),
        and write RUN_DIR/selection.json (rank 0). `calibrate()` (every rank) gives the model as it is now as
        served on validation ((V,) per-point figures, its PriorChoice), or None: where given, an earlier epoch
        that leads on plain figures is judged again under the priors (module docstring), and `kept_prior` is
        the kept model's choice. Returns the choice (None: nothing chosen)."""
        self.kept_prior = None
        choice = broadcast_object(self.choose(), self.ctx)
        if choice is None:
            return None
        kept, last = choice["kept"], choice["last"]
        if kept["global_step"] != last["global_step"]:
            try:
                served_last = calibrate() if calibrate is not None else None
                load_weights(ckpt.step_dir(run_dir, kept["global_step"]))
                if served_last is not None:
                    choice = self._judge_served(choice, served_last, calibrate())
                    kept = choice["kept"]
                    if kept["global_step"] == last["global_step"]:  # the last wins as served: back to its weights
                        load_weights(ckpt.step_dir(run_dir, last["global_step"]))
            except CheckpointError as exc:  # removed or damaged by hand since: the run still ends with a model
                log.warning("the kept epoch's checkpoint is unusable, keeping the last epoch: %s", exc)
                choice = dict(choice, kept=last, unusable=str(exc)[:500])
                kept = last
                self.kept_prior = None
        if self.ctx.is_main:
            write_json_atomic(str(Path(run_dir) / ckpt.SELECTION_FILE), choice)
            best = choice["best"]
            if kept["global_step"] != last["global_step"]:
                log.info("kept epoch %d of %d: validation mean P@k %.2f against the last epoch's %.2f (gain %.2f, "
                         "more than its SE %.2f)", kept["epoch"], last["epoch"], kept["valid"], last["valid"],
                         choice["gain"], choice["gain_se"])
            elif "served" in choice:
                log.info("kept the last epoch %d: epoch %d led it on plain validation (%.2f against %.2f), not as "
                         "served (%.2f against %.2f)", last["epoch"], best["epoch"], best["valid"], last["valid"],
                         choice["served"]["best"], choice["served"]["last"])
            elif best["global_step"] != last["global_step"]:
                log.info("kept the last epoch %d (validation mean P@k %.2f): the best, epoch %d (%.2f), is within one "
                         "SE of it (gain %.2f, SE %.2f)", last["epoch"], last["valid"], best["epoch"], best["valid"],
                         choice["gain"], choice["gain_se"])
            else:
                log.info("kept the last epoch %d, the best on validation (mean P@k %.2f)", last["epoch"], last["valid"])
            self.logger.event("select_epoch", epoch=kept["epoch"], global_step=kept["global_step"],
                              last_epoch=last["epoch"], gain=choice["gain"], gain_se=choice["gain_se"])
        return choice
