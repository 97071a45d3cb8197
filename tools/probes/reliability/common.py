"""What every reliability probe shares: the outcomes and the classifier (tracebacks, file hashes before and
after, the line a user reads), running a command (paths under the probes' temporary folder read TMP/..., a folder
made read-only), the @probe registry, and the verdicts several rounds give (a refusal in one line, a Python call's
XCError). The outcomes are described in tools/probes/reliability_probes.py, which runs the probes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from tools.probes.reliability.fixtures import Ctx

BIN = Path(sys.executable).parent
PY = sys.executable

CLEAN, LOSS, SILENT, TRACEBACK, FAILED, SKIPPED, ERROR = (
    "CLEAN", "LOSS", "SILENT", "TRACEBACK", "FAILED", "SKIPPED", "ERROR")
OUTCOMES = (CLEAN, LOSS, SILENT, TRACEBACK, FAILED, SKIPPED, ERROR)

TRACEBACK_HEAD = "Traceback (most recent call last)"
HYDRA_ERROR = "Error executing job"
LAUNCHER_PREFIX = "torch.distributed.elastic."  # only torchrun's agent raises these (its summary after a rank fails)


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


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("XC_THREADS", "1")
    env.update({"WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": env.get("HYDRA_FULL_ERROR", "")})
    if not env["HYDRA_FULL_ERROR"]:
        del env["HYDRA_FULL_ERROR"]
    env.update(extra or {})
    return env


SHOWN_ROOT: list[str] = []  # the probes' temporary folder, shown as TMP in the outputs (set by Ctx)


def shown(text: str) -> str:
    for root in SHOWN_ROOT:
        text = text.replace(root, "TMP")
    return text


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float = 300, stdin: str | None = None,
        preexec: Callable[[], None] | None = None) -> Proc:
    """CMD's exit code and output; paths under the probes' temporary folder read TMP/... in the output.
    PREEXEC runs in the child before CMD (a resource limit)."""
    t0 = time.monotonic()
    try:
        p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=child_env(env), capture_output=True, text=True,
                           input=stdin, timeout=timeout, errors="replace", preexec_fn=preexec)
        return Proc(p.returncode, shown(p.stdout), shown(p.stderr), time.monotonic() - t0)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return Proc(None, shown(out), shown(err) + f"\n(probe: timed out after {timeout}s)", time.monotonic() - t0)


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


# ---------------------------------------------------------------------------------------------- registry

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


# ---------------------------------------------------------------------------------------------- verdicts

def said_line(text: str, needle: str) -> str:
    """The first line holding NEEDLE, without the log prefix."""
    line = next((r.strip() for r in text.splitlines() if needle in r), "")
    return re.sub(r"^\d\d:\d\d:\d\d \[rank\d+\] \w+ [\w.]+: ", "", line)


def one_line_refusal(p: Proc, *words: str, what: str = "accepted", rc: int = 2) -> tuple[str, str]:
    """CLEAN when P exited RC with an `error:` line holding every word of WORDS; SILENT when it exited 0."""
    line = error_line(p.text)
    ok = p.rc == rc and line.startswith("error:") and all(w in line for w in words)
    return classify(p.rc, p.text, wrong=f"{what}: exit 0" if p.rc == 0 else None,
                    failed=None if ok else f"exit {p.rc}, not one line with {list(words)}: {line[:150]}",
                    clean=f"exit {p.rc}: {line[:170]}")


def api_result(p: Proc) -> dict:
    rows = [r for r in p.out.splitlines() if r.startswith("{")]
    return json.loads(rows[-1]) if rows else {}


def api_refusal(p: Proc, words: list[str], wrong_if_ran: str) -> tuple[str, str]:
    """A Python call that must raise XCError in one line holding WORDS (the script prints it as JSON, exit 2)."""
    res = api_result(p)
    if p.rc == 0:
        return classify(0, p.text, wrong=f"{wrong_if_ran} ({json.dumps(res)[:120]})")
    msg = res.get("error", "")
    ok = p.rc == 2 and msg and "\n" not in msg and all(w in msg for w in words)
    return classify(p.rc, p.text, failed=None if ok else
                    f"exit {p.rc}, not one {res.get('type', 'XCError')} line with {words}: "
                    f"{(msg or error_line(p.text))[:150]!r}", clean=f"{res.get('type')}: {msg[:170]}")
