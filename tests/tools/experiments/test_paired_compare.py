"""tools/experiments/paired_compare.py: the paired statistics against hand-computed values, and which scores each
mode asks for."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tools.experiments import paired_compare


@pytest.fixture(autouse=True)
def _runs_here(tmp_path, monkeypatch):
    """The run directories the command lines below name, in a folder of their own."""
    monkeypatch.chdir(tmp_path)
    for name in ("run_a", "run_b", "a", "b", "run"):
        (tmp_path / name).mkdir()


def test_a_run_or_rankings_file_that_is_not_there_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["paired_compare.py", "a", "nowhere"])
    with pytest.raises(SystemExit):
        paired_compare.main()
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("nowhere: no such run directory or rankings file")


def _hits(p1, beta=None):
    p1 = np.asarray(p1, float)
    return {"beta": beta, "P@1": p1, "P@3": p1 / 3, "P@5": p1 / 5}


def test_paired_report_matches_hand_computed_difference_and_se():
    a = _hits([1, 1, 0, 1], beta=0.5)
    b = _hits([1, 0, 0, 0], beta=0.0)
    report = paired_compare.paired_report(a, b)
    # per-point difference [0, 1, 0, 1]: mean 0.5, sample std sqrt(1/3), SE sqrt(1/3) / 2
    assert report["P@1"]["a"] == 75.0 and report["P@1"]["b"] == 25.0
    assert report["P@1"]["a_minus_b"] == 50.0
    assert report["P@1"]["se"] == round(100 * np.sqrt(1 / 3) / 2, 3)
    lo, hi = report["P@1"]["ci95"]
    assert 0.0 <= lo <= 50.0 <= hi <= 100.0
    assert report["P@3"]["a_minus_b"] == round(50 / 3, 3)
    assert (report["beta_a"], report["beta_b"]) == (0.5, 0.0)


@pytest.mark.parametrize("flags, expect, scored", [([], ("prior", True), "model with its prior"),
                                                   (["--plain"], ("prior", False), "plain"),
                                                   (["--served"], ("served", None), "served")])
def test_each_mode_scores_the_runs_as_it_says(monkeypatch, tmp_path, flags, expect, scored):
    asked = []
    monkeypatch.setattr(paired_compare, "per_point_hits",
                        lambda run, prior=True: asked.append(("prior", prior)) or _hits([1, 0]))
    monkeypatch.setattr(paired_compare, "served_hits", lambda run: asked.append(("served", None)) or _hits([0, 1]))
    out = tmp_path / "paired.json"
    monkeypatch.setattr(sys, "argv", ["paired_compare.py", "run_a", "run_b", "--out", str(out), *flags])
    paired_compare.main()
    assert asked == [expect, expect]
    assert json.loads(out.read_text())["scored"] == scored


def test_all_reports_each_scoring_under_its_own_key(monkeypatch, tmp_path):
    monkeypatch.setattr(paired_compare, "per_point_hits", lambda run, prior=True: _hits([1, 1] if prior else [1, 0]))
    monkeypatch.setattr(paired_compare, "served_hits", lambda run: _hits([0, 1] if run == "a" else [0, 0]))
    out = tmp_path / "paired.json"
    monkeypatch.setattr(sys, "argv", ["paired_compare.py", "a", "b", "--out", str(out), "--all"])
    paired_compare.main()
    report = json.loads(out.read_text())
    assert report["plain"]["P@1"]["a"] == 50.0 and report["model with its prior"]["P@1"]["a"] == 100.0
    assert report["served"]["P@1"]["a_minus_b"] == 50.0


@pytest.mark.parametrize("flags", [["--served", "--plain"], ["--all", "--served"], ["--all", "--plain"]])
def test_the_modes_exclude_each_other(monkeypatch, flags):
    monkeypatch.setattr(sys, "argv", ["paired_compare.py", "a", "b", *flags])
    with pytest.raises(SystemExit):
        paired_compare.main()


@pytest.mark.parametrize("flags", [[], ["--plain"], ["--all"]])
def test_an_ensemble_compares_as_served_only_in_one_line(monkeypatch, tmp_path, capsys, flags):
    (tmp_path / "ens").mkdir()
    (tmp_path / "ens" / "ensemble.json").write_text("{}")
    monkeypatch.setattr(sys, "argv", ["paired_compare.py", str(tmp_path / "ens"), "b", *flags])
    with pytest.raises(SystemExit) as stop:
        paired_compare.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "is an ensemble" in err and "use --served" in err


def test_model_share_pairs_one_run_as_served_with_its_own_model(monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(paired_compare, "per_point_hits",
                        lambda run, prior=True: asked.append(("model", run, prior)) or _hits([1, 0, 0, 0]))
    monkeypatch.setattr(paired_compare, "served_hits", lambda run: asked.append(("served", run)) or _hits([1, 1, 0, 1]))
    out = tmp_path / "share.json"
    monkeypatch.setattr(sys, "argv", ["paired_compare.py", "run", "--model-share", "--out", str(out)])
    paired_compare.main()
    assert asked == [("served", "run"), ("model", "run", True)]
    report = json.loads(out.read_text())
    assert report["P@1"]["a"] == 75.0 and report["P@1"]["b"] == 25.0 and report["P@1"]["a_minus_b"] == 50.0


@pytest.mark.parametrize("args", [["a", "b", "--model-share"], ["a"], ["a", "--model-share", "--served"]])
def test_model_share_takes_one_run_and_two_runs_need_no_flag_for_it(monkeypatch, capsys, args):
    monkeypatch.setattr(sys, "argv", ["paired_compare.py", *args])
    with pytest.raises(SystemExit) as stop:
        paired_compare.main()
    assert stop.value.code == 2 and "error:" in capsys.readouterr().err


def _kept(tmp_path, ids, indptr, indices):
    from tools.experiments.bench_peers import save_rankings

    path = tmp_path / "tiny-pecos.npz"
    save_rankings(path, np.asarray(ids), {"truth_indptr": np.asarray(indptr), "truth_indices": np.asarray(indices),
                                          "label": "tiny"}, "pecos")
    return path


def test_a_librarys_rankings_pair_in_every_mode_against_the_test_labels_kept_with_them(monkeypatch, tmp_path):
    # two test points with labels {2} and {0, 1}; the library's top 1 is right on the first only
    path = _kept(tmp_path, [[2, 0, 1, 3, 4], [3, 2, 4, 0, 1]], [0, 1, 3], [2, 0, 1])
    monkeypatch.setattr(paired_compare, "test_labels", lambda run: (np.array([0, 1, 3]), np.array([2, 0, 1])))
    monkeypatch.setattr(paired_compare, "per_point_hits", lambda run, prior=True: _hits([1, 1]))
    monkeypatch.setattr(paired_compare, "served_hits", lambda run: _hits([1, 0]))
    out = tmp_path / "paired.json"
    monkeypatch.setattr(sys, "argv", ["paired_compare.py", "a", str(path), "--out", str(out), "--all"])
    paired_compare.main()
    report = json.loads(out.read_text())
    for scored in ("plain", "model with its prior", "served"):
        assert report[scored]["P@1"]["b"] == 50.0 and report[scored]["beta_b"] is None
        assert report[scored]["P@3"]["b"] == round(100 * (1 / 3 + 0) / 2, 2)  # top 3: {2} hit once, then none
    assert report["plain"]["P@1"]["a_minus_b"] == 50.0 and report["served"]["P@1"]["a_minus_b"] == 0.0


FIVE = [[2, 0, 1, 3, 4], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("ids, labels, message", [
    (FIVE, (np.array([0, 1, 2]), np.array([2, 0])), "are not a's"), (FIVE, None, "not a library's rankings"),
    ([[2, 0, 1], [0, 1, 2]], (np.array([0, 1, 3]), np.array([2, 0, 1])), "ids must be (test points, k >= 5)")])
def test_rankings_of_other_test_points_or_not_rankings_are_one_line(monkeypatch, tmp_path, capsys, ids, labels,
                                                                     message):
    path = _kept(tmp_path, ids, [0, 1, 3], [2, 0, 1])
    if labels is None:
        path.write_bytes(b"not an npz")
    monkeypatch.setattr(paired_compare, "test_labels", lambda run: labels)
    monkeypatch.setattr(sys, "argv", ["paired_compare.py", "a", str(path)])
    with pytest.raises(SystemExit):
        paired_compare.main()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err and str(path) in err and "Traceback" not in err


@pytest.mark.slow  # trains a tiny run in a subprocess
def test_test_labels_are_the_served_models_without_restoring_it(tmp_path):
    from tests.conftest import REPO, run_cli
    from tests.integration.test_predict import TINY
    from xc.serve.model import TrainedModel

    run_dir = tmp_path / "tiny"
    run_cli([*TINY, "train.epochs=1", f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}"], cwd=REPO)
    indptr, indices = paired_compare.test_labels(str(run_dir))
    want = TrainedModel(run_dir).dataset.test.labels
    assert indptr.size == 401  # TINY's 400 test points
    np.testing.assert_array_equal(indptr, np.asarray(want.indptr))
    np.testing.assert_array_equal(indices, np.asarray(want.indices))
