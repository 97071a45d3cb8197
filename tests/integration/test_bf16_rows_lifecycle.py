"""bfloat16 classifier rows (stochastic rounding, no float32 masters) from training to serving: a 2-rank
checkpoint resumed on one process keeps its rows in bfloat16 and ends where the 2-rank run ends; `xc-eval`,
`xc.load` and the saved DiskANN serving index read those rows and score what training scored."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import xc
from tests.conftest import REPO, load_final_state, run_cli
from xc.data.sparse import SparseMatrix
from xc.eval.metrics import evaluate

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

BF16_SR = ["model.classifier_dtype=bfloat16", "model.classifier_master_fp32=false"]
ARGS = [
    "data.synthetic.num_train=2000", "data.synthetic.num_test=300", "data.synthetic.num_labels=500",
    "data.synthetic.num_features=1000", "train.epochs=2", "train.batch_size=128", "train.warmup_steps=5",
    "train.checkpoint_every_steps=4", "train.keep_checkpoints=3", "model.embed_dim=64", "model.hidden_dims=[32]",
    "model.dropout=0.0", "sampler.start_epoch=1", "logger.wandb=disabled", "logger.progress=false",
    "data.valid_fraction=0", "train.ensemble=1", *BF16_SR,  # 15 steps an epoch; hard negatives in use from step 16
]
KILL_AT = 22  # newest checkpoint then: step 20, mid-epoch, hard negatives in use


def _killed(run_dir: Path, cache: Path, nproc: int) -> subprocess.CompletedProcess:
    """The run under torchrun, SIGKILLed after step KILL_AT (run_cli would raise on its failure)."""
    env = {"XC_FAULT_KILL_AT_STEP": str(KILL_AT)}
    full_env = {**os.environ, "XC_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **env}
    cmd = [sys.executable, "-m", "xc.cli.train"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "xc.cli.train"]
    cmd += [*ARGS, f"run_dir={run_dir}", f"data.cache_dir={cache}"]
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600)


def _module(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled")
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """An uninterrupted 2-rank run with bfloat16 rows, and one SIGKILLed after step 22 (newest checkpoint 20)."""
    base = tmp_path_factory.mktemp("bf16_rows")
    cache, straight, killed = base / "cache", base / "straight", base / "killed"
    run_cli([*ARGS, f"run_dir={straight}", f"data.cache_dir={cache}"], cwd=REPO, nproc=2)
    died = _killed(killed, cache, 2)
    assert died.returncode != 0 and not (killed / "metrics.json").exists(), died.stdout[-2000:]
    return cache, straight, killed


def test_two_rank_bf16_checkpoint_resumes_on_one_process_in_bf16(tmp_path, two_rank_runs):
    """The adopted resume reads the bfloat16 rows as stored (no float32 round trip that would change what the
    rounding sees) and goes on rounding stochastically: the final rows are bfloat16 and match the 2-rank run's
    up to the summation-order flips that tests/distributed/test_equivalence.py bounds."""
    cache, straight, killed = two_rank_runs
    run_dir = tmp_path / "on_one"
    shutil.copytree(killed, run_dir)
    proc = run_cli([*ARGS, f"run_dir={run_dir}", f"data.cache_dir={cache}"], cwd=REPO)
    assert "adopted its 2 label shards" in proc.stdout and "global step 20" in proc.stdout, proc.stdout[-3000:]
    meta = json.loads(sorted((run_dir / "checkpoints").glob("step-*[0-9]"))[-1].joinpath("meta.json").read_text())
    assert meta["world_size"] == 1
    a, b = load_final_state(straight, 2), load_final_state(run_dir, 1)
    assert a["classifier"].dtype == b["classifier"].dtype == torch.bfloat16
    assert float((a["classifier"] == b["classifier"]).float().mean()) > 0.99
    rows_a, rows_b = a["classifier"].float(), b["classifier"].float()
    assert float((rows_b - rows_a).norm() / rows_a.norm()) < 1e-3
    m2, m1 = (json.loads((d / "metrics.json").read_text()) for d in (straight, run_dir))
    assert abs(m1["P@1"] - m2["P@1"]) < 1.0, (m1["P@1"], m2["P@1"])


def _test_rows(model) -> SparseMatrix:
    f = model.dataset.test.features
    return SparseMatrix(np.asarray(f.indptr), np.asarray(f.indices), None if f.values is None else np.asarray(f.values),
                        f.num_cols)


def test_xc_eval_xc_load_and_the_serving_index_score_bf16_rows_as_training_did(tmp_path, two_rank_runs):
    _, straight, _ = two_rank_runs
    out = tmp_path / "plain.npz"
    proc = _module(["xc.cli.evaluate", str(straight), "--predictions", str(out), "--out", str(out) + ".json",
                    "--no-fusion"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = dict(np.load(out))

    model = xc.load(straight)  # one process reading the 2 ranks' bfloat16 rows
    assert model.shard.weight.dtype == torch.bfloat16  # served in the precision it was trained in: half the bytes
    rows = _test_rows(model)
    plain = model.predict(rows, k=5, fusion=False)
    np.testing.assert_array_equal(plain.ids, ref["ids"])
    np.testing.assert_allclose(plain.scores, ref["scores"], rtol=1e-5, atol=1e-6)
    labels = model.dataset.test.labels
    got = evaluate(plain.ids, np.asarray(labels.indptr, np.int64), np.asarray(labels.indices, np.int64), None,
                   ks=(1, 3, 5))
    metrics = json.loads((straight / "metrics.json").read_text())
    assert abs(got["P@1"] - metrics["P@1"]) < 1e-6 and abs(got["P@5"] - metrics["P@5"]) < 1e-6

    # the serving index is built on the rows' float32 upcast (exact in float32) and fingerprints those values
    saved = _module(["xc.cli.evaluate", str(straight), "--ann", "diskann", "--save-index", "--out",
                     str(tmp_path / "ann.json")])
    assert saved.returncode == 0, saved.stderr[-3000:]
    manifest = json.loads((straight / "serving" / "diskann" / "manifest.json").read_text())
    assert manifest["shards"]["0"]["rows_sha256"]
    model.use_prior(False)  # ANN serving serves the plain scores: compare with the plain exact top-k
    exact = model.predict(rows, k=5, fusion=False)
    assert model.use_ann("diskann").reused
    served = model.predict(rows, k=5)
    assert np.mean(served.ids == exact.ids) > 0.9
