"""The reliability probes of the second, third and fourth rounds, re-run as a whole, as a user would.

    XC_THREADS=1 .venv/bin/python tools/probes/reliability_probes.py [--only NAME ...] [--out JSON] [--keep DIR]

75 probes: the 18 of the second round (docs/reliability.md; 11 that were clean then, 7 that were not), the
18 of the third, and the 39 of the fourth (records data, `xc.fit`, exports, thresholds, storage errors, rough
edges). Each one runs the real commands (`xc-train`, `xc-eval`, `xc-predict`, `xc-export`,
`xc-data`, `xc-miner`, `torchrun`, `python -m xc.cli.train`, a `python -c` calling `xc.load` or `xc.fit`) as
subprocesses in a temporary folder on small synthetic (or hand-written XC-repository, JSON-lines, CSV) data, and
classifies what happened (a Python call's XCError, printed by the probe's script, is its one-line message):

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
A file size limit is a real `ulimit -f` (RLIMIT_FSIZE in the child, SIGXFSZ ignored, no bytecode written).

Probes that only read share what they read, trained once: runs A and B (small synthetic, seeds 0 and 1), an
export of A, and a small JSON-lines run; a probe that writes takes a copy.

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

REPO = Path(__file__).resolve().parents[2]
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


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float = 300, stdin: str | None = None,
        preexec: Callable[[], None] | None = None) -> Proc:
    """CMD's exit code and output; paths under the probes' temporary folder read TMP/... in the output.
    PREEXEC runs in the child before CMD (a resource limit)."""
    t0 = time.monotonic()
    try:
        p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(env), capture_output=True, text=True,
                           input=stdin, timeout=timeout, errors="replace", preexec_fn=preexec)
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


# a small records run (JSON lines, tf-idf of the texts): xc-train data=jsonl data.path=DIR
RECORDS_RUN = ["data=jsonl", "data.name=probe-records", "train.epochs=2", "train.ensemble=1", "logger.wandb=disabled",
               "logger.progress=false"]
RECORDS_LABELS = 50
NEWLINE_LABEL = 7  # tag7 is named "two\nlines"
UNSEEN_LABEL = "never-trained"  # only in test.jsonl


def records_names() -> list[str]:
    """The records run's label names by id: first appearance in train.jsonl, then in test.jsonl."""
    names = [f"tag{j}" for j in range(RECORDS_LABELS)]
    names[NEWLINE_LABEL] = "two\nlines"
    return names + [UNSEEN_LABEL]


def records_text(j: int, i: int) -> str:
    return f"item {i} about topic{j} word{j}a word{j}b"


def write_records(directory: Path) -> Path:
    """train.jsonl (8 records a label, each text naming its label's words) and test.jsonl (2 a label, and 3 of a
    label no training record has)."""
    names = records_names()
    directory.mkdir(parents=True, exist_ok=True)
    rows = {"train": [(j, i) for i in range(8) for j in range(RECORDS_LABELS)],
            "test": [(j, 100 + i) for i in range(2) for j in range(RECORDS_LABELS)]}
    for split, pairs in rows.items():
        lines = [json.dumps({"text": records_text(j, i), "labels": [names[j]]}) for j, i in pairs]
        if split == "test":
            lines += [json.dumps({"text": f"unseen {i} word{i}a", "labels": [UNSEEN_LABEL]}) for i in range(3)]
        (directory / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
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

    def export(self, which: str = "A") -> Path:
        """`xc-export` of run WHICH, written once; read, never written (a probe that edits it takes a copy)."""
        dest = self.root / "shared" / f"export-{which}"
        if not (dest / "export.json").exists():
            p = run([xc("xc-export"), self.shared(which), dest], self.root, timeout=300)
            if p.rc != 0:
                raise RuntimeError(f"xc-export of run {which} failed (exit {p.rc}): {error_line(p.text)}")
        return dest

    def records_run(self) -> tuple[Path, Path, str]:
        """(run directory, source folder, xc-train's output) of a small JSON-lines run (write_records: a label
        name with a line break, a test label no training record has), trained once."""
        base = self.root / "shared" / "records"
        run_dir, src, said = base / "run", base / "src", base / "xc-train.out"
        if not (run_dir / "metrics.json").exists():
            write_records(src)
            p = run([xc("xc-train"), *RECORDS_RUN, f"data.path={src}", f"data.cache_dir={self.cache}",
                     f"run_dir={run_dir}"], self.root, timeout=600)
            said.write_text(p.text)
            if p.rc != 0:
                raise RuntimeError(f"the records run did not train (exit {p.rc}): {error_line(p.text)}")
        return run_dir, src, said.read_text()

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
    (target,) = list(cache.glob("synthetic/*/train.features.values.npy"))  # the shared run's dataset
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


# ---- round 4: records data, xc.fit, exports, thresholds, storage errors, rough edges

def _said(text: str, needle: str) -> str:
    """The first line holding NEEDLE, without the log prefix."""
    line = next((r.strip() for r in text.splitlines() if needle in r), "")
    return re.sub(r"^\d\d:\d\d:\d\d \[rank\d+\] \w+ [\w.]+: ", "", line)


def _one_line_refusal(p: Proc, *words: str, what: str = "accepted", rc: int = 2) -> tuple[str, str]:
    """CLEAN when P exited RC with an `error:` line holding every word of WORDS; SILENT when it exited 0."""
    line = error_line(p.text)
    ok = p.rc == rc and line.startswith("error:") and all(w in line for w in words)
    return classify(p.rc, p.text, wrong=f"{what}: exit 0" if p.rc == 0 else None,
                    failed=None if ok else f"exit {p.rc}, not one line with {list(words)}: {line[:150]}",
                    clean=f"exit {p.rc}: {line[:170]}")


@probe("r4_records_label_name_with_newline", 4, SILENT,
       "JSON lines whose label name holds a line break ('two\\nlines'): xc-predict prints every label's own name")
def _r4_records_label_name_with_newline(ctx: Ctx):
    d = ctx.tmp("r4_records_label_name_with_newline")
    run_dir, _, _ = ctx.records_run()
    names = records_names()
    queries = [records_text(j, 900) for j in (3, NEWLINE_LABEL, 20, 41, 49)]
    p = run([xc("xc-predict"), run_dir, "--input", "-", "--k", "3"], d, stdin="\n".join(queries) + "\n")
    if p.rc != 0:
        return classify(p.rc, p.text, failed=f"exit {p.rc}: {error_line(p.text)[:150]}")
    rows = [json.loads(r) for r in p.out.splitlines() if r.startswith("{")]
    misnamed = [(i, n) for row in rows for i, n in zip(row["ids"], row.get("names", [])) if names[i] != n]
    top = [row["ids"][0] for row in rows]
    wrong = None
    if len(rows) != len(queries) or any("names" not in row for row in rows):
        wrong = f"{len(rows)} rows with names for {len(queries)} queries"
    elif misnamed:
        wrong = f"label {misnamed[0][0]} printed as {misnamed[0][1]!r}, its name is {names[misnamed[0][0]]!r}"
    return classify(p.rc, p.text, wrong=wrong,
                    clean=f"{len(rows)} rows, every id printed with its own name (top: "
                          f"{', '.join(repr(names[i]) for i in top[:2])}, ...)")


def _bad_records(ctx: Ctx, name: str, kind: str, body: bytes):
    """xc-train data=KIND on a train file holding BODY: exit 2, one line naming the file and the line."""
    d = ctx.tmp(name)
    src = d / "src"
    src.mkdir()
    (src / f"train.{kind}").write_bytes(body)
    p = run([xc("xc-train"), f"data={kind}", f"data.name={name}", *RECORDS_RUN[2:], f"data.path={src}",
             f"data.cache_dir={d / 'cache'}", f"run_dir={d / 'run'}"], d)
    line = error_line(p.text)
    named = re.search(rf"train\.{kind}:\d+:", line) is not None
    return classify(p.rc, p.text, wrong="the bad file was trained on" if p.rc == 0 else None,
                    failed=None if (p.rc == 2 and named) else f"exit {p.rc}, no file:line: field line: {line[:150]}",
                    clean=line[:180])


def _csv_rows(n: int = 400) -> list[str]:
    return ["text,labels"] + [f"item {i} about topic{i % 20},tag{i % 20}" for i in range(n)]


@probe("r4_csv_unclosed_quote", 4, SILENT, "a CSV whose row 200 opens a quote it never closes")
def _r4_csv_unclosed_quote(ctx: Ctx):
    rows = _csv_rows()
    rows[200] = '"' + rows[200]
    return _bad_records(ctx, "r4_csv_unclosed_quote", "csv", ("\n".join(rows) + "\n").encode())


@probe("r4_csv_stray_quote", 4, SILENT, "a CSV row whose labels field ends in a stray quote (tag21\")")
def _r4_csv_stray_quote(ctx: Ctx):
    rows = _csv_rows()
    rows[22] = 'item 21 about topic1,tag21"'
    return _bad_records(ctx, "r4_csv_stray_quote", "csv", ("\n".join(rows) + "\n").encode())


@probe("r4_jsonl_not_utf8", 4, TRACEBACK, "a JSON-lines text holding bytes that are not UTF-8")
def _r4_jsonl_not_utf8(ctx: Ctx):
    lines = [json.dumps({"text": f"item {i}", "labels": [f"tag{i % 20}"]}).encode() for i in range(200)]
    lines[50] = b'{"text": "caf\xe9 \xff", "labels": ["tag10"]}'
    return _bad_records(ctx, "r4_jsonl_not_utf8", "jsonl", b"\n".join(lines) + b"\n")


@probe("r4_csv_not_utf8", 4, TRACEBACK, "a CSV (Latin-1 saved) whose text holds bytes that are not UTF-8")
def _r4_csv_not_utf8(ctx: Ctx):
    rows = [r.encode() for r in _csv_rows(200)]
    rows[77] = b"\xe9t\xe9 76,tag16"
    return _bad_records(ctx, "r4_csv_not_utf8", "csv", b"\n".join(rows) + b"\n")


FIT_SCRIPT = """
import json, sys
import numpy as np
import xc
from xc.errors import XCError
rng = np.random.default_rng(0)
n, L = 200, 10
truth = np.arange(n) % L
X = rng.random((n, 30)).astype(np.float32)
X[np.arange(n), truth] += 3.0
Y = (truth[:, None] == np.arange(L)[None, :]).astype(np.int64)
label_names = None
{setup}
try:
    m = xc.fit(X, Y, label_names=label_names, run_dir=sys.argv[1], data__cache_dir=sys.argv[2], train__epochs=1,
               train__ensemble=1, logger__wandb="disabled", logger__progress=False)
except XCError as exc:
    print(json.dumps({{"error": str(exc), "type": type(exc).__name__}}))
    sys.exit(2)
out = m.predict(X[:5], k=3)
names = getattr(out, "names", None)
print(json.dumps({{"num_labels": int(m.num_labels), "names": None if names is None else [list(r) for r in names]}}))
"""


def _api_result(p: Proc) -> dict:
    rows = [r for r in p.out.splitlines() if r.startswith("{")]
    return json.loads(rows[-1]) if rows else {}


def _api_refusal(p: Proc, words: list[str], wrong_if_ran: str) -> tuple[str, str]:
    """A Python call that must raise XCError in one line holding WORDS (the script prints it as JSON, exit 2)."""
    res = _api_result(p)
    if p.rc == 0:
        return classify(0, p.text, wrong=f"{wrong_if_ran} ({json.dumps(res)[:120]})")
    msg = res.get("error", "")
    ok = p.rc == 2 and msg and "\n" not in msg and all(w in msg for w in words)
    return classify(p.rc, p.text, failed=None if ok else
                    f"exit {p.rc}, not one {res.get('type', 'XCError')} line with {words}: "
                    f"{(msg or error_line(p.text))[:150]!r}", clean=f"{res.get('type')}: {msg[:170]}")


def _fit(ctx: Ctx, name: str, setup: str, words: list[str], wrong: str):
    d = ctx.tmp(name)
    p = run([PY, "-c", FIT_SCRIPT.format(setup=setup), d / "run", d / "cache"], d)
    return _api_refusal(p, words, wrong)


@probe("r4_fit_y_plus_minus_one", 4, SILENT, "xc.fit(X, Y) with Y in {-1, +1}")
def _r4_fit_y_plus_minus_one(ctx: Ctx):
    return _fit(ctx, "r4_fit_y_plus_minus_one", "Y = 2 * Y - 1", ["Y[", "-1"],
                "trained with every -1 taken as a relevant label")


@probe("r4_fit_y_fractional", 4, SILENT, "xc.fit(X, Y) with fractional Y (0.5)")
def _r4_fit_y_fractional(ctx: Ctx):
    return _fit(ctx, "r4_fit_y_fractional", "Y = Y * 0.5", ["Y[", "0.5"], "trained with Y binarised")


@probe("r4_fit_label_names_too_many", 4, SILENT, "xc.fit(label_names=) with 12 names for 10 label columns")
def _r4_fit_label_names_too_many(ctx: Ctx):
    return _fit(ctx, "r4_fit_label_names_too_many", "label_names = [f'n{j}' for j in range(12)]",
                ["label_names", "12", "10"], "a model trained with 12 names for 10 labels")


@probe("r4_fit_label_names_too_few", 4, SILENT, "xc.fit(label_names=) with 8 names for 10 label columns")
def _r4_fit_label_names_too_few(ctx: Ctx):
    return _fit(ctx, "r4_fit_label_names_too_few", "label_names = [f'n{j}' for j in range(8)]",
                ["label_names", "8", "10"], "a model trained with 8 names for 10 labels")


@probe("r4_fit_label_names_duplicate", 4, SILENT, "xc.fit(label_names=) naming two columns alike")
def _r4_fit_label_names_duplicate(ctx: Ctx):
    return _fit(ctx, "r4_fit_label_names_duplicate",
                "label_names = [f'n{j}' for j in range(10)]; label_names[4] = 'n1'",
                ["label_names[4]", "repeats"], "a model trained with a name given twice")


@probe("r4_fit_label_names_tab", 4, TRACEBACK, "xc.fit(label_names=) with a name holding a tab")
def _r4_fit_label_names_tab(ctx: Ctx):
    return _fit(ctx, "r4_fit_label_names_tab", "label_names = [f'n{j}' for j in range(10)]; label_names[2] = 'a\\tb'",
                ["label_names[2]", "tab"], "a model trained with a tab in a name")


@probe("r4_fit_label_names_newline", 4, TRACEBACK, "xc.fit(label_names=) with a name holding a line break")
def _r4_fit_label_names_newline(ctx: Ctx):
    return _fit(ctx, "r4_fit_label_names_newline",
                "label_names = [f'n{j}' for j in range(10)]; label_names[3] = 'two\\nlines'",
                ["label_names[3]", "line break"], "a model trained with a line break in a name")


@probe("r4_fit_x_not_texts", 4, TRACEBACK, "xc.fit(X, Y) with X a list of numbers (not texts)")
def _r4_fit_x_not_texts(ctx: Ctx):
    return _fit(ctx, "r4_fit_x_not_texts", "X = [int(t) for t in truth]", ["X[0]", "not a text"],
                "a model trained on a list of numbers")


def reseal(folder: Path) -> None:
    """Recompute every checksum of the export's manifest (the files it lists, wherever they lead, and its own),
    as someone editing an export by hand would: what the loader then reads is what its checks must refuse."""
    manifest = json.loads((folder / "export.json").read_text())
    for name, entry in manifest["files"].items():
        path = Path(name) if os.path.isabs(name) else folder / name
        if path.is_file():
            data = path.read_bytes()
            entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    manifest["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    (folder / "export.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))


QUERIES = "1:0.5 5:1.0\n3:1.0\n"


def _export_copy(ctx: Ctx, d: Path, name: str = "exp") -> Path:
    return Path(shutil.copytree(ctx.export("A"), d / name, symlinks=True))


def _tampered_export(ctx: Ctx, name: str, edit, words: list[str], what: str):
    """A copy of the shared export, EDIT(folder, d) applied and resealed, served by xc-predict: refused in one line
    holding WORDS, never served (SILENT) and never a traceback."""
    d = ctx.tmp(name)
    folder = _export_copy(ctx, d)
    edit(folder, d)
    reseal(folder)
    p = run([xc("xc-predict"), folder, "--input", "-", "--k", "3"], d, stdin=QUERIES)
    return _one_line_refusal(p, *words, what=what)


def _name_outside(manifest_name):
    def edit(folder: Path, d: Path):
        outside = d / "queries.txt"
        outside.write_text("1:0.5 5:1.0\n")
        manifest = json.loads((folder / "export.json").read_text())
        manifest["files"][manifest_name(outside, folder)] = {"bytes": 0, "sha256": ""}
        (folder / "export.json").write_text(json.dumps(manifest))
    return edit


@probe("r4_export_manifest_names_parent_file", 4, SILENT,
       "an export whose manifest lists ../queries.txt (checksums recomputed): xc-predict EXPORT")
def _r4_export_manifest_names_parent_file(ctx: Ctx):
    return _tampered_export(ctx, "r4_export_manifest_names_parent_file", _name_outside(lambda o, f: "../queries.txt"),
                            ["export.json", "not a plain file name"], "a file outside the export listed and served")


@probe("r4_export_manifest_names_absolute_path", 4, SILENT,
       "an export whose manifest lists an absolute path (checksums recomputed): xc-predict EXPORT")
def _r4_export_manifest_names_absolute_path(ctx: Ctx):
    return _tampered_export(ctx, "r4_export_manifest_names_absolute_path", _name_outside(lambda o, f: str(o)),
                            ["export.json", "not a plain file name"], "an absolute path listed and served")


@probe("r4_export_models_name_another_export", 4, SILENT,
       "an export whose manifest's models names ../another-run/model (checksums recomputed)")
def _r4_export_models_name_another_export(ctx: Ctx):
    def edit(folder: Path, d: Path):
        _export_copy(ctx, d, "another-run")
        manifest = json.loads((folder / "export.json").read_text())
        manifest["models"] = ["../another-run/model"]
        (folder / "export.json").write_text(json.dumps(manifest))
    return _tampered_export(ctx, "r4_export_models_name_another_export", edit, ["models"],
                            "another folder's weights served under this export's fusion and prior")


@probe("r4_export_symlink_out", 4, SILENT,
       "an export whose prior.json is a symbolic link to a file outside it (checksums recomputed)")
def _r4_export_symlink_out(ctx: Ctx):
    def edit(folder: Path, d: Path):
        outside = d / "elsewhere-prior.json"
        outside.write_text('{"beta": 0.9}\n')
        (folder / "prior.json").unlink()
        (folder / "prior.json").symlink_to(outside)
    return _tampered_export(ctx, "r4_export_symlink_out", edit, ["prior.json", "symbolic link"],
                            "a link out of the export followed")


@probe("r4_export_json_edited", 4, TRACEBACK,
       "an export's model/config.json (global_step \"five\") and fusion.json (k \"fifty\") edited, checksums "
       "recomputed")
def _r4_export_json_edited(ctx: Ctx):
    d = ctx.tmp("r4_export_json_edited")
    results = []
    for file, key, value in (("model/config.json", "global_step", "five"), ("fusion.json", "k", "fifty")):
        folder = d / f"exp-{key}"
        shutil.copytree(ctx.export("A"), folder)
        body = json.loads((folder / file).read_text())
        body[key] = value
        (folder / file).write_text(json.dumps(body))
        reseal(folder)
        p = run([xc("xc-predict"), folder, "--input", "-", "--k", "3"], d, stdin=QUERIES)
        results.append(_one_line_refusal(p, file.split("/")[-1], key, what=f"{file} with {key}={value!r} served"))
    bad = [r for r in results if r[0] != CLEAN]
    return bad[0] if bad else (CLEAN, " | ".join(r[1] for r in results))


def _edit_header(path: Path, how: str) -> None:
    """model.safetensors' header edited in place: its length past the file's end, or a tensor's shape."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    if how == "length":
        data[:8] = (len(data) * 4).to_bytes(8, "little")
    else:
        header = json.loads(data[8:8 + n])
        shape = header["classifier.weight"]["shape"]
        header["classifier.weight"]["shape"] = [shape[0] // 2, shape[1]]
        text = json.dumps(header, separators=(",", ":")).encode()
        data[8:8 + n] = text + b" " * (n - len(text))  # the same length: the offsets still point at the data
    path.write_bytes(bytes(data))


@probe("r4_export_safetensors_header_edited", 4, TRACEBACK,
       "an export's model.safetensors header edited (its length; a tensor's shape), checksums recomputed")
def _r4_export_safetensors_header_edited(ctx: Ctx):
    d = ctx.tmp("r4_export_safetensors_header_edited")
    results = []
    for how in ("length", "shape"):
        folder = d / f"exp-{how}"
        shutil.copytree(ctx.export("A"), folder)
        _edit_header(folder / "model" / "model.safetensors", how)
        reseal(folder)
        p = run([xc("xc-predict"), folder, "--input", "-", "--k", "3"], d, stdin=QUERIES)
        results.append(_one_line_refusal(p, "model.safetensors", what=f"a header with its {how} edited served"))
    bad = [r for r in results if r[0] != CLEAN]
    return bad[0] if bad else (CLEAN, " | ".join(r[1] for r in results))


@probe("r4_export_pickle_for_safetensors", 4, LOSS,
       "a code-running pickle in place of an export's model.safetensors (checksums recomputed): xc-predict, xc.load")
def _r4_export_pickle_for_safetensors(ctx: Ctx):
    d = ctx.tmp("r4_export_pickle_for_safetensors")
    folder = _export_copy(ctx, d)
    marker = d / "PWNED"
    subprocess.run([PY, "-c", PICKLE_SRC, str(folder / "model" / "model.safetensors"), str(marker)], check=True)
    reseal(folder)
    p = run([xc("xc-predict"), folder, "--input", "-", "--k", "3"], d, stdin=QUERIES)
    q = run([PY, "-c", LOAD_SCRIPT, folder], d)
    if marker.exists():
        return LOSS, "the pickle's code ran (it could have overwritten any file)"
    first = _one_line_refusal(p, "model.safetensors", "not a safetensors file", what="a pickle served")
    if first[0] != CLEAN:
        return first
    second = _api_refusal(q, ["model.safetensors"], "xc.load took a pickle")
    return second if second[0] != CLEAN else (CLEAN, f"never unpickled; xc-predict {first[1]}; xc.load: {second[1]}")


LOAD_SCRIPT = """
import json, sys
import scipy.sparse
import xc
from xc.errors import XCError
try:
    m = xc.load(sys.argv[1])
    rows = scipy.sparse.csr_matrix(([0.5, 1.0], ([0, 0], [1, 5])), shape=(1, m.num_features))
    print(json.dumps({"ids": m.predict(rows, k=3).ids.tolist()}))
except XCError as exc:
    print(json.dumps({"error": str(exc), "type": type(exc).__name__}))
    sys.exit(2)
"""


@probe("r4_export_keeps_users_file", 4, LOSS,
       "xc-export into an earlier export holding a file of the user's (NOTES.md)")
def _r4_export_keeps_users_file(ctx: Ctx):
    d = ctx.tmp("r4_export_keeps_users_file")
    folder = _export_copy(ctx, d)
    (folder / "NOTES.md").write_text("# my notes on this model\n")
    before = file_hashes(folder)
    p = run([xc("xc-export"), ctx.shared("A"), folder], d)
    after = file_hashes(folder)
    left = [x.name for x in d.iterdir() if x.name.startswith(".")]
    ok = p.rc == 2 and "NOTES.md" in error_line(p.text) and not left
    return classify(p.rc, p.text, before=before, after=after,
                    wrong="exported over the user's file" if p.rc == 0 else None,
                    failed=None if ok else f"exit {p.rc}, left {left}: {error_line(p.text)[:140]}",
                    clean=f"exit 2, NOTES.md and the export byte-identical: {error_line(p.text)[:130]}")


@probe("r4_reexport_read_only_export", 4, TRACEBACK,
       "xc-export again into an earlier export on a read-only mount: one line, no hidden staging folder left")
def _r4_reexport_read_only_export(ctx: Ctx):
    d = ctx.tmp("r4_reexport_read_only_export")
    folder = _export_copy(ctx, d)
    before = file_hashes(folder)
    p, how = read_only(folder, [xc("xc-export"), ctx.shared("A"), folder], d)
    if p is None:
        return SKIPPED, how
    left = [x.name for x in d.iterdir() if x.name != folder.name]
    ok = p.rc == 2 and error_line(p.text).startswith("error:") and not left
    return classify(p.rc, p.text, before=before, after=file_hashes(folder),
                    wrong="exit 0 over a read-only export" if p.rc == 0 else None,
                    failed=None if ok else f"exit {p.rc}, left {left}: {error_line(p.text)[:140]}",
                    clean=f"[{how}] exit 2, nothing left beside it: {error_line(p.text)[:130]}")


@probe("r4_export_live_run", 4, SILENT, "xc-export of a run that is still training")
def _r4_export_live_run(ctx: Ctx):
    d = ctx.tmp("r4_export_live_run")
    run_dir = d / "run"
    ctx.shared("A")
    trainer = subprocess.Popen(train_cmd(run_dir, ctx.cache, "train.epochs=200"), cwd=d, env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not checkpoints(run_dir) and trainer.poll() is None:
            time.sleep(0.3)
        if trainer.poll() is not None:
            return FAILED, f"the trainer ended early (exit {trainer.returncode})"
        p = run([xc("xc-export"), run_dir, d / "exp"], d)
    finally:
        trainer.send_signal(signal.SIGTERM)
        try:
            trainer.wait(timeout=120)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait()
    if (d / "exp").exists() and p.rc == 0:
        return classify(0, p.text, wrong="a live run exported without a word")
    return _one_line_refusal(p, "still training", "--allow-running", what="a live run exported")


THRESHOLD_SCRIPT = """
import json, sys
import scipy.sparse
import xc
from xc.errors import XCError
m = xc.load(sys.argv[1])
{setup}
rows = scipy.sparse.csr_matrix(([0.5, 1.0, 1.0], ([0, 0, 1], [1, 5, 3])), shape=(2, m.num_features))
try:
    out = m.predict(rows, k=5, threshold={threshold})
except XCError as exc:
    print(json.dumps({{"error": str(exc), "type": type(exc).__name__}}))
    sys.exit(2)
print(json.dumps({{"ids": out.ids.tolist()}}))
"""


@probe("r4_threshold_after_use_prior_false", 4, SILENT,
       "xc.load(RUN).use_prior(False), then predict(..., threshold=0.5): the map was fitted on scores with the prior")
def _r4_threshold_after_use_prior_false(ctx: Ctx):
    d = ctx.tmp("r4_threshold_after_use_prior_false")
    p = run([PY, "-c", THRESHOLD_SCRIPT.format(setup="m.use_prior(False)", threshold="0.5"), ctx.shared("A")], d)
    return _api_refusal(p, ["does not fit these scores", "no label prior"],
                        "the calibration applied to scores it was not fitted on")


@probe("r4_threshold_other_checkpoint", 4, SILENT,
       "xc-predict RUN --checkpoint step-N (not the one calibrated) --min-score 0.5")
def _r4_threshold_other_checkpoint(ctx: Ctx):
    d = ctx.tmp("r4_threshold_other_checkpoint")
    run_dir = ctx.shared("A")
    older = checkpoints(run_dir)[0]
    p = run([xc("xc-predict"), run_dir, "--checkpoint", older, "--min-score", "0.5", "--input", "-", "--k", "5"], d,
            stdin=QUERIES)
    return _one_line_refusal(p, "does not fit these scores", older.name,
                             what="the calibration applied to another checkpoint's scores")


@probe("r4_threshold_not_a_number", 4, TRACEBACK, "xc.load(RUN).predict(..., threshold=\"abc\")")
def _r4_threshold_not_a_number(ctx: Ctx):
    d = ctx.tmp("r4_threshold_not_a_number")
    p = run([PY, "-c", THRESHOLD_SCRIPT.format(setup="", threshold="'abc'"), ctx.shared("A")], d)
    return _api_refusal(p, ["threshold", "a probability in [0, 1]"], "a threshold of 'abc' taken")


@probe("r4_data_verify_cache_root", 4, TRACEBACK, "xc-data verify on the cache root (datasets two levels down)")
def _r4_data_verify_cache_root(ctx: Ctx):
    d = ctx.tmp("r4_data_verify_cache_root")
    ctx.shared("A")
    ctx.records_run()
    p = run([xc("xc-data"), "verify", ctx.cache], d)
    oks = [r for r in p.out.splitlines() if r.startswith("ok: ")]
    said = _said(p.text, "intact")
    failed = None if (p.rc == 0 and len(oks) >= 2 and said) else \
        f"exit {p.rc}, {len(oks)} ok: {error_line(p.text)[:140]}"
    return classify(p.rc, p.text, failed=failed, clean=f"exit 0, {len(oks)} datasets: {said[:150]}")


# ---- storage errors: a file size limit (ulimit -f), a full disk, an unwritable parent

def _fsize_limit(limit: int) -> Callable[[], None]:
    """A child's RLIMIT_FSIZE (`ulimit -f`), with SIGXFSZ ignored as Python does, so a write past it is EFBIG."""
    def preexec():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


NO_BYTECODE = {"PYTHONDONTWRITEBYTECODE": "1"}  # under the limit, Python would rename a truncated .pyc into place


def _efbig(p: Proc, leftovers: list[str], what: str, clean_extra: str = "") -> tuple[str, str]:
    line = error_line(p.text)
    ok = p.rc == 2 and line.startswith("error:") and "file too large" in line and not leftovers
    return classify(p.rc, p.text, wrong=f"{what}: exit 0 under the limit" if p.rc == 0 else None,
                    failed=None if ok else f"exit {p.rc}, left {leftovers[:3]}: {line[:140]}",
                    clean=f"exit 2{clean_extra}: {line[:160]}")


@probe("r4_efbig_xc_train", 4, TRACEBACK, "xc-train under ulimit -f 1 MB (the checkpoint is bigger)")
def _r4_efbig_xc_train(ctx: Ctx):
    d = ctx.tmp("r4_efbig_xc_train")
    ctx.shared("A")  # the cache is built: only the run directory is written under the limit
    p = run(train_cmd(d / "run", ctx.cache), d, env=NO_BYTECODE, preexec=_fsize_limit(1 << 20))
    left = [str(x.relative_to(d)) for x in (d / "run").rglob("*.part")] if (d / "run").exists() else []
    return _efbig(p, left, "a run")


@probe("r4_efbig_xc_export", 4, TRACEBACK, "xc-export under ulimit -f 1 MB: one line, no staging folder left")
def _r4_efbig_xc_export(ctx: Ctx):
    d = ctx.tmp("r4_efbig_xc_export")
    p = run([xc("xc-export"), ctx.shared("A"), d / "exp"], d, env=NO_BYTECODE, preexec=_fsize_limit(1 << 20))
    return _efbig(p, [x.name for x in d.iterdir()], "an export", ", nothing left")


@probe("r4_efbig_predict_out", 4, TRACEBACK, "xc-predict --out under ulimit -f 64 KB: one line, no partial file")
def _r4_efbig_predict_out(ctx: Ctx):
    d = ctx.tmp("r4_efbig_predict_out")
    rows = d / "rows.txt"
    rows.write_text("".join(f"{i % 500}:1.0 {(7 * i) % 500}:0.5\n" for i in range(3000)))
    out = d / "preds.jsonl"
    p = run([xc("xc-predict"), ctx.shared("A"), "--input", rows, "--k", "20", "--out", out], d, env=NO_BYTECODE,
            preexec=_fsize_limit(64 << 10))
    return _efbig(p, [x.name for x in d.iterdir() if x.name != rows.name], "a partial --out", ", no file left")


@probe("r4_efbig_eval_predictions", 4, TRACEBACK,
       "xc-eval --predictions under ulimit -f 32 KB: the metrics printed, one line, no partial file")
def _r4_efbig_eval_predictions(ctx: Ctx):
    d = ctx.tmp("r4_efbig_eval_predictions")
    p = run([xc("xc-eval"), ctx.shared("A"), "--out", d / "eval.json", "--topk", "100", "--predictions",
             d / "preds.npz"], d, env=NO_BYTECODE, preexec=_fsize_limit(32 << 10))
    left = [x.name for x in d.iterdir() if x.name != "eval.json"]
    if p.rc == 2 and "P@1" not in p.text:
        left.append("(no metrics printed)")
    return _efbig(p, left, "predictions", ", metrics printed first")


EXPORT_DISK_FULL = r"""
set -u
mnt="$1"; out="$2"; shift 2
mount -t tmpfs -o size=3m tmpfs "$mnt" || exit 90
"$@" > "$out/export.txt" 2>&1; echo $? > "$out/export.rc"
ls -A "$mnt" > "$out/left"
"""


@probe("r4_export_full_disk", 4, TRACEBACK, "xc-export onto a full disk (a 3 MB tmpfs): one line, nothing left")
def _r4_export_full_disk(ctx: Ctx):
    if not UNSHARE:
        return SKIPPED, "needs unshare -m to mount a small tmpfs"
    d = ctx.tmp("r4_export_full_disk")
    mnt, out = d / "mnt", d / "out"
    mnt.mkdir()
    out.mkdir()
    cmd = [xc("xc-export"), ctx.shared("A"), mnt / "exp"]
    p = run(["unshare", "-m", "--propagation", "private", "bash", "-c", EXPORT_DISK_FULL, "_", mnt, out, *cmd], d)
    if p.rc == 90:
        return SKIPPED, "could not mount a tmpfs"
    text = _short((out / "export.txt").read_text(errors="replace"))
    rc = int((out / "export.rc").read_text())
    left = (out / "left").read_text().split()
    line = error_line(text)
    ok = rc == 2 and "no space left" in line.lower() and not left
    return classify(rc, text, wrong="exit 0 on a full disk" if rc == 0 else None,
                    failed=None if ok else f"exit {rc}, left {left}: {line[:140]}",
                    clean=f"exit 2, nothing left on the disk: {line[:150]}")


@probe("r4_export_unwritable_parent", 4, TRACEBACK, "xc-export into a folder below a read-only one")
def _r4_export_unwritable_parent(ctx: Ctx):
    d = ctx.tmp("r4_export_unwritable_parent")
    locked = d / "locked"
    locked.mkdir()
    p, how = read_only(locked, [xc("xc-export"), ctx.shared("A"), locked / "sub" / "exp"], d)
    if p is None:
        return SKIPPED, how
    left = [x.name for x in locked.iterdir()]
    line = error_line(p.text)
    ok = p.rc == 2 and line.startswith("error:") and "locked" in line and not left
    return classify(p.rc, p.text, wrong="exit 0 under a read-only folder" if p.rc == 0 else None,
                    failed=None if ok else f"exit {p.rc}, left {left}: {line[:140]}",
                    clean=f"[{how}] exit 2: {line[:160]}")


@probe("r4_ann_save_index_read_only_export", 4, TRACEBACK,
       "xc-predict EXPORT --ann faiss_hnsw --save-index on a read-only export: served, one warning")
def _r4_ann_save_index_read_only_export(ctx: Ctx):
    d = ctx.tmp("r4_ann_save_index_read_only_export")
    folder = _export_copy(ctx, d)
    before = file_hashes(folder)
    queries = d / "queries.txt"
    queries.write_text(QUERIES)
    p, how = read_only(folder, [xc("xc-predict"), folder, "--ann", "faiss_hnsw", "--save-index", "--input", queries,
                                "--k", "3"], d)
    if p is None:
        return SKIPPED, how
    rows = [r for r in p.out.splitlines() if r.startswith("{")]
    warned = _said(p.text, "could not save")
    failed = None if (p.rc == 0 and len(rows) == 2 and warned) else \
        f"exit {p.rc}, {len(rows)} rows, warned: {bool(warned)}: {error_line(p.text)[:130]}"
    return classify(p.rc, p.text, before=before, after=file_hashes(folder), failed=failed,
                    clean=f"[{how}] 2 rows served; {warned[:150]}")


@probe("r4_export_ctrl_c", 4, LOSS,
       "Ctrl-C (SIGINT) during xc-export over an earlier export: it stays whole, no staging folder left")
def _r4_export_ctrl_c(ctx: Ctx):
    d = ctx.tmp("r4_export_ctrl_c")
    folder = _export_copy(ctx, d)
    before = file_hashes(folder)
    proc = subprocess.Popen([xc("xc-export"), str(ctx.shared("A")), str(folder)], cwd=d, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, staged = time.monotonic() + 120, False
    while time.monotonic() < deadline and proc.poll() is None:
        if any(x.name.startswith(".") for x in d.iterdir()):  # the staging folder: it is writing now
            staged = True
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    text = _short(out + "\n" + err)
    left = [x.name for x in d.iterdir() if x.name != folder.name]
    if not staged:
        return FAILED, f"the export ended (exit {proc.returncode}) before its staging folder was seen: not interrupted"
    line = next((r for r in text.splitlines() if "interrupted" in r), error_line(text))
    ok = proc.returncode == 130 and "interrupted" in line and not left
    return classify(proc.returncode, text, before=before, after=file_hashes(folder),
                    failed=None if ok else f"exit {proc.returncode}, left {left}: {line[:140]}",
                    clean=f"SIGINT while staging: exit 130, the earlier export byte-identical, nothing left: "
                          f"{line[:110]}")


# ---- rough edges

@probe("r4_cache_rebuild_warning_once", 4, SILENT,
       "a damaged cached .npy: the warning is printed once and does not ask to delete what is being rebuilt")
def _r4_cache_rebuild_warning_once(ctx: Ctx):
    import numpy as np

    d = ctx.tmp("r4_cache_rebuild_warning_once")
    ctx.shared("A")
    cache = d / "cache"
    shutil.copytree(ctx.cache, cache)
    (target,) = list(cache.glob("synthetic/*/train.features.values.npy"))
    arr = np.load(target, mmap_mode="r")
    header, shape, dtype = target.stat().st_size - arr.nbytes, arr.shape, arr.dtype
    del arr
    with open(target, "r+b") as f:
        f.seek(header)
        f.write(np.zeros(shape, dtype).tobytes())
    p = run(train_cmd(d / "run", cache), d)
    said = [r for r in p.text.splitlines() if "damaged" in r]
    problems = []
    if len(said) != 1:
        problems.append(f"said {len(said)} times")
    if any("delete" in r for r in said):
        problems.append("asks to delete what it rebuilds")
    if p.rc != 0:
        problems.append(f"exit {p.rc}: {error_line(p.text)[:100]}")
    return classify(p.rc, p.text, failed="; ".join(problems) or None,
                    clean=f"rebuilt, said once: {_said(p.text, 'damaged')[:170]}")


@probe("r4_predict_blank_lines_only", 4, SILENT, "xc-predict of an input holding only blank lines")
def _r4_predict_blank_lines_only(ctx: Ctx):
    d = ctx.tmp("r4_predict_blank_lines_only")
    rows = d / "rows.txt"
    rows.write_text("\n\n \n\n")
    p = run([xc("xc-predict"), ctx.shared("A"), "--input", rows], d)
    line = error_line(p.text)
    if p.rc == 2 and "raw text" in line.split("(")[0]:
        return classify(p.rc, p.text, failed=f"blamed on raw text: {line[:150]}")
    return _one_line_refusal(p, "holds no queries", what="blank lines answered")


@probe("r4_test_labels_never_in_training", 4, SILENT,
       "xc-train on records whose test split holds a label no training record has: one log line says so")
def _r4_test_labels_never_in_training(ctx: Ctx):
    _, _, text = ctx.records_run()
    said = _said(text, "never occur in training")
    return classify(0, text, wrong=None if said else "no line says a test label never occurs in training",
                    clean=said[:180])


@probe("r4_records_run_source_moved", 4, TRACEBACK,
       "xc-predict of a records run whose source folder was moved away")
def _r4_records_run_source_moved(ctx: Ctx):
    d = ctx.tmp("r4_records_run_source_moved")
    run_dir, src, _ = ctx.records_run()
    moved = src.with_name(src.name + "-moved")
    src.rename(moved)
    try:
        p = run([xc("xc-predict"), run_dir, "--input", "-", "--k", "3"], d, stdin=records_text(3, 900) + "\n")
    finally:
        moved.rename(src)
    return _one_line_refusal(p, "serving a run reads the data it trained on", "xc-export",
                             what="served without its source")


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
            "command": "XC_THREADS=1 .venv/bin/python tools/probes/reliability_probes.py" + "".join(
                f" --only {n}" for n in args.only or []), "wall_seconds": round(wall, 1),
            "read_only_by": "unshare -m read-only bind mount" if UNSHARE else ("chmod -w" if not IS_ROOT else "none"),
            "user": "root" if IS_ROOT else os.geteuid(), "counts": c, "probes": results}, indent=1) + "\n")
    return 0 if c[CLEAN] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
