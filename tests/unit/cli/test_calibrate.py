"""xc/cli/calibrate.py: the map is fitted on the held-out points and the test split scored, one served model in
memory at a time."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import numpy as np

from xc.cli import calibrate
from xc.data.sparse import SparseMatrix
from xc.fitting.final_eval import ServedScores
from xc.serve.model import Predictions

LIVE: list = []


class FakeModel:
    """A served model over 4 labels whose top-2 for every point is labels (0, 1) with scores (2, -2)."""

    num_labels = 4
    prior_beta, meta = 0.5, {"global_step": 7}  # what the map records of the scores it was fitted on

    def __init__(self, run_dir: Path):
        self.run_dir, self.checkpoint = run_dir, run_dir / "checkpoints" / "step-00000007"
        labels = SparseMatrix(np.arange(0, 7, dtype=np.int64), np.zeros(6, np.int32), np.ones(6, np.float32), 4)
        self.dataset = type("D", (), {"train": type("S", (), {"labels": labels, "num_points": 6})(),
                                      "test": type("S", (), {"labels": labels, "num_points": 6})()})()
        self.memories = []  # the kNN memory each predict was given
        LIVE.append(weakref.ref(self))

    def predict(self, block, k, knn_memory=None):
        self.memories.append(None if knn_memory is None else knn_memory.tolist())
        n = 6 if block == "test" else 3
        ids = np.tile(np.array([[0, 1]], np.int64), (n, 1))
        scores = np.tile(np.array([[2.0, -2.0]], np.float32), (n, 1))
        return Predictions(ids, scores, None, False)


def _alive() -> int:
    gc.collect()
    return sum(ref() is not None for ref in LIVE)


def test_a_single_run_is_loaded_once_and_scored_on_validation_and_test(monkeypatch, tmp_path):
    loads, peak, models = [], [], []

    def load(run_dir):
        peak.append(_alive())  # models alive while the next one loads
        loads.append(Path(run_dir))
        models.append(FakeModel(Path(run_dir)))
        return models[-1]

    monkeypatch.setattr(calibrate, "load_run", load)
    monkeypatch.setattr(calibrate, "_held_out", lambda run_dir: [(run_dir, np.array([0, 1, 2]))])
    monkeypatch.setattr(calibrate, "split_block", lambda dataset, split, rows: split)
    out = calibrate.calibrate_run(tmp_path)
    assert loads == [tmp_path] and peak == [0]
    # validation rows 0-2 served with the other training points as the kNN memory, test rows with every one
    assert models[0].memories == [[3, 4, 5], None]
    saved = json.loads((tmp_path / "calibration.json").read_text())
    assert saved["fused"] is False
    assert saved["scores"] == {"models": [{"checkpoint": "step-00000007", "global_step": 7, "prior_beta": 0.5}],
                               "fused": False}
    # label 0 is every point's positive and scores 2; label 1 never is and scores -2: the map separates them
    assert out["thr@0.5/precision"] == 100.0 and out["thr@0.5/recall"] == 100.0


def test_members_are_released_before_the_ensemble_loads(monkeypatch, tmp_path):
    members = [tmp_path / "members" / f"m{i}" for i in range(2)]
    loads, peak = [], []

    def load(run_dir):
        peak.append(_alive())
        loads.append(Path(run_dir))
        return FakeModel(Path(run_dir))

    LIVE.clear()
    monkeypatch.setattr(calibrate, "load_run", load)
    monkeypatch.setattr(calibrate, "_held_out", lambda run_dir: [(m, np.array([0, 1, 2])) for m in members])
    monkeypatch.setattr(calibrate, "split_block", lambda dataset, split, rows: split)
    calibrate.calibrate_run(tmp_path)
    assert loads == [*members, tmp_path]
    assert peak == [0, 0, 0]  # never two served models at once


def _served(width: int) -> ServedScores:
    """Three held-out rows and six test rows whose top 2 are a relevant label scoring 2 and another scoring -2."""
    top = lambda n: np.tile(np.array([[2.0, -2.0] + [-9.0] * (width - 2)], np.float32), (n, 1))  # noqa: E731
    hits = lambda n: np.tile(np.array([[True] + [False] * (width - 1)]), (n, 1))  # noqa: E731
    return ServedScores(width, 0.5, top(3), hits(3), 3, top(6), hits(6), 6)


def test_the_final_evaluations_own_ranking_is_fitted_on_without_loading_the_run(monkeypatch, tmp_path):
    loads = []
    monkeypatch.setattr(calibrate, "load_run", lambda run_dir: loads.append(run_dir))
    meta = {"global_step": 7}
    monkeypatch.setattr(calibrate, "final_checkpoint", lambda run_dir: (Path(run_dir) / "checkpoints/step-00000007", meta))
    out = calibrate.calibrate_run(tmp_path, _served(calibrate.CANDIDATES))
    assert loads == []
    saved = json.loads((tmp_path / "calibration.json").read_text())
    assert saved["fused"] is True
    assert saved["scores"] == {"models": [{"checkpoint": "step-00000007", "global_step": 7, "prior_beta": 0.5}],
                               "fused": True}
    assert out["thr@0.5/precision"] == 100.0 and out["thr@0.5/recall"] == 100.0


def test_a_ranking_narrower_than_the_served_one_is_not_fitted_on(monkeypatch, tmp_path):
    """Candidates narrower than CANDIDATES are not the lists `predict(k=CANDIDATES)` serves: the run is loaded."""
    monkeypatch.setattr(calibrate, "load_run", lambda run_dir: FakeModel(Path(run_dir)))
    monkeypatch.setattr(calibrate, "_held_out", lambda run_dir: [(run_dir, np.array([0, 1, 2]))])
    monkeypatch.setattr(calibrate, "split_block", lambda dataset, split, rows: split)
    calibrate.calibrate_run(tmp_path, _served(calibrate.CANDIDATES - 1))
    assert json.loads((tmp_path / "calibration.json").read_text())["fused"] is False  # FakeModel's plain scores


def test_the_reloaded_map_is_fitted_on_the_scores_the_final_evaluation_served(tmp_path, monkeypatch):
    """Loaded again, the run serves its validation rows as the final evaluation ranked them (the points that trained
    the model as the kNN memory); with every training point as memory each row would vote for its own labels."""
    from tests.unit.train.test_plan import _setup
    from xc.cli import train as cli_train
    from xc.faults import NO_FAULTS

    kept = []
    monkeypatch.setattr(calibrate, "calibrate_run", lambda run_dir, served=None: kept.append(served) or {})
    cfg, ctx, dataset = _setup(tmp_path, "classifier", "data.synthetic.num_train=600", "data.synthetic.num_test=40",
                               "data.synthetic.num_labels=300", "data.synthetic.num_features=500", "model.embed_dim=16",
                               "train.warmup_steps=2", "train.ensemble=1", "train.epochs=1",
                               "eval.knn_fusion.enabled=true", "eval.ranker.enabled=false", "eval.label_prior.beta=0")
    cli_train._train_model(cfg, ctx, dataset, None, NO_FAULTS)
    served = kept[0]
    run_dir = tmp_path / "run"
    [(_, rows)] = calibrate._held_out(run_dir)
    model = calibrate.load_run(run_dir)
    block = calibrate.split_block(model.dataset, "train", rows)
    memory = np.setdiff1d(np.arange(model.dataset.train.num_points), rows)
    k = calibrate.CANDIDATES
    held_out = model.predict(block, k=k, knn_memory=memory)
    np.testing.assert_allclose(held_out.scores, served.valid_scores[:, :k], rtol=1e-5)
    assert np.array_equal(calibrate.relevance(held_out.ids, model.dataset.train.labels, rows),
                          served.valid_hits[:, :k])
    itself = model.predict(block, k=k)  # every training point as memory: the row is its own nearest neighbour
    share = lambda p: calibrate.relevance(p.ids, model.dataset.train.labels, rows)[:, :1].mean()  # noqa: E731
    assert share(itself) > share(held_out)
