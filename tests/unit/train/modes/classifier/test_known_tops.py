"""The final phase reads the last epoch's test and validation rankings again instead of ranking the same points anew
(xc/fitting/model_memory.py `KnownTops`): the run's metrics and fusion choice are those of ranking everything again,
with dense rows and with lexical weights; under a label prior other than 0 only what was ranked under it is read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from xc.faults import NO_FAULTS
from xc.fitting.fusion import ModelScorer
from xc.fitting.model_memory import KnownTops

BASE = ["data.synthetic.num_train=600", "data.synthetic.num_test=80", "data.synthetic.num_labels=300",
        "data.synthetic.num_features=500", "model.embed_dim=16", "train.warmup_steps=2", "train.ensemble=1",
        "train.epochs=2", "eval.calibrate=false"]


def _run(tmp_path, monkeypatch, known: bool, *extra: str) -> tuple[dict, dict, list[int]]:
    """(metrics, fusion.json without its timings, the widths of the searches the final phase made); the two epochs'
    validation rankings are checked 5 and 20 deep."""
    from tests.unit.train.test_plan import _setup
    from xc.cli import train as cli_train
    from xc.train.modes.classifier.mode import ClassifierMode

    import xc.train.modes.classifier.mode as mode_module

    searched, final, validated = [], [], []
    real_top, real_final, real_valid = ModelScorer.top, ClassifierMode.final_metrics, mode_module.validation_ranking

    def top(scorer, emb, k, queries=None):
        if final:
            searched.append(k)
        return real_top(scorer, emb, k, queries)

    def final_metrics(mode, *args):
        final.append(True)
        return real_final(mode, *args)

    def validation_ranking(cfg, c, dataset, ctx, width):
        out = real_valid(cfg, c, dataset, ctx, width)
        validated.append(out[2].shape[1])
        return out

    monkeypatch.setattr(ModelScorer, "top", top)
    monkeypatch.setattr(mode_module, "validation_ranking", validation_ranking)
    monkeypatch.setattr(ClassifierMode, "final_metrics", final_metrics)
    if not known:
        monkeypatch.setattr(KnownTops, "top", lambda self, queries, width: None)
    cfg, ctx, dataset = _setup(tmp_path, "classifier", *BASE, *extra)
    metrics = cli_train._train_model(cfg, ctx, dataset, None, NO_FAULTS)
    fusion = json.loads((tmp_path / "run" / "fusion.json").read_text())
    assert validated == [5, 20]  # the epochs' validation rankings: the last one as deep as the fusion reads it
    return metrics, {k: v for k, v in fusion.items() if not k.endswith("_seconds")}, searched


@pytest.mark.parametrize("extra", [[], ["model.lexical_features=4"]], ids=["dense", "lexical"])
def test_the_final_phase_reads_the_last_epochs_rankings_and_scores_as_ranking_again(tmp_path, monkeypatch, extra):
    overrides = ["eval.knn_fusion.enabled=true", "eval.ranker.enabled=true", "eval.label_prior.beta=0", *extra]
    with monkeypatch.context() as patch:
        again = _run(tmp_path / "again", patch, False, *overrides)
    kept = _run(tmp_path / "kept", monkeypatch, True, *overrides)
    assert again[2] and not kept[2]  # ranked validation and test again / read them
    assert kept[0] == again[0] and kept[1] == again[1]
    metrics = kept[0]  # what serving adds to the model, paired: the mean difference is the difference of the means
    for k in (1, 3, 5):
        assert metrics[f"over_model/P@{k}"] == pytest.approx(metrics[f"P@{k}"] - metrics[f"model/P@{k}"], abs=1e-9)
        assert metrics[f"over_model_se/P@{k}"] >= 0.0


@pytest.mark.parametrize("how", ["fixed", "chosen"])
def test_a_label_prior_reads_only_the_rankings_made_under_it(tmp_path, monkeypatch, how):
    """A fixed beta: both splits ranked again under it. A beta chosen on validation: its validation ranking, made by
    the choice, is read; the test split is ranked again."""
    import xc.fitting.label_prior as lp

    overrides = ["eval.knn_fusion.enabled=true", "eval.ranker.enabled=false"]
    if how == "fixed":
        overrides.append("eval.label_prior.beta=0.5")
    else:  # the choice forced to 0.5, whatever the tiny validation split says
        overrides.append("eval.label_prior.betas=[0.5]")
        monkeypatch.setattr(lp, "choose_from", lambda per_point, betas: lp.PriorChoice(0.5, 1, None, None, []))
    with monkeypatch.context() as patch:
        again = _run(tmp_path / "again", patch, False, *overrides)
    kept = _run(tmp_path / "kept", monkeypatch, True, *overrides)
    assert len(again[2]) == 2 and len(kept[2]) == (2 if how == "fixed" else 1)
    assert kept[0] == again[0] and kept[1] == again[1]


def test_known_tops_give_a_prefix_of_the_same_query_set_only():
    known = KnownTops()
    inputs, other = object(), object()
    rows = np.array([3, 1, 2])
    scores, ids = np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(12).reshape(3, 4)
    known.add(inputs, rows, scores, ids)
    got = known.top((inputs, rows.copy()), 2)
    assert np.array_equal(got[0], scores[:, :2]) and np.array_equal(got[1], ids[:, :2])
    assert known.top((inputs, rows), 5) is None  # wider than kept
    assert known.top((other, rows), 2) is None  # another query set's inputs
    assert known.top((inputs, np.array([3, 1])), 2) is None  # other rows
    assert known.top(None, 2) is None
    known.add(inputs, rows, scores + 1, ids)  # the same query set again: replaced
    assert np.array_equal(known.top((inputs, rows), 4)[0], scores + 1)
    known.clear()
    assert known.top((inputs, rows), 2) is None
