"""An ensemble run (trained by xc/ensemble/members.py) as one model: `xc.load(run_dir)` returns an `EnsembleModel` when the run
directory holds an ensemble, and `xc-predict` / `xc-eval` serve it like a single model.

    model = xc.load("runs/bibtex-astra")        # RUN_DIR/ensemble.json: every member restored
    model.predict(rows, k=5)                    # members' probabilities averaged, fused once with the kNN vote
    model.members[0].encode(rows)               # each member has its own embedding space

`predict` scores what training's final evaluation scored (xc/fitting/memory.py, with the choice in
RUN_DIR/fusion.json and, where it fuses one, the lexical ranker in RUN_DIR/ranker/), so its top-k are the
ensemble's test predictions. Without fusion (`fusion=False`, or ANN serving, where each member's index gives its
top labels) the members' averaged probabilities over their top labels rank alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from xc.data import read_texts
from xc.data.sparse import SparseMatrix
from xc.errors import ConfigError, DataFormatError, XCError
from xc.eval.inference import ExactSearcher, encode_rows, sharded_topk
from xc.eval.metrics import evaluate, inverse_propensities, true_labels
from xc.fitting.fusion import FusionChoice
from xc.fitting.label_prior import PriorChoice
from xc.fitting.memory import FusionEvaluator
from xc.fitting.model_memory import ModelMemory
from xc.serve.calibration import Calibration, apply_threshold, score_source
from xc.serve.model import Predictions, TrainedModel, check_knn_memory

# an ensemble run's layout: RUN_DIR/members/m{m}/ (each a run of its own) and RUN_DIR/ensemble.json
MEMBERS_DIR = "members"
ENSEMBLE_FILE = "ensemble.json"


def member_dir(run_dir: str | Path, m: int) -> Path:
    return Path(run_dir) / MEMBERS_DIR / f"m{m}"


def load_members(run_dir: str | Path, members: int, device: str = "cpu", batch_size: int | None = None) -> list:
    """Members 0..members-1 of an ensemble run as TrainedModels (each its newest valid checkpoint)."""
    return [TrainedModel(member_dir(run_dir, m), device=device, batch_size=batch_size) for m in range(members)]


def read_ensemble(run_dir: str | Path) -> dict:
    path = Path(run_dir) / ENSEMBLE_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise XCError(f"{path}: unreadable ensemble record ({exc})") from exc


class EnsembleModel:
    """Every member of an ensemble run restored in this process (see the module docstring)."""

    def __init__(self, run_dir: str | Path, device: str = "cpu", batch_size: int | None = None):
        self.run_dir = Path(run_dir)
        self.members = load_members(run_dir, int(read_ensemble(run_dir)["members"]), device, batch_size)
        if (self.run_dir / "prior.json").exists():  # the ensemble's one label prior, not each member's own
            beta = PriorChoice.read_beta(self.run_dir)
            for member in self.members:
                member.use_prior(True, beta)
        first = self.members[0]
        self.cfg, self.dataset, self.mode = first.cfg, first.dataset, first.mode
        self.num_labels, self.label_names = first.num_labels, first.label_names
        names = ", ".join(m.checkpoint.name for m in self.members)
        self.checkpoint = SimpleNamespace(name=f"ensemble of {len(self.members)} ({names})")  # what xc-predict logs
        self.memory = FusionEvaluator([ModelMemory.of(m.cfg, m.components, self.dataset, m.ctx)
                                       for m in self.members], self.dataset)
        self.fusion = FusionChoice.read(self.run_dir)
        self.memory.use_saved_ranker(self.run_dir, self.fusion)  # where the fusion chose the lexical ranker

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

    def predict(self, data, k: int = 10, fusion: bool = True, threshold: float | None = None,
                knn_memory: np.ndarray | None = None) -> Predictions:
        """Top-k labels of texts or feature rows by the ensemble's score (see the module docstring); `threshold` and
        `knn_memory` as for `TrainedModel.predict`."""
        memory_rows = None if knn_memory is None else check_knn_memory(knn_memory, self.dataset.train.num_points)
        preds = self._predict(data, k, fusion, memory_rows)
        if threshold is not None:
            apply_threshold(preds, Calibration.read(self.run_dir), threshold, self.run_dir,
                            score_source(self, preds.fused))
            preds.names = self.members[0]._names(preds.ids)
        return preds

    def _predict(self, data, k: int, fusion: bool, memory_rows: np.ndarray | None = None) -> Predictions:
        if k < 1:
            raise ConfigError("k", f"must be >= 1, got {k}")
        first = self.members[0]
        block = first._as_block(data)
        rows = np.arange(len(block), dtype=np.int64)
        embs, features = [], None
        for m in self.members:
            fn, feats = m._inputs(block)
            features = feats if features is None else features
            embs.append(encode_rows(m.encoder, fn, rows, m.batch_size, m.ctx))
        exact = all(isinstance(m.searcher, ExactSearcher) for m in self.members)
        fused = fusion and self.fusion is not None and exact
        if fused:
            if self.fusion.needs_features and features is None and block.texts is not None:
                features = first._features_of_texts(block.texts)
            if self.fusion.needs_features and features is None:
                raise DataFormatError("<input>", block.first_line, "format", "kNN fusion in the input space and the "
                                      "lexical ranker need feature rows; pass fusion=False (--no-fusion)")
            scores, ids = self.memory.predict(self.fusion, features, embs, k, memory_rows=memory_rows)
        else:
            width = max(k, self.memory.width)
            tops = [sharded_topk(e.to(m.ctx.device), m.searcher, width, m.ctx)[1].cpu().numpy()
                    for m, e in zip(self.members, embs)]
            scores, ids = self.memory.candidates(embs, None, width, tops).fuse(0.0, k)
        ids = ids.astype(np.int64)
        return Predictions(ids, scores.astype(np.float32), first._names(ids), fused)

    def __repr__(self) -> str:
        return (f"<EnsembleModel {self.run_dir} members={len(self.members)} labels={self.num_labels} "
                f"fusion={self.fusion.as_dict() if self.fusion else None}>")


def split_test_inputs(model: EnsembleModel, n: int):
    """The first n test points as the members read them: texts, or feature rows."""
    test = model.dataset.test
    if model.input_kind == "text":
        return read_texts(test.texts_path)[:n]
    f = test.features
    indptr = np.asarray(f.indptr[:n + 1], np.int64)
    end = int(indptr[-1])
    values = None if f.values is None else np.asarray(f.values[:end])
    return SparseMatrix(indptr, np.asarray(f.indices[:end]), values, f.num_cols)


def evaluate_ensemble(run_dir: str | Path, topk: int | None = None, max_points: int | None = None,
                      predictions: str | None = None, ann: str | None = None, fusion: bool = True,
                      save_index: bool = False) -> dict[str, float]:
    """`xc-eval` of an ensemble run: every member's newest checkpoint, as the ensemble, on the test split."""
    model = EnsembleModel(run_dir)
    cfg, test = model.cfg, model.dataset.test
    n = test.num_points if not max_points else min(max_points, test.num_points)
    k = max(topk or cfg.eval.topk, max(cfg.eval.ks))
    if ann:
        model.use_ann(ann, save_index=save_index)
    preds = model.predict(split_test_inputs(model, n), k=k, fusion=fusion and not ann)
    indptr, truth = true_labels(test.labels, first=n)
    inv = inverse_propensities(model.dataset.train, cfg.eval.propensity_a, cfg.eval.propensity_b)
    if predictions:
        np.savez(predictions, ids=preds.ids, scores=preds.scores, fused=preds.fused)
    return evaluate(preds.ids, indptr, truth, inv, ks=tuple(cfg.eval.ks))
