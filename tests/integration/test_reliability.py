"""Faults injected into real training runs (docs/reliability.md): a rank SIGKILLed under torchrun with
restarts, resume on another world size, NaN/inf losses, gradients and weights.

Tiny synthetic data: 2000 rows / batch 128 = 15 steps per epoch, 2 epochs; checkpoints every 4 steps;
hard negatives mined at the start of epoch 1 (start_epoch=1), so a kill after step 22 leaves a newest
checkpoint (step 20) mid-epoch with hard negatives in use. Dropout is 0: dropout masks come from each
rank's own RNG, so only without it can 1 process redo exactly what 2 ranks did.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, load_final_state

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

ARGS = [
    "data.synthetic.num_train=2000", "data.synthetic.num_test=300", "data.synthetic.num_labels=500",
    "data.synthetic.num_features=1000", "train.epochs=2", "train.batch_size=128", "train.warmup_steps=5",
    "train.checkpoint_every_steps=4", "train.keep_checkpoints=3", "model.embed_dim=64", "model.hidden_dims=[32]",
    "model.dropout=0.0", "sampler.start_epoch=1", "logger.wandb=disabled", "logger.progress=false",
    "train.log_every=5", "data.valid_fraction=0",  # all 2000 points train: 15 steps an epoch
    "train.prune_when_done=false",  # every checkpoint and generation stays, for the tests to look at
]
KILL_AT = 22  # newest checkpoint then: step 20 = epoch 1, micro-step 5


def _launch(args: list[str], run_dir: Path, cache: Path, nproc: int = 1, env: dict | None = None,
            launcher: list[str] = ()) -> subprocess.CompletedProcess:
    """Run xc.cli.train on ARGS + args; under `torchrun --standalone` (as launch/single_node.sh does, and it
    picks its own free port) when nproc > 1. Returns failures instead of raising."""
    full_env = {**os.environ, "XC_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **(env or {})}
    cmd = [sys.executable, "-m", "xc.cli.train"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *launcher, "-m", "xc.cli.train"]
    cmd += [*ARGS, *args, f"run_dir={run_dir}", f"data.cache_dir={cache}"]
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600)


def _run(args: list[str], run_dir: Path, cache: Path, nproc: int = 1, **kw) -> subprocess.CompletedProcess:
    proc = _launch(args, run_dir, cache, nproc, **kw)
    assert proc.returncode == 0, f"failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()) if e["event"] == kind]


def _steps(run_dir: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in sorted((run_dir / "checkpoints").glob("step-*[0-9]"))]


def _assert_same_model(a: dict, b: dict, atol: float, rtol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """An uninterrupted 2-rank run, and a 2-rank run SIGKILLed (both ranks) after step 22."""
    base = tmp_path_factory.mktemp("two_ranks")
    cache, straight, killed = base / "cache", base / "straight", base / "killed"
    _run([], straight, cache, nproc=2)
    died = _launch([], killed, cache, nproc=2, env={"XC_FAULT_KILL_AT_STEP": str(KILL_AT)})
    assert died.returncode != 0 and not (killed / "metrics.json").exists(), died.stdout[-2000:]
    assert max(_steps(killed)) == 20
    return cache, straight, killed


# ------------------------------------------------------------------ item 1: torchrun --max-restarts

def test_torchrun_restarts_after_one_rank_is_sigkilled_and_ends_with_the_same_model(tmp_path, two_rank_runs):
    cache, straight, _ = two_rank_runs
    run_dir = tmp_path / "restarted"
    proc = _launch([], run_dir, cache, nproc=2, launcher=["--max-restarts=1", "--monitor-interval=0.5"],
                   env={"XC_FAULT_KILL_AT_STEP": str(KILL_AT), "XC_FAULT_KILL_RANK": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert (run_dir / "fault-kill-fired").read_text() == "rank 1 killed\n"  # one rank really died
    assert "resumed from" in proc.stdout and "micro-step 5, global step 20" in proc.stdout, out[-3000:]
    _assert_same_model(load_final_state(straight, 2), load_final_state(run_dir, 2), atol=1e-6, rtol=0)
    assert json.loads((run_dir / "metrics.json").read_text()) == json.loads((straight / "metrics.json").read_text())


def test_a_rank_killed_without_restarts_stops_its_peer_with_one_line_naming_it(tmp_path, two_rank_runs):
    """Rank 0 used to print hydra's "Error executing job" and a gloo "Connection reset by peer" traceback."""
    cache, _, _ = two_rank_runs
    run_dir = tmp_path / "dead_peer"
    proc = _launch([], run_dir, cache, nproc=2, env={"XC_FAULT_KILL_AT_STEP": str(KILL_AT), "XC_FAULT_KILL_RANK": "1"})
    assert proc.returncode != 0 and (run_dir / "fault-kill-fired").read_text() == "rank 1 killed\n"
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: rank 0:")]
    assert "Error executing job" not in proc.stderr and "Connection reset by peer" not in proc.stderr, proc.stderr[-3000:]
    assert "broadcast_buffers" not in proc.stderr  # torch's deprecation notice, once per rank, is not for users
    # torchrun may SIGTERM rank 0 first (then it checkpoints and says so); otherwise rank 0 names the dead rank
    if ours:
        assert len(ours) == 1 and "rank 1 (pid " in ours[0] and "has exited" in ours[0], ours
    else:
        assert "stopped" in proc.stderr.lower(), proc.stderr[-3000:]


# ------------------------------------------------------------------ item 2: another world size

def test_checkpoint_of_two_ranks_resumes_on_one_exactly(tmp_path, two_rank_runs):
    cache, straight, killed = two_rank_runs
    run_dir = tmp_path / "on_one"
    shutil.copytree(killed, run_dir)
    proc = _run([], run_dir, cache)
    assert "adopted its 2 label shards" in proc.stdout and "global step 20" in proc.stdout, proc.stdout[-3000:]
    (event,) = _events(run_dir, "resume")
    assert (event["mode"], event["from_world_size"], event["world_size"], event["label_shards"]) == ("adopt", 2, 1, 2)
    # the same training as 2 ranks, up to float summation order (as tests/distributed/test_equivalence.py)
    _assert_same_model(load_final_state(straight, 2), load_final_state(run_dir, 1), atol=1e-5, rtol=1e-4)
    m2, m1 = (json.loads((d / "metrics.json").read_text()) for d in (straight, run_dir))
    for key in ("P@1", "P@3", "P@5"):
        assert abs(m1[key] - m2[key]) < 0.5, (key, m1[key], m2[key])


def test_checkpoint_of_two_ranks_resumes_on_four_by_resplitting(tmp_path, two_rank_runs):
    cache, straight, killed = two_rank_runs
    run_dir = tmp_path / "on_four"
    shutil.copytree(killed, run_dir)
    proc = _run([], run_dir, cache, nproc=4)
    assert "RE-SPLIT into 4 label shards" in proc.stdout and "not bit-identical" in proc.stdout, proc.stdout[-3000:]
    (event,) = _events(run_dir, "resume")
    assert (event["mode"], event["from_label_shards"], event["label_shards"]) == ("resplit", 2, 4)
    meta = json.loads((run_dir / "checkpoints" / f"step-{max(_steps(run_dir)):08d}" / "meta.json").read_text())
    assert (meta["world_size"], meta["num_label_shards"], meta["global_step"]) == (4, 4, 30)
    # the re-split hard negatives were used, not dropped, and training went on sensibly
    train = [e for e in _events(run_dir, "train") if e["global_step"] > 20]
    assert train and all(e["hard_generation"] == 1 for e in train)
    m4, m2 = (json.loads((d / "metrics.json").read_text()) for d in (run_dir, straight))
    assert abs(m4["P@1"] - m2["P@1"]) < 5 and m4["P@1"] > 30, (m4, m2)


@pytest.mark.parametrize("override,needles", [
    ("parallel.num_label_shards=1", ["written with 2 label shards", "parallel.num_label_shards=1"]),
    ("data.synthetic.num_labels=400", ["trained on 500 labels", "has 400"]),
    ("model.hidden_dims=[16]", ["model.hidden_dims was [32]", "this run sets [16]"]),
])
def test_impossible_resume_stops_naming_both_values(tmp_path, two_rank_runs, override, needles):
    cache, _, killed = two_rank_runs
    run_dir = tmp_path / "bad"
    shutil.copytree(killed, run_dir)
    proc = _launch([override], run_dir, cache)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: "), proc.stderr[-2000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    assert max(_steps(run_dir)) == 20  # nothing was written


# ------------------------------------------------------------------ item 3: damaged newest checkpoint

def test_damaged_newest_checkpoint_resume_uses_the_previous_one(tmp_path, two_rank_runs):
    cache, _, killed = two_rank_runs
    run_dir = tmp_path / "damaged"
    shutil.copytree(killed, run_dir)
    victim = run_dir / "checkpoints" / "step-00000020" / "rank1.pt"
    victim.write_bytes(victim.read_bytes()[:-100])  # a partial write the rename did not protect against
    proc = _run(["train.max_steps=17"], run_dir, cache)
    assert f"skipping damaged checkpoint step-00000020, trying the previous one: {victim}: truncated" in proc.stdout
    assert "resumed from" in proc.stdout and "step-00000016" in proc.stdout and "global step 16" in proc.stdout


# ------------------------------------------------------------------ item 5: numerical faults

def test_nonfinite_gradient_on_one_rank_is_skipped_on_every_rank(tmp_path, two_rank_runs):
    cache = two_rank_runs[0]
    run_dir = tmp_path / "skip"
    proc = _launch(["train.nonfinite=skip", "train.epochs=1"], run_dir, cache, nproc=2,
                   env={"XC_FAULT_NAN_AT_STEP": "6", "XC_FAULT_NAN_KIND": "grad", "XC_FAULT_NAN_RANK": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # rank 1's classifier gradient was poisoned; both ranks saw it and skipped the same step
    for rank in (0, 1):
        assert f"[rank{rank}] WARNING xc.train.trainer: non-finite classifier row gradient at epoch 0 micro-step 6" in proc.stdout
    (event,) = _events(run_dir, "nonfinite")
    assert event["what"] == "classifier row gradient" and event["skipped_steps"] == 1
    assert _events(run_dir, "train")[-1]["skipped_steps"] == 1
    assert max(_steps(run_dir)) == 14  # 15 micro-steps, one skipped: 14 optimizer steps
    state = load_final_state(run_dir, 2)
    assert all(torch.isfinite(v).all() for v in state.values())
    assert json.loads((run_dir / "metrics.json").read_text())["P@1"] > 10


@pytest.mark.parametrize("kind,message", [
    ("loss", "non-finite loss at epoch 0 micro-step 10 (global step 10); stopping without writing a checkpoint"),
    ("grad", "non-finite classifier row gradient at epoch 0 micro-step 10 (global step 10)"),
    ("weight", "non-finite values in the classifier rows at epoch 0 global step 12; refusing to write a checkpoint"),
])
def test_nonfinite_stop_exits_2_and_writes_no_checkpoint_from_the_poisoned_state(tmp_path, two_rank_runs, kind, message):
    cache = two_rank_runs[0]
    run_dir = tmp_path / "stop"
    proc = _launch(["train.nonfinite=stop", "train.epochs=1"], run_dir, cache,
                   env={"XC_FAULT_NAN_AT_STEP": "10" if kind != "weight" else "9", "XC_FAULT_NAN_KIND": kind})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert _steps(run_dir) == [4, 8]  # the last good checkpoint is the newest; nothing after the fault
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
