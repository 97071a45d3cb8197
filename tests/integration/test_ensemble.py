"""An ensemble end to end (xc/ensemble/members.py): member 0 is exactly the single model, the averaged fusion of one
member is that model's own fusion, the cross-fitted choice is made on every member's own fold, `xc.load(...).predict` and `xc-eval` reproduce the ensemble's metrics, a
finished ensemble re-run only re-evaluates, and a run directory never mixes an ensemble with a single model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import xc
from tests.conftest import REPO, run_cli
from xc.data.sparse import SparseMatrix
from xc.eval.metrics import evaluate, inverse_propensities
from xc.fitting.fusion import FusionChoice
from xc.fitting.memory import FusionEvaluator
from xc.fitting.model_memory import ModelMemory

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

TINY = ["data.synthetic.num_train=3000", "data.synthetic.num_test=400", "data.synthetic.num_labels=800",
        "data.synthetic.num_features=2000", "train.epochs=2", "train.batch_size=128", "logger.progress=false",
        "train.warmup_steps=5", "logger.wandb=disabled", "model.embed_dim=64",
        "eval.knn_fusion.spaces=[embedding]",  # fused scores that depend on each member's own model
        "eval.label_prior.beta=0.25"]  # one prior for members and ensemble alike: their fusion grids compare


def _module(args):
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled")
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _metrics(run_dir) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def test_ensemble_end_to_end(tmp_path):
    # the lexical ranker fused whatever validation would say of it here: each member's fold scored by its own
    # member's ranker, the one trained on every point fused at test and served from RUN_DIR/ranker/
    common = f"data.cache_dir={tmp_path / 'cache'} eval.ranker.gamma=1.0".split()
    single, ens = tmp_path / "single", tmp_path / "ens"
    run_cli([*TINY, *common, f"run_dir={single}"], cwd=REPO)  # run_cli: train.ensemble=1
    # no train.ensemble: 2,700 training points are "small data", so the default is 3 members
    proc = run_cli([*TINY, *common, f"run_dir={ens}", "train.ensemble=null"], cwd=REPO)
    assert "ensemble of 3 models" in proc.stdout + proc.stderr
    # each fold's ranker is the one its member's own run trained (gamma 1 kept it), not fitted a second time
    assert (proc.stdout + proc.stderr).count("the one its model's own run trained on these points, reused") == 3
    record = json.loads((ens / "ensemble.json").read_text())
    assert record["members"] == 3 and record["seeds"] == [0, 1, 2]

    # member 0 is the single model, bit for bit
    np.testing.assert_equal(_metrics(ens / "members" / "m0"), _metrics(single))
    metrics = _metrics(ens)
    assert metrics["m0/P@1"] == _metrics(single)["P@1"]
    plain = [_metrics(ens / "members" / f"m{m}")["model/P@1"] for m in range(3)]
    assert len(set(plain)) == 3, f"members with other seeds are other models: {plain}"

    # the averaged fusion of one member is that member's own fusion, under its own choice
    one = xc.load(single)
    own = FusionChoice.read(single)  # with the lexical ranker (eval.ranker.gamma=1.0)
    memory = FusionEvaluator([ModelMemory.of(one.cfg, one.components, one.dataset, one.ctx)], one.dataset)
    memory.use_saved_ranker(single, own)
    alone = memory.test_metrics(own, np.arange(one.dataset.test.num_points))
    for key in ("P@1", "P@5", "model/P@1", "model/P@5", "knn/P@1", "PSP@3"):
        assert abs(alone[key] - _metrics(single)[key]) < 1e-6, (key, alone[key], _metrics(single)[key])
    assert (ens / "fusion.json").exists() and metrics["model/P@1"] > 0

    # cross-fitted (the default): member m held out fold m, disjoint; the ensemble's fusion was chosen on all
    # three folds, each scored by the one member that never saw it, so every grid point's validation value is
    # the mean of the members' own values there (equal folds)
    assert record["split"] == "crossfit" and record["valid_points"] == 3 * 300
    fused = json.loads((ens / "fusion.json").read_text())
    member_grids = [{(t["space"], t["k"], t["temperature"], t["lambda"]): t["value"]
                     for t in json.loads((ens / "members" / f"m{m}" / "fusion.json").read_text())["grid"]
                     if "gamma" not in t}  # the points without the lexical ranker
                    for m in range(3)]
    assert fused["gamma"] == 1.0 and (ens / "ranker" / "part0-of1.npz").exists()
    for t in (t for t in fused["grid"] if "gamma" not in t):
        key = (t["space"], t["k"], t["temperature"], t["lambda"])
        assert abs(t["value"] - np.mean([g[key] for g in member_grids])) < 1e-9, (key, t["value"])

    # the served ensemble predicts what training scored, every member under the ensemble's label prior
    model = xc.load(ens)
    assert len(model.members) == 3
    assert json.loads((ens / "prior.json").read_text())["beta"] == 0.25 == record["prior_beta"]
    assert [m.prior_beta for m in model.members] == [0.25] * 3
    f = model.dataset.test.features
    rows = SparseMatrix(np.asarray(f.indptr), np.asarray(f.indices), None if f.values is None else np.asarray(f.values),
                        f.num_cols)
    preds = model.predict(rows, k=5)
    labels = model.dataset.test.labels
    served = evaluate(preds.ids, np.asarray(labels.indptr, np.int64), np.asarray(labels.indices, np.int64),
                      inverse_propensities(model.dataset.train), ks=(1, 3, 5))
    for key in ("P@1", "P@3", "P@5", "PSP@5"):
        assert abs(served[key] - metrics[key]) < 1e-6, (key, served[key], metrics[key])

    # xc-eval of the run directory evaluates the ensemble
    out = tmp_path / "eval.json"
    evaluated = _module(["xc.cli.evaluate", str(ens), "--out", str(out)])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert abs(json.loads(out.read_text())["P@1"] - metrics["P@1"]) < 1e-6

    # a finished ensemble re-run evaluates only, and reports the same figures
    again = run_cli([*TINY, *common, f"run_dir={ens}", "train.ensemble=null"], cwd=REPO)
    assert (again.stdout + again.stderr).count("already complete") == 3
    assert _metrics(ens)["P@1"] == metrics["P@1"]

    # a finished ensemble re-run with eval.* overrides is judged as the command line asks, not as its members stored
    plain = run_cli([*TINY, *common, f"run_dir={ens}", "train.ensemble=null", "eval.ranker.enabled=false"], cwd=REPO)
    assert "already complete" in plain.stdout + plain.stderr
    assert not json.loads((ens / "fusion.json").read_text()).get("gamma")

    # one run directory, one kind of run
    refused = _module(["xc.cli.train", *TINY, *common, f"run_dir={ens}", "train.ensemble=1"])
    assert refused.returncode == 2 and "holds an ensemble" in refused.stderr and "Traceback" not in refused.stderr


def test_ensemble_trained_on_two_ranks_equals_one_process(tmp_path):
    """Members train model-parallel under torchrun (gloo), rank 0 averages them: the same ensemble as in one
    process, figure for figure."""
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    args = [*TINY, cache, "train.ensemble=2", "parallel.num_label_shards=2", "model.dropout=0.0"]  # dropout: per-rank masks
    run_cli([*args, f"run_dir={tmp_path / 'one'}"], cwd=REPO)
    run_cli([*args, f"run_dir={tmp_path / 'two'}"], cwd=REPO, nproc=2)
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    for key in ("P@1", "P@3", "P@5", "model/P@1", "m0/P@1", "m1/P@1"):
        assert abs(one[key] - two[key]) < 1e-6, (key, one[key], two[key])
    assert json.loads((tmp_path / "one" / "fusion.json").read_text())["lambda"] == \
        json.loads((tmp_path / "two" / "fusion.json").read_text())["lambda"]
