"""Rank heartbeats: naming the rank that holds a job up, long before the collective timeout fires.

A rank that is stopped (SIGSTOP, a frozen node, a machine swapping to death) makes every other rank
wait inside its next collective, silently, until `parallel.timeout_s` (gloo's and nccl's default is
30 minutes). Each rank runs a daemon thread that writes `RUN_DIR/heartbeat/rank{r}.json` (pid, host,
time, last optimizer step) every `parallel.heartbeat_s / 4` seconds. A thread keeps beating while its
main thread waits in a collective, but not while the whole process is stopped, so on rank 0 the same
thread reads every rank's file and logs, once per episode, each rank not heard from for
`parallel.heartbeat_s`, with its pid, host and last step, and when the job will give up.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from xc.fsutil import pid_alive

log = logging.getLogger("xc.run.heartbeat")


class Heartbeat:
    def __init__(self, run_dir: str | Path, rank: int, world_size: int, every_s: float, timeout_s: float):
        self.dir = Path(run_dir) / "heartbeat"
        self.rank, self.world_size = rank, world_size
        self.every_s, self.timeout_s = every_s, timeout_s
        self.step = 0  # set by the trainer after each optimizer step (a plain attribute: no lock needed)
        self._stop = threading.Event()
        self._silent: set[int] = set()
        self._thread: threading.Thread | None = None

    def start(self) -> "Heartbeat":
        if self.every_s <= 0 or self.world_size < 2:
            return self  # one process cannot wait for a peer
        self.dir.mkdir(parents=True, exist_ok=True)
        self._beat()
        self._thread = threading.Thread(target=self._run, daemon=True, name="xc-heartbeat")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _beat(self) -> None:
        path = self.dir / f"rank{self.rank}.json"
        tmp = path.with_name(path.name + ".part")
        tmp.write_text(json.dumps({"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                                   "time": time.time(), "step": self.step}))
        os.replace(tmp, path)

    def _run(self) -> None:
        interval = max(0.2, self.every_s / 4)
        started = time.time()
        while not self._stop.wait(interval):
            try:
                self._beat()
                if self.rank == 0 and time.time() - started >= self.every_s:
                    self._watch()
            except OSError as exc:  # a full or vanished disk must not kill training from this thread
                log.debug("heartbeat: %s", exc)

    def _watch(self) -> None:
        now = time.time()
        for rank in range(1, self.world_size):
            try:
                beat = json.loads((self.dir / f"rank{rank}.json").read_text())
            except (OSError, ValueError):
                beat = {"time": 0.0}
            age = now - float(beat.get("time", 0.0))
            if age < self.every_s:
                if rank in self._silent:
                    log.warning("rank %d is beating again", rank)
                    self._silent.discard(rank)
                continue
            if rank in self._silent:
                continue
            self._silent.add(rank)
            log.warning("rank %d (pid %s on host %s) has not been heard from for %.0fs (its last optimizer step: %s; "
                        "rank 0: %d): it may be stopped or hung. The job fails once a collective has waited "
                        "parallel.timeout_s=%.0fs", rank, beat.get("pid", "?"), beat.get("host", "?"), age,
                        beat.get("step", "?"), self.step, self.timeout_s)

    def gone_peers(self, wait_s: float = 0.0) -> list[tuple[int, int]]:
        """(rank, pid) of each peer on this host whose process has exited (or is a zombie torchrun has not yet
        reaped), read from its heartbeat file: names the rank a broken connection came from. With `wait_s`, asks
        again every 0.1 s until one is gone or the time is up."""
        deadline = time.monotonic() + wait_s
        while not (gone := self._gone_now()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return gone

    def _gone_now(self) -> list[tuple[int, int]]:
        host = socket.gethostname()
        gone = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                beat = json.loads((self.dir / f"rank{rank}.json").read_text())
            except (OSError, ValueError):
                continue
            if beat.get("host") == host and not pid_alive(int(beat.get("pid", 0))):
                gone.append((rank, int(beat["pid"])))
        return gone
