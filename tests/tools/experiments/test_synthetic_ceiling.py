"""tools/experiments/synthetic_ceiling.py: the ceilings against the generator's oracle and hand-computed values, the
top-1 breakdown on a hand-built example."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tools.experiments import synthetic_ceiling as sc
from xc.data import generate_synthetic

SMALL = dict(num_train=3000, num_test=1000, num_labels=500, num_features=3000, seed=1)


def test_the_ceiling_without_a_count_is_the_oracle_and_falls_with_the_count(tmp_path):
    ds = generate_synthetic(str(tmp_path), **SMALL)
    counts = sc.train_counts(SMALL)
    np.testing.assert_array_equal(counts, np.diff(np.asarray(ds.train.labels.to_scipy().tocsc().indptr)))
    test = sc.generating_labels(SMALL, "test")
    ceil = sc.ceilings(test, counts)
    assert ceil[0] == [round(ds.meta[f"oracle_p{k}"], 2) for k in (1, 3, 5)]
    for lo, hi in zip(sc.MIN_COUNTS, sc.MIN_COUNTS[1:]):
        assert all(a >= b for a, b in zip(ceil[lo], ceil[hi]))


def _toy():
    """Three points: generating labels (most popular first) [5, 7] kept [no, yes]; [2] kept; [9, 4] kept [yes, yes]."""
    return {"indptr": np.array([0, 2, 3, 5]), "labels": np.array([5, 7, 2, 9, 4]), "ranks": np.array([0, 1, 0, 0, 1]),
            "kept": np.array([False, True, True, True, True])}


def test_ceilings_by_hand():
    counts = np.zeros(10, np.int64)
    counts[[5, 7, 2, 9, 4]] = [4, 1, 0, 2, 30]
    ceil = sc.ceilings(_toy(), counts)
    assert ceil[0][0] == round(100 * 2 / 3, 2)  # point 0's first label was dropped
    assert ceil[1][0] == round(100 / 3, 2)  # label 2 unseen: point 1 has nothing left; point 0 still misses
    assert ceil[3][0] == round(100 * 1 / 3, 2)  # only 5 (dropped) and 4 remain; 4 is point 2's first seen
    assert ceil[1][1] == round(100 * (1 + 0 + 2) / 3 / 3, 2)  # P@3: kept seen labels in the first 3 places


def test_top1_breakdown_by_hand():
    counts = np.zeros(10, np.int64)
    counts[[5, 7, 2, 9, 4, 8]] = [4, 1, 0, 2, 30, 6]
    out = sc.top1_breakdown(np.array([5, 8, 8]), _toy(), counts)
    # point 0: 5 generated it but was dropped; points 1 and 2: 8 did not generate them
    assert out["P@1"] == 0.0 and out["top1_generating"] == round(100 / 3, 2)
    assert out["dropped_by_noise"] == round(100 / 3, 2)
    assert out["confused_by_best_count"]["0"] == {"points": round(100 / 3, 2), "confused": round(100 / 3, 2)}
    assert out["confused_by_best_count"]["21+"] == {"points": round(100 / 3, 2), "confused": round(100 / 3, 2)}
    assert out["confused_by_best_count"]["3-5"] == {"points": round(100 / 3, 2), "confused": 0.0}
    assert out["confused_top1_count_median"] == 6.0
    assert sc.top1_breakdown(np.array([7, 2, 9]), _toy(), counts)["P@1"] == 100.0


def test_found_from_gives_the_confused_points_their_best_trained_label_by_hand():
    counts = np.zeros(10, np.int64)
    counts[[5, 7, 2, 9, 4, 8]] = [4, 1, 0, 2, 30, 6]
    # point 1's only label (2) was never seen: nothing to find; point 2's best (4, 30 points, kept) is found from any m
    assert sc.top1_breakdown(np.array([5, 8, 8]), _toy(), counts)["found_from"] == {1: 33.33, 2: 33.33, 3: 33.33}
    counts[4] = 2  # now label 9 and 4 tie at 2: the first, 9 (kept), is the one found, from m = 1 and 2 only
    assert sc.top1_breakdown(np.array([5, 8, 8]), _toy(), counts)["found_from"] == {1: 33.33, 2: 33.33, 3: 0.0}
    toy = _toy()
    toy["kept"] = np.array([False, True, True, False, True])  # the best label dropped by the noise: not a hit
    assert sc.top1_breakdown(np.array([5, 8, 8]), toy, counts)["found_from"] == {1: 0.0, 2: 0.0, 3: 0.0}


def test_paired_generating_by_hand():
    counts = np.zeros(10, np.int64)
    counts[[5, 7, 2, 9, 4, 8]] = [4, 1, 0, 2, 30, 6]
    runs = {"a": {"model": sc.top1_breakdown(np.array([5, 8, 8]), _toy(), counts)},  # generating: 1, 0, 0
            "b": {"top-1": sc.top1_breakdown(np.array([7, 2, 8]), _toy(), counts)}}  # generating: 1, 1, 0
    out = sc.paired_generating(runs)
    # differences 0, 1, 0: mean 1/3, sd sqrt(1/3), se sqrt(1/3) / sqrt(3) = 1/3
    assert out == {"b top-1 - a model": {"diff": 33.33, "se": 33.33}}
    assert "generating_per_point" not in runs["a"]["model"] and "generating_per_point" not in runs["b"]["top-1"]


def test_a_librarys_rankings_break_down_like_a_run(monkeypatch, tmp_path):
    test = sc.generating_labels(SMALL, "test")
    observed = [test["labels"][a:b][test["kept"][a:b]] for a, b in zip(test["indptr"][:-1], test["indptr"][1:])]
    indptr = np.concatenate([[0], np.cumsum([len(o) for o in observed])])
    ids = np.array([[o[0] if len(o) else 0] * 5 for o in observed])  # every point's first observed label first
    good = tmp_path / "set-peer.npz"
    np.savez(good, ids=ids, truth_indptr=indptr, truth_indices=np.concatenate(observed))
    np.testing.assert_array_equal(sc.rankings_top1(good, test), ids[:, 0])
    out = tmp_path / "c.json"
    monkeypatch.setattr(sys, "argv", ["synthetic_ceiling.py", "--params", *[f"{k}={v}" for k, v in SMALL.items()],
                                      "--rankings", str(good), "--out", str(out)])
    sc.main()
    row = json.loads(out.read_text())["runs"][str(good)]["top-1"]
    assert row["P@1"] == round(100 * np.mean([len(o) > 0 for o in observed]), 2)
    other = tmp_path / "other-peer.npz"
    np.savez(other, ids=ids, truth_indptr=indptr, truth_indices=np.concatenate(observed) + 1)
    with pytest.raises(SystemExit, match="not this synthetic set's test labels"):
        sc.rankings_top1(other, test)
    flat = tmp_path / "flat-peer.npz"
    np.savez(flat, ids=ids[:, 0], truth_indptr=indptr, truth_indices=np.concatenate(observed))
    with pytest.raises(SystemExit, match=r"ids must be \(test points, k\)"):
        sc.rankings_top1(flat, test)
    junk = tmp_path / "junk.npz"
    np.savez(junk, something=np.zeros(3))
    with pytest.raises(SystemExit, match="not a rankings file"):
        sc.rankings_top1(junk, test)


def test_rare_summary_by_hand():
    """Three queries over four training points: query 0's label (7) is the model's first and its point (2) the
    nearest by both scores; query 1's label (3) is its third and its points (0, 1) are second by cosine, first by
    shared features; query 2's label (5) is missing from its top and has no training point."""
    ids = np.array([[7, 1, 2], [4, 6, 3], [8, 9, 0]])
    cosine = np.array([[0.1, 0.2, 0.9, 0.3], [0.5, 0.1, 0.8, 0.0], [0.0, 0.0, 0.0, 0.0]])
    overlap = np.array([[1, 1, 5, 2], [4, 4, 3, 1], [0, 0, 0, 0]])
    points = [np.array([2]), np.array([0, 1]), np.array([], dtype=np.int64)]
    assert sc.point_ranks(cosine, points).tolist() == [0, 1, -1]
    out = sc.rare_summary(ids, np.array([7, 3, 5]), {"cosine": cosine, "shared": overlap}, points)
    assert out["points"] == 3 and out["with_its_point"] == 2
    assert (out["model_top1"], out["model_top5"], out["model_top3"]) == (33.3, 66.7, 66.7)
    assert (out["point_nearest_by_cosine"], out["point_top5_by_cosine"]) == (50.0, 100.0)
    assert out["point_nearest_by_shared"] == 100.0


@pytest.mark.parametrize("argv, message", [
    ([], "give runs, or --params"), (["run", "--params", "num_labels=10"], "give runs, or --params"),
    (["--params", "num_labelz=10"], "synthetic.num_labelz"), (["no-such-run"], "no-such-run is not a trained run"),
    (["--params", "num_labels=10", "--rankings", "nowhere.npz"], "nowhere.npz: no such rankings file"),
])
def test_bad_arguments_are_one_line_errors(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["synthetic_ceiling.py", *argv])
    with pytest.raises(SystemExit):
        sc.main()
    assert message in capsys.readouterr().err


def test_params_alone_write_the_ceilings(monkeypatch, tmp_path):
    out = tmp_path / "c.json"
    monkeypatch.setattr(sys, "argv", ["synthetic_ceiling.py", "--params", *[f"{k}={v}" for k, v in SMALL.items()],
                                      "--out", str(out)])
    sc.main()
    report = json.loads(out.read_text())
    assert report["params"]["num_labels"] == 500 and set(report["ceiling_by_min_train_count"]) == {
        str(m) for m in sc.MIN_COUNTS}
