"""Kill-anywhere soak: a small 2-rank run killed at random moments, resumed each time, ends bit-identical.

Measures: trains one uninterrupted reference run, then the same configuration in a second run directory,
launched as a user launches it (`python -m torch.distributed.run --nproc-per-node=2 -m xc.cli.train ...`, env
XC_THREADS=1, WANDB_MODE=disabled), killed, re-launched with the same command until it finishes, and again on a
fresh run directory until --kills kills have been sent. Each kill is drawn from a seeded RNG:

- when: mostly a delay uniform over the expected remaining run time (from the reference run's timeline and the
  step the relaunch resumes from), so kills land in start-up, training, the miner's refresh, checkpoint writes
  and the final evaluation/fitting phase in proportion to their length; some kills instead strike at the first
  moment within that delay that is too short to be hit by chance: a checkpoint's `step-*.tmp/` appearing, its
  `meta.json` written (publication follows), or a miner/snapshot stage directory appearing (none within it: at
  the delay's end). The phase hit is read from the run directory (log.jsonl, stage directories) right after the
  kill.
- the signal: SIGKILL or SIGTERM.
- the target: the whole job (every process of it at once, as a scheduler ends a job: the torchrun agent, the
  ranks, which torchrun starts with setsid, each in a process group of its own, and the miner pool), one rank (a child of the agent), or
  the miner pool's worker process (a child of rank 0, `miner=pool miner.workers=1`); a target not running at that
  moment (no pool yet) falls back to the whole job.

After a kill the tool waits for the job to exit (a job still alive after --hang-s is a hang: killed, recorded); a
job that goes on after its rank or miner was hit counts as having survived that kill. Before each relaunch it
checks that nothing half-written is published: every checkpoint validates (sizes and CRC-32,
xc.run.checkpoint.validate), every published snapshot/negatives generation verifies (xc.handoff), no process of
the job is left. Every attempt's output is scanned for "damaged", "skipping", "unreadable", "rejected" (something
half-written was published and then read) and, up to the kill, for tracebacks. A finished run's newest
checkpoint (every tensor of every rank's state, the hard-negative tables) and its metrics.json / selection.json
are compared with the reference's: the figure is the largest absolute difference (0.0 = bit-identical).

    XC_THREADS=1 .venv/bin/python tools/probes/soak.py --kills 50 --seed 0 --out tools/results/soak.json

The miner runs as `miner=pool miner.workers=1 miner.ann.backend=exact miner.late_policy=wait`, so the figures do
not depend on the miner's speed (tests/integration/test_resume.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from xc import handoff  # noqa: E402
from xc.errors import XCError  # noqa: E402
from xc.run import checkpoint as ckpt  # noqa: E402

# tests/integration/test_resume.py's small synthetic run, 3 epochs: 3600 training rows / batch 128 = 28 steps per
# epoch, a checkpoint every 7 steps, hard negatives from epoch 0 (a refresh per epoch, mined by the pool)
ARGS = [
    "data.synthetic.num_train=4000", "data.synthetic.num_test=500", "data.synthetic.num_labels=1000",
    "data.synthetic.num_features=3000", "train.batch_size=128", "train.warmup_steps=5",
    "train.checkpoint_every_steps=7", "model.dropout=0.2", "model.hidden_dims=[64]", "sampler.start_epoch=0",
    "logger.wandb=disabled", "logger.progress=false", "train.lr_classifier=8", "train.ensemble=1",
    "eval.ranker.gamma=1.0", "miner=pool", "miner.workers=1", "miner.ann.backend=exact", "miner.late_policy=wait",
]
STEPS_PER_EPOCH = 28
# What an attempt's output may never say: a damaged checkpoint or generation, a half-written file, was read
BAD_WORDS = ("damaged", "skipping", "unreadable", "rejected")
# Outcomes of a kill that a finished, bit-identical run vindicates
GOOD = ("resumed", "survived", "finished")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(run_dir: Path, cache: Path, nproc: int, epochs: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={_free_port()}", "-m", "xc.cli.train", *ARGS, f"train.epochs={epochs}",
            f"run_dir={run_dir}", f"data.cache_dir={cache}"]


# ---------------------------------------------------------------------------------------------- processes

def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, process group) from /proc/PID/stat; None for a process gone (or a zombie: it holds nothing)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[2]))


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    return sorted(p for p in _all_pids() if (s := _stat(p)) and s[0] == pid)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`. The soak is a child subreaper (prctl), so a rank or miner worker orphaned by a
    killed agent stays below it and is found."""
    parents = {p: s[0] for p in _all_pids() if (s := _stat(p))}
    out, frontier = [], [pid]
    while frontier:
        below = [p for p, parent in parents.items() if parent in frontier]
        out += below
        frontier = below
    return sorted(out)


def become_subreaper() -> None:
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def rank_pids(agent: int) -> dict[int, int]:
    """{rank: pid} of the agent's worker processes (their RANK from /proc/PID/environ)."""
    out = {}
    for pid in children(agent):
        try:
            env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in v)
        except OSError:
            continue
        if "RANK" in env and "xc.cli.train" in _cmdline(pid):
            out[int(env["RANK"])] = pid
    return out


def miner_pids(rank0: int) -> list[int]:
    """The pool's worker processes: rank 0's spawned children (not multiprocessing's resource tracker)."""
    return [p for p in children(rank0) if "spawn_main" in (c := _cmdline(p)) and "resource_tracker" not in c]


# ---------------------------------------------------------------------------------------------- the run directory

def events(run_dir: Path) -> list[dict]:
    """log.jsonl's events; a last line still being written is left out."""
    try:
        lines = (run_dir / "log.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _stages(run_dir: Path) -> list[str]:
    root = handoff.handoff_root(run_dir)
    return [p.name for sub in ("snapshots", "negatives") if (root / sub).is_dir()
            for p in (root / sub).iterdir() if ".tmp" in p.name]


def _checkpoint_tmp(run_dir: Path) -> list[Path]:
    root = ckpt.checkpoint_root(run_dir)
    return [p for p in root.iterdir() if p.name.endswith(".tmp")] if root.is_dir() else []


def phase(run_dir: Path, since: float, total_steps: int) -> str:
    """What the job was doing at this moment, read from the run directory: start-up (this attempt has logged
    nothing yet), checkpoint (a step-*.tmp/ being written), refresh (a snapshot or negatives generation being
    staged, or the trainer waiting for the miner), epoch-end evaluation, final (after the last epoch's
    checkpoint: epoch selection, label prior, ranker, kNN fusion, calibration) or training."""
    mine = [e for e in events(run_dir) if e.get("time", 0) >= since]
    attempts = [e for e in mine if e["event"] == "attempt"]
    if not attempts:
        return "start-up"
    if _checkpoint_tmp(run_dir):
        return "checkpoint"
    last = mine[-1]
    if attempts[-1]["global_step"] >= total_steps or any(e["event"] in ("select_epoch", "eval_kept") for e in mine) \
            or (last["global_step"] >= total_steps and last["event"] in ("checkpoint", "valid")):
        return "final"
    if _stages(run_dir) or last["event"] in ("snapshot", "attempt"):
        return "refresh"  # with start_epoch=0 a run's first act is the epoch's refresh (late_policy=wait)
    if last["event"] in ("epoch", "eval", "valid"):
        return "epoch-end evaluation"
    return "training"


def published_problems(run_dir: Path, nproc: int) -> list[str]:
    """Every published checkpoint and handoff generation must verify: a kill may leave unpublished stage
    directories behind, never a published file that is half-written."""
    problems = []
    for path in ckpt.list_checkpoints(run_dir):
        try:
            meta = ckpt.validate(path)
            bad = [n for n in meta["files"] if n.endswith((".part", ".tmp"))]
            if bad:
                problems.append(f"{path.name}: meta.json lists {bad}")
        except XCError as exc:
            problems.append(f"checkpoint {path.name}: {exc}")
    root = handoff.handoff_root(run_dir)
    for generation in handoff.list_generations(root / "snapshots"):
        try:
            handoff.open_snapshot(run_dir, generation)
        except XCError as exc:
            problems.append(f"snapshot generation {generation}: {exc}")
    for generation in handoff.list_generations(root / "negatives"):
        try:
            handoff.open_negatives(run_dir, generation, range(nproc))
        except XCError as exc:
            problems.append(f"negatives generation {generation}: {exc}")
    return problems


# ---------------------------------------------------------------------------------------------- comparison

def _flatten(value, prefix: str, out: dict) -> None:
    if isinstance(value, dict):
        for key in value:
            _flatten(value[key], f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _flatten(item, f"{prefix}[{i}]", out)
    else:
        out[prefix] = value


def final_state(run_dir: Path) -> tuple[str, dict]:
    """The newest valid checkpoint's name and every value in it: each rank's state and hard-negative tables."""
    found = ckpt.latest_valid(run_dir)
    if found is None:
        raise SystemExit(f"{run_dir}: no valid checkpoint")
    path, meta = found
    out: dict = {}
    for rank in range(int(meta["world_size"])):
        state, tables = ckpt.load_rank(path, rank)
        _flatten(state, f"rank{rank}", out)
        for shard, table in (tables or {}).items():
            out[f"rank{rank}.hard.shard{shard}"] = np.asarray(table)
    return path.name, out


def compare(reference: Path, ref_state: tuple[str, dict], run_dir: Path) -> dict:
    """Largest absolute difference over every tensor and array of the newest checkpoints (0.0: bit-identical), the
    keys or plain values that differ, and whether metrics.json and selection.json equal the reference's."""
    (ref_name, ref), (name, got) = ref_state, final_state(run_dir)
    differ, max_diff = [], 0.0
    if name != ref_name:
        differ.append(f"newest checkpoint {name}, reference {ref_name}")
    for key in sorted(ref.keys() | got.keys()):
        if key not in ref or key not in got:
            differ.append(f"{key}: only in {'the reference' if key in ref else 'the soaked run'}")
            continue
        a, b = ref[key], got[key]
        if a is None or b is None:
            if a is not b:
                differ.append(f"{key}: {b!r}, reference {a!r}")
        elif isinstance(a, (torch.Tensor, np.ndarray)):
            a, b = torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b))
            if a.shape != b.shape or a.dtype != b.dtype:
                differ.append(f"{key}: {tuple(b.shape)} {b.dtype}, reference {tuple(a.shape)} {a.dtype}")
                max_diff = float("inf")
            elif a.numel():
                diff = float((a.double() - b.double()).abs().nan_to_num(float("inf")).max())
                if a.dtype.is_floating_point and not torch.equal(a.isnan(), b.isnan()):
                    diff = float("inf")
                max_diff = max(max_diff, diff)
                if diff:
                    differ.append(f"{key}: max difference {diff:g}")
        elif a != b:
            differ.append(f"{key}: {b!r}, reference {a!r}")
    same = {file: _json(run_dir / file) is not None and _json(run_dir / file) == _json(reference / file)
            for file in ("metrics.json", "selection.json")}
    return {"checkpoint": name, "max_difference": max_diff, "differences": differ[:20], "same_files": same,
            "identical": max_diff == 0.0 and not differ and all(same.values())}


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- one launch

class Job:
    """One launch of the training command, all of its output in one file. The job is the torchrun agent and every
    process below it: the ranks (torchrun starts each with setsid, in a process group of its own, so the agent's process group holds
    the agent alone) and the miner pool's workers below rank 0."""

    def __init__(self, cmd: list[str], out: Path, env: dict):
        self.out, self.handle = out, open(out, "wb")
        self.started_wall, self.started = time.time(), time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.handle, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    def wait(self, timeout: float | None) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self, start: int = 0, end: int | None = None) -> str:
        self.handle.flush()
        data = self.out.read_bytes()
        return data[start:end].decode(errors="replace")

    def offset(self) -> int:
        return self.out.stat().st_size

    def processes(self) -> list[int]:
        return [self.pid, *descendants(self.pid)] if self.alive() else []

    def leftovers(self, grace_s: float = 10.0) -> list[str]:
        """Processes of the job still alive `grace_s` after the agent exited (an orphaned rank or miner worker: the
        soak's only other descendants), then SIGKILLed; [] when none."""
        deadline = time.monotonic() + grace_s
        while (left := descendants(os.getpid())) and time.monotonic() < deadline:
            time.sleep(0.2)
        named = [f"{pid} {_cmdline(pid)[:120]}" for pid in left]
        _signal(left, signal.SIGKILL)
        time.sleep(0.1 if left else 0)
        while True:  # reap the orphans that exited below the subreaper (the agent is reaped already)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        return named

    def kill_all(self) -> None:
        _signal(self.processes(), signal.SIGKILL)
        self.proc.wait()


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def scan(text: str) -> dict[str, list[str]]:
    """Lines of an attempt's output that say a damaged or half-written file was read, and traceback headers."""
    lines = text.splitlines()
    return {"bad": [line[:300] for line in lines if any(w in line.lower() for w in BAD_WORDS)],
            "tracebacks": [lines[i + 1][:300] if i + 1 < len(lines) else line for i, line in enumerate(lines)
                           if line.startswith("Traceback")]}


def _attempt(run_dir: Path, since: float) -> dict | None:
    found = [e for e in events(run_dir) if e["event"] == "attempt" and e.get("time", 0) >= since]
    return found[0] if found else None


class Timeline:
    """The reference run's clock: seconds from launch to its first event (start-up), the time of each checkpoint
    after that, and of its exit; a relaunch's expected remaining time follows from the step it resumes from."""

    def __init__(self, run_dir: Path, launched: float, ended: float):
        evs = events(run_dir)
        self.first = evs[0]["time"]
        self.startup, self.end = self.first - launched, ended - self.first
        self.at = {}
        for e in evs:
            if e["event"] == "checkpoint":
                self.at[e["global_step"]] = e["time"] - self.first  # the later write of a step is the resumed one

    def remaining(self, run_dir: Path) -> float:
        newest = ckpt.list_checkpoints(run_dir)
        step = int(newest[-1].name.split("-")[1]) if newest else 0
        return self.startup + self.end - self.at.get(step, 0.0)


# ---------------------------------------------------------------------------------------------- the soak

MODES = {"uniform": 0.6, "checkpoint-write": 0.15, "checkpoint-publish": 0.1, "refresh": 0.15}
TARGETS = {"job": 0.4, "rank": 0.35, "miner": 0.25}


def _moment(job: Job, run_dir: Path, mode: str, delay: float) -> str | None:
    """Wait for the kill's moment: `delay` seconds, or (a trigger mode) the first moment within them at which this
    attempt starts writing a checkpoint, has written one's meta.json (publication follows), or stages a
    snapshot/negatives generation. Returns "trigger", "delay" (the drawn delay passed first), or None: the job
    exited before."""
    deadline = time.monotonic() + delay
    if mode == "uniform":
        return "delay" if job.wait(delay) is None else None
    started = False
    while time.monotonic() < deadline and job.alive():
        if not started:  # stale stage directories of a killed attempt are swept at start-up, before this event
            started = _attempt(run_dir, job.started_wall) is not None
            time.sleep(0.02)
            continue
        if mode == "refresh":
            if _stages(run_dir):
                return "trigger"
        else:
            tmp = _checkpoint_tmp(run_dir)
            if mode == "checkpoint-write" and tmp:
                return "trigger"
            if mode == "checkpoint-publish" and any((p / "meta.json").exists() for p in tmp):
                return "trigger"
        time.sleep(0.002)
    return "delay" if job.alive() else None


def _send(job: Job, rng: random.Random, nproc: int) -> dict:
    """Draw the signal and target, send it; the record of what was hit."""
    signum = rng.choice([signal.SIGKILL, signal.SIGTERM])
    wanted = rng.choices(list(TARGETS), weights=list(TARGETS.values()))[0]
    rank = rng.randrange(nproc)
    ranks = rank_pids(job.pid)
    target, pids = "job", job.processes()  # as a scheduler ends a job: every process of it at once
    if wanted == "rank" and rank in ranks:
        target, pids = f"rank {rank}", [ranks[rank]]
    elif wanted == "miner" and 0 in ranks and (miners := miner_pids(ranks[0])):
        target, pids = "miner", miners
    _signal(pids, signum)
    return {"signal": signal.Signals(signum).name, "wanted": wanted, "target": target, "pids": pids}


def soak(kills: int, seed: int, workdir: Path, nproc: int = 2, epochs: int = 3, hang_s: float = 180.0,
         log=print) -> dict:
    """The soak's core (tests/integration/test_soak.py runs it with a few kills); returns the report."""
    t0 = time.monotonic()
    become_subreaper()
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "XC_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    cache, total_steps = workdir / "cache", STEPS_PER_EPOCH * epochs

    def launch(run_dir: Path, name: str) -> Job:
        return Job(command(run_dir, cache, nproc, epochs), workdir / f"{name}.out", env)

    reference = workdir / "reference"
    job = launch(reference, "reference")
    if job.wait(None) != 0:
        raise SystemExit(f"the reference run failed:\n{job.output()[-3000:]}")
    timeline = Timeline(reference, job.started_wall, time.time())
    ref_state = final_state(reference)
    log(f"reference run: {time.monotonic() - job.started:.1f}s (start-up {timeline.startup:.1f}s), "
        f"newest checkpoint {ref_state[0]}")

    records: list[dict] = []
    rounds: list[dict] = []
    while len(records) < kills or (rounds and not rounds[-1].get("finished")):
        run_dir = workdir / f"run{len(rounds)}"
        current = {"run_dir": str(run_dir), "kills": [], "attempts": 0, "problems": [], "tracebacks": [],
                   "finished": False}
        rounds.append(current)
        job, pending = None, []
        while True:
            if job is None:
                job = launch(run_dir, f"run{len(rounds) - 1}-attempt{current['attempts']}")
                current["attempts"] += 1
                expected = timeline.remaining(run_dir)
            out_start = 0
            if len(records) < kills:
                mode = rng.choices(list(MODES), weights=list(MODES.values()))[0]
                left = max(0.2, expected - (time.monotonic() - job.started))
                delay = rng.uniform(0.0, left)
                hit = _moment(job, run_dir, mode, delay)
                if hit == "delay" and mode != "uniform":
                    mode += " (not within the delay: killed at its end)"
            else:
                hit = None  # enough kills: let the run finish
            if not hit:
                rc = job.wait(hang_s * 4)
                if rc is None:
                    job.kill_all()
                    current["problems"].append(f"attempt {current['attempts']}: no exit within {hang_s * 4:.0f}s "
                                               "without a kill (hang)")
                    job = None
                    continue
                found = scan(job.output())
                _resumed(pending, run_dir, job)
                current["problems"] += [f"attempt {current['attempts']}: {line}" for line in found["bad"]]
                current["tracebacks"] += found["tracebacks"]
                current["problems"] += [f"orphan: {p}" for p in job.leftovers()]
                if rc == 0:
                    current["finished"] = True
                    break
                current["problems"].append(f"attempt {current['attempts']}: exit {rc} without a kill: "
                                           f"{job.output()[-600:]!r}")
                if current["attempts"] > len(current["kills"]) + 3:
                    raise SystemExit(f"{run_dir}: keeps failing without kills:\n{job.output()[-3000:]}")
                job = None
                continue
            # the moment: kill at once (a trigger's moment lasts milliseconds), then read what the job was doing
            # (a SIGKILLed job's run directory stays as it was; what a SIGTERMed one does next is its own business)
            at = time.monotonic() - job.started
            out_at_kill = job.offset()
            sent = _send(job, rng, nproc)
            where = phase(run_dir, job.started_wall, total_steps)
            last = ([e for e in events(run_dir) if e.get("time", 0) >= job.started_wall] or [{}])[-1]
            _resumed(pending, run_dir, job)
            record = {"kill": len(records) + 1, "round": len(rounds) - 1, "attempt": current["attempts"],
                      "seconds_into_attempt": round(at, 3), "time": round(job.started_wall + at, 3), "mode": mode, "phase": where,
                      "last_event": [last.get("event"), last.get("global_step")], **sent}
            records.append(record)
            current["kills"].append(record["kill"])
            rc = job.wait(3.0 if sent["target"] == "miner" else hang_s)
            if rc is None and sent["target"] == "miner":
                record.update(outcome="survived", exit_code=None)
                log(_line(record))
                continue
            if rc is None:
                job.kill_all()
                record.update(outcome="hang", exit_code=None)
            else:
                record.update(outcome="finished" if rc == 0 else "stopped", exit_code=rc)
            _resumed(pending, run_dir, job)  # the earlier kills', where this attempt got far enough to say it
            before, after = scan(job.output(out_start, out_at_kill)), scan(job.output(out_at_kill))
            record["problems"] = before["bad"] + after["bad"]
            record["tracebacks"] = before["tracebacks"]  # the attempt's own, before it was killed
            record["tracebacks_after_kill"] = after["tracebacks"]  # the dying job's (torchrun reports a lost child)
            record["problems"] += [f"orphan: {p}" for p in job.leftovers()]
            record["problems"] += published_problems(run_dir, nproc)
            log(_line(record))
            if rc == 0:
                current["finished"] = True
                break
            pending.append(record)
            job = None
        current["comparison"] = compare(reference, ref_state, run_dir)
        for record in records:
            if record["round"] == len(rounds) - 1:
                record["end_identical"] = current["comparison"]["identical"]
        log(f"run {len(rounds) - 1}: finished after {current['attempts']} attempt(s), {len(current['kills'])} "
            f"kill(s); max difference {current['comparison']['max_difference']:g}, identical "
            f"{current['comparison']['identical']}, problems {len(current['problems'])}")

    return _report(records, rounds, time.monotonic() - t0, timeline)


def _resumed(pending: list[dict], run_dir: Path, job: Job) -> None:
    """Fill in, for the kills that stopped the previous attempt, where this attempt resumed from."""
    if not pending:
        return
    event = _attempt(run_dir, job.started_wall)
    if event is None:
        return
    for record in pending:
        record["resumed_from_step"] = event["global_step"] if event["resumed_from"] else None
        record["outcome"] = "resumed"
    pending.clear()


def _line(r: dict) -> str:
    return (f"kill {r['kill']:3d}: run {r['round']} attempt {r['attempt']} at {r['seconds_into_attempt']:6.2f}s "
            f"({r['mode']}, {r['phase']}, last event {r['last_event'][0]}@{r['last_event'][1]}): {r['signal']} -> "
            f"{r['target']}: {r.get('outcome')} (exit {r.get('exit_code')})"
            + (f"; PROBLEMS {r['problems']}" if r.get("problems") else ""))


def _report(records: list[dict], rounds: list[dict], wall: float, timeline: Timeline) -> dict:
    hangs = sum(r["outcome"] == "hang" for r in records)
    tracebacks = sum(len(r.get("tracebacks", [])) for r in records) + sum(len(c["tracebacks"]) for c in rounds)
    good = sum(r["outcome"] in GOOD and r.get("end_identical") and not r.get("problems") and not r.get("tracebacks")
               for r in records)
    max_diff = max((c["comparison"]["max_difference"] for c in rounds if "comparison" in c), default=float("nan"))
    problems = sum(len(r.get("problems", [])) for r in records) + sum(len(c["problems"]) for c in rounds)
    summary = {"kills": len(records), "resumed_bit_identical": good, "hangs": hangs, "tracebacks": tracebacks,
               "kills_with_problems": sum(bool(r.get("problems")) for r in records), "problems": problems,
               "runs": len(rounds), "runs_identical": sum(c.get("comparison", {}).get("identical", False)
                                                        for c in rounds),
               "max_difference": max_diff, "wall_seconds": round(wall, 1),
               "reference_seconds": round(timeline.startup + timeline.end, 1),
               "phases": _count(r["phase"] for r in records), "targets": _count(r["target"] for r in records),
               "signals": _count(r["signal"] for r in records), "outcomes": _count(r["outcome"] for r in records)}
    return {"summary": summary, "kills": records, "runs": rounds}


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="tools/results/soak.json")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--hang-s", type=float, default=180.0, help="a job still alive this long after a kill hangs")
    parser.add_argument("--workdir", default=None, help="run directories (default: a fresh temporary folder)")
    args = parser.parse_args()
    import tempfile

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="xc-soak-"))
    report = soak(args.kills, args.seed, workdir, args.nproc, args.epochs, args.hang_s)
    report["command"] = " ".join(["XC_THREADS=1", ".venv/bin/python", "tools/probes/soak.py", *sys.argv[1:]])
    report["train_command"] = " ".join(command(workdir / "runN", workdir / "cache", args.nproc, args.epochs)[1:])
    report["machine"] = f"{os.cpu_count()} cores, {_cpu_model()}"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    s = report["summary"]
    print(f"soak: {s['kills']} kills, {s['resumed_bit_identical']} resumed and ended bit-identical, {s['hangs']} hangs, {s['tracebacks']} tracebacks, "
          f"{s['kills_with_problems']} kills with problems ({s['problems']} problem lines), {s['runs_identical']} of "
          f"{s['runs']} runs identical, max difference {s['max_difference']:g}, wall time {s['wall_seconds']:.0f}s; "
          f"phases {s['phases']}; targets {s['targets']}; {args.out}")


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    main()
