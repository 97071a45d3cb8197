"""Graceful stops and timed checkpoints: what SIGTERM, SIGINT and `train.checkpoint_every_minutes` do.

Slurm and Kubernetes send SIGTERM some seconds before they kill a job; Ctrl-C sends SIGINT. Python's
defaults exit at once (143, no message) or raise KeyboardInterrupt wherever the main thread happens to
be, possibly between two collectives of one step. Here a signal only sets a flag; the trainer
finishes the optimizer step it is in, all ranks agree on the stop (`StopControl.poll` all-reduces the
flags once per optimizer step, so a signal that reached only some ranks, or reached them at different
steps, stops every rank after the same step), every rank writes its part of one checkpoint at that
step, and the process exits with one line and code 143 (SIGTERM) or 130 (SIGINT). A second signal of
either kind (more than SAME_REQUEST_S after the first) exits at once, the old way, for a user who will not wait.

Once training is over and its last checkpoint written (the final phase: the kept epoch's evaluation, the label prior,
the kNN fusion, the lexical ranker, the calibration; 35 minutes at 10^7 labels on 2 cores), there is no step left to
finish: `leave_at_once` makes the first signal stop the run where it is, with one line and the same exit codes. Every
file the final phase writes is published whole (written aside, then renamed) and the run is complete, so the same
command evaluates it again. Before it, the flag was never read there and a SIGTERM or Ctrl-C waited out the phase.

The same all-reduce carries the "checkpoint due" flag of `train.checkpoint_every_minutes`, so that a
timed checkpoint is written at the same step on every rank although each rank reads its own clock.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

import torch

from xc.distributed import DistContext, all_reduce

log = logging.getLogger("xc.run.signals")

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}
# A second signal this soon after the first is the same request delivered twice (a scheduler's SIGTERM reaches each
# rank directly and again through torchrun), not a user asking to leave at once: it is ignored
SAME_REQUEST_S = 2.0
_received = 0  # this process's first signal, for waits that must not outlast a scheduler's grace period


def stop_signal_received() -> bool:
    """Whether this process got SIGTERM/SIGINT (a wait for the miner then gives up at once; the stop
    itself happens after the next optimizer step, on every rank alike)."""
    return _received != 0


class StopRequested(Exception):
    """Raised by the trainer after it checkpointed because of a signal; the entry point exits with
    `exit_code` and prints `str(self)` as its one line."""

    def __init__(self, signum: int, message: str):
        self.signum, self.exit_code = signum, EXIT_CODES.get(signum, 143)
        super().__init__(message)


@dataclass
class Poll:
    stop_signal: int = 0  # the signal number every rank stops for; 0 = go on
    checkpoint_due: bool = False  # train.checkpoint_every_minutes elapsed (on some rank)


class StopControl:
    """Signal flags of this process plus the timed-checkpoint clock; `poll` makes all ranks agree."""

    def __init__(self, checkpoint_every_minutes: float = 0.0):
        self.received = 0
        self._received_at = 0.0
        self.every_s = 60.0 * checkpoint_every_minutes
        self.last_checkpoint = time.monotonic()
        self._previous: dict[int, object] = {}
        self.at_once: str | None = None  # `leave_at_once`'s message: a signal stops the run where it is

    def install(self) -> "StopControl":
        """Handle SIGTERM and SIGINT in this (main) thread until `uninstall`."""
        for signum in EXIT_CODES:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        global _received
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        _received = 0

    def leave_at_once(self, message: str) -> None:
        """From now on a signal raises StopRequested(signum, "stopped by SIGNAME <message>") in the main thread, where
        it is; one that came before (after the last poll) raises it here."""
        self.at_once = message
        if self.received:
            self._stop_here(self.received)

    def _stop_here(self, signum: int) -> None:
        raise StopRequested(signum, f"stopped by {signal.Signals(signum).name} {self.at_once}")

    def finish_steps_first(self) -> None:
        """Back to the training's way (a signal stops after the step it is in): an ensemble's next member trains."""
        self.at_once = None

    def _handle(self, signum, frame) -> None:
        global _received
        if self.received and time.monotonic() - self._received_at < SAME_REQUEST_S:
            return  # one request delivered twice: a job's SIGTERM reaches a rank directly and again from torchrun
        if self.at_once is not None:
            self.received = _received = signum
            self._received_at = time.monotonic()
            self._stop_here(signum)
        if self.received:  # a second request: leave now
            self.uninstall()
            signal.signal(signum, signal.SIG_DFL)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)
            return
        self.received = _received = signum
        self._received_at = time.monotonic()
        # Not logging or print: the main thread may be inside a write to the same buffered stream, and a
        # handler writing there raises "reentrant call". os.write is unbuffered.
        try:
            os.write(1, f"received {signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
                        "(send it again in 2 s or more to exit at once)\n".encode())
        except OSError:
            pass

    def checkpointed(self) -> None:
        """A checkpoint was written (for whatever reason): the timed clock restarts."""
        self.last_checkpoint = time.monotonic()

    def poll(self, ctx: DistContext) -> Poll:
        """After each optimizer step, on every rank: the agreed decision (one tiny all-reduce)."""
        due = self.every_s > 0 and time.monotonic() - self.last_checkpoint >= self.every_s
        if not ctx.active:
            return Poll(self.received, due)
        flags = all_reduce(torch.tensor([float(self.received), 1.0 if due else 0.0], device=ctx.device), ctx, "max")
        # SIGTERM (15) > SIGINT (2): when ranks got different signals, the scheduler's one wins.
        return Poll(int(flags[0].item()), bool(flags[1].item()))


def stop_message(signum: int, global_step: int, path) -> str:
    name = signal.Signals(signum).name
    return (f"stopped by {name} after global step {global_step}; checkpoint {path} written on every rank. "
            "Run the same command again to resume from it")
