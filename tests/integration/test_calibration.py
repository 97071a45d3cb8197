"""Thresholds on calibrated scores: the map is fitted on validation only (another test split leaves it as it
was), the final metrics report precision/recall at the thresholds on test, and `xc-predict --min-score` and
`predict(..., threshold=)` keep exactly the labels at or above it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import scipy.sparse as sp
import pytest

import xc
from tests.conftest import REPO, run_cli
from xc.data import generate_synthetic

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

ARGS = ["train.max_steps=30", "train.epochs=3", "train.batch_size=128", "train.warmup_steps=3", "model.embed_dim=64",
        "model.hidden_dims=[32]", "logger.wandb=disabled", "logger.progress=false", "seed=3"]


def test_calibration_is_fitted_on_validation_and_thresholds_cut_predictions(tmp_path):
    synth = generate_synthetic(str(tmp_path / "synth"), num_train=1500, num_test=300, num_labels=200,
                               num_features=600, seed=1)
    train = (synth.train.features.to_scipy(), synth.train.labels.to_scipy())
    test = (synth.test.features.to_scipy(), synth.test.labels.to_scipy())
    shuffled = sp.csr_matrix(test[1].toarray()[np.random.default_rng(0).permutation(300)])  # another test split
    metrics, calibrations = {}, {}
    for name, test_labels in (("a", test[1]), ("b", shuffled)):
        src = tmp_path / f"src-{name}"
        src.mkdir()
        for split, (x, y) in (("train", train), ("test", (test[0], test_labels))):
            sp.save_npz(src / f"{split}_X.npz", x)
            sp.save_npz(src / f"{split}_Y.npz", y)
        run_dir = tmp_path / f"run-{name}"
        run_cli([*ARGS, "data.kind=npz", f"data.path={src}", f"data.cache_dir={tmp_path / 'cache'}",
                 f"run_dir={run_dir}"], cwd=REPO)
        metrics[name] = json.loads((run_dir / "metrics.json").read_text())
        calibrations[name] = json.loads((run_dir / "calibration.json").read_text())
    assert calibrations["a"] == calibrations["b"]  # nothing of test reaches the map
    a = metrics["a"]
    assert {"thr@0.5/precision", "thr@0.5/recall", "thr@0.5/F1", "thr@best/p", "thr@best/F1"} <= set(a)
    assert a["thr@0.5/precision"] > metrics["b"]["thr@0.5/precision"]  # the test figures are test's own
    assert 0 < a["thr@0.5/recall"] < 100 and 0 < a["thr@0.5/precision"] <= 100

    model = xc.load(tmp_path / "run-a")
    rows = test[0][:20]
    cut = model.predict(rows, k=10, threshold=0.5)
    full = model.predict(rows, k=10)
    kept = cut.ids >= 0
    assert np.all(cut.probs[kept] >= 0.5) and np.all(cut.probs[(~kept) & (full.ids >= 0)] < 0.5)
    assert np.array_equal(cut.ids[kept], full.ids[kept])  # the same labels, only those below p dropped
    lines = "".join(" ".join(f"{j}:{v:.6g}" for j, v in zip(r.indices, r.data)) + "\n" for r in rows)
    proc = subprocess.run([sys.executable, "-m", "xc.cli.predict", str(tmp_path / "run-a"), "--input", "-", "--k",
                           "10", "--min-score", "0.5"], input=lines, capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["ids"] for r in recs] == [row[row >= 0].tolist() for row in cut.ids]
    assert all(p >= 0.5 for r in recs for p in r["probs"])
