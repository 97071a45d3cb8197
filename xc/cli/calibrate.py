"""The run's score calibration fitted after training (xc/serve/calibration.py says what it is): the served model on
its held-out validation points, the map written to RUN_DIR/calibration.json, the thresholds' test figures."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from xc.arrays import csr_rows
from xc.config import build_config
from xc.data import read_texts
from xc.data.inputs import validation_split
from xc.data.queries import QueryBlock
from xc.data.sparse import SparseMatrix
from xc.datasets import load_configured_dataset
from xc.fitting.final_eval import ServedScores
from xc.serve.ensemble import EnsembleModel, member_dir, read_ensemble
from xc.fsutil import write_json_atomic
from xc.serve.calibration import (CALIBRATION_FILE, CANDIDATES, GRID, Calibration, precision_recall, relevance,
                                  score_source)
from xc.run.checkpoint import final_checkpoint
from xc.serve.model import TrainedModel

log = logging.getLogger(__name__)


def load_run(run_dir) -> TrainedModel | EnsembleModel:
    """A finished run as `xc.load` serves it (one model, or an ensemble)."""
    run_dir = Path(run_dir)
    return EnsembleModel(run_dir) if (run_dir / "ensemble.json").exists() else TrainedModel(run_dir)


def split_block(dataset, split_name: str, rows: np.ndarray) -> QueryBlock:
    """Points `rows` of a split as the served model's input: their feature rows and, where the data has them,
    texts."""
    split = getattr(dataset, split_name)
    features = None
    if split.features is not None:
        indptr, indices = csr_rows(split.features.indptr, split.features.indices, rows)
        _, values = csr_rows(split.features.indptr, split.features.values, rows)
        features = SparseMatrix(indptr, indices.astype(np.int32), values.astype(np.float32), split.features.num_cols)
    texts = read_texts(split.texts_path, rows) if split.texts_path else None
    return QueryBlock(1, texts=texts, features=features)


def _held_out(run_dir: Path) -> list[tuple[Path, np.ndarray]]:
    """(model directory, its validation rows) whose served scores the map is fitted on: the run itself, or a
    cross-fitted ensemble's members (RUN_DIR/members/m*, each a run with its config), each on the fold it held out."""
    cfg = build_config(json.loads((run_dir / "config.json").read_text()))
    num_points = load_configured_dataset(cfg).train.num_points
    if not ((run_dir / "ensemble.json").exists() and cfg.train.ensemble_split == "crossfit"):
        return [(run_dir, validation_split(cfg.data, num_points, cfg.seed)[1])]
    out = []
    for member in sorted((run_dir / "members").glob("m*"), key=lambda d: int(d.name[1:])):
        member_cfg = build_config(json.loads((member / "config.json").read_text()))
        out.append((member, validation_split(member_cfg.data, num_points, member_cfg.seed)[1]))
    return out


def other_points(model, rows: np.ndarray) -> np.ndarray:
    """The kNN memory of held-out rows `rows`: every other training point, the memory the model trained beside (with
    itself in it, a validation point votes for its own labels and the map promises more than test gives)."""
    return np.setdiff1d(np.arange(model.dataset.train.num_points), rows)


def held_out_scores(held_out: list[tuple[Path, np.ndarray]], memory=other_points):
    """(scores (V, CANDIDATES), hits (V, CANDIDATES) bool, relevant labels of the rows, fused, the last model loaded)
    of each model's held-out rows (`_held_out`) served with `memory(model, rows)` as the kNN memory (None: every
    training point), one served model in memory at a time: with its kNN memory and ranker, two at 10^6 labels have
    exhausted 24 GiB beside another run."""
    scores, hits, num_true, model, preds = [], [], 0, None, None
    for model_dir, rows in held_out:
        model = None
        model = load_run(model_dir)
        preds = model.predict(split_block(model.dataset, "train", rows), k=min(CANDIDATES, model.num_labels),
                              knn_memory=memory(model, rows))
        scores.append(preds.scores)
        hits.append(relevance(preds.ids, model.dataset.train.labels, rows))
        num_true += int(np.diff(model.dataset.train.labels.indptr)[rows].sum())
    return np.concatenate(scores), np.concatenate(hits), num_true, bool(preds.fused), model


def calibrate_run(run_dir: str | Path, served: ServedScores | None = None) -> dict[str, float]:
    """Fit the run's map on validation, write RUN_DIR/calibration.json, and return the test figures at p = 0.5
    and at the best validation-F1 p (keys `thr@0.5/precision`, ..., `thr@best/p`); {} when nothing to fit on.
    `served`: the training process's own fused ranking of the held-out and test rows (xc/fitting/final_eval.py),
    fitted on where its candidates are those served (at least `CANDIDATES` wide); else the run is loaded and its
    held-out and test rows ranked as served."""
    run_dir = Path(run_dir)
    if served is not None and served.width >= CANDIDATES:
        return _calibrate_served(run_dir, served)
    held_out = _held_out(run_dir)
    if any(len(rows) == 0 for _, rows in held_out):
        log.info("no validation split: scores are not calibrated (--min-score unavailable)")
        return {}
    scores, hits, num_true_valid, fused, model = held_out_scores(held_out)
    calibration = _fit(scores, hits, num_true_valid, fused)
    if [d for d, _ in held_out] != [run_dir]:  # fitted on the members: the ensemble itself serves the test split
        model = None
        model = load_run(run_dir)
    calibration.source = score_source(model, fused)  # the scores the map applies to, checked at threshold
    write_json_atomic(os.path.join(run_dir, CALIBRATION_FILE), calibration.as_dict())
    test = model.dataset.test
    rows = np.arange(test.num_points, dtype=np.int64)
    preds = model.predict(split_block(model.dataset, "test", rows), k=min(CANDIDATES, model.num_labels))
    return _test_figures(calibration, preds.scores, relevance(preds.ids, test.labels, rows),
                         int(test.labels.indptr[-1]), len(scores))


def _calibrate_served(run_dir: Path, served: ServedScores) -> dict[str, float]:
    """`calibrate_run` on the final evaluation's own ranking: no model loaded, nothing ranked again (at 10^7 labels
    that was two rankings as long as the final evaluation's, about 20 minutes)."""
    top = slice(0, CANDIDATES)
    calibration = _fit(served.valid_scores[:, top], served.valid_hits[:, top], served.valid_true, True)
    # what `score_source` gives the run as `xc.load` serves it: each model's final checkpoint (an ensemble's members)
    dirs = ([member_dir(run_dir, m) for m in range(int(read_ensemble(run_dir)["members"]))]
            if (run_dir / "ensemble.json").exists() else [run_dir])
    models = []
    for model_dir in dirs:
        checkpoint, meta = final_checkpoint(model_dir)
        models.append({"checkpoint": checkpoint.name, "global_step": int(meta["global_step"]),
                       "prior_beta": served.prior_beta})
    calibration.source = {"models": models, "fused": True}
    write_json_atomic(os.path.join(run_dir, CALIBRATION_FILE), calibration.as_dict())
    return _test_figures(calibration, served.test_scores[:, top], served.test_hits[:, top], served.test_true,
                         len(served.valid_scores))


def _fit(scores: np.ndarray, hits: np.ndarray, num_true_valid: int, fused: bool) -> Calibration:
    """The map fitted on validation scores (n, k) and their hits (n, k) bool (-inf pads left out), with the p of the
    best validation F1 (`num_true_valid`: every relevant label of the points)."""
    finite = np.isfinite(scores)
    calibration = Calibration.fit(scores[finite], hits[finite])
    calibration.fused = fused
    valid_probs = calibration(scores)
    f1 = [precision_recall(valid_probs, hits, num_true_valid, p)["F1"] for p in GRID]
    calibration.best_p = float(GRID[int(np.argmax(f1))])
    return calibration


def _test_figures(calibration: Calibration, scores: np.ndarray, hits: np.ndarray, num_true: int,
                  valid_points: int) -> dict[str, float]:
    """Test precision, recall and F1 of the labels the map gives probability >= 0.5 and >= its best p, logged."""
    probs = calibration(scores)
    out = {"thr@best/p": calibration.best_p}
    for tag, p in (("0.5", 0.5), ("best", calibration.best_p)):
        out.update({f"thr@{tag}/{k}": v for k, v in precision_recall(probs, hits, num_true, p).items()})
    log.info("scores calibrated on %d validation points (RUN_DIR/%s): labels with probability >= 0.5 have test "
             "precision %.2f, recall %.2f; best validation F1 at p = %.2f: test precision %.2f, recall %.2f",
             valid_points, CALIBRATION_FILE, out["thr@0.5/precision"], out["thr@0.5/recall"], calibration.best_p,
             out["thr@best/precision"], out["thr@best/recall"])
    return out
