"""The kept epoch end to end (xc/eval/epoch_select.py), on real data that overfits: a single Bibtex model (seed 1,
30 epochs planned) peaks on its validation split around epoch 7 and stops 8 epochs later (the patience); the run
keeps that epoch, its checkpoint survives pruning, training's metrics, `xc-eval` and `xc.load` all score with it,
and the same command again trains no further."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import xc
from tests.conftest import REPO, ranked, run_cli, shared_dataset
from xc.run import checkpoint as ckpt
from xc.data.sparse import SparseMatrix
from xc.eval.metrics import evaluate

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)


def test_bibtex_keeps_an_earlier_epoch_and_every_reader_uses_it(tmp_path):
    data = shared_dataset("bibtex")
    run_dir = tmp_path / "run"
    command = ["data=bibtex", f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}",
               "seed=1", "train.ensemble=1", "train.keep_checkpoints=1", "eval.every_epochs=0",
               "eval.knn_fusion.enabled=false", "eval.label_prior.enabled=false", "logger.wandb=disabled",
               "logger.progress=false"]
    run_cli(command, cwd=REPO)
    selection = json.loads((run_dir / ckpt.SELECTION_FILE).read_text())
    kept, last = selection["kept"], selection["last"]
    assert kept["epoch"] < last["epoch"] < 30, selection  # 30 planned; stopped by the patience
    assert last["epoch"] - selection["best"]["epoch"] == 8  # eval.select_epoch_patience
    assert selection["gain"] > selection["gain_se"] > 0
    assert [row["epoch"] for row in selection["epochs"]] == list(range(1, last["epoch"] + 1))
    assert kept["valid"] == max(row["valid"] for row in selection["epochs"])
    kept_dir, last_dir = ckpt.step_dir(run_dir, kept["global_step"]), ckpt.step_dir(run_dir, last["global_step"])
    assert ckpt.list_checkpoints(run_dir) == [kept_dir, last_dir]  # keep_checkpoints=1, plus the kept epoch

    metrics = json.loads((run_dir / "metrics.json").read_text())
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    final = [e for e in events if e["event"] == "eval_kept"]
    assert len(final) == 1 and final[0]["P@1"] == metrics["P@1"]

    model = xc.load(run_dir)
    assert model.checkpoint == kept_dir
    labels = model.dataset.test.labels
    f = model.dataset.test.features
    rows = SparseMatrix(np.asarray(f.indptr), np.asarray(f.indices), None if f.values is None else np.asarray(f.values),
                        f.num_cols)
    pred = model.predict(rows, k=5)
    got = evaluate(pred.ids, np.asarray(labels.indptr, np.int64), np.asarray(labels.indices, np.int64), None,
                   ks=(1, 3, 5))
    assert abs(got["P@1"] - metrics["P@1"]) < 1e-6 and abs(got["P@5"] - metrics["P@5"]) < 1e-6

    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "xc.cli.evaluate", str(run_dir), "--out", str(out)], cwd=REPO,
                          env=dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == ranked(metrics)  # xc-eval reproduces metrics.json from the kept checkpoint

    # the same command on the stopped run evaluates again and trains no further epoch
    run_cli(command, cwd=REPO)
    again = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert [e for e in again if e["event"] == "epoch"] == [e for e in events if e["event"] == "epoch"]
    assert ckpt.list_checkpoints(run_dir)[-1] == last_dir
    assert json.loads((run_dir / "metrics.json").read_text())["P@1"] == metrics["P@1"]
