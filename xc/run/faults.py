"""Fault injection for the reliability tests (docs/reliability.md); every switch is off by default.

XC_FAULT_KILL_AT_STEP=k SIGKILLs the process right after optimizer step k (a real, unclean death);
with XC_FAULT_KILL_RANK=r only rank r dies, and only once per run directory (a marker file), so a job
restarted by `torchrun --max-restarts` gets past it.
XC_FAULT_NAN_AT_STEP=k poisons the first micro-step run at global_step == k, once:
XC_FAULT_NAN_KIND=loss (default) makes the loss NaN, grad puts an inf into the classifier row
gradient, weight puts a NaN into a classifier row that no step scores (only the pre-checkpoint check
can see it); XC_FAULT_NAN_RANK=r limits it to rank r.
XC_FAULT_SNAPSHOT_ENOSPC=1 makes every refresh snapshot write fail with ENOSPC after half a file (a
full disk), on every rank.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

KILL_AT_STEP = int(os.environ.get("XC_FAULT_KILL_AT_STEP", "-1"))
KILL_RANK = int(os.environ.get("XC_FAULT_KILL_RANK", "-1"))
NAN_AT_STEP = int(os.environ.get("XC_FAULT_NAN_AT_STEP", "-1"))
NAN_KIND = os.environ.get("XC_FAULT_NAN_KIND", "loss")
NAN_RANK = int(os.environ.get("XC_FAULT_NAN_RANK", "-1"))
SNAPSHOT_ENOSPC = os.environ.get("XC_FAULT_SNAPSHOT_ENOSPC", "") == "1"


def kill(rank: int, run_dir: str) -> None:
    """SIGKILL this process; with a kill rank set, only that rank, and only once per run directory."""
    if KILL_RANK >= 0:
        marker = Path(run_dir) / "fault-kill-fired"
        if rank != KILL_RANK or marker.exists():
            return
        marker.write_text(f"rank {rank} killed\n")
    os.kill(os.getpid(), signal.SIGKILL)


def poison(value: torch.Tensor, rows_leaf: torch.Tensor, shard) -> torch.Tensor:
    """Poison this micro-step's loss, classifier row gradient or weights (per XC_FAULT_NAN_KIND)."""
    if NAN_KIND == "grad":
        rows_leaf.grad[0, 0] = float("inf")
    elif NAN_KIND == "weight":
        # A stand-in for an update that overflows, put in the last row: padding where there is any,
        # which no step scores, so only the check before a checkpoint can see it.
        shard.weight[shard.num_rows - 1, 0] = float("nan")
    else:
        value = value * float("nan")
    return value


# XC_FAULT_SIGNAL_AT_STEP=k sends XC_FAULT_SIGNAL (TERM, default, INT, or STOP: the rank stops itself) right after optimizer step k,
# once, from rank XC_FAULT_SIGNAL_RANK (default 0) only: to itself (XC_FAULT_SIGNAL_TARGET=self, the
# default), or to its parent (=parent: the torchrun agent, which forwards it to every rank, as a
# scheduler's SIGTERM to the job would arrive).
SIGNAL_NAME = os.environ.get("XC_FAULT_SIGNAL", "TERM")
SIGNAL_RANK = int(os.environ.get("XC_FAULT_SIGNAL_RANK", "0"))
SIGNAL_TARGET = os.environ.get("XC_FAULT_SIGNAL_TARGET", "self")
# XC_FAULT_SIGNAL_AT_EPOCH_END=e sends it instead once e epochs have ended, after the last one's evaluation and
# before its checkpoint (where a signal that arrived during that evaluation is first seen).
# Each trigger fires once: "step" after optimizer step k, "epoch_end" after e epochs.
_SIGNAL_AT = {"step": int(os.environ.get("XC_FAULT_SIGNAL_AT_STEP", "-1")),
              "epoch_end": int(os.environ.get("XC_FAULT_SIGNAL_AT_EPOCH_END", "-1"))}


def maybe_signal(count: int, rank: int, at: str = "step") -> None:
    """Send the fault signal once, when `count` (the global step, or the epochs done for at="epoch_end") is the
    configured one, from rank XC_FAULT_SIGNAL_RANK."""
    if count != _SIGNAL_AT[at] or rank != SIGNAL_RANK:
        return
    _SIGNAL_AT[at] = -1
    _send()


def _send() -> None:
    signum = getattr(signal, f"SIG{SIGNAL_NAME}")
    if signum == signal.SIGSTOP:  # a stopped rank (XC_FAULT_SIGNAL=STOP): the job waits on it
        os.kill(os.getpid(), signum)
        return
    if SIGNAL_TARGET == "parent":
        os.kill(os.getppid(), signum)
        import time

        time.sleep(1.0)  # let the agent forward it, so every rank has it before the step's poll
    else:
        signal.raise_signal(signum)
