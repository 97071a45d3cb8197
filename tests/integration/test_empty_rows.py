"""Rows with no features (an empty input line, a row of zero values, a test point without features) score as an
empty query everywhere: training's final evaluation, `xc-eval`, `xc.load(...).predict` and `xc-predict`. Such a
last row used to end in an IndexError from np.add.reduceat (xc/fitting/knn.py `query_blocks`) and no output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import xc
from tests.conftest import REPO
from xc.data.sparse import SparseMatrix

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)


def _write_data(directory: Path, features: int = 300, labels: int = 40) -> Path:
    """A small XC-repository dataset whose labels follow the features, and whose last test point has none."""
    gen = np.random.default_rng(11)
    directory.mkdir()
    for split, n in {"train": 1200, "test": 120}.items():
        lines = [f"{n} {features} {labels}"]
        for i in range(n):
            label = int(gen.integers(0, labels))
            feats = sorted({label * 7 % features, *gen.integers(0, features, 4).tolist()})
            xs = " ".join(f"{f}:1" for f in feats)
            lines.append(f"{label} {xs}" if split == "train" or i < n - 1 else f"{label}")
        (directory / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return directory


def _module(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled")
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          input=stdin, timeout=600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("empty_rows")
    data = _write_data(tmp / "data")
    run_dir = tmp / "run"
    proc = _module(["xc.cli.train", "data.kind=xc_sparse", f"data.path={data}", "data.name=emptyrows",
                    f"data.cache_dir={tmp / 'cache'}", f"run_dir={run_dir}", "train.ensemble=1", "train.epochs=2",
                    "train.batch_size=128", "train.warmup_steps=5", "logger.progress=false",
                    "logger.wandb=disabled"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return run_dir


def test_a_test_point_without_features_is_evaluated_and_counted(trained):
    metrics = json.loads((trained / "metrics.json").read_text())
    assert metrics["P@1"] > 0
    out = trained / "eval-again.json"
    proc = _module(["xc.cli.evaluate", str(trained), "--out", str(out)])
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert json.loads(out.read_text())["P@1"] == pytest.approx(metrics["P@1"], abs=1e-6)


def test_predict_answers_a_row_without_features_as_an_empty_query(trained):
    model = xc.load(trained)
    empty = SparseMatrix(np.array([0, 0]), np.zeros(0, np.int32), np.zeros(0, np.float32), model.num_features)
    alone = model.predict(empty, k=5)
    rows = SparseMatrix(np.array([0, 2, 2, 3]), np.array([1, 5, 3], np.int32), np.array([0.5, 1.0, 0.0], np.float32),
                        model.num_features)  # features; none; a zero value only (last)
    got = model.predict(rows, k=5)
    for row in (1, 2):
        np.testing.assert_array_equal(got.ids[row], alone.ids[0])
        np.testing.assert_allclose(got.scores[row], alone.scores[0], rtol=1e-5, atol=1e-6)
    for text in ("1:0.5 5:1.0\n\n", "1:0.5 5:1.0\n3:0.0\n"):  # a trailing blank line; a last row of zeros
        proc = _module(["xc.cli.predict", str(trained), "--input", "-", "--k", "5"], stdin=text)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines = [json.loads(line) for line in proc.stdout.splitlines()]
        assert len(lines) == 2 and lines[1]["ids"] == alone.ids[0].tolist()
