"""Scores calibrated to probabilities, so predictions can be cut at "every label above p" (`xc-predict --min-score`,
`model.predict(..., threshold=p)`).

The served score (fused probability, or the plain model's score) is mapped to the chance that the label is
relevant by isotonic regression (monotone, no parametric shape assumed), fitted on the top
`CANDIDATES` labels the served model gives each validation point: the run's held-out validation split, never
test. A cross-fitted ensemble's points are each scored by the member that held them out (the way the ensemble's
fusion is chosen; xc/ensemble/members.py), pooled, and the map is applied to the ensemble's averaged score.
The map is stored as knots in RUN_DIR/calibration.json, with the scores it was fitted on (`score_source`: each
model's checkpoint and step, the label prior's beta, kNN fusion on or off): a threshold is refused in one line where
the scores served differ (another checkpoint, the prior switched off or changed, fusion off, ANN serving), since the
map says nothing about them. Training reports, on test, micro precision, recall and
F1 of "the labels with probability >= p" at p = 0.5 and at the p that maximises F1 on validation
(`thr@0.5/...`, `thr@best/...`, the chosen p as `thr@best/p`): xc/cli/calibrate.py fits it after training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from xc.errors import CheckpointError, XCError

if TYPE_CHECKING:
    from xc.data.sparse import SparseMatrix

CALIBRATION_FILE = "calibration.json"
CANDIDATES = 20  # top labels per point the map is fitted on and thresholds apply to (predict's k caps them)
GRID = np.round(np.arange(0.05, 1.0, 0.05), 2)  # the p searched for the best validation F1


class Calibration:
    """A monotone map score -> probability: knots `xs` (m,) increasing and `ps` (m,) in [0, 1]; scores between
    knots are interpolated, outside them clipped to the end knots."""

    def __init__(self, xs, ps, best_p: float | None = None, fused: bool = False, source: dict | None = None):
        self.xs, self.ps, self.best_p = np.asarray(xs, np.float64), np.asarray(ps, np.float64), best_p
        self.fused = fused  # fitted on fused scores (kNN fusion as trained) or on the plain model's
        self.source = source  # `score_source` of the scores fitted on (None: a map written before it was recorded)

    @classmethod
    def fit(cls, scores: np.ndarray, relevant: np.ndarray) -> "Calibration":
        """Isotonic fit of `relevant` (n,) bool on `scores` (n,) float."""
        from sklearn.isotonic import IsotonicRegression

        iso = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip", increasing=True)
        iso.fit(scores.astype(np.float64), relevant.astype(np.float64))
        return cls(iso.X_thresholds_, iso.y_thresholds_)

    def __call__(self, scores: np.ndarray) -> np.ndarray:
        """Probabilities of `scores` (any shape), float32; -inf pads stay 0."""
        out = np.interp(np.nan_to_num(scores, neginf=-1e30), self.xs, self.ps)
        return out.astype(np.float32)

    def as_dict(self) -> dict:
        out = {"kind": "isotonic", "x": self.xs.tolist(), "p": self.ps.tolist(), "best_p": self.best_p,
               "fused": self.fused}
        return out if self.source is None else dict(out, scores=self.source)

    @classmethod
    def read(cls, run_dir) -> "Calibration | None":
        """RUN_DIR/calibration.json (None where there is none); a damaged file is one CheckpointError line naming
        the field."""
        path = Path(run_dir) / CALIBRATION_FILE
        if not path.exists():
            return None
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not readable JSON ({exc})") from None

        def bad(key: str, want: str) -> CheckpointError:
            found = json.dumps(body.get(key)) if isinstance(body, dict) else type(body).__name__
            return CheckpointError(f"{path}: {key}: {want} expected, found {found[:80]}; calibrate the run again")

        if not isinstance(body, dict):
            raise bad("(top level)", "a JSON object")
        for key in ("x", "p"):
            if not isinstance(body.get(key), list) or not body[key] or not all(_number(v) for v in body[key]):
                raise bad(key, "a non-empty list of numbers")
        if len(body["x"]) != len(body["p"]):
            raise bad("p", f"{len(body['x'])} numbers (one per x)")
        if not (body.get("best_p") is None or _number(body["best_p"])):
            raise bad("best_p", "a number or null")
        if not isinstance(body.get("fused", False), bool):
            raise bad("fused", "true or false")
        source = body.get("scores")
        if source is not None and not (isinstance(source, dict) and isinstance(source.get("fused"), bool)
                                       and isinstance(source.get("models"), list)
                                       and all(isinstance(m, dict) for m in source["models"])):
            raise bad("scores", '{"models": [{"checkpoint", "global_step", "prior_beta"}, ...], "fused": bool}')
        return cls(body["x"], body["p"], body.get("best_p"), bool(body.get("fused")), source)

    def differs(self, served: dict) -> str | None:
        """Why the scores `served` (`score_source`) are not those the map was fitted on, or None where they are
        (or where the map predates the record, which then checks fusion alone)."""
        if self.source is None:
            fitted = {"fused": self.fused}
            served = {"fused": served["fused"]}
        else:
            fitted = self.source
        if fitted == served:
            return None
        return f"it was fitted on the scores of {_describe(fitted)}; these are of {_describe(served)}"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and bool(np.isfinite(value))


def score_source(model, fused: bool) -> dict:
    """What a served model's scores are: each model's (an ensemble's members') checkpoint, its step and the label
    prior's beta it scores with, and whether kNN fusion is applied."""
    members = getattr(model, "members", None) or [model]
    return {"models": [{"checkpoint": m.checkpoint.name, "global_step": int(m.meta["global_step"]),
                        "prior_beta": float(m.prior_beta or 0.0)} for m in members], "fused": bool(fused)}


def _describe(source: dict) -> str:
    parts = []
    models = source.get("models")
    if models is not None:
        each = [f"{m.get('checkpoint')} (step {m.get('global_step')})" for m in models]
        parts.append(f"checkpoint {each[0]}" if len(each) == 1 else f"members {', '.join(each)}")
        betas = sorted({m.get("prior_beta") for m in models}, key=str)
        parts.append("no label prior" if betas == [0.0] else f"label prior beta {', '.join(map(str, betas))}")
    parts.append("kNN fusion" if source["fused"] else "no kNN fusion")
    return ", ".join(parts)


def check_threshold(threshold) -> None:
    """A threshold is a probability: a number in [0, 1] (not a string, not a bool, not NaN), else one XCError line."""
    if not _number(threshold) or not 0.0 <= threshold <= 1.0:
        raise XCError(f"threshold (--min-score) is a probability in [0, 1], got {threshold!r}")


def apply_threshold(preds, calibration: "Calibration | None", threshold: float, where, served: dict | None = None) \
        -> None:
    """Keep, in place, the labels of `preds` (xc.serve.model.Predictions) whose calibrated probability is at least
    `threshold` (the others become -1 pads) and give every row its probabilities (`preds.probs`). `served`
    (`score_source` of the model that scored `preds`) must be what the map was fitted on."""
    check_threshold(threshold)
    if calibration is None:
        raise XCError(f"{where} has no {CALIBRATION_FILE}: its scores were not calibrated (eval.calibrate=false); "
                      f"thresholds need it")
    if calibration.fused != preds.fused:
        raise XCError(f"{where}'s calibration was fitted on {'fused' if calibration.fused else 'plain'} scores; "
                      f"these are {'fused' if preds.fused else 'plain'} (--no-fusion or --ann changes them): "
                      f"serve as trained to threshold")
    why = None if served is None else calibration.differs(served)
    if why is not None:
        raise XCError(f"{where}'s {CALIBRATION_FILE} does not fit these scores: {why}; thresholds apply only to the "
                      "scores they were fitted on (serve the run's model as trained: no --checkpoint, no prior change)")
    preds.probs = calibration(preds.scores)
    below = (preds.probs < threshold) | (preds.ids < 0)
    preds.ids = np.where(below, -1, preds.ids)


def relevance(ids: np.ndarray, truth: SparseMatrix, rows: np.ndarray) -> np.ndarray:
    """(n, k) bool: ids[i, j] is a label of point rows[i] (-1 pads are not)."""
    out = np.zeros(ids.shape, dtype=bool)
    for i, r in enumerate(rows):
        labels = truth.indices[truth.indptr[r]:truth.indptr[r + 1]]
        out[i] = np.isin(ids[i], labels) & (ids[i] >= 0)
    return out


def precision_recall(probs: np.ndarray, hits: np.ndarray, num_true: int, p: float) -> dict[str, float]:
    """Micro precision, recall and F1 (percent) of the labels with probability >= p; `num_true` is every
    relevant label of the points (those outside the candidates count as missed)."""
    chosen = probs >= p
    picked, right = int(chosen.sum()), int((chosen & hits).sum())
    precision = 100.0 * right / picked if picked else 0.0
    recall = 100.0 * right / num_true if num_true else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "F1": f1}
