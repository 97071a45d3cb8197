"""The reliability probes of the second and third rounds, re-run as a whole, as a user would.

    XC_THREADS=1 .venv/bin/python tools/reliability_probes.py [--only NAME ...] [--out JSON] [--keep DIR]

36 probes: the 18 of the second round (docs/reliability.md; 11 that were clean then, 7 that were not) and the
18 of the third. Each one runs the real commands (`xc-train`, `xc-eval`, `xc-predict`, `xc-miner`,
`torchrun`, `python -m xc.cli.train`, a `python -c "xc.load(...)"`) as subprocesses in a temporary folder
on small synthetic (or hand-written XC-repository) data, and classifies what happened:

    CLEAN      the promised behaviour: a refusal in one line, the right answer, the same figures
    LOSS       a user's file overwritten or removed (file hashes before and after), or code run from a file
    SILENT     a wrong answer or a wrong write with exit 0 and no word about it
    TRACEBACK  a Python traceback (or hydra's "Error executing job") where a one-line message belongs
               (torchrun's own ChildFailedError / SignalException, the launcher's output, is not counted)
    FAILED     none of those, but the promised behaviour did not happen (a one-line error where an answer
               was due, readers of a live run that gave up): unclean too
    SKIPPED    the probe cannot run here (says why); ERROR: the probe itself broke (a bug of this tool)

Read-only folders, a full disk and `run_dir=/` are made real with a private mount namespace
(`unshare -m`: a read-only bind mount, a small tmpfs, `/` remounted read-only), because root (which the test
machines run as) ignores `chmod -w`; without `unshare`, a non-root user gets `chmod -w` and root gets SKIPPED.

Prints a table and the counts (paths under the probes' temporary folder read TMP/...); exit code 1 if any
probe is not CLEAN (SKIPPED included).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PY = sys.executable

CLEAN, LOSS, SILENT, TRACEBACK, FAILED, SKIPPED, ERROR = (
    "CLEAN", "LOSS", "SILENT", "TRACEBACK", "FAILED", "SKIPPED", "ERROR")
OUTCOMES = (CLEAN, LOSS, SILENT, TRACEBACK, FAILED, SKIPPED, ERROR)

TRACEBACK_HEAD = "Traceback (most recent call last)"
HYDRA_ERROR = "Error executing job"
LAUNCHER_PREFIX = "torch.distributed.elastic."  # only torchrun's agent raises these (its summary after a rank fails)

# the small synthetic run every probe trains (one model, not the small-data ensemble, unless said)
SMALL = ["data.synthetic.num_train=600", "data.synthetic.num_test=150", "data.synthetic.num_labels=200",
         "data.synthetic.num_features=500", "train.epochs=2", "train.ensemble=1", "logger.wandb=disabled",
         "logger.progress=false"]


# ---------------------------------------------------------------------------------------------- classifier

def find_tracebacks(text: str) -> list[str]:
    """The final exception line of every Python traceback in TEXT (chained ones each), and hydra's
    "Error executing job" lines; torchrun's own tracebacks (torch.distributed.elastic.*: its ChildFailedError
    summary after a rank fails, its SignalException when it is signalled) are the launcher's and left out."""
    lines = text.splitlines()
    found: list[str] = []
    for i, line in enumerate(lines):
        if HYDRA_ERROR in line:
            found.append(line.strip())
        if TRACEBACK_HEAD not in line:
            continue
        exc = "(traceback with no exception line)"
        for nxt in lines[i + 1:]:
            if not nxt.strip() or nxt.startswith((" ", "\t")) or nxt.lstrip().startswith("^"):
                continue
            if TRACEBACK_HEAD in nxt:
                break
            exc = nxt.strip()
            break
        if exc.startswith(LAUNCHER_PREFIX):  # torchrun's own (ChildFailedError, SignalException): the launcher's
            continue
        found.append(exc)
    return found


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every regular file under ROOT (or of ROOT itself), by path relative to ROOT."""
    root = Path(root)
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def hash_changes(before: dict[str, str], after: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(changed, removed, added) paths between two `file_hashes`."""
    changed = sorted(k for k in before if k in after and after[k] != before[k])
    removed = sorted(k for k in before if k not in after)
    added = sorted(k for k in after if k not in before)
    return changed, removed, added


def error_line(text: str) -> str:
    """The line a user reads: the first `error:` line, else the last non-empty line."""
    rows = [r.strip() for r in text.splitlines() if r.strip()]
    for r in rows:
        if r.startswith("error:") or " error: " in r[:60]:
            return r
    return rows[-1] if rows else "(no output)"


def classify(rc: int | None, output: str, *, before: dict[str, str] | None = None,
             after: dict[str, str] | None = None, wrong: str | None = None, failed: str | None = None,
             clean: str = "") -> tuple[str, str]:
    """One outcome and a one-line detail, the worst first: LOSS (a file of BEFORE changed or gone in AFTER),
    SILENT (WRONG, a wrong answer or write the probe saw, with exit 0: if the command failed it said something,
    so a WRONG with rc != 0 counts as FAILED), TRACEBACK (in OUTPUT), FAILED (FAILED, what did not happen),
    else CLEAN (CLEAN, what did)."""
    if before is not None and after is not None:
        changed, removed, _ = hash_changes(before, after)
        if changed or removed:
            what = [f"{p} overwritten" for p in changed] + [f"{p} removed" for p in removed]
            return LOSS, "; ".join(what[:4]) + (f" (+{len(what) - 4} more)" if len(what) > 4 else "")
    tbs = find_tracebacks(output)
    if wrong and rc == 0 and not tbs:
        return SILENT, wrong
    if tbs:
        return TRACEBACK, f"{len(tbs)} traceback(s), last: {tbs[-1][:200]}"
    if wrong:
        return FAILED, f"{wrong} (exit {rc}: {error_line(output)[:160]})"
    if failed:
        return FAILED, failed
    return CLEAN, clean


# ---------------------------------------------------------------------------------------------- running

@dataclass
class Proc:
    rc: int | None
    out: str
    err: str
    secs: float

    @property
    def text(self) -> str:
        return self.out + "\n" + self.err


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("XC_THREADS", "1")
    env.update({"WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": env.get("HYDRA_FULL_ERROR", "")})
    if not env["HYDRA_FULL_ERROR"]:
        del env["HYDRA_FULL_ERROR"]
    env.update(extra or {})
    return env


SHOWN_ROOT: list[str] = []  # the probes' temporary folder, shown as TMP in the outputs (set by Ctx)


def _short(text: str) -> str:
    for root in SHOWN_ROOT:
        text = text.replace(root, "TMP")
    return text


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float = 300, stdin: str | None = None) -> Proc:
    """CMD's exit code and output; paths under the probes' temporary folder read TMP/... in the output."""
    t0 = time.monotonic()
    try:
        p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(env), capture_output=True, text=True,
                           input=stdin, timeout=timeout, errors="replace")
        return Proc(p.returncode, _short(p.stdout), _short(p.stderr), time.monotonic() - t0)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return Proc(None, _short(out), _short(err) + f"\n(probe: timed out after {timeout}s)", time.monotonic() - t0)


def xc(name: str) -> str:
    return str(BIN / name)


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True,
                              timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


UNSHARE = _unshare_works()
IS_ROOT = os.geteuid() == 0


def read_only(directory: Path, cmd: list[str], cwd: Path, env: dict | None = None, timeout: float = 300
              ) -> tuple[Proc | None, str]:
    """Run CMD with DIRECTORY read-only: a read-only bind mount in a private mount namespace, or chmod -w
    for a non-root user. (None, why) when neither can be done here."""
    if UNSHARE:
        script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
        return run(["unshare", "-m", "--propagation", "private", "bash", "-c", script, "_", directory, *cmd],
                   cwd, env, timeout), "read-only bind mount (unshare -m)"
    if not IS_ROOT:
        modes = {p: p.stat().st_mode for p in [directory, *directory.rglob("*")] if p.is_dir()}
        for p in modes:
            p.chmod(modes[p] & ~0o222)
        try:
            return run(cmd, cwd, env, timeout), "chmod -w (non-root user)"
        finally:
            for p, m in modes.items():
                p.chmod(m)
    return None, "root ignores chmod -w and unshare -m is not available: needs a non-root user"


def train_cmd(run_dir: Path, cache: Path, *over: str, launcher: str = "xc-train", small: bool = True) -> list[str]:
    head = [xc("xc-train")] if launcher == "xc-train" else [PY, "-m", "xc.cli.train"]
    return [*head, *(SMALL if small else []), *over, f"run_dir={run_dir}", f"data.cache_dir={cache}"]


def torchrun_cmd(nproc: int, run_dir: Path, cache: Path, *over: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "xc.cli.train",
            *SMALL, *over, f"run_dir={run_dir}", f"data.cache_dir={cache}"]


def checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "checkpoints").glob("step-*") if re.fullmatch(r"step-\d+", p.name))


def final_state(run_dir: Path, world: int) -> dict:
    import torch

    states = [torch.load(checkpoints(run_dir)[-1] / f"rank{r}.pt", weights_only=True) for r in range(world)]
    out = {f"encoder.{k}": v for k, v in states[0]["encoder"].items()}
    out["classifier"] = torch.cat([s["classifier"]["weight"] for s in states])
    return out


def metrics(run_dir: Path) -> dict:
    m = json.loads((run_dir / "metrics.json").read_text())
    return {k: v for k, v in m.items() if not any(w in k for w in ("time", "seconds", "wall", "_s"))}


def write_xc_sparse(directory: Path, n_train=200, n_test=50, features=50, labels=20, seed=0,
                    empty_last_test=False) -> Path:
    """A small XC-repository dataset (train.txt, test.txt) whose labels follow their features."""
    import numpy as np

    gen = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in {"train": n_train, "test": n_test}.items():
        lines = [f"{n} {features} {labels}"]
        for i in range(n):
            label = int(gen.integers(0, labels))
            feats = sorted({label * 7 % features, *gen.integers(0, features, 4).tolist()})
            xs = " ".join(f"{f}:1.0" for f in feats)
            last = split == "test" and i == n - 1 and empty_last_test
            lines.append(f"{label}" if last else f"{label} {xs}")
        (directory / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return directory


# ---------------------------------------------------------------------------------------------- context

class Ctx:
    """A temporary root, the shared data cache, and the runs that probes only read (trained once)."""

    def __init__(self, root: Path):
        self.root = root
        SHOWN_ROOT[:] = [str(root)]
        self.cache = root / "cache"
        self._runs: dict[str, Path] = {}
        self._launcher_runs: dict[str, Path] = {}

    def tmp(self, name: str) -> Path:
        d = self.root / "probes" / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        return d

    def shared(self, which: str = "A") -> Path:
        """Run A (seed 0) and run B (seed 1): finished small runs on the same data; read, never written (readers
        get --out into their own folder). A probe that writes takes a copy."""
        if which not in self._runs:
            run_dir = self.root / "shared" / which
            if (run_dir / "metrics.json").exists():  # a kept folder (--keep) of an earlier invocation
                self._runs[which] = run_dir
                return run_dir
            seed = {"A": 0, "B": 1}[which]
            p = run(train_cmd(run_dir, self.cache, f"seed={seed}"), self.root, timeout=600)
            if p.rc != 0 or not (run_dir / "metrics.json").exists():
                raise RuntimeError(f"shared run {which} did not train (exit {p.rc}): {error_line(p.text)}")
            self._runs[which] = run_dir
        return self._runs[which]

    def copy_of(self, which: str, dest: Path) -> Path:
        shutil.copytree(self.shared(which), dest, symlinks=True)
        return dest

    def launcher_run(self, key: str) -> Path:
        """The launcher probes' runs with the defaults (the small-data ensemble): xc-train or python -m, in a
        directory (run and cache) of its own."""
        if key not in self._launcher_runs:
            launcher, n = key.split(":")
            base = self.root / "launchers" / f"{'console' if launcher == 'xc-train' else 'module'}{n}"
            run_dir, cache = base / "run", base / "cache"
            over = [o for o in SMALL if not o.startswith("train.ensemble")]
            cmd = [*([xc("xc-train")] if launcher == "xc-train" else [PY, "-m", "xc.cli.train"]), *over,
                   f"run_dir={run_dir}", f"data.cache_dir={cache}"]
            base.mkdir(parents=True, exist_ok=True)
            p = run(cmd, base, timeout=600)
            if p.rc != 0:
                raise RuntimeError(f"{launcher} run {n} failed (exit {p.rc}): {error_line(p.text)}")
            self._launcher_runs[key] = run_dir
        return self._launcher_runs[key]


# ---------------------------------------------------------------------------------------------- probes

@dataclass
class Probe:
    name: str
    round: int
    kind: str  # the kind if it fails
    what: str
    fn: Callable[[Ctx], tuple[str, str]]


PROBES: list[Probe] = []


def probe(name: str, rnd: int, kind: str, what: str):
    def deco(fn):
        PROBES.append(Probe(name, rnd, kind, what, fn))
        return fn
    return deco


# ---- round 2: the 11 that were clean

@probe("r2_sigterm_two_ranks_resume", 2, SILENT,
       "SIGTERM to torchrun (forwarded to 2 gloo ranks) mid-epoch, re-run: bit-identical to an uninterrupted run")
def _r2_sigterm_two_ranks_resume(ctx: Ctx):
    import torch

    d = ctx.tmp("r2_sigterm_two_ranks_resume")
    over = ["train.checkpoint_every_steps=4"]
    straight, signalled = d / "straight", d / "signalled"
    p0 = run(torchrun_cmd(2, straight, ctx.cache, *over), d, timeout=400)
    if p0.rc != 0:
        return classify(p0.rc, p0.text, failed=f"uninterrupted 2-rank run failed: {error_line(p0.text)}")
    env = {"XC_FAULT_SIGNAL_AT_STEP": "6", "XC_FAULT_SIGNAL": "TERM", "XC_FAULT_SIGNAL_TARGET": "parent"}
    p1 = run(torchrun_cmd(2, signalled, ctx.cache, *over), d, env=env, timeout=400)
    said = [r for r in p1.err.splitlines() if "stopped by SIGTERM after global step 6" in r]
    tb1 = find_tracebacks(p1.text)
    if tb1:
        return classify(p1.rc, p1.text)
    if not said or (signalled / "metrics.json").exists():
        return FAILED, f"signalled run: exit {p1.rc}, no 'stopped by SIGTERM' line: {error_line(p1.text)}"
    p2 = run(torchrun_cmd(2, signalled, ctx.cache, *over), d, timeout=400)
    if p2.rc != 0:
        return classify(p2.rc, p2.text, failed=f"resume failed: {error_line(p2.text)}")
    a, b = final_state(straight, 2), final_state(signalled, 2)
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    same_metrics = metrics(straight) == metrics(signalled)
    wrong = None
    if diff or not same_metrics:
        wrong = f"resumed model differs from the uninterrupted one ({len(diff)} tensors, metrics equal: {same_metrics})"
    return classify(p2.rc, p1.text + p2.text, wrong=wrong,
                    clean=f"stopped at step 6 (exit {p1.rc}), resumed: {len(a)} tensors torch.equal, metrics equal")


@probe("r2_two_trainers_refused", 2, LOSS, "a second xc-train on a run directory a live trainer holds")
def _r2_two_trainers_refused(ctx: Ctx):
    d = ctx.tmp("r2_two_trainers_refused")
    run_dir = d / "run"
    cmd = train_cmd(run_dir, ctx.cache, "train.epochs=200")
    first = subprocess.Popen(cmd, cwd=d, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not checkpoints(run_dir) and first.poll() is None:
            time.sleep(0.3)
        if first.poll() is not None:
            return FAILED, f"the first trainer ended early (exit {first.returncode})"
        keep = {k: v for k, v in file_hashes(run_dir).items() if k in ("config.json", "identity.json", ".xc-run")}
        second = run(cmd, d, timeout=120)
        after = file_hashes(run_dir)
    finally:
        first.send_signal(signal.SIGTERM)
        try:
            out1, _ = first.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            first.kill()
            out1, _ = first.communicate()
    refused = second.rc == 2 and "in use by pid" in second.text and str(first.pid) in second.text
    return classify(second.rc, second.text, before=keep, after=after,
                    wrong=None if refused else "the second trainer was not refused",
                    clean=f"exit 2: {error_line(second.text)[:150]}")


@probe("r2_two_miners_refused", 2, LOSS, "a second xc-miner on a run one xc-miner serves")
def _r2_two_miners_refused(ctx: Ctx):
    d = ctx.tmp("r2_two_miners_refused")
    run_dir = ctx.copy_of("A", d / "run")
    cmd = [xc("xc-miner"), "--run-dir", run_dir, "--workers", "1"]
    first = subprocess.Popen([str(c) for c in cmd], cwd=d, env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    lease = run_dir / "handoff" / "control" / "miner.lease"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not lease.exists() and first.poll() is None:
            time.sleep(0.2)
        second = run([*cmd, "--once"], d, timeout=120)
    finally:
        (run_dir / "handoff" / "control").mkdir(parents=True, exist_ok=True)
        (run_dir / "handoff" / "control" / "stop").touch()
        try:
            out1, _ = first.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            first.kill()
            out1, _ = first.communicate()
    refused = second.rc == 2 and f"xc-miner pid {first.pid}" in second.text
    text = second.text + out1
    if refused and first.returncode != 0:
        return classify(first.returncode, text, failed=f"the first miner ended with exit {first.returncode}")
    return classify(second.rc, text, wrong=None if refused else "the second miner was not refused",
                    clean=f"exit 2 naming the first: {error_line(second.text)[:120]}; the first stopped, exit 0")


@probe("r2_path_traversing_manifest", 2, SILENT,
       "a checkpoint's meta.json naming a file outside its directory (../../outside.pt)")
def _r2_path_traversing_manifest(ctx: Ctx):
    d = ctx.tmp("r2_path_traversing_manifest")
    run_dir = ctx.copy_of("A", d / "run")
    newest = checkpoints(run_dir)[-1]
    outside = d / "outside.pt"
    shutil.copy(newest / "rank0.pt", outside)
    (newest / "rank0.pt").unlink()
    meta = json.loads((newest / "meta.json").read_text())
    rel = os.path.relpath(outside, newest)
    meta["files"][rel] = meta["files"].pop("rank0.pt")
    meta["crc32"][rel] = meta["crc32"].pop("rank0.pt")
    (newest / "meta.json").write_text(json.dumps(meta))
    (run_dir / "selection.json").unlink(missing_ok=True)
    p = run([xc("xc-eval"), run_dir, "--out", d / "eval.json"], d)
    skipped = "skipping damaged checkpoint" in p.text or "outside" in p.text
    used_newest = f"{newest.name}" in p.text and not skipped
    return classify(p.rc, p.text,
                    wrong=None if skipped else f"the escaping path was not refused (used {newest.name}: {used_newest})",
                    clean=f"exit {p.rc}: {next((r.strip() for r in p.text.splitlines() if 'skipping' in r), '')[:170]}")


PICKLE_SRC = """
import os, pickle, sys
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
open(sys.argv[1], "wb").write(pickle.dumps({"encoder": Evil()}, protocol=2))
"""


def _plant_pickle(run_dir: Path, marker: Path) -> Path:
    """The newest checkpoint's rank0.pt replaced by a code-running pickle, with its size and CRC-32 in meta.json
    recomputed (as an attacker would), so that the loader reaches torch.load."""
    newest = checkpoints(run_dir)[-1]
    target = newest / "rank0.pt"
    subprocess.run([PY, "-c", PICKLE_SRC, str(target), str(marker)], check=True)
    data = target.read_bytes()
    meta = json.loads((newest / "meta.json").read_text())
    meta["files"]["rank0.pt"] = len(data)
    meta.setdefault("crc32", {})["rank0.pt"] = f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
    meta.pop("sha256", None)
    (newest / "meta.json").write_text(json.dumps(meta))
    (run_dir / "selection.json").unlink(missing_ok=True)
    return newest


@probe("r2_code_running_pickle_never_runs", 2, LOSS,
       "a checkpoint .pt replaced by a code-running pickle (meta.json recomputed): xc-eval, xc-predict, xc.load")
def _r2_code_running_pickle_never_runs(ctx: Ctx):
    d = ctx.tmp("r2_code_running_pickle_never_runs")
    run_dir = ctx.copy_of("A", d / "run")
    marker = d / "PWNED"
    _plant_pickle(run_dir, marker)
    outs = [run([xc("xc-eval"), run_dir, "--out", d / "eval.json"], d),
            run([xc("xc-predict"), run_dir, "--input", "-", "--k", "3"], d, stdin="1:0.5 5:1.0\n"),
            run([PY, "-c", f"import xc; m = xc.load({str(run_dir)!r}); print(len(m.predict(['1:0.5 5:1.0'], k=3)))"],
                d)]
    if marker.exists():
        return LOSS, "the pickle's code ran (it could have overwritten any file)"
    raised = (find_tracebacks(outs[2].text) or ["-"])[-1]
    return CLEAN, "the pickle's code never ran (xc-eval exit {}, xc-predict exit {}; xc.load raised {})".format(
        outs[0].rc, outs[1].rc, raised[:170])


@probe("r2_bad_data_short_header", 2, TRACEBACK, "xc_sparse train.txt with a header of two numbers")
def _r2_bad_data_short_header(ctx: Ctx):
    return _bad_data(ctx, "r2_bad_data_short_header", lambda t: t.replace(t.splitlines()[0], "200 50", 1))


@probe("r2_bad_data_truncated", 2, TRACEBACK, "xc_sparse train.txt with fewer rows than its header says")
def _r2_bad_data_truncated(ctx: Ctx):
    return _bad_data(ctx, "r2_bad_data_truncated", lambda t: "\n".join(t.splitlines()[:-5]) + "\n")


@probe("r2_bad_data_label_out_of_range", 2, TRACEBACK, "xc_sparse row with label id 99 of 20")
def _r2_bad_data_label_out_of_range(ctx: Ctx):
    return _bad_data(ctx, "r2_bad_data_label_out_of_range", lambda t: _edit_row(t, 7, lambda r: "99" + r[r.index(" "):]))


@probe("r2_bad_data_nan_value", 2, TRACEBACK, "xc_sparse row with a feature value nan")
def _r2_bad_data_nan_value(ctx: Ctx):
    return _bad_data(ctx, "r2_bad_data_nan_value", lambda t: _edit_row(t, 9, lambda r: r + " 3:nan"))


@probe("r2_bad_data_not_utf8", 2, TRACEBACK, "xc_sparse train.txt with bytes that are not UTF-8")
def _r2_bad_data_not_utf8(ctx: Ctx):
    return _bad_data(ctx, "r2_bad_data_not_utf8", None, raw=lambda b: _bytes_row(b, 11))


@probe("r2_bad_data_test_header_disagrees", 2, TRACEBACK, "xc_sparse test.txt whose header names 51 features, train 50")
def _r2_bad_data_test_header_disagrees(ctx: Ctx):
    return _bad_data(ctx, "r2_bad_data_test_header_disagrees", lambda t: t.replace(" 50 20\n", " 51 20\n", 1),
                     file="test.txt")


def _edit_row(text: str, row: int, fn) -> str:
    lines = text.splitlines()
    lines[row] = fn(lines[row])
    return "\n".join(lines) + "\n"


def _bytes_row(data: bytes, row: int) -> bytes:
    lines = data.split(b"\n")
    lines[row] = lines[row] + b" \xff\xfe:1.0"
    return b"\n".join(lines)


def _bad_data(ctx: Ctx, name: str, edit, raw=None, file: str = "train.txt"):
    d = ctx.tmp(name)
    data = write_xc_sparse(d / "data")
    path = data / file
    if raw is not None:
        path.write_bytes(raw(path.read_bytes()))
    else:
        path.write_text(edit(path.read_text()))
    p = run([xc("xc-train"), "data.kind=xc_sparse", f"data.path={data}", f"data.cache_dir={d / 'cache'}",
             f"run_dir={d / 'run'}", "train.epochs=1", "train.ensemble=1", "logger.wandb=disabled",
             "logger.progress=false"], d)
    line = error_line(p.text)
    names = re.search(r"\.txt:\d+:", line) is not None
    wrong = "the bad file was accepted" if p.rc == 0 else None
    failed = None if (p.rc == 2 and names) else f"exit {p.rc}, no file:line: field line: {line[:150]}"
    return classify(p.rc, p.text, wrong=wrong, failed=failed, clean=line[:180])


# ---- round 2: the 7 that were not clean

def _user_folder(d: Path, sub: str | None = None) -> Path:
    folder = d / "mine"
    folder.mkdir()
    (folder / "config.json").write_text('{"my": "settings, not xc\'s"}\n')
    (folder / "metrics.json").write_text('{"accuracy": 0.93}\n')
    if sub is None:
        (folder / "log.jsonl").write_text('{"note": "my own log"}\n')
    else:
        (folder / sub).mkdir()
        (folder / sub / "notes.txt").write_text("mine\n")
    return folder


def _user_folder_probe(ctx: Ctx, name: str, sub: str | None):
    d = ctx.tmp(name)
    folder = _user_folder(d, sub)
    before = file_hashes(folder)
    p = run(train_cmd(folder, ctx.cache), d)
    after = file_hashes(folder)
    _, _, added = hash_changes(before, after)
    wrong = None
    if p.rc == 0:
        wrong = f"xc-train exit 0 into the user's folder (wrote {', '.join(added[:4])})"
    elif added:
        wrong = f"wrote {', '.join(added[:4])} before refusing"
    failed = None if (p.rc == 2 and "holds no xc run" in p.text) else f"exit {p.rc}: {error_line(p.text)[:150]}"
    return classify(0 if added else p.rc, p.text, before=before, after=after, wrong=wrong, failed=failed,
                    clean=f"exit 2, files byte-identical, nothing added: {error_line(p.text)[:110]}")


@probe("r2_run_dir_users_folder", 2, LOSS,
       "run_dir= a folder of the user's config.json, metrics.json, log.jsonl that never held a run")
def _r2_run_dir_users_folder(ctx: Ctx):
    return _user_folder_probe(ctx, "r2_run_dir_users_folder", None)


@probe("r2_run_dir_root", 2, SILENT, "run_dir=/ (in a mount namespace where / is read-only)")
def _r2_run_dir_root(ctx: Ctx):
    if not UNSHARE:
        return SKIPPED, "needs unshare -m (a sandbox where / is read-only): not run on the real root"
    d = Path(tempfile.mkdtemp(prefix="xc-probe-root-", dir="/dev/shm"))
    try:
        cmd = [xc("xc-train"), *SMALL, "run_dir=/", f"data.cache_dir={d / 'cache'}"]
        script = 'mount -o remount,bind,ro / && cd "$1" && shift && exec "$@"'
        p = run(["unshare", "-m", "--propagation", "private", "bash", "-c", script, "_", d, *cmd], d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    tried_write = "read-only file system" in p.text.lower() or "Errno 30" in p.text
    refused = p.rc == 2 and ("run_dir" in error_line(p.text)) and not tried_write
    return classify(p.rc, p.text, wrong=None if refused or p.rc != 0 else "run_dir=/ accepted",
                    failed=None if refused else f"not refused up front (tried to write at /: {tried_write}): "
                    f"{error_line(p.text)[:140]}", clean=f"exit 2: {error_line(p.text)[:160]}")


DISK_FULL_SCRIPT = r"""
set -u
mnt="$1"; out="$2"; shift 2
mount -t tmpfs -o size=64m tmpfs "$mnt" || exit 90
mkdir -p "$mnt/run"
# leave about 3 MB: the lock, config.json and the log fit, a checkpoint (13 MB) does not
head -c $((61*1024*1024)) /dev/zero > "$mnt/filler" 2>/dev/null
"$@" > "$out/first.txt" 2>&1; echo $? > "$out/first.rc"
find "$mnt/run" \( -name '*.part' -o \( -name '*.tmp' -not -empty \) \) > "$out/first.left"
find "$mnt/run" -name '*.tmp' -empty > "$out/first.empty"
find "$mnt/run" -ls > "$out/first.ls" 2>&1
"$@" > "$out/second.txt" 2>&1; echo $? > "$out/second.rc"
find "$mnt/run" \( -name '*.part' -o \( -name '*.tmp' -not -empty \) -o -name '.lock' \) > "$out/second.left"
ls -la "$mnt/run" > "$out/second.ls" 2>&1
rm -f "$mnt/filler"
"$@" > "$out/third.txt" 2>&1; echo $? > "$out/third.rc"
test -f "$mnt/run/metrics.json" && echo yes > "$out/third.done"
"""


@probe("r2_disk_full_at_checkpoint", 2, TRACEBACK,
       "a full disk (tmpfs) while a checkpoint is written; the same command again; again after freeing space")
def _r2_disk_full_at_checkpoint(ctx: Ctx):
    if not UNSHARE:
        return SKIPPED, "needs unshare -m to mount a small tmpfs"
    d = ctx.tmp("r2_disk_full_at_checkpoint")
    mnt, out = d / "mnt", d / "out"
    mnt.mkdir()
    out.mkdir()
    ctx.shared("A")  # the cache is built, so only the run directory is on the small disk
    cmd = [xc("xc-train"), *SMALL, f"run_dir={mnt / 'run'}", f"data.cache_dir={ctx.cache}"]
    p = run(["unshare", "-m", "--propagation", "private", "bash", "-c", DISK_FULL_SCRIPT, "_", mnt, out, *cmd], d,
            timeout=600)
    if p.rc == 90:
        return SKIPPED, "could not mount a tmpfs"
    texts = {k: _short((out / f"{k}.txt").read_text(errors="replace")) if (out / f"{k}.txt").exists() else ""
             for k in ("first", "second", "third")}
    rcs = {k: int((out / f"{k}.rc").read_text()) if (out / f"{k}.rc").exists() else None for k in texts}
    left1 = (out / "first.left").read_text().split() if (out / "first.left").exists() else []
    left2 = (out / "second.left").read_text().split() if (out / "second.left").exists() else []
    empty1 = (out / "first.empty").read_text().split() if (out / "first.empty").exists() else []
    allout = "\n".join(texts.values())
    problems = []
    for k in ("first", "second"):
        if rcs[k] == 0:
            problems.append(f"{k} run exit 0 on a full disk")
        elif "no space left" not in error_line(texts[k]).lower():
            problems.append(f"{k} run: {error_line(texts[k])[:100]}")
    if left1:
        problems.append(f"left behind after the first: {', '.join(Path(x).name for x in left1[:3])}")
    if rcs["third"] != 0 or not (out / "third.done").exists():
        problems.append(f"after freeing space: exit {rcs['third']}: {error_line(texts['third'])[:100]}")
    return classify(rcs["first"], allout, failed="; ".join(problems) or None,
                    clean=f"exit {rcs['first']}/{rcs['second']} in one line ({error_line(texts['first'])[:90]}); "
                          f"no file left{'' if not left2 else ' but ' + ','.join(Path(x).name for x in left2)}"
                          f"{' (an empty ' + Path(empty1[0]).name + '/ stays, swept at the next start)' if empty1 else ''}"
                          f"; space freed: the same command exit 0")


@probe("r2_read_only_run_dir_eval", 2, TRACEBACK, "xc-eval on a finished run on a read-only mount (eval.json)")
def _r2_read_only_run_dir_eval(ctx: Ctx):
    d = ctx.tmp("r2_read_only_run_dir_eval")
    run_dir = ctx.copy_of("A", d / "run")
    p, how = read_only(run_dir, [xc("xc-eval"), run_dir], d)
    if p is None:
        return SKIPPED, how
    printed = "P@1=" in p.text
    failed = None
    if not printed:
        failed = f"no metrics printed (exit {p.rc}): {error_line(p.text)[:140]}"
    elif p.rc not in (0, 2):
        failed = f"exit {p.rc}"
    return classify(p.rc, p.text, failed=failed,
                    clean=f"[{how}] metrics printed, exit {p.rc}: {error_line(p.text)[:120]}")


def _live_readers(ctx: Ctx, name: str, tries: int):
    """A trainer checkpointing every 5 steps (default keep_checkpoints), xc-eval / xc-predict tried while it
    trains; the trainer is stopped with SIGTERM when the tries are done."""
    d = ctx.tmp(name)
    run_dir = d / "run"
    ctx.shared("A")
    cmd = train_cmd(run_dir, ctx.cache, "train.checkpoint_every_steps=5", "train.epochs=100000",
                    "eval.select_epoch_patience=0")  # no early stop: it trains until the tries are done
    trainer = subprocess.Popen(cmd, cwd=d, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not checkpoints(run_dir) and trainer.poll() is None:
            time.sleep(0.2)
        for i in range(tries):
            if trainer.poll() is not None:
                break
            if i % 2 == 0:
                p = run([xc("xc-eval"), run_dir, "--out", d / f"eval{i}.json"], d, timeout=120)
            else:
                p = run([xc("xc-predict"), run_dir, "--input", "-", "--k", "3"], d, stdin="1:0.5 5:1.0\n3:1.0\n",
                        timeout=120)
            ok = p.rc == 0 and (("P@1=" in p.text) if i % 2 == 0 else len(p.out.strip().splitlines()) == 2)
            results.append((("xc-eval", "xc-predict")[i % 2], ok, p))
    finally:
        alive = trainer.poll() is None
        trainer.send_signal(signal.SIGTERM)
        try:
            tout, _ = trainer.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            trainer.kill()
            tout, _ = trainer.communicate()
    if not results:
        return FAILED, f"the trainer ended before any reader ran (exit {trainer.returncode})"
    bad = [(tool, p) for tool, ok, p in results if not ok]
    text = "\n".join(p.text for _, _, p in results)
    note = "" if alive else f" (the trainer ended by itself, exit {trainer.returncode}: {error_line(tout)[:80]})"
    failed = None
    if bad:
        tool, p = bad[0]
        failed = f"{len(bad)} of {len(results)} tries failed{note}; first: {tool} exit {p.rc}: {error_line(p.text)[:120]}"
    return classify(bad[0][1].rc if bad else 0, text, failed=failed,
                    clean=f"{len(results)} of {len(results)} tries answered while it trained{note}")


@probe("r2_live_readers", 2, TRACEBACK, "xc-eval / xc-predict on a run while it trains (3 tries)")
def _r2_live_readers(ctx: Ctx):
    return _live_readers(ctx, "r2_live_readers", 3)


@probe("r2_sigkill_rank1_no_restarts", 2, TRACEBACK, "SIGKILL of rank 1 of 2 under torchrun without --max-restarts")
def _r2_sigkill_rank1_no_restarts(ctx: Ctx):
    d = ctx.tmp("r2_sigkill_rank1_no_restarts")
    run_dir = d / "run"
    env = {"XC_FAULT_KILL_AT_STEP": "6", "XC_FAULT_KILL_RANK": "1"}
    p = run(torchrun_cmd(2, run_dir, ctx.cache, "train.checkpoint_every_steps=4"), d, env=env, timeout=400)
    fired = (run_dir / "fault-kill-fired").exists()
    ours = [r for r in p.err.splitlines() if r.startswith("error: rank 0:")]
    named = bool(ours) and "rank 1 (pid" in ours[0]
    stopped = "stopped" in p.err.lower()
    failed = None
    if not fired:
        failed = "the fault did not fire"
    elif p.rc == 0:
        failed = "the job exited 0"
    elif not (named or stopped):
        failed = f"no line naming the dead rank: {error_line(p.err)[:140]}"
    return classify(p.rc, p.text, failed=failed, clean=(ours[0] if ours else error_line(p.err))[:180]
                    + " (torchrun's own ChildFailedError summary not counted)")


@probe("r2_pickle_messages_and_fallback", 2, TRACEBACK,
       "a checkpoint .pt replaced by a pickle: xc-eval's message; xc-train falls back to the previous checkpoint")
def _r2_pickle_messages_and_fallback(ctx: Ctx):
    d = ctx.tmp("r2_pickle_messages_and_fallback")
    run_dir = ctx.copy_of("A", d / "run")
    newest = _plant_pickle(run_dir, d / "PWNED")
    pe = run([xc("xc-eval"), run_dir, "--out", d / "eval.json"], d)
    pt = run(train_cmd(run_dir, ctx.cache, "train.epochs=3"), d)
    text = pe.text + pt.text
    problems = []
    if "weights_only=False" in text:
        problems.append("torch's advice to retry with weights_only=False is shown")
    if pe.rc not in (0, 2):
        problems.append(f"xc-eval exit {pe.rc}")
    if pt.rc != 0 or "skipping damaged checkpoint" not in pt.text:
        problems.append(f"xc-train did not fall back (exit {pt.rc}: {error_line(pt.text)[:100]})")
    return classify(pe.rc, text, failed="; ".join(problems) or None,
                    clean=f"xc-eval exit {pe.rc}: {error_line(pe.text)[:160]}; xc-train skipped {newest.name}, "
                          f"resumed from the previous, exit 0")


# ---- round 3

@probe("r3_users_folder_with_archive", 3, LOSS, "run_dir= the user's config.json, metrics.json and archive/")
def _r3_users_folder_with_archive(ctx: Ctx):
    return _user_folder_probe(ctx, "r3_users_folder_with_archive", "archive")


@probe("r3_users_folder_with_handoff", 3, LOSS, "run_dir= the user's config.json, metrics.json and handoff/")
def _r3_users_folder_with_handoff(ctx: Ctx):
    return _user_folder_probe(ctx, "r3_users_folder_with_handoff", "handoff")


@probe("r3_users_folder_with_checkpoints", 3, LOSS, "run_dir= the user's config.json, metrics.json and checkpoints/")
def _r3_users_folder_with_checkpoints(ctx: Ctx):
    return _user_folder_probe(ctx, "r3_users_folder_with_checkpoints", "checkpoints")


def _foreign(p: Proc, out_json: Path | None) -> tuple[str | None, str]:
    """(wrong, clean) for a command run on run A with run B's checkpoint."""
    said = "another run" in p.text
    fused = False
    if out_json is not None and out_json.exists():
        fused = any(k.startswith(("knn/", "ranker/", "model/")) for k in json.loads(out_json.read_text()))
    if p.rc == 2 and "Traceback" not in p.text:
        return None, f"refused: {error_line(p.text)[:150]}"
    if p.rc == 0 and said and not fused:
        line = re.sub(r"^\d\d:\d\d:\d\d \[rank\d+\] \w+ [\w.]+: ", "",
                      next(r.strip() for r in p.text.splitlines() if "another run" in r))
        return None, f"scored alone, said: {line[:150]}"
    if p.rc == 0:
        return (f"exit 0, run A's fusion applied to run B's checkpoint ({'fused keys in the output' if fused else 'no'}"
                f"{'' if said else ', no word'})"), ""
    return None, ""


@probe("r3_foreign_checkpoint_eval", 3, SILENT, "xc-eval runs/A --checkpoint runs/B/checkpoints/step-…")
def _r3_foreign_checkpoint_eval(ctx: Ctx):
    d = ctx.tmp("r3_foreign_checkpoint_eval")
    a, b = ctx.shared("A"), ctx.shared("B")
    p = run([xc("xc-eval"), a, "--checkpoint", checkpoints(b)[-1], "--out", d / "eval.json"], d)
    wrong, clean = _foreign(p, d / "eval.json")
    return classify(p.rc, p.text, wrong=wrong, clean=clean,
                    failed=None if (wrong or clean) else f"exit {p.rc}: {error_line(p.text)[:150]}")


@probe("r3_foreign_checkpoint_copied_in", 3, SILENT,
       "run B's newest checkpoint copied over run A's (same step, the one A's selection names), xc-eval A")
def _r3_foreign_checkpoint_copied_in(ctx: Ctx):
    d = ctx.tmp("r3_foreign_checkpoint_copied_in")
    a = ctx.copy_of("A", d / "A")
    b = ctx.shared("B")
    src = checkpoints(b)[-1]
    dest = a / "checkpoints" / src.name  # A's newest (and selected) checkpoint replaced by B's of the same step
    shutil.rmtree(dest)
    shutil.copytree(src, dest)
    p = run([xc("xc-eval"), a, "--out", d / "eval.json"], d)
    wrong, clean = _foreign(p, d / "eval.json")
    return classify(p.rc, p.text, wrong=wrong, clean=clean,
                    failed=None if (wrong or clean) else f"exit {p.rc}: {error_line(p.text)[:150]}")


@probe("r3_foreign_checkpoint_predict", 3, SILENT, "xc-predict runs/A --checkpoint runs/B/checkpoints/step-…")
def _r3_foreign_checkpoint_predict(ctx: Ctx):
    d = ctx.tmp("r3_foreign_checkpoint_predict")
    a, b = ctx.shared("A"), ctx.shared("B")
    p = run([xc("xc-predict"), a, "--checkpoint", checkpoints(b)[-1], "--input", "-", "--k", "3"], d,
            stdin="1:0.5 5:1.0\n")
    wrong, clean = _foreign(p, None)
    if wrong is None and not clean and p.rc == 0:
        wrong = "exit 0 without a word that the checkpoint is another run's"
    return classify(p.rc, p.text, wrong=wrong, clean=clean,
                    failed=None if (wrong or clean) else f"exit {p.rc}: {error_line(p.text)[:150]}")


def _predict_rows(ctx: Ctx, name: str, text: str):
    d = ctx.tmp(name)
    p = run([xc("xc-predict"), ctx.shared("A"), "--input", "-", "--k", "5"], d, stdin=text)
    rows = [r for r in p.out.splitlines() if r.strip().startswith("{")]
    wrong = None
    if p.rc == 0 and len(rows) != 2:
        wrong = f"{len(rows)} output rows for 2 input rows"
    elif p.rc == 0 and not json.loads(rows[1])["ids"]:
        wrong = "the empty row got no labels"
    failed = None if p.rc == 0 else f"exit {p.rc}: {error_line(p.text)[:150]}"
    return classify(p.rc, p.text, wrong=wrong, failed=failed,
                    clean=f"2 rows answered; the empty one: ids {json.loads(rows[1])['ids'] if len(rows) == 2 else ''}")


@probe("r3_empty_row_trailing_blank_line", 3, TRACEBACK, "printf '1:0.5 5:1.0\\n\\n' | xc-predict RUN --input -")
def _r3_empty_row_trailing_blank_line(ctx: Ctx):
    return _predict_rows(ctx, "r3_empty_row_trailing_blank_line", "1:0.5 5:1.0\n\n")


@probe("r3_empty_row_last_zero", 3, TRACEBACK, "xc-predict with a last row 3:0.0")
def _r3_empty_row_last_zero(ctx: Ctx):
    return _predict_rows(ctx, "r3_empty_row_last_zero", "1:0.5 5:1.0\n3:0.0\n")


XC_LOAD_EMPTY = """
import json, sys
import numpy as np
import xc
from xc.data.sparse import SparseMatrix
m = xc.load(sys.argv[1])
rows = SparseMatrix(np.array([0, 2, 2]), np.array([1, 5], np.int32), np.array([0.5, 1.0], np.float32), m.num_features)
empty = SparseMatrix(np.array([0, 0]), np.zeros(0, np.int32), np.zeros(0, np.float32), m.num_features)
got, alone = m.predict(rows, k=5), m.predict(empty, k=5)
print(json.dumps({"n": len(got), "last": got.ids[-1].tolist(), "alone": alone.ids[0].tolist()}))
"""


@probe("r3_empty_row_xc_load_predict", 3, TRACEBACK, "xc.load(RUN).predict of rows whose last has no features")
def _r3_empty_row_xc_load_predict(ctx: Ctx):
    d = ctx.tmp("r3_empty_row_xc_load_predict")
    p = run([PY, "-c", XC_LOAD_EMPTY, ctx.shared("A")], d)
    wrong = clean = None
    if p.rc == 0:
        res = json.loads(p.out.strip().splitlines()[-1])
        if res["n"] != 2 or res["last"] != res["alone"]:
            wrong = f"{res['n']} rows; the empty row's answer {res['last']} is not the empty query's {res['alone']}"
        clean = f"2 rows; the empty one answered as an empty query ({res['last']})"
    return classify(p.rc, p.text, wrong=wrong, clean=clean or "",
                    failed=None if p.rc == 0 else f"exit {p.rc}: {error_line(p.text)[:150]}")


@probe("r3_empty_test_row_trains", 3, TRACEBACK, "xc-train on own data whose last test row has no features")
def _r3_empty_test_row_trains(ctx: Ctx):
    d = ctx.tmp("r3_empty_test_row_trains")
    data = write_xc_sparse(d / "data", n_train=600, n_test=80, features=100, labels=20, empty_last_test=True)
    run_dir = d / "run"
    p = run([xc("xc-train"), "data.kind=xc_sparse", f"data.path={data}", f"data.cache_dir={d / 'cache'}",
             f"run_dir={run_dir}", "train.epochs=2", "train.ensemble=1", "logger.wandb=disabled",
             "logger.progress=false"], d)
    done = (run_dir / "metrics.json").exists()
    failed = None if (p.rc == 0 and done) else f"exit {p.rc}, metrics.json {'written' if done else 'missing'}: " \
                                                f"{error_line(p.text)[:130]}"
    final = next((r for r in p.out.splitlines() if r.startswith("final P@1")), "")
    return classify(p.rc, p.text, failed=failed, clean=f"exit 0, metrics.json written: {final[:120]}")


@probe("r3_read_only_run_dir_train", 3, TRACEBACK, "xc-train on an existing run on a read-only mount")
def _r3_read_only_run_dir_train(ctx: Ctx):
    d = ctx.tmp("r3_read_only_run_dir_train")
    run_dir = ctx.copy_of("A", d / "run")
    p, how = read_only(run_dir, train_cmd(run_dir, ctx.cache, "train.epochs=3"), d)
    if p is None:
        return SKIPPED, how
    line = error_line(p.text)
    failed = None if (p.rc == 2 and "read-only" in line) else f"exit {p.rc}: {line[:150]}"
    return classify(p.rc, p.text, wrong="exit 0 on a read-only run directory" if p.rc == 0 else None,
                    failed=failed, clean=f"[{how}] exit 2: {line[:150]}")


@probe("r3_read_only_cache_new_dataset", 3, TRACEBACK, "a new dataset into a read-only data.cache_dir")
def _r3_read_only_cache_new_dataset(ctx: Ctx):
    d = ctx.tmp("r3_read_only_cache_new_dataset")
    cache = d / "cache"
    cache.mkdir()
    p, how = read_only(cache, train_cmd(d / "run", cache, "data.synthetic.seed=5"), d)
    if p is None:
        return SKIPPED, how
    line = error_line(p.text)
    failed = None if (p.rc == 2 and "read-only" in line and "cache" in line) else f"exit {p.rc}: {line[:150]}"
    return classify(p.rc, p.text, wrong="exit 0 with a read-only cache" if p.rc == 0 else None,
                    failed=failed, clean=f"[{how}] exit 2: {line[:150]}")


def _damaged_cache(ctx: Ctx, name: str, fill: str):
    """The shared cache copied, train.features.values.npy overwritten in place (same size, header kept)
    with NaN bytes or zeros; then a new run on it."""
    import numpy as np

    d = ctx.tmp(name)
    ctx.shared("A")
    cache = d / "cache"
    shutil.copytree(ctx.cache, cache)
    (target,) = list(cache.rglob("train.features.values.npy"))
    arr = np.load(target, mmap_mode="r")
    header = target.stat().st_size - arr.nbytes
    size = target.stat().st_size
    body = (np.full(arr.shape, np.nan, arr.dtype) if fill == "nan" else np.zeros(arr.shape, arr.dtype)).tobytes()
    with open(target, "r+b") as f:
        f.seek(header)
        f.write(body)
    assert target.stat().st_size == size
    run_dir = d / "run"
    p = run(train_cmd(run_dir, cache), d)
    named = target.name in p.text or "train.features.values" in p.text
    wrong = None if named else "trained on the damaged cache without a word about it"
    failed = None
    if named and p.rc != 0 and not error_line(p.text).startswith("error:"):
        failed = f"exit {p.rc}: {error_line(p.text)[:150]}"
    said = re.sub(r"^\d\d:\d\d:\d\d \[rank\d+\] \w+ [\w.]+: ", "",
                  next((r.strip() for r in p.text.splitlines() if "train.features.values" in r), ""))
    return classify(p.rc, p.text, wrong=wrong, failed=failed, clean=f"exit {p.rc}: {said[:170]}")


@probe("r3_damaged_cache_nan_bytes", 3, SILENT, "a cached .npy overwritten in place with NaN bytes (same size)")
def _r3_damaged_cache_nan_bytes(ctx: Ctx):
    return _damaged_cache(ctx, "r3_damaged_cache_nan_bytes", "nan")


@probe("r3_damaged_cache_zeroed", 3, SILENT, "a cached .npy overwritten in place with zeros (same size)")
def _r3_damaged_cache_zeroed(ctx: Ctx):
    return _damaged_cache(ctx, "r3_damaged_cache_zeroed", "zero")


@probe("r3_live_readers", 3, TRACEBACK, "xc-eval / xc-predict on a run while it trains (10 tries)")
def _r3_live_readers(ctx: Ctx):
    return _live_readers(ctx, "r3_live_readers", 10)


@probe("r3_same_figures_two_directories", 3, SILENT,
       "the defaults (small-data ensemble), xc-train twice in two run and cache directories: identical figures")
def _r3_same_figures_two_directories(ctx: Ctx):
    one, two = ctx.launcher_run("xc-train:1"), ctx.launcher_run("xc-train:2")
    m1, m2 = metrics(one), metrics(two)
    diff = sorted(k for k in m1 if m1.get(k) != m2.get(k))
    return classify(0, "", wrong=f"{len(diff)} figures differ, e.g. {diff[0]}: {m1[diff[0]]} vs {m2.get(diff[0])}"
                    if diff else None, clean=f"{len(m1)} figures identical (P@1 {m1.get('P@1'):.2f})")


@probe("r3_same_figures_two_launchers", 3, SILENT,
       "the same, with python -m xc.cli.train in two more directories: identical to xc-train's")
def _r3_same_figures_two_launchers(ctx: Ctx):
    ref = metrics(ctx.launcher_run("xc-train:1"))
    problems = []
    for n in ("1", "2"):
        m = metrics(ctx.launcher_run(f"python-m:{n}"))
        diff = sorted(k for k in ref if ref.get(k) != m.get(k))
        if diff:
            problems.append(f"python -m run {n}: {len(diff)} differ, e.g. {diff[0]}: {ref[diff[0]]} vs {m.get(diff[0])}")
    return classify(0, "", wrong="; ".join(problems) or None,
                    clean=f"{len(ref)} figures identical across both launchers, 4 directories")


@probe("r3_path_with_spaces_unquoted", 3, TRACEBACK, "xc-train data.path=/a folder/with spaces, unquoted")
def _r3_path_with_spaces_unquoted(ctx: Ctx):
    d = ctx.tmp("r3_path_with_spaces_unquoted")
    data = write_xc_sparse(d / "my data")
    p = run([xc("xc-train"), "data.kind=xc_sparse", f"data.path={d}/my", "data", f"run_dir={d / 'run'}",
             f"data.cache_dir={d / 'cache'}", "train.ensemble=1", "train.epochs=1", "logger.wandb=disabled",
             "logger.progress=false"], d)
    line = error_line(p.text)
    failed = None if (p.rc == 2 and "quote" in line) else f"exit {p.rc}, no hint to quote: {line[:150]}"
    return classify(p.rc, p.text, wrong="exit 0" if p.rc == 0 else None, failed=failed,
                    clean=f"exit 2: {line[:170]} ({data.name})")


# ---------------------------------------------------------------------------------------------- main

def run_probes(names: list[str] | None, root: Path) -> list[dict]:
    ctx = Ctx(root)
    chosen = [p for p in PROBES if not names or p.name in names]
    results = []
    for pr in chosen:
        t0 = time.monotonic()
        try:
            outcome, detail = pr.fn(ctx)
        except Exception as e:  # the probe itself broke: say so, do not hide it
            outcome, detail = ERROR, f"{type(e).__name__}: {str(e)[:200]}"
        secs = time.monotonic() - t0
        results.append({"probe": pr.name, "round": pr.round, "kind_if_fails": pr.kind, "what": pr.what,
                        "outcome": outcome, "detail": _short(" ".join(str(detail).split())), "seconds": round(secs, 1)})
        print(f"  {pr.name:<38} {outcome:<9} {secs:6.1f}s  {results[-1]['detail'][:150]}", flush=True)
    return results


def counts(results: list[dict]) -> dict[str, int]:
    return {o: sum(r["outcome"] == o for r in results) for o in OUTCOMES}


def table(results: list[dict]) -> str:
    rows = ["| probe | round | kind if it fails | outcome | detail |", "|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['probe']} | {r['round']} | {r['kind_if_fails']} | {r['outcome']} | "
                    f"{r['detail'].replace('|', '/')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", metavar="NAME", help="run this probe (repeatable)")
    ap.add_argument("--out", type=Path, help="write the results to this JSON file")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one, removed)")
    ap.add_argument("--list", action="store_true", help="list the probes and exit")
    args = ap.parse_args(argv)
    if args.list:
        for p in PROBES:
            print(f"{p.name:<38} round {p.round}  {p.kind:<9}  {p.what}")
        return 0
    unknown = [n for n in args.only or [] if n not in {p.name for p in PROBES}]
    if unknown:
        print(f"error: --only {', '.join(unknown)}: no such probe (see --list)", file=sys.stderr)
        return 2
    os.environ.setdefault("XC_THREADS", "1")
    t0 = time.monotonic()
    print(f"{len(args.only or PROBES)} probe(s); read-only folders by "
          f"{'a read-only bind mount (unshare -m)' if UNSHARE else 'chmod -w' if not IS_ROOT else 'nothing (root)'}"
          f"; running as {'root' if IS_ROOT else 'uid ' + str(os.geteuid())}", flush=True)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        results = run_probes(args.only, args.keep.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="xc-probes-") as tmp:
            results = run_probes(args.only, Path(tmp))
    wall = time.monotonic() - t0
    c = counts(results)
    print()
    print(table(results))
    print()
    print("counts: " + ", ".join(f"{k} {v}" for k, v in c.items()) + f"; wall time {wall:.0f}s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": "XC_THREADS=1 .venv/bin/python tools/reliability_probes.py" + "".join(
                f" --only {n}" for n in args.only or []), "wall_seconds": round(wall, 1),
            "read_only_by": "unshare -m read-only bind mount" if UNSHARE else ("chmod -w" if not IS_ROOT else "none"),
            "user": "root" if IS_ROOT else os.geteuid(), "counts": c, "probes": results}, indent=1) + "\n")
    return 0 if c[CLEAN] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
