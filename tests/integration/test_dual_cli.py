"""The dual-encoder mode end to end through the CLI on the synthetic LF set: a run SIGKILLed (or SIGTERMed)
mid-epoch and resumed (towers, optimiser, label cache, corrector and its optimiser, encoding counters) ends exactly where
an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, free_port, run_cli
from tests.distributed.test_dual_equivalence import TINY, load_dual_state

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

# 512 rows / batch 64 = 8 steps per epoch, 2 epochs; checkpoints every 3 steps; killed after step 11, so
# the newest checkpoint (step 9) is mid-epoch and the corrector has trained for 9 steps.
ARGS = [a for a in TINY if not a.startswith("parallel.")] + [
    "sampler=corrector", "train.checkpoint_every_steps=3", "model.free_vectors=true", "model.share_towers=false",
    "data.valid_fraction=0"]  # every row trains: the step counts above


@pytest.mark.parametrize("fault,micro", [
    ("XC_FAULT_KILL_AT_STEP", 1),  # SIGKILL after step 11: the newest checkpoint is step 9 (epoch 1, micro 1)
    ("XC_FAULT_SIGNAL_AT_STEP", 3),  # SIGTERM after step 11: a checkpoint at step 11 itself (epoch 1, micro 3)
])
def test_dual_kill_and_resume_equals_uninterrupted(tmp_path, fault, micro):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_cli([*ARGS, cache, f"run_dir={straight}"], cwd=REPO)
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled", **{fault: "11"})
    died = subprocess.run([sys.executable, "-m", "xc.cli.train", *ARGS, cache, f"run_dir={killed}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert died.returncode == (143 if "SIGNAL" in fault else -9), "the fault injection did not stop the run"
    resumed = run_cli([*ARGS, cache, f"run_dir={killed}", "train.resume=auto"], cwd=REPO)
    assert "resumed from" in resumed.stdout and f"micro-step {micro}," in resumed.stdout, resumed.stdout[-2000:]
    a, b = load_dual_state(straight, 1), load_dual_state(killed, 1)
    assert any(".h." in k for k in a) and any("label_tower" in k for k in a)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert json.loads((straight / "metrics.json").read_text()) == json.loads((killed / "metrics.json").read_text())


def test_dual_run_stopped_on_two_ranks_resumes_on_one(tmp_path):
    """A dual run SIGTERMed on 2 ranks (2 label shards) resumes in 1 process, which takes both shards (each
    shard's cache and corrector from the file of the rank that held it, free vectors stitched by label id),
    and ends where an uninterrupted 1-process run over the same 2 shards ends, up to float summation order."""
    # one shared tower: with two, Adam turns the float noise of the label tower's never-seen token rows into
    # full-size steps, and 1 and 2 ranks differ there even without a resume
    args = [a for a in ARGS if a != "model.share_towers=false"] + [f"data.cache_dir={tmp_path / 'cache'}"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_cli([*args, "parallel.num_label_shards=2", f"run_dir={straight}"], cwd=REPO)
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled", XC_FAULT_SIGNAL_AT_STEP="11")
    died = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           f"--master-port={free_port()}", "-m", "xc.cli.train", *args, "train.ensemble=1",
                           f"run_dir={stopped}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert died.returncode != 0 and not (stopped / "metrics.json").exists(), died.stdout[-2000:] + died.stderr[-2000:]
    resumed = run_cli([*args, f"run_dir={stopped}", "train.resume=auto"], cwd=REPO)
    assert "2 label shards from 2 rank(s) onto 1" in resumed.stdout, resumed.stdout[-2000:]
    a, b = load_dual_state(straight, 1), load_dual_state(stopped, 1)
    assert a.keys() == b.keys() and any(k.startswith("shard1.") for k in a) and "free" in a
    for name in a:
        if name.endswith(".h.outer.bias"):  # zero gradient under the softmax corrector loss (see the 2-rank test)
            continue
        atol = 1e-3 if ".h." in name else 1e-5
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")
    counts = [[json.loads(x) for x in (r / "log.jsonl").read_text().splitlines() if '"encodings"' in x][-1]
              for r in (straight, stopped)]
    assert counts[0]["fresh_encodings"] == counts[1]["fresh_encodings"]


def test_dual_run_fuses_a_knn_vote_chosen_on_its_validation_split(tmp_path):
    """Dual mode holds out data.valid_fraction of the training points, chooses the kNN fusion on them
    (fusion.json), and reports the fused, plain-model and vote metrics; lambda fixed at 0 gives the plain
    model's figures exactly."""
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    base = [a for a in TINY if not a.startswith("parallel.")] + ["sampler=corrector", cache]
    run_cli([*base, f"run_dir={tmp_path / 'chosen'}"], cwd=REPO)
    record = json.loads((tmp_path / "chosen" / "fusion.json").read_text())
    assert record["valid_points"] == 51  # round(0.1 * 512)
    assert record["grid"] and record["valid_fused"] >= record["valid_model"]
    metrics = json.loads((tmp_path / "chosen" / "metrics.json").read_text())
    assert {"P@1", "model/P@1", "knn/P@1"} <= metrics.keys()
    run_cli([*base, f"run_dir={tmp_path / 'zero'}", "eval.knn_fusion.lam=0", "eval.knn_fusion.k=10",
             "eval.knn_fusion.space=embedding"], cwd=REPO)
    zero = json.loads((tmp_path / "zero" / "metrics.json").read_text())
    assert zero["P@1"] == zero["model/P@1"] and zero["P@5"] == zero["model/P@5"]
    assert zero["model/P@1"] == metrics["model/P@1"]  # the same trained model either way


def test_dual_run_logs_its_phases_and_cpu_seconds(tmp_path):
    """train.profile_phases in dual mode: every train event carries the mean seconds of each dual phase, which
    add up to no more than the wall time per step, and CPU seconds per step beside it."""
    from xc.train.phases import DUAL_PHASES

    run = tmp_path / "run"
    run_cli([*[a for a in TINY if not a.startswith("parallel.")], "sampler=corrector", "train.profile_phases=true",
             "train.log_every=2", f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run}"], cwd=REPO)
    events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    train = [e for e in events if e["event"] == "train"]
    assert train
    for e in train:
        phases = e["phase_seconds"]
        assert tuple(phases) == DUAL_PHASES and all(v >= 0 for v in phases.values())
        assert phases["negatives"] > 0 and phases["backward"] > 0
        assert sum(phases.values()) <= e["sec_per_step"] * 1.05 and e["cpu_sec_per_step"] > 0


def test_dual_run_trains_under_bf16_autocast(tmp_path):
    """train.amp=bf16 in dual mode: both towers run under autocast (the trained towers differ from a float32
    run's, which they would not if amp were ignored), the metrics are finite, xc.load serves the towers in
    bf16 too, and fp16 is refused with the key to change."""
    import math

    import xc

    # a hidden layer, so the towers have a matmul for autocast to run in bf16 (the bag mean itself stays fp32)
    base = [a for a in TINY if not a.startswith("parallel.")] + ["sampler=corrector", "train.epochs=1",
                                                                 "model.hidden_dims=[16]",
                                                                 f"data.cache_dir={tmp_path / 'cache'}"]
    run_cli([*base, f"run_dir={tmp_path / 'fp32'}"], cwd=REPO)
    run_cli([*base, f"run_dir={tmp_path / 'bf16'}", "train.amp=bf16"], cwd=REPO)
    fp32, bf16 = load_dual_state(tmp_path / "fp32", 1), load_dual_state(tmp_path / "bf16", 1)
    assert any(not torch.equal(fp32[k], bf16[k]) for k in fp32 if "tower" in k or "query" in k)
    metrics = json.loads((tmp_path / "bf16" / "metrics.json").read_text())
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))
    model = xc.load(tmp_path / "bf16")
    assert model.encoder.autocast == torch.bfloat16
    refused = subprocess.run([sys.executable, "-m", "xc.cli.train", *base, f"run_dir={tmp_path / 'fp16'}",
                              "train.amp=fp16"], cwd=REPO, env=dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled"),
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "train.amp" in refused.stderr + refused.stdout


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_dual_nonfinite_step_is_skipped_or_stops_the_run(tmp_path, policy):
    """train.nonfinite in dual mode: an inf in a tower gradient at step 3 is dropped whole under `skip` (one
    optimizer step fewer, a `nonfinite` event, finite weights), and stops the run with exit 2 under `stop`."""
    run = tmp_path / policy
    args = [*[a for a in TINY if not a.startswith("parallel.")], "sampler=corrector", "train.epochs=1",
            f"train.nonfinite={policy}", f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run}"]
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled", XC_FAULT_NAN_AT_STEP="3", XC_FAULT_NAN_KIND="grad")
    proc = subprocess.run([sys.executable, "-m", "xc.cli.train", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    if policy == "stop":
        assert proc.returncode == 2 and "non-finite encoder gradient at epoch 0 micro-step 3" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    (skipped,) = [e for e in events if e["event"] == "nonfinite"]
    assert skipped["what"] == "encoder gradient" and skipped["micro"] == 3 and skipped["skipped_steps"] == 1
    train = [e for e in events if e["event"] == "train"]
    micro_steps = 461 // 64  # 512 rows less the 10% validation split, batch 64
    assert train[-1]["global_step"] == micro_steps - 1 and train[-1]["skipped_steps"] == 1
    assert all(torch.isfinite(v).all() for v in load_dual_state(run, 1).values())
