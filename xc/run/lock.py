"""One trainer per run directory: a lock file naming its holder.

Two `xc-train` on one run directory would write the same `step-*.tmp` checkpoint directory and the
same log; one then dies with a raw FileNotFoundError, and the survivor's checkpoints may mix both.
Rank 0 therefore takes `RUN_DIR/.lock` (created with O_EXCL, so exactly one process wins) before
anything is written there, and removes it when the run ends, however it ends short of SIGKILL.

The lock file holds the holder's pid, host, start time and torchrun run id. A lock is *stale*, and
is taken over with a log line, when

* its pid is not alive on this host (the holder was SIGKILLed, or the machine rebooted), or
* it was taken by an earlier attempt of this same torchrun job (`TORCHELASTIC_RUN_ID` matches and
  `TORCHELASTIC_RESTART_COUNT` is higher): torchrun restarts every rank after a failure, and the
  restarted rank 0 may even run on another host.

A lock held by a live process, or by another host (whose pids cannot be checked from here), stops
the run with one line naming the holder and the lock file. The holder then writes the run marker
`RUN_DIR/.xc-run` before anything else, so a folder xc has written into is known for an xc run's
(xc/run/guard.py), and a user's folder never is. A lock or marker that cannot be written (read-only
mount, permissions, full disk, quota) stops the run with one line naming the path and the fix.
The external miner (`xc-miner`) takes no lock: it cooperates with the trainer through the handoff
directory.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
from pathlib import Path

from xc.errors import XCError
from xc.fsutil import pid_alive, storage_error
from xc.run.checkpoint import sweep_partial
from xc.run.identity import RUN_MARKER, write_run_marker

log = logging.getLogger("xc.lock")
LOCK_FILE = ".lock"


class RunLockedError(XCError):
    """The run directory is in use by another live trainer."""


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "torchrun_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)}




def _stale_reason(holder: dict, me: dict) -> str | None:
    """Why the lock `holder` wrote can be taken over by `me`, or None if it cannot."""
    same_job = holder.get("torchrun_run_id") and holder.get("torchrun_run_id") == me["torchrun_run_id"]
    if same_job and int(holder.get("restart_count") or 0) < me["restart_count"]:
        return f"taken by attempt {holder.get('restart_count')} of this torchrun job"
    if holder.get("host") == me["host"]:
        pid = int(holder.get("pid") or 0)
        if pid == me["pid"]:
            return "taken by this very process"
        if pid <= 0 or not pid_alive(pid):
            return f"its process {pid} on this host is gone"
    return None


def live_holder(run_dir: str | Path) -> dict | None:
    """The holder (pid, host, started) of `run_dir`'s lock where a live trainer holds it (or one on another host,
    whose pids cannot be checked from here), else None: a reader's test of "is this run still training"."""
    try:
        holder = json.loads((Path(run_dir) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict) or not {"pid", "host"} <= set(holder):
        return None
    return None if _stale_reason(holder, dict(_me(), torchrun_run_id=None)) else holder


class RunLock:
    """`RunLock(run_dir).acquire()` ... `.release()`; a context manager too."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def acquire(self) -> None:
        """Take the lock, or raise RunLockedError naming its live holder. A lock that cannot be written (disk full,
        read-only, permission denied) is an XCError naming the path and the cause, and leaves no lock file behind;
        a full disk is first given back the unpublished checkpoint folders a crash left (we hold the lock then)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._storage_error(exc, f"could not create the run directory {self.path.parent}") from None
        me = _me()
        for _ in range(3):  # a race with another process taking over the same stale lock: look again
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is None:  # being written right now, or emptied by a crash mid-write
                    time.sleep(0.2)
                    holder = self._read() or {"pid": 0, "host": me["host"]}
                why = _stale_reason(holder, me)
                if why is None:
                    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started") or 0)))
                    raise RunLockedError(
                        f"run directory {self.path.parent} is in use by pid {holder.get('pid')} on host "
                        f"{holder.get('host')} (since {since}; lock file {self.path}). Wait for that run, pass "
                        "another run_dir=, or delete the lock file if that process is gone")
                # Rename, not unlink: of two processes taking over the same stale lock only one rename
                # succeeds, and the loser then meets the winner's fresh lock.
                aside = self.path.with_name(f"{LOCK_FILE}.stale-{me['pid']}")
                try:
                    os.replace(self.path, aside)
                except FileNotFoundError:
                    continue
                except OSError as exc:  # a stale lock on a read-only mount cannot be taken over either
                    raise self._storage_error(exc, f"could not take over the stale lock {self.path}") from None
                aside.unlink(missing_ok=True)
                log.warning("took over the stale lock %s (%s)", self.path, why)
                continue
            except OSError as exc:  # an existing run on a read-only mount, no permission, a full disk or quota
                raise self._storage_error(exc, f"could not write the lock {self.path}") from None
            try:
                self._write(fd, me)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:  # the lock is ours (O_EXCL): a crash's half-written checkpoints can go
                    if sweep_partial(self.path.parent):
                        try:
                            self._write(os.open(self.path, os.O_WRONLY | os.O_TRUNC), me)
                        except OSError as again:
                            exc = again
                        else:
                            self.held = True
                            self._mark_as_xc_run()
                            return
                self.path.unlink(missing_ok=True)
                raise self._storage_error(exc, f"could not write the lock {self.path}") from None
            self.held = True
            self._mark_as_xc_run()
            return
        raise RunLockedError(f"could not take the lock {self.path}: other processes keep taking it")

    def _mark_as_xc_run(self) -> None:
        """Write the run marker (xc/run/identity.py RUN_MARKER) now, the first file after the lock: whatever a crash
        leaves in the folder from here on, the guard knows it for an xc run's. A marker that cannot be written gives
        the lock back and stops the run in one line."""
        try:
            write_run_marker(self.path.parent)
        except OSError as exc:
            self.release()
            raise self._storage_error(exc, f"could not write {self.path.parent / RUN_MARKER}") from None

    @staticmethod
    def _write(fd: int, me: dict) -> None:
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(me))
            handle.flush()
            os.fsync(handle.fileno())

    @staticmethod
    def _storage_error(exc: OSError, what: str) -> BaseException:
        return storage_error(exc, what, "the run directory must be writable with free space: free some, fix its "
                             "permissions, or pass another run_dir=")

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"pid": 0, "host": socket.gethostname()}
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            holder = json.loads(self.path.read_text())
            if holder.get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError) as exc:
            if getattr(exc, "errno", None) != errno.ENOENT:
                log.warning("could not remove the lock %s: %s", self.path, exc)

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
