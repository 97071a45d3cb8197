"""The life of a run around its steps (docs/reliability.md, section 8): run identity, train.resume=never,
the run-directory lock, SIGTERM/SIGINT, timed checkpoints, attempt markers and a stopped rank.

Tiny synthetic data, as in test_reliability.py: 2000 rows / batch 128 = 15 steps per epoch, 2 epochs,
checkpoints every 4 steps, hard negatives from epoch 1 on. Signals arrive after step 18 (epoch 1,
micro-step 3): not a checkpoint step, hard negatives in use.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, load_final_state
from tests.integration.test_reliability import ARGS  # the same small synthetic run
from xc.run import checkpoint as ckpt

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

SIGNAL_AT = 18


def _cmd(args: list[str], run_dir: Path, cache: Path, nproc: int) -> list[str]:
    cmd = [sys.executable, "-m", "xc.cli.train"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "xc.cli.train"]
    return cmd + [*ARGS, *args, f"run_dir={run_dir}", f"data.cache_dir={cache}"]


def _env(extra: dict | None = None) -> dict:
    return {**os.environ, "XC_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **(extra or {})}


def _launch(args: list[str], run_dir: Path, cache: Path, nproc: int = 1, env: dict | None = None):
    return subprocess.run(_cmd(args, run_dir, cache, nproc), cwd=REPO, env=_env(env), capture_output=True, text=True,
                          timeout=300)


def _run(args, run_dir, cache, nproc=1, env=None):
    proc = _launch(args, run_dir, cache, nproc, env)
    assert proc.returncode == 0, f"failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _steps(run_dir: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in ckpt.list_checkpoints(run_dir)]


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()) if e["event"] == kind]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 1-rank run (checkpoints 24, 28, 30) and the data cache."""
    base = tmp_path_factory.mktemp("lifecycle")
    cache, run_dir = base / "cache", base / "finished"
    _run([], run_dir, cache)
    assert _steps(run_dir) == [24, 28, 30]
    return cache, run_dir


# ------------------------------------------------------------------ items 1-3, 13: run identity


def test_resume_never_archives_the_old_run_and_keeps_its_own_checkpoint(tmp_path, finished):
    cache, done = finished
    run_dir = tmp_path / "again"
    shutil.copytree(done, run_dir)
    proc = _run(["train.resume=never", "train.max_steps=3"], run_dir, cache)
    # The old run's steps 24..30 used to win the pruning and delete this run's step-3 checkpoint.
    assert _steps(run_dir) == [3], proc.stdout[-2000:]
    (archived,) = (run_dir / "archive").iterdir()
    assert _steps(archived) == [24, 28, 30]
    assert json.loads((archived / "metrics.json").read_text()) == json.loads((done / "metrics.json").read_text())
    assert "train.resume=never: moved the previous run's files to" in proc.stdout
    assert [e["global_step"] for e in _events(run_dir, "checkpoint")] == [3]  # a fresh log.jsonl too


@pytest.mark.parametrize("override,needle", [
    ("data.synthetic.seed=7", "the data has the same counts but other content"),  # same L and F
    ("data.synthetic.num_train=1500", "it was trained on 2000 training points, but this run's data has 1500"),
    ("model.hidden_dims=[16]", "model.hidden_dims was [32], this run sets [16]"),
])
def test_other_data_or_model_is_refused_before_anything_is_written(tmp_path, finished, override, needle):
    cache, done = finished
    run_dir = tmp_path / "other"
    shutil.copytree(done, run_dir)
    before = {name: (run_dir / name).read_bytes() for name in ("config.json", "log.jsonl", "metrics.json")}
    proc = _launch([override, "logger.wandb=offline"], run_dir, cache)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith("error: run directory") and "Traceback" not in proc.stderr, proc.stderr
    assert needle in proc.stderr and "run_dir=" in proc.stderr and "train.resume=never" in proc.stderr, proc.stderr
    assert {name: (run_dir / name).read_bytes() for name in before} == before  # config.json not rewritten
    assert not (run_dir / "wandb").exists() and not (run_dir / ".lock").exists()  # no wandb run opened
    assert _steps(run_dir) == [24, 28, 30]


def _write_xc_sparse(directory: Path, rows: dict[str, int], features: int, labels: int) -> Path:
    """A random dataset in the XC-repository format with the given counts."""
    import numpy as np

    gen = np.random.default_rng(5)
    directory.mkdir()
    for split, n in rows.items():
        lines = [f"{n} {features} {labels}"]
        for _ in range(n):
            ys = ",".join(map(str, sorted(set(gen.integers(0, labels, 3).tolist()))))
            xs = " ".join(f"{f}:1" for f in sorted(set(gen.integers(0, features, 6).tolist())))
            lines.append(f"{ys} {xs}")
        (directory / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return directory


def test_own_data_without_a_preset_does_not_resume_the_synthetic_run(tmp_path, finished):
    """data.kind=xc_sparse data.path=... keeps data.name=synthetic, so the run lands in the synthetic run's
    directory; with the very same counts (L, F, N) it used to be taken for that run ("already complete")."""
    cache, done = finished
    run_dir = tmp_path / "own"
    shutil.copytree(done, run_dir)
    data = _write_xc_sparse(tmp_path / "mine", {"train": 2000, "test": 300}, features=1000, labels=500)
    proc = _launch(["data.kind=xc_sparse", f"data.path={data}"], run_dir, cache)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "the data has the same counts but other content" in proc.stderr, proc.stderr
    assert _steps(run_dir) == [24, 28, 30]


# ------------------------------------------------------------------ item 5: one trainer per run directory


def test_a_live_lock_refuses_the_run_and_a_stale_one_is_taken_over(tmp_path, finished):
    cache, _ = finished
    run_dir = tmp_path / "locked"
    run_dir.mkdir()
    host = socket.gethostname()
    (run_dir / ".lock").write_text(json.dumps({"pid": os.getpid(), "host": host, "started": time.time()}))
    proc = _launch(["train.max_steps=2"], run_dir, cache)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"is in use by pid {os.getpid()} on host {host}" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # nothing written

    dead = subprocess.Popen(["true"])
    dead.wait()
    (run_dir / ".lock").write_text(json.dumps({"pid": dead.pid, "host": host, "started": time.time()}))
    proc = _run(["train.max_steps=2"], run_dir, cache)
    assert f"took over the stale lock {run_dir / '.lock'} (its process {dead.pid} on this host is gone)" in proc.stdout
    assert not (run_dir / ".lock").exists()  # released at the end


def test_two_real_trainers_on_one_run_directory(tmp_path, finished):
    """A holds the lock (stopped after step 2, so it is alive but not finishing); B is refused naming A;
    A is SIGKILLed (its lock stays behind); C takes the stale lock over and completes the run."""
    cache, _ = finished
    run_dir = tmp_path / "shared"
    holder = subprocess.Popen(_cmd([], run_dir, cache, 1), cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL,
                              env=_env({"XC_FAULT_SIGNAL_AT_STEP": "2", "XC_FAULT_SIGNAL": "STOP"}))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and Path(f"/proc/{holder.pid}/stat").read_text().split()[2] != "T":
            time.sleep(0.2)
        assert json.loads((run_dir / ".lock").read_text())["pid"] == holder.pid
        second = _launch([], run_dir, cache)
        assert second.returncode == 2 and f"is in use by pid {holder.pid} on host" in second.stderr, second.stderr
    finally:
        holder.kill()
        holder.wait(30)
    third = _run([], run_dir, cache)
    assert f"(its process {holder.pid} on this host is gone)" in third.stdout
    assert _steps(run_dir)[-1] == 30 and not (run_dir / ".lock").exists()


# ------------------------------------------------------------------ item 6: SIGTERM / SIGINT, timed checkpoints


@pytest.fixture(scope="module")
def straight_two_ranks(finished, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight2") / "run"
    _run([], run_dir, finished[0], nproc=2)
    return run_dir


@pytest.mark.parametrize("nproc,sig,target", [(1, "TERM", "self"), (1, "INT", "self"), (2, "TERM", "parent"),
                                              (2, "TERM", "self")])
def test_signal_checkpoints_every_rank_at_that_step_and_the_resume_is_bit_identical(
        tmp_path, finished, straight_two_ranks, nproc, sig, target):
    """(2, TERM, self): only rank 0 receives SIGTERM; rank 1 learns it through the per-step all-reduce."""
    cache, straight = finished[0], (finished[1] if nproc == 1 else straight_two_ranks)
    run_dir = tmp_path / "signalled"
    proc = _launch([], run_dir, cache, nproc, env={"XC_FAULT_SIGNAL_AT_STEP": str(SIGNAL_AT), "XC_FAULT_SIGNAL": sig,
                                                     "XC_FAULT_SIGNAL_TARGET": target})
    line = (f"stopped by SIG{sig} after global step {SIGNAL_AT}; checkpoint "
            f"{run_dir / 'checkpoints' / f'step-{SIGNAL_AT:08d}'} written on every rank")
    assert sum(line in row for row in proc.stderr.splitlines()) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    if nproc == 1:
        assert proc.returncode == (143 if sig == "TERM" else 130)
        assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    else:  # the workers exit 143; torchrun then reports the job as failed (its own SignalException when signalled)
        assert proc.returncode != 0
    assert not (run_dir / "metrics.json").exists()
    assert max(_steps(run_dir)) == SIGNAL_AT
    meta = ckpt.validate(run_dir / "checkpoints" / f"step-{SIGNAL_AT:08d}")
    assert meta["world_size"] == nproc and all(f"rank{r}.pt" in meta["files"] for r in range(nproc))
    (stopped,) = _events(run_dir, "stopped")
    assert (stopped["signal"], stopped["global_step"]) == (f"SIG{sig}", SIGNAL_AT)

    resumed = _run([], run_dir, cache, nproc)
    assert "resumed from" in resumed.stdout and f"global step {SIGNAL_AT}" in resumed.stdout, resumed.stdout[-2000:]
    a, b = load_final_state(straight, nproc), load_final_state(run_dir, nproc)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert json.loads((straight / "metrics.json").read_text()) == json.loads((run_dir / "metrics.json").read_text())
    # item 12: each attempt is marked; events after step 18 of the first attempt are superseded
    attempts = _events(run_dir, "attempt")
    assert [(e["global_step"], e["superseded_after_step"]) for e in attempts] == [(0, 0), (SIGNAL_AT, SIGNAL_AT)]
    assert attempts[1]["resumed_from"].endswith(f"step-{SIGNAL_AT:08d}")


def test_signal_during_the_epoch_end_evaluation_stops_before_the_next_refresh(tmp_path, finished):
    """A SIGTERM that arrives after an epoch's last step (during its evaluation; XC_FAULT_SIGNAL_AT_EPOCH_END)
    stops the run at the epoch's own checkpoint, before the next epoch's synchronous refresh mines (minutes at
    10^6 labels, longer than many schedulers' grace), and the resume equals the uninterrupted run. Before, it
    was honoured only after the refresh and the next step."""
    cache, straight = finished
    run_dir = tmp_path / "signalled"
    proc = _launch([], run_dir, cache, env={"XC_FAULT_SIGNAL_AT_EPOCH_END": "1"})
    assert proc.returncode == 143, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stopped by SIGTERM after global step 15" in proc.stderr, proc.stderr[-3000:]
    assert max(_steps(run_dir)) == 15 and not (run_dir / "metrics.json").exists()
    (stopped,) = _events(run_dir, "stopped")
    assert (stopped["global_step"], stopped["epoch"], stopped["micro"]) == (15, 1, 0)
    assert _events(run_dir, "negatives") == [] and max(e["global_step"] for e in _events(run_dir, "train")) == 15

    _run([], run_dir, cache)
    assert _events(run_dir, "negatives"), "the resumed run refreshes at epoch 1 as the uninterrupted one did"
    a, b = load_final_state(straight, 1), load_final_state(run_dir, 1)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert json.loads((straight / "metrics.json").read_text()) == json.loads((run_dir / "metrics.json").read_text())


def test_a_signal_in_the_final_phase_stops_at_once_and_the_same_command_evaluates_again(tmp_path, finished):
    """Once training is over there is no step to finish: a SIGTERM in the final evaluation (the kept epoch's test
    ranking, the prior, the fusion, the ranker, the calibration: 35 minutes at 10^7 labels) stops the run where it
    is, with one line and 143, its checkpoints whole; the same command then evaluates only, to the uninterrupted
    run's metrics. Before, the flag was never read there and the signal waited out the phase."""
    cache, straight = finished
    run_dir = tmp_path / "final"
    proc = _launch([], run_dir, cache, env={"XC_FAULT_SIGNAL_IN_FINAL_PHASE": "1"})
    assert proc.returncode == 143, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stopped by SIGTERM in the final evaluation, after global step 30" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (run_dir / "metrics.json").exists()
    assert _steps(run_dir) == [24, 28, 30]

    again = _run([], run_dir, cache)
    assert "evaluating only" in again.stdout + again.stderr
    assert json.loads((straight / "metrics.json").read_text()) == json.loads((run_dir / "metrics.json").read_text())


def test_a_finished_run_keeps_what_it_serves_and_resumes_from_and_drops_the_rest(tmp_path, finished):
    """train.prune_when_done (the default; this module's runs turn it off to count their checkpoints): at the end
    the checkpoints neither served nor newest go, and so do the miner's snapshots and negatives (at 10^7 labels
    43 GB of a run's 53), said in one line and a `pruned` event; the same command then evaluates to the same
    metrics, and a raised train.epochs trains on from the newest checkpoint."""
    cache, straight = finished
    run_dir = tmp_path / "pruned"
    proc = _run(["train.prune_when_done=true", "miner=pool", "miner.workers=1"], run_dir, cache)
    assert _steps(run_dir) == [30]  # no validation split: the newest is what the run serves
    (pruned,) = _events(run_dir, "pruned")
    assert pruned["checkpoints"] == ["step-00000024", "step-00000028"] and pruned["generations"] >= 1
    assert pruned["freed_bytes"] > 0 and "finished: removed 2 checkpoints" in proc.stdout + proc.stderr
    handoff = run_dir / "handoff"
    assert not list((handoff / "snapshots").glob("gen-*")) and not list((handoff / "negatives").glob("gen-*"))
    assert (handoff / "control" / "trainer-done").exists()
    metrics = json.loads((run_dir / "metrics.json").read_text())

    again = _run(["train.prune_when_done=true", "miner=pool", "miner.workers=1"], run_dir, cache)
    assert "evaluating only" in again.stdout + again.stderr
    assert json.loads((run_dir / "metrics.json").read_text()) == metrics

    _run(["train.prune_when_done=true", "miner=pool", "miner.workers=1", "train.epochs=3", "train.max_steps=40"],
         run_dir, cache)
    assert _steps(run_dir) == [40] and _events(run_dir, "negatives")[-1]["global_step"] == 30  # mined afresh


def test_checkpoint_every_minutes(tmp_path, finished):
    run_dir = tmp_path / "timed"
    _run(["train.checkpoint_every_steps=0", "train.checkpoint_every_minutes=0.00001", "train.max_steps=5"], run_dir,
         finished[0])
    assert sorted({e["global_step"] for e in _events(run_dir, "checkpoint")}) == [1, 2, 3, 4, 5]


# ------------------------------------------------------------------ item 9: a stopped rank


def test_a_stopped_rank_is_named_and_the_job_ends_at_parallel_timeout_s(tmp_path, finished):
    run_dir = tmp_path / "stopped"
    cmd = _cmd(["parallel.timeout_s=12", "parallel.heartbeat_s=3"], run_dir, finished[0], nproc=2)
    env = _env({"XC_FAULT_SIGNAL_AT_STEP": "10", "XC_FAULT_SIGNAL": "STOP", "XC_FAULT_SIGNAL_RANK": "1"})
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    stopped_pid = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("a collective waited longer" in row for row in list(lines)):
            time.sleep(0.5)
        named = [row for row in list(lines) if "rank 1 (pid" in row and "has not been heard from" in row]
        assert named, "".join(lines)[-3000:]
        stopped_pid = int(named[0].split("rank 1 (pid ")[1].split()[0])
        errors = [row for row in lines if row.startswith("error: rank 0: a collective waited longer than "
                                                          "parallel.timeout_s=12s")]
        assert errors, "".join(lines)[-3000:]
        assert time.monotonic() - start < 90
    finally:
        if stopped_pid is not None:
            os.kill(stopped_pid, signal.SIGKILL)  # torchrun would wait 30 s on the stopped rank
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode != 0


# ------------------------------------------------------------------ item 14: relative paths


def test_relative_paths_are_stored_absolute_and_xc_eval_works_from_elsewhere(tmp_path, finished):
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    cmd = [sys.executable, "-m", "xc.cli.train", *ARGS, "train.max_steps=3", "run_dir=runs/rel", "data.cache_dir=cache"]
    proc = subprocess.run(cmd, cwd=here, env=_env({"PYTHONPATH": str(REPO)}), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads((here / "runs" / "rel" / "config.json").read_text())
    assert config["run_dir"] == str(here / "runs" / "rel") and config["data"]["cache_dir"] == str(here / "cache")
    evaluated = subprocess.run([sys.executable, "-m", "xc.cli.evaluate", str(here / "runs" / "rel")], cwd=elsewhere,
                               env=_env({"PYTHONPATH": str(REPO)}), capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert list(elsewhere.iterdir()) == []  # the data was found where the run left it, not regenerated here
