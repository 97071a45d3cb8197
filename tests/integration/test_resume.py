"""A run SIGKILLed mid-epoch and resumed ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, free_port, load_final_state, run_cli

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

# 3600 training rows (4000 less the validation tenth) / batch 128 = 28 steps per epoch; checkpoints every 7
# steps; killed after step 40, so the newest checkpoint (step 35, epoch 1, micro-step 7) is mid-epoch with
# hard negatives in use (start_epoch=0) and carries epoch 1's validation figures for the choice of the kept
# epoch (xc/eval/epoch_select.py).
ARGS = [
    "data.synthetic.num_train=4000", "data.synthetic.num_test=500", "data.synthetic.num_labels=1000",
    "data.synthetic.num_features=3000", "train.epochs=2", "train.batch_size=128", "train.warmup_steps=5",
    "train.checkpoint_every_steps=7", "model.dropout=0.2", "model.hidden_dims=[64]", "sampler.start_epoch=0",
    "logger.wandb=disabled", "logger.progress=false", "train.lr_classifier=8", "train.ensemble=1",
    "eval.ranker.gamma=1.0",  # the lexical ranker in the served model however validation would judge it on this set
]


def _kill_run(args: list[str], nproc: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled", XC_FAULT_KILL_AT_STEP="40")
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={free_port()}", "-m", "xc.cli.train", *args]
    else:
        cmd = [sys.executable, "-m", "xc.cli.train", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


BF16_SR = ["model.classifier_dtype=bfloat16", "model.classifier_master_fp32=false"]  # stochastic rounding


@pytest.mark.parametrize("nproc, extra", [(1, []), (2, []), (1, ["train.device_batches=true"]),
                                         (1, ["train.static_shapes=on"]), (2, BF16_SR), (1, ["model.lexical_features=8"])],
                         ids=["1", "2", "device-batches", "static-shapes", "bf16-stochastic-rows", "lexical"])
def test_kill_and_resume_equals_uninterrupted(tmp_path, nproc, extra):
    """extra train.device_batches=true: the device batch path (xc/train/modes/classifier/device_batches.py, here on
    CPU tensors) redraws from its keyed generators exactly what the killed run would have drawn;
    train.static_shapes=on: its fixed-shape form (xc/sampling/fixed_shapes.py) too; bfloat16 rows without masters:
    their stochastic rounding is keyed by the step, so the resumed run rounds as the uninterrupted one did."""
    args = [*ARGS, *extra, f"data.cache_dir={tmp_path / 'cache'}"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_cli([*args, f"run_dir={straight}"], cwd=REPO, nproc=nproc)

    died = _kill_run([*args, f"run_dir={killed}"], nproc)
    assert died.returncode != 0, "the fault injection did not kill the run"
    assert not (killed / "metrics.json").exists()
    resumed = run_cli([*args, f"run_dir={killed}"], cwd=REPO, nproc=nproc)
    assert "resumed from" in resumed.stdout and "epoch 1, micro-step 7," in resumed.stdout, resumed.stdout[-2000:]

    a, b = load_final_state(straight, nproc), load_final_state(killed, nproc)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    if extra == ["model.lexical_features=8"]:  # the labels' weights on their features resume with their accumulators
        assert "lexical" in a and a["lexical"].abs().sum() > 0
    if extra == BF16_SR:  # rows stored in bf16 alone, rounded alike: bit for bit
        assert a["classifier"].dtype == torch.bfloat16 and torch.equal(a["classifier"], b["classifier"])
    metrics = json.loads((straight / "metrics.json").read_text())
    assert "ranker/P@1" in metrics and metrics == json.loads((killed / "metrics.json").read_text())
    selection = json.loads((straight / "selection.json").read_text())
    assert [row["epoch"] for row in selection["epochs"]] == [1, 2]
    assert json.loads((killed / "selection.json").read_text()) == selection


def test_pool_miner_with_reranking_kill_and_resume_equals_uninterrupted(tmp_path):
    """An asynchronous miner whose candidates are re-ranked at the switch (miner.rerank_candidates, the pool's
    rule): the resumed run restores the re-ranked table from its checkpoint (re-ranking again with the rows of
    step 35 would keep other negatives) and ends where the uninterrupted run ends."""
    args = [*ARGS, "miner=pool", "miner.workers=1", "miner.ann.backend=exact", "miner.late_policy=wait",
            f"data.cache_dir={tmp_path / 'cache'}"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_cli([*args, f"run_dir={straight}"], cwd=REPO)
    died = _kill_run([*args, f"run_dir={killed}"], 1)
    assert died.returncode != 0, "the fault injection did not kill the run"
    resumed = run_cli([*args, f"run_dir={killed}"], cwd=REPO)
    assert "epoch 1, micro-step 7," in resumed.stdout, resumed.stdout[-2000:]
    events = [json.loads(line) for line in (straight / "log.jsonl").read_text().splitlines()]
    assert [e["rerank"]["candidates"] for e in events if e["event"] == "negatives"] == [128, 128]
    a, b = load_final_state(straight, 1), load_final_state(killed, 1)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert json.loads((straight / "metrics.json").read_text()) == json.loads((killed / "metrics.json").read_text())
    # the negatives' ages as the resumed run logs them: the snapshot's step and the re-ranking switch's, restored
    ages = [{(e["global_step"], e["hard_age_steps"], e["hard_ranked_age_steps"]) for e in
             (json.loads(line) for line in (run / "log.jsonl").read_text().splitlines())
             if e["event"] == "train" and e["hard_generation"] is not None} for run in (straight, killed)]
    assert ages[1] <= ages[0] and any(ranked for _, _, ranked in ages[1])


def test_two_ranks_stopped_mid_rotation_resume_bit_identical(tmp_path):
    """miner.refresh_share=0.5: each generation mines half of the training queries, a window rotating over the
    rows, and the trainer merges it into the table in use. Killed in epoch 1 (generation 1 merged into half of
    generation 0's rows), the 2-rank run resumes from its checkpoint's merged table and ends where the
    uninterrupted run ends; every row is covered from the second generation on."""
    args = [*ARGS, "train.epochs=3", "miner=pool", "miner.workers=1", "miner.ann.backend=exact",
            "miner.late_policy=wait", "miner.refresh_share=0.5", f"data.cache_dir={tmp_path / 'cache'}"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_cli([*args, f"run_dir={straight}"], cwd=REPO, nproc=2)
    events = [json.loads(line) for line in (straight / "log.jsonl").read_text().splitlines()]
    boundaries = [e for e in events if e["event"] == "refresh"]
    assert [(e["epoch"], e["generation"], e["refreshed_share"], e["covered_share"]) for e in boundaries] == [
        (0, 0, 0.5, 0.5), (1, 1, 0.5, 1.0), (2, 2, 0.5, 1.0)]
    assert boundaries[2]["age_max_steps"] > boundaries[2]["age_mean_steps"] > 0  # two windows of different ages
    died = _kill_run([*args, f"run_dir={killed}"], 2)
    assert died.returncode != 0, "the fault injection did not kill the run"
    resumed = run_cli([*args, f"run_dir={killed}"], cwd=REPO, nproc=2)
    assert "epoch 1, micro-step 7," in resumed.stdout, resumed.stdout[-2000:]
    a, b = load_final_state(straight, 2), load_final_state(killed, 2)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert json.loads((straight / "metrics.json").read_text()) == json.loads((killed / "metrics.json").read_text())


def test_more_epochs_on_a_finished_run_say_the_schedule_is_replanned(tmp_path):
    """A finished run resumed with a larger train.epochs trains on, and the re-planned learning-rate schedule is said
    (a warning and a `schedule` event with the factor before and after), never a silent jump of the rate."""
    run_dir = tmp_path / "run"
    base = [*ARGS, f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"]
    run_cli(base, cwd=REPO)
    proc = run_cli([*base, "train.epochs=3"], cwd=REPO)
    assert "the learning-rate schedule is re-planned over" in proc.stdout + proc.stderr
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    schedule = [e for e in events if e["event"] == "schedule"]
    assert len(schedule) == 1 and schedule[0]["planned_steps"] == 3 * schedule[0]["planned_steps_before"] // 2
    assert schedule[0]["lr_factor_before"] < 0.01 < schedule[0]["lr_factor"]
    assert max(e["epoch"] for e in events if e["event"] == "eval") == 3


def test_lexical_weights_are_refused_on_a_checkpoint_without_them(tmp_path):
    """A run trained without lexical weights (the rule's 0), resumed with model.lexical_features: one line naming
    the checkpoint and the key, no traceback, and the checkpoint untouched; the run resumes as it was trained without
    the override. A run given 0 is another run for the guard: one line naming both values."""
    run_dir = tmp_path / "run"
    base = [*ARGS, "train.epochs=1", f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"]
    run_cli(base, cwd=REPO)
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "xc.cli.train", *base, "train.epochs=2", "model.lexical_features=8"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "has no lexical weights" in proc.stderr, proc.stderr[-2000:]
    assert "model.lexical_features" in proc.stderr and ckpts[-1] in proc.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ckpts
    run_cli([*base, "train.epochs=2"], cwd=REPO)  # the same run goes on without the override
    given = [*base, "train.epochs=2", f"run_dir={tmp_path / 'given'}"]
    run_cli([*given, "train.epochs=1", "model.lexical_features=0"], cwd=REPO)
    proc = subprocess.run([sys.executable, "-m", "xc.cli.train", *given, "model.lexical_features=8"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert "holds checkpoints of another run" in proc.stderr and "sets 8" in proc.stderr
