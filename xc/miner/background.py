"""The trainer's in-process miner: a MinerService (or, with `miner=ray`, a RayMinerService) serving in a daemon
thread of rank 0, supervised, restarted a bounded number of times. Kept apart from `service` so the import order is
one-way: service <- ray_pool <- background.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from xc.config import MinerConfig
from xc.errors import XCError
from xc.handoff import HandoffStorageError
from xc.miner.lease import MinerLease
from xc.miner.service import MinerService

log = logging.getLogger("xc.miner")


class MinerDiedError(XCError):
    """The in-process miner thread kept dying: training on would silently use ever staler negatives."""


class BackgroundMiner:
    """The trainer's in-process pool: a MinerService serving in a daemon thread of rank 0, supervised.

    A thread that dies (an exception escaping `serve`) is restarted by `check`, which the trainer calls
    while it waits for a generation, up to `miner.max_restarts` times; then `check` raises
    MinerDiedError and the run stops, naming the last error. Never silent staleness."""

    def __init__(self, run_dir: str | Path, cfg: MinerConfig):
        # taken here, not in the thread: an xc-miner already serving this run stops the trainer at once,
        # with the holder named, rather than after max_restarts thread deaths
        self.lease = MinerLease(run_dir, "trainer").acquire()
        try:
            if cfg.mode == "ray":
                from xc.miner.ray_pool import RayMinerService  # lazy: the optional Ray backend, only in that mode

                self.service = RayMinerService(run_dir, cfg, self.lease)
            else:
                self.service = MinerService(run_dir, cfg, self.lease)
        except BaseException:
            self.lease.release()
            raise
        self.max_restarts, self.restarts = cfg.max_restarts, 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._serve, daemon=True, name="xc-miner")
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.service.serve(self._stop, False)
        except BaseException as exc:  # recorded for check(); a daemon thread's traceback would be lost
            self.error = exc
            log.error("miner thread died: %s: %s", type(exc).__name__, exc)

    def check(self) -> None:
        """Restart a dead miner thread (bounded), or raise MinerDiedError."""
        if self._stop.is_set() or self._thread.is_alive():
            return
        why = f"{type(self.error).__name__}: {self.error}" if self.error is not None else "it exited"
        if self.restarts >= self.max_restarts and isinstance(self.error, HandoffStorageError):
            # storage that keeps failing (full, read-only, no permission, over quota): its own line, which names the
            # file and the fix (each failed generation was marked, and the previous negatives kept, until now)
            raise HandoffStorageError(f"{self.error} (the miner thread died {self.restarts + 1} times, the last on "
                                      "this; the run stops, and the newest checkpoint resumes it)")
        if self.restarts >= self.max_restarts:
            raise MinerDiedError(f"the hard-negative miner thread died {self.restarts + 1} times (last: {why}); "
                                 f"stopping instead of training on stale negatives (miner.max_restarts="
                                 f"{self.max_restarts}). The newest checkpoint resumes the run")
        self.restarts += 1
        log.warning("miner thread died (%s); restarting it (%d of %d)", why, self.restarts, self.max_restarts)
        self.service._reset_pool()
        self.error = None
        self._start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop serving: a generation being mined is abandoned at once (the trainer needs nothing more)."""
        self._stop.set()
        halt = getattr(self.service, "halt", None)  # the Ray service cancels its own tasks
        if halt is not None:
            halt()
        self._thread.join(timeout)
        self.lease.release()
