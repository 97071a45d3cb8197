"""An ensemble run (xc/ensemble.py) as one model: `xc.load(run_dir)` returns an `EnsembleModel` when the run
directory holds an ensemble, and `xc-predict` / `xc-eval` serve it like a single model.

    model = xc.load("runs/bibtex-astra")        # RUN_DIR/ensemble.json: every member restored
    model.predict(rows, k=5)                    # the members' fused probabilities, averaged
    model.members[0].encode(rows)               # each member has its own embedding space

`predict` averages what training's final evaluation averaged: each member's every fused candidate (its top C
and its vote's top C, `TrainedModel.candidates`), so its top-k equal the ensemble's test predictions. Without
fusion (`fusion=False`, or ANN serving) the members' top-C scores are averaged instead.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from xc.ensemble import average_predictions, member_dir, read_ensemble
from xc.errors import ConfigError, XCError
from xc.predictor import Predictions, TrainedModel


class EnsembleModel:
    """Every member of an ensemble run restored in this process (see the module docstring)."""

    def __init__(self, run_dir: str | Path, device: str = "cpu", batch_size: int | None = None):
        self.run_dir = Path(run_dir)
        record = read_ensemble(run_dir)
        self.members = [TrainedModel(member_dir(run_dir, m), device=device, batch_size=batch_size)
                        for m in range(int(record["members"]))]
        first = self.members[0]
        self.cfg, self.dataset, self.mode = first.cfg, first.dataset, first.mode
        self.num_labels, self.label_names = first.num_labels, first.label_names
        # what xc-predict reports: the members' checkpoints
        names = ", ".join(m.checkpoint.name for m in self.members)
        self.checkpoint = SimpleNamespace(name=f"ensemble of {len(self.members)} ({names})")

    @property
    def fusion(self):
        """Member 0's fusion choice (each member chose its own on the shared validation split), None without."""
        return self.members[0].fusion

    @property
    def input_kind(self) -> str:
        return self.members[0].input_kind

    @property
    def num_features(self) -> int:
        return self.members[0].num_features

    def encode(self, data) -> np.ndarray:
        raise XCError("an ensemble has one embedding space per member: use model.members[i].encode(...)")

    def use_ann(self, backend: str | None, save_index: bool = False, **ann_overrides):
        """ANN serving for every member (indexes saved in each member's run directory); returns member 0's
        searcher, with `reused` true only when every member's index was reused."""
        searchers = [m.use_ann(backend, save_index=save_index, **ann_overrides) for m in self.members]
        if backend is not None:
            searchers[0].reused = all(getattr(s, "reused", False) for s in searchers)
        return searchers[0]

    def predict(self, data, k: int = 10, fusion: bool = True) -> Predictions:
        """Top-k labels by the members' mean score (see the module docstring)."""
        if k < 1:
            raise ConfigError("k", f"must be >= 1, got {k}")
        parts = [m.candidates(data, fusion) for m in self.members]
        ids, scores = average_predictions([(p.ids, p.scores) for p in parts], self.num_labels)
        if ids.shape[1] < k:
            pad = k - ids.shape[1]
            ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
            scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
        ids, scores = ids[:, :k], scores[:, :k]
        return Predictions(ids, scores.astype(np.float32), self.members[0]._names(ids), parts[0].fused)

    def __repr__(self) -> str:
        return f"<EnsembleModel {self.run_dir} members={len(self.members)} labels={self.num_labels}>"


def split_test_inputs(model: EnsembleModel, n: int):
    """The first n test points as the members read them: texts, or feature rows."""
    from xc.data.sparse import SparseMatrix

    test = model.dataset.test
    if model.input_kind == "text":
        from xc.data import read_texts

        return read_texts(test.texts_path)[:n]
    f = test.features
    indptr = np.asarray(f.indptr[:n + 1], np.int64)
    end = int(indptr[-1])
    values = None if f.values is None else np.asarray(f.values[:end])
    return SparseMatrix(indptr, np.asarray(f.indices[:end]), values, f.num_cols)


def evaluate_ensemble(run_dir: str | Path, topk: int | None = None, max_points: int | None = None,
                      predictions: str | None = None, ann: str | None = None, fusion: bool = True,
                      save_index: bool = False) -> dict[str, float]:
    """`xc-eval` of an ensemble run: every member's newest checkpoint, averaged, on the test split."""
    from xc.metrics import evaluate, inverse_propensities

    model = EnsembleModel(run_dir)
    cfg, test = model.cfg, model.dataset.test
    n = test.num_points if not max_points else min(max_points, test.num_points)
    k = max(topk or cfg.eval.topk, max(cfg.eval.ks))
    if ann:
        model.use_ann(ann, save_index=save_index)
    preds = model.predict(split_test_inputs(model, n), k=k, fusion=fusion and not ann)
    labels = test.labels
    indptr = np.asarray(labels.indptr[:n + 1], dtype=np.int64)
    truth = np.asarray(labels.indices[:indptr[-1]], dtype=np.int64)
    inv = inverse_propensities(model.dataset.train, cfg.eval.propensity_a, cfg.eval.propensity_b)
    if predictions:
        np.savez(predictions, ids=preds.ids, scores=preds.scores, fused=preds.fused)
    return evaluate(preds.ids, indptr, truth, inv, ks=tuple(cfg.eval.ks))
