"""One miner per run: `RUN_DIR/handoff/control/miner.lease`, held while a miner serves the run.

Two miners on one run would mine every shard twice and race to publish (the loser gets "already
published"), and the miner of a `miner=pool` (or `ray`) trainer would collide with an `xc-miner` started
by hand. So whoever mines a run (the trainer's in-process pool, or `xc-miner`) first takes the lease:
a JSON file created with O_EXCL (exactly one process wins, on a local disk or NFS), naming its holder
(kind, host, pid, start time). A thread of the holder touches the file every `heartbeat_s`, so the lease
proves the holder alive on any host, where pids cannot be checked.

A lease is *stale*, and taken over with a log line, when

* its holder's pid is dead on this host (SIGKILL, OOM kill): at once;
* its file has not been touched for `stale_s` (a holder on another host that died or lost the disk);
* the taker is a trainer and the holder was a trainer's pool: one trainer per run is already guaranteed
  by the run lock (xc/run/lock.py), so that holder is an earlier life of this run (torchrun restarts it,
  possibly on another host).

Otherwise the second miner stops with one line naming the holder, the file and what to do. Take-over
renames the stale file away first (atomic), so two miners that both saw it stale cannot both win.
Pure stdlib: the miner imports this.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from xc.errors import XCError
from xc.fsutil import pid_alive

log = logging.getLogger("xc.miner")
LEASE_FILE = "miner.lease"
KINDS = ("trainer", "xc-miner")


class MinerAttachedError(XCError):
    """Another live miner already serves this run."""


def lease_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "handoff" / "control" / LEASE_FILE




class MinerLease:
    """Take with `acquire()` (raises MinerAttachedError), give back with `release()`; a context manager too."""

    def __init__(self, run_dir: str | Path, kind: str, heartbeat_s: float = 5.0, stale_s: float = 60.0):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if stale_s <= 2 * heartbeat_s:
            raise ValueError(f"stale_s ({stale_s}) must exceed two heartbeats ({heartbeat_s} s each)")
        self.path, self.kind = lease_path(run_dir), kind
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self.me = {"kind": kind, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                   "token": os.urandom(8).hex()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ holder
    def read_holder(self) -> dict | None:
        """The current holder's record (with its file's age in seconds as `age_s`), or None if no lease."""
        try:
            text, mtime = self.path.read_text(), self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(text)
        except ValueError:  # written by a process that died mid-write: no one holds it
            holder = {}
        if not isinstance(holder, dict):
            holder = {}
        holder["age_s"] = max(0.0, time.time() - mtime)
        return holder

    def stale_reason(self, holder: dict) -> str | None:
        """Why `holder` may be taken over by this process, or None if it is a live miner."""
        if not holder.get("pid"):
            return "its lease file is unreadable (a holder died while writing it)"
        if holder.get("host") == self.me["host"] and not pid_alive(int(holder["pid"])):
            return f"its pid {holder['pid']} is not running on this host"
        if holder["age_s"] > self.stale_s:
            return f"its lease has not been renewed for {holder['age_s']:.0f} s (> {self.stale_s:.0f} s)"
        if self.kind == "trainer" and holder.get("kind") == "trainer":
            return "it was an earlier life of this run's trainer (the run lock admits one trainer)"
        return None

    def _describe(self, holder: dict) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
        return (f"{holder.get('kind', '?')} pid {holder.get('pid')} on {holder.get('host')} (since {since}, "
                f"renewed {holder['age_s']:.0f} s ago)")

    # ------------------------------------------------------------------ acquire / release
    def acquire(self) -> MinerLease:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):  # a few rounds of create / take-over races, then give up loudly
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.read_holder()
                if holder is None:
                    continue  # released between our open and our read
                reason = self.stale_reason(holder)
                if reason is None:
                    raise MinerAttachedError(self._refusal(holder))
                self._take_over(holder, reason)
                continue
            with os.fdopen(fd, "w") as handle:
                json.dump(self.me, handle)
                handle.flush()
                os.fsync(handle.fileno())
            self._thread = threading.Thread(target=self._beat, daemon=True, name="xc-miner-lease")
            self._thread.start()
            return self
        raise MinerAttachedError(f"{self.path}: could not take the miner lease (other miners keep taking it)")

    def _refusal(self, holder: dict) -> str:
        where = (f"{self.path} is held by {self._describe(holder)}: one miner serves a run, a second would mine "
                 f"every shard twice and race the first to publish. ")
        if holder.get("kind") == "trainer":
            fix = ("This run's trainer drives its own miner (miner=pool or miner=ray); xc-miner serves runs trained with "
                   "miner=external: restart the trainer with miner=external to mine elsewhere.")
        elif self.kind == "trainer":
            fix = ("An xc-miner serves this run: train with miner=external to use it, or stop that xc-miner "
                   f"(touch {self.path.parent / 'stop'}, or Ctrl-C) and start the trainer again.")
        else:
            fix = ("Stop that xc-miner first, or wait: a lease not renewed for "
                   f"{self.stale_s:.0f} s (its holder died) is taken over automatically.")
        return where + fix

    def _take_over(self, holder: dict, reason: str) -> None:
        aside = self.path.with_name(f"{LEASE_FILE}.stale-{self.me['token']}")
        try:
            os.rename(self.path, aside)  # only one taker can move a given file
        except FileNotFoundError:
            return  # another taker moved it first; race for the new one
        # the file moved may already be a *new* holder's (taken over between our read and our rename)
        try:
            moved = json.loads(aside.read_text())
        except (OSError, ValueError):
            moved = {}
        if moved.get("token") and moved.get("token") != holder.get("token"):
            try:
                os.link(aside, self.path)  # give it back; fails if yet another holder appeared
            except OSError as exc:
                if exc.errno != errno.EEXIST:
                    raise
        else:
            log.warning("taking over the miner lease %s from %s: %s", self.path, self._describe(holder), reason)
        aside.unlink(missing_ok=True)

    def held(self) -> bool:
        holder = self.read_holder()
        return holder is not None and holder.get("token") == self.me["token"]

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if not self.held():  # taken over (we were presumed dead): stop renewing someone else's lease
                    log.error("lost the miner lease %s to another miner", self.path)
                    return
                os.utime(self.path)
            except OSError as exc:  # the disk went away for a moment: the next beat retries
                log.warning("cannot renew the miner lease %s: %s", self.path, exc)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.heartbeat_s + 1)
            self._thread = None
        try:
            if self.held():
                self.path.unlink()
        except OSError:
            pass

    def __enter__(self) -> MinerLease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
