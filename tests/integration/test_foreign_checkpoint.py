"""A checkpoint named for a run it does not belong to (`xc-eval runs/A --checkpoint runs/B/checkpoints/step-…`,
`xc-predict`, `xc.load`) is scored alone, with one log line saying so: run A's kNN fusion, ranker and label prior
were chosen for A's model (they used to be applied to B's, silently). Another number of labels is refused in one
line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import xc
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

TINY = ["data.synthetic.num_train=3000", "data.synthetic.num_test=400", "data.synthetic.num_labels=800",
        "data.synthetic.num_features=2000", "train.epochs=2", "train.batch_size=128", "logger.progress=false",
        "train.warmup_steps=5", "logger.wandb=disabled", "model.dropout=0.0", "train.ensemble=1"]


def _module(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled")
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """Run A (trained, with a fusion and a prior), run B (another run directory: a copy of A, so the same data and
    counts), and run C whose checkpoint records another number of labels."""
    tmp = tmp_path_factory.mktemp("foreign")
    run_a = tmp / "A"
    proc = _module(["xc.cli.train", f"run_dir={run_a}", f"data.cache_dir={tmp / 'cache'}", *TINY])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (run_a / "fusion.json").exists()
    run_b, run_c = tmp / "B", tmp / "C"
    shutil.copytree(run_a, run_b)
    shutil.copytree(run_a, run_c)
    for meta_path in (run_c / "checkpoints").glob("step-*/meta.json"):  # as a run on 700 labels records it
        meta = json.loads(meta_path.read_text())
        meta["layout"]["num_labels"] = meta["identity"]["data"]["num_labels"] = 700
        meta_path.write_text(json.dumps(meta))
    return run_a, run_b, run_c


def _newest(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step-*"))[-1]


def test_xc_eval_scores_another_runs_checkpoint_alone_and_says_so(runs, tmp_path):
    run_a, run_b, _ = runs
    proc = _module(["xc.cli.evaluate", str(run_a), "--checkpoint", str(_newest(run_b)),
                    "--out", str(tmp_path / "b.json")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr  # xc-eval logs to stdout
    assert "is another run's than" in said and "it lies in another run directory" in said, said[-3000:]
    foreign = json.loads((tmp_path / "b.json").read_text())
    assert not any(key.startswith(("knn/", "model/", "ranker/")) for key in foreign)  # no fusion
    proc = _module(["xc.cli.evaluate", str(run_a), "--checkpoint", str(_newest(run_a)),
                    "--out", str(tmp_path / "a.json")])
    assert proc.returncode == 0 and "another run" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    own = json.loads((tmp_path / "a.json").read_text())
    assert any(key.startswith("knn/") for key in own)  # the run's own checkpoint keeps its fusion
    assert foreign["P@1"] == pytest.approx(own["model/P@1"], abs=1e-6)  # B is a copy: the plain model's figures


def test_xc_load_of_another_runs_checkpoint_has_no_fusion_or_prior(runs):
    run_a, run_b, _ = runs
    model = xc.load(run_a, _newest(run_b))
    assert model.foreign and model.fusion is None and not model.prior_beta
    assert model.use_prior(True) in (None, 0.0)  # asking for the prior does not bring run A's back
    own = xc.load(run_a, _newest(run_a))
    assert own.foreign is None and own.fusion is not None


def test_a_checkpoint_with_another_number_of_labels_is_refused_in_one_line(runs, tmp_path):
    run_a, _, run_c = runs
    for module in ("xc.cli.evaluate", "xc.cli.predict"):
        extra = ["--input", str(tmp_path / "q.txt")] if module == "xc.cli.predict" else []
        (tmp_path / "q.txt").write_text("1:0.5 5:1.0\n")
        proc = _module([module, str(run_a), "--checkpoint", str(_newest(run_c)), *extra])
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "has 700 labels and the run in" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_another_runs_checkpoint_copied_into_the_run_is_scored_alone_and_said(runs, tmp_path):
    """A checkpoint of another run (same data and model, another seed: the identity agrees) copied over the run's own
    under the same name: its meta.json records the other run's id (written by xc/run/checkpoint.py from the run
    directory's marker), so xc-eval, xc-predict and xc.load score it alone and say so (before: the run's fusion,
    ranker and prior were applied to it, exit 0, no word)."""
    run_a = runs[0]
    copied = tmp_path / "A-with-a-copied-checkpoint"
    shutil.copytree(run_a, copied)
    for meta_path in (copied / "checkpoints").glob("step-*/meta.json"):
        meta = json.loads(meta_path.read_text())
        assert meta["run_id"]  # every checkpoint records its run
        meta["run_id"] = "0" * 32  # as another run wrote it
        meta_path.write_text(json.dumps(meta))
    proc = _module(["xc.cli.evaluate", str(copied), "--out", str(tmp_path / "e.json")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "is another run's than" in said and "was written by run 00000000" in said, said[-3000:]
    assert not any(key.startswith(("knn/", "model/", "ranker/")) for key in json.loads((tmp_path / "e.json").read_text()))
    (tmp_path / "q.txt").write_text("1:0.5 5:1.0\n")
    proc = _module(["xc.cli.predict", str(copied), "--input", str(tmp_path / "q.txt")])
    assert proc.returncode == 0 and "was written by run 00000000" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    model = xc.load(copied)
    assert model.foreign and model.fusion is None and not model.prior_beta
    assert xc.load(run_a).foreign is None  # the run's own checkpoints, untouched
