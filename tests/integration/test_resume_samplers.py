"""Samplers with their own index (MIDX) resume mid-epoch exactly where an uninterrupted run would be."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import pytest

from tests.conftest import REPO, load_final_state, run_cli

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

# 31 steps per epoch, checkpoints every 7 steps, killed after step 16: the newest checkpoint (step 14)
# is mid-epoch, so the resumed run must sample from the codebooks built at that epoch's start.
ARGS = [
    "data.name=resume-midx", "data.synthetic.num_train=4000", "data.synthetic.num_test=300",
    "data.synthetic.num_labels=1000", "data.synthetic.num_features=3000", "train.epochs=2", "train.batch_size=128",
    "train.warmup_steps=5", "train.checkpoint_every_steps=7", "model.embed_dim=32", "sampler=midx_rq",
    "sampler.midx_codewords=8", "sampler.k_hard=0", "sampler.k_random=32", "logger.wandb=disabled",
    "logger.progress=false", "train.ensemble=1",
]


def test_midx_kill_and_resume_equals_uninterrupted(tmp_path):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_cli([*ARGS, cache, f"run_dir={straight}"], cwd=REPO)
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled", XC_FAULT_KILL_AT_STEP="16")
    died = subprocess.run([sys.executable, "-m", "xc.cli.train", *ARGS, cache, f"run_dir={killed}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert died.returncode != 0, "the fault injection did not kill the run"
    resumed = run_cli([*ARGS, cache, f"run_dir={killed}"], cwd=REPO)
    assert "resumed from" in resumed.stdout
    a, b = load_final_state(straight, 1), load_final_state(killed, 1)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
