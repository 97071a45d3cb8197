"""Scores calibrated to probabilities, so predictions can be cut at "every label above p" (`xc-predict --min-score`,
`model.predict(..., threshold=p)`).

The served score (fused probability, or the plain model's score) is mapped to the chance that the label is
relevant by isotonic regression (monotone, no parametric shape assumed), fitted on the top
`CANDIDATES` labels the served model gives each validation point: the run's held-out validation split, never
test. A cross-fitted ensemble's points are each scored by the member that held them out (the way the ensemble's
fusion is chosen; xc/ensemble/members.py), pooled, and the map is applied to the ensemble's averaged score.
The map is stored as knots in RUN_DIR/calibration.json; training reports, on test, micro precision, recall and
F1 of "the labels with probability >= p" at p = 0.5 and at the p that maximises F1 on validation
(`thr@0.5/...`, `thr@best/...`, the chosen p as `thr@best/p`): xc/cli/calibrate.py fits it after training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from xc.errors import XCError

if TYPE_CHECKING:
    from xc.data.sparse import SparseMatrix

CALIBRATION_FILE = "calibration.json"
CANDIDATES = 20  # top labels per point the map is fitted on and thresholds apply to (predict's k caps them)
GRID = np.round(np.arange(0.05, 1.0, 0.05), 2)  # the p searched for the best validation F1


class Calibration:
    """A monotone map score -> probability: knots `xs` (m,) increasing and `ps` (m,) in [0, 1]; scores between
    knots are interpolated, outside them clipped to the end knots."""

    def __init__(self, xs, ps, best_p: float | None = None, fused: bool = False):
        self.xs, self.ps, self.best_p = np.asarray(xs, np.float64), np.asarray(ps, np.float64), best_p
        self.fused = fused  # fitted on fused scores (kNN fusion as trained) or on the plain model's

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
        return {"kind": "isotonic", "x": self.xs.tolist(), "p": self.ps.tolist(), "best_p": self.best_p,
                "fused": self.fused}

    @classmethod
    def read(cls, run_dir) -> "Calibration | None":
        path = Path(run_dir) / CALIBRATION_FILE
        if not path.exists():
            return None
        body = json.loads(path.read_text())
        return cls(body["x"], body["p"], body.get("best_p"), bool(body.get("fused")))


def apply_threshold(preds, calibration: "Calibration | None", threshold: float, where) -> None:
    """Keep, in place, the labels of `preds` (xc.serve.model.Predictions) whose calibrated probability is at least
    `threshold` (the others become -1 pads) and give every row its probabilities (`preds.probs`)."""
    if not 0.0 <= threshold <= 1.0:
        raise XCError(f"threshold (--min-score) is a probability in [0, 1], got {threshold}")
    if calibration is None:
        raise XCError(f"{where} has no {CALIBRATION_FILE}: its scores were not calibrated (eval.calibrate=false); "
                      f"thresholds need it")
    if calibration.fused != preds.fused:
        raise XCError(f"{where}'s calibration was fitted on {'fused' if calibration.fused else 'plain'} scores; "
                      f"these are {'fused' if preds.fused else 'plain'} (--no-fusion or --ann changes them): "
                      f"serve as trained to threshold")
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
