"""SIGTERM while the trainer waits for the miner at an epoch's refresh (miner.late_policy=wait): the run stops there,
before the epoch's first step, and the resume ends exactly where an uninterrupted run ends.

Found by the kill-anywhere soak (tools/probes/soak.py): rank 0 gives up the wait at a signal and keeps the negatives it
had (none at the first refresh: uniform draws); the trainer then trained one step with them and checkpointed it, so
the resumed run, mid-epoch, kept them for the rest of the epoch and ended elsewhere (max difference 30 in the
classifier rows, other metrics)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import torch
import pytest

from tests.conftest import REPO, load_final_state, run_cli
from tests.integration.test_resume import ARGS

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

# hard negatives from epoch 1 (28 steps an epoch): generation 1 is mined during epoch 0, and a slow miner makes
# the trainer wait for it at step 28, right after epoch 0's checkpoint
POOL = ["miner=pool", "miner.workers=1", "miner.ann.backend=exact", "miner.late_policy=wait", "sampler.start_epoch=1"]


def test_sigterm_while_waiting_for_the_miner_stops_before_the_epoch_and_resumes_bit_identical(tmp_path):
    args = [*ARGS, *POOL, f"data.cache_dir={tmp_path / 'cache'}"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_cli([*args, f"run_dir={straight}"], cwd=REPO)

    env = {**os.environ, "XC_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
           "XC_FAULT_MINER_DELAY_S": "120"}
    proc = subprocess.Popen([sys.executable, "-m", "xc.cli.train", *args, f"run_dir={stopped}"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "waiting for the miner" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=300)
    output = "".join(seen) + rest
    assert proc.returncode == 143, output[-3000:]
    assert "stopped by SIGTERM after global step 28" in output, output[-3000:]
    steps = sorted(p.name for p in (stopped / "checkpoints").glob("step-*[0-9]"))
    assert steps[-1] == "step-00000028", steps  # no step trained with the negatives kept instead of generation 1

    resumed = run_cli([*args, f"run_dir={stopped}"], cwd=REPO)
    assert "epoch 1, micro-step 0," in resumed.stdout, resumed.stdout[-2000:]
    a, b = load_final_state(straight, 1), load_final_state(stopped, 1)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert json.loads((straight / "metrics.json").read_text()) == json.loads((stopped / "metrics.json").read_text())
