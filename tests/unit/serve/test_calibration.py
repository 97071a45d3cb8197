"""The score calibration: the isotonic map, thresholds applied to predictions, precision/recall by hand."""

from __future__ import annotations

import numpy as np
import pytest

from xc.data.sparse import SparseMatrix
from xc.errors import XCError
from xc.serve.calibration import Calibration, apply_threshold, precision_recall, relevance
from xc.serve.model import Predictions


def test_isotonic_map_pools_violators_and_clips_outside_the_knots():
    cal = Calibration.fit(np.array([0.1, 0.2, 0.3, 0.4]), np.array([False, True, False, True]))
    # 0.2 (hit) above 0.3 (miss) violates monotonicity: both pooled to 0.5
    assert np.allclose(cal(np.array([0.0, 0.1, 0.25, 0.4, 0.9])), [0.0, 0.0, 0.5, 1.0, 1.0])
    assert cal(np.array([-np.inf]))[0] == 0.0  # a pad's score
    again = Calibration(**{k: v for k, v in zip(("xs", "ps"), (cal.as_dict()["x"], cal.as_dict()["p"]))})
    assert np.allclose(again(np.linspace(0, 1, 11)), cal(np.linspace(0, 1, 11)))


def test_precision_recall_against_hand_counts():
    probs = np.array([[0.9, 0.6, 0.2], [0.7, 0.4, 0.1]])
    hits = np.array([[True, False, True], [True, True, False]])
    # p = 0.5: picked 0.9, 0.6, 0.7 -> 2 right of 3; 5 true labels in all (one outside the candidates)
    out = precision_recall(probs, hits, num_true=5, p=0.5)
    assert out["precision"] == pytest.approx(200 / 3) and out["recall"] == pytest.approx(40.0)
    assert out["F1"] == pytest.approx(2 * (200 / 3) * 40 / (200 / 3 + 40))
    assert precision_recall(probs, hits, 5, 0.95) == {"precision": 0.0, "recall": 0.0, "F1": 0.0}


def test_relevance_reads_each_points_labels():
    truth = SparseMatrix(np.array([0, 2, 3]), np.array([1, 4, 0], np.int32), None, 5)
    ids = np.array([[4, 0, -1], [0, 1, 2]])
    assert relevance(ids, truth, np.array([0, 1])).tolist() == [[True, False, False], [True, False, False]]


def test_threshold_pads_labels_below_it_and_refuses_other_scores():
    cal = Calibration(xs=[0.0, 1.0], ps=[0.0, 1.0], fused=True)
    preds = Predictions(np.array([[3, 1, 2]]), np.array([[0.8, 0.5, 0.3]], np.float32), None, fused=True)
    apply_threshold(preds, cal, 0.5, "run")
    assert preds.ids.tolist() == [[3, 1, -1]]
    rec = next(preds.records())
    assert rec["ids"] == [3, 1] and rec["probs"] == [0.8, 0.5]
    plain = Predictions(np.array([[3]]), np.array([[0.8]], np.float32), None, fused=False)
    with pytest.raises(XCError, match="fitted on fused scores"):
        apply_threshold(plain, cal, 0.5, "run")
    with pytest.raises(XCError, match="no calibration.json"):
        apply_threshold(plain, None, 0.5, "run")
    with pytest.raises(XCError, match=r"in \[0, 1\]"):
        apply_threshold(plain, cal, 1.5, "run")


def test_a_threshold_that_is_not_a_number_is_one_line():
    cal = Calibration(xs=[0.0, 1.0], ps=[0.0, 1.0])
    for bad in ("abc", "0.5", None, True, float("nan")):
        preds = Predictions(np.array([[3]]), np.array([[0.8]], np.float32), None, fused=False)
        with pytest.raises(XCError, match=r"a probability in \[0, 1\], got") as info:
            apply_threshold(preds, cal, bad, "run")
        assert "\n" not in str(info.value)


def _model(checkpoint="step-00000010", step=10, beta=0.5):
    from types import SimpleNamespace

    return SimpleNamespace(checkpoint=SimpleNamespace(name=checkpoint), meta={"global_step": step}, prior_beta=beta)


def test_thresholds_are_refused_on_scores_the_map_was_not_fitted_on():
    from xc.serve.calibration import score_source

    fitted = score_source(_model(), fused=False)
    cal = Calibration(xs=[0.0, 1.0], ps=[0.0, 1.0], source=fitted)
    again = Calibration(**{"xs": [0.0, 1.0], "ps": [0.0, 1.0]}, source=cal.as_dict()["scores"])
    for served, words in ((_model(), None), (_model("step-00000004", 4), "checkpoint step-00000004 (step 4)"),
                          (_model(beta=None), "no label prior"), (_model(beta=0.25), "label prior beta 0.25")):
        preds = Predictions(np.array([[3]]), np.array([[0.8]], np.float32), None, fused=False)
        if words is None:
            apply_threshold(preds, again, 0.5, "run", score_source(served, False))
            assert preds.ids.tolist() == [[3]]
            continue
        with pytest.raises(XCError) as info:
            apply_threshold(preds, again, 0.5, "run", score_source(served, False))
        message = str(info.value)
        assert "does not fit these scores" in message and words in message and "\n" not in message
        assert "checkpoint step-00000010 (step 10), label prior beta 0.5, no kNN fusion" in message


def test_a_damaged_calibration_file_is_one_line(tmp_path):
    from xc.errors import CheckpointError

    for body, field in (("{oops", "not readable JSON"), ('{"x": [0, 1], "p": ["a", 1]}', "p: a non-empty list"),
                        ('{"x": [0, 1], "p": [0]}', "p: 2 numbers"), ("[1, 2]", "(top level)"),
                        ('{"x": [0], "p": [0], "scores": 3}', "scores:")):
        (tmp_path / "calibration.json").write_text(body)
        with pytest.raises(CheckpointError) as info:
            Calibration.read(tmp_path)
        assert field in str(info.value) and str(tmp_path / "calibration.json") in str(info.value)
        assert "\n" not in str(info.value)
