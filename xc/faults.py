"""Fault injection for the reliability tests (docs/reliability.md): a `Faults` object, every switch off by default.

Tests switch faults on with `XC_FAULT_*` environment variables on the process they launch; a process's entry
point (xc-train's hydra main, a miner pool worker's shard task, a Ray search task) turns them into a `Faults`
once, with `Faults.from_env`, and hands it to what injects them (the Trainer, its lifecycle helpers and modes,
the refresher's snapshot writer). Library code given no `Faults` gets `NO_FAULTS`, which injects nothing: a
Trainer built by a test or a benchmark cannot be killed by a variable left in its environment. The module sits
at the bottom of the layer order (pyproject.toml [tool.importlinter]), beside errors, so that the miner, a layer below
xc/run/, can take its faults too; it imports nothing of xc.

Each field is one injection point, named after its variable (XC_FAULT_KILL_AT_STEP -> kill_at_step):

kill_at_step=k SIGKILLs the process right after optimizer step k (a real, unclean death); with kill_rank=r only
rank r dies, and only once per run directory (a marker file), so a job restarted by `torchrun --max-restarts`
gets past it.
nan_at_step=k poisons the first micro-step run at global_step == k, once: nan_kind=loss (the default) makes the
loss NaN, grad puts an inf into the classifier row gradient, weight puts a NaN into a classifier row that no
step scores (only the pre-checkpoint check can see it); nan_rank=r limits it to rank r.
snapshot_enospc makes every refresh snapshot write fail with ENOSPC after half a file (a full disk), on every
rank.
signal_at_step=k sends the signal `signal_name` (TERM, the default, INT, or STOP: the rank stops itself) right
after optimizer step k, once, from rank `signal_rank` (default 0) only: to itself (signal_target=self, the
default), or to its parent (=parent: the torchrun agent, which forwards it to every rank, as a scheduler's
SIGTERM to the job would arrive). signal_at_epoch_end=e sends it instead once e epochs have ended, after the
last one's evaluation and before its checkpoint (where a signal that arrived during that evaluation is first
seen). signal_in_final_phase sends it once training is over, as the final evaluation begins.
miner_hang: a miner worker sleeps an hour in its first shard task (its pid in handoff/control/fault-hang-pid).
miner_delay_s=s: every miner shard task sleeps s seconds before it mines (a miner slower than training).
miner_kill / miner_enospc: a miner worker SIGKILLs itself after half its file / the write fails with ENOSPC
there; each once per run directory (handoff/control/fault-fired).
ray_mark_dir: each Ray search task leaves a file there named after its node (so a test can kill that node
mid-task); ray_task_delay_s keeps each Ray search task running that long.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a miner worker reads its faults before it needs torch
    import torch


@dataclass(frozen=True)
class Faults:
    """The fault injection points of one process (the module docstring); `Faults()` injects nothing. Picklable."""

    kill_at_step: int = -1
    kill_rank: int = -1
    nan_at_step: int = -1
    nan_kind: str = "loss"
    nan_rank: int = -1
    snapshot_enospc: bool = False
    signal_at_step: int = -1
    signal_at_epoch_end: int = -1
    signal_in_final_phase: bool = False
    signal_name: str = "TERM"
    signal_rank: int = 0
    signal_target: str = "self"
    miner_hang: bool = False
    miner_delay_s: float = 0.0
    miner_kill: bool = False
    miner_enospc: bool = False
    ray_mark_dir: str = ""
    ray_task_delay_s: float = 0.0
    # the signal triggers ("step", "epoch_end") that have fired: each fires once per process, and one Faults is
    # built per process, so the state lives here (not compared: a Faults that fired equals its configuration)
    _signalled: set = field(default_factory=set, init=False, compare=False, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Faults:
        """The faults the `XC_FAULT_*` variables of `environ` (os.environ at a process's entry) switch on."""
        get = environ.get
        return cls(
            kill_at_step=int(get("XC_FAULT_KILL_AT_STEP", "-1")),
            kill_rank=int(get("XC_FAULT_KILL_RANK", "-1")),
            nan_at_step=int(get("XC_FAULT_NAN_AT_STEP", "-1")),
            nan_kind=get("XC_FAULT_NAN_KIND", "loss"),
            nan_rank=int(get("XC_FAULT_NAN_RANK", "-1")),
            snapshot_enospc=get("XC_FAULT_SNAPSHOT_ENOSPC", "") == "1",
            signal_at_step=int(get("XC_FAULT_SIGNAL_AT_STEP", "-1")),
            signal_at_epoch_end=int(get("XC_FAULT_SIGNAL_AT_EPOCH_END", "-1")),
            signal_in_final_phase=get("XC_FAULT_SIGNAL_IN_FINAL_PHASE", "") == "1",
            signal_name=get("XC_FAULT_SIGNAL", "TERM"),
            signal_rank=int(get("XC_FAULT_SIGNAL_RANK", "0")),
            signal_target=get("XC_FAULT_SIGNAL_TARGET", "self"),
            # the miner's switches are on when set to anything but the empty string ("0" included)
            miner_hang=bool(get("XC_FAULT_MINER_HANG")),
            miner_delay_s=float(get("XC_FAULT_MINER_DELAY_S", "0")),
            miner_kill=bool(get("XC_FAULT_MINER_KILL")),
            miner_enospc=bool(get("XC_FAULT_MINER_ENOSPC")),
            ray_mark_dir=get("XC_FAULT_RAY_MARK_DIR", ""),
            ray_task_delay_s=float(get("XC_FAULT_RAY_TASK_DELAY_S", "0") or 0),
        )

    def maybe_kill(self, step: int, rank: int, run_dir: str) -> None:
        """After optimizer step `step`: SIGKILL this process at kill_at_step; with a kill rank set, only that rank,
        and only once per run directory."""
        if step != self.kill_at_step:
            return
        if self.kill_rank >= 0:
            marker = Path(run_dir) / "fault-kill-fired"
            if rank != self.kill_rank or marker.exists():
                return
            marker.write_text(f"rank {rank} killed\n")
        os.kill(os.getpid(), signal.SIGKILL)

    def poisons(self, rank: int) -> bool:
        """Whether the NaN fault, once due (nan_at_step, which its caller fires once), applies on `rank`."""
        return self.nan_rank in (-1, rank)

    def poison(self, value: torch.Tensor, rows_leaf: torch.Tensor, shard) -> torch.Tensor:
        """Poison this micro-step's loss, classifier row gradient or weights (per nan_kind)."""
        if self.nan_kind == "grad":
            rows_leaf.grad[0, 0] = float("inf")
        elif self.nan_kind == "weight":
            # A stand-in for an update that overflows, put in the last row: padding where there is any,
            # which no step scores, so only the check before a checkpoint can see it.
            shard.weight[shard.num_rows - 1, 0] = float("nan")
        else:
            value = value * float("nan")
        return value

    def maybe_signal(self, count: int, rank: int, at: str = "step") -> None:
        """Send the fault signal once, when `count` (the global step, or the epochs done for at="epoch_end") is the
        configured one (signal_at_step, signal_at_epoch_end; at="final": any count, with signal_in_final_phase), from
        rank signal_rank."""
        due = {"step": self.signal_at_step, "epoch_end": self.signal_at_epoch_end,
               "final": count if self.signal_in_final_phase else -1}[at]
        if count != due or rank != self.signal_rank or at in self._signalled:
            return
        self._signalled.add(at)
        self._send()

    def _send(self) -> None:
        signum = getattr(signal, f"SIG{self.signal_name}")
        if signum == signal.SIGSTOP:  # a stopped rank: the job waits on it
            os.kill(os.getpid(), signum)
            return
        if self.signal_target == "parent":
            os.kill(os.getppid(), signum)
            time.sleep(1.0)  # let the agent forward it, so every rank has it before the step's poll
        else:
            signal.raise_signal(signum)


NO_FAULTS = Faults()
