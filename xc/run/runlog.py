"""Run logging: stdout (rank 0), a JSONL event log in the run directory, and wandb (offline by default).

wandb is optional at run time: if it cannot start (no key for online mode, no package, a broken
install) the run says so once and continues with stdout and JSONL.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from xc.config import LoggerConfig

log = logging.getLogger("xc")


def setup_stdout_logging(rank: int) -> None:
    """INFO on rank 0, WARNING elsewhere, with the rank in every line."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return value


def memory_gib() -> dict[str, float]:
    """This process's resident memory now and at its peak so far, in GiB: every logged event carries them, so a run's
    log says which phase set its peak. {} off Linux. Children are left out: Linux records a child's peak from the
    pages it inherits (a subprocess started while the trainer holds 12 GiB reports 12 GiB), which says nothing of
    what the child itself used."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return {}
    gib = float(1 << 30)
    # ru_maxrss is in KiB on Linux
    return {"rss_gib": round(resident_pages * os.sysconf("SC_PAGE_SIZE") / gib, 3),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib, 3)}


class RunLogger:
    """Event sink; only rank 0 writes anything."""

    def __init__(self, cfg: LoggerConfig, run_dir: str, run_name: str, rank: int, config: dict[str, Any]):
        self.enabled = rank == 0
        self.jsonl = None
        self.wandb = None
        if not self.enabled:
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        if cfg.jsonl:
            self.jsonl = open(Path(run_dir) / "log.jsonl", "a", buffering=1)
        if cfg.wandb != "disabled":
            self.wandb = self._start_wandb(cfg, run_dir, run_name, config)

    @staticmethod
    def _start_wandb(cfg: LoggerConfig, run_dir: str, run_name: str, config: dict[str, Any]):
        try:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            return wandb.init(project=cfg.project, entity=cfg.entity, name=run_name, dir=run_dir,
                              mode=cfg.wandb, config=config, reinit="finish_previous")
        except Exception as exc:  # any failure to start wandb must not stop training
            log.warning("wandb disabled (%s: %s); logging to stdout and log.jsonl only", type(exc).__name__, exc)
            return None

    def event(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        record = {"event": kind, "time": round(time.time(), 3), **{k: _jsonable(v) for k, v in fields.items()},
                  **memory_gib()}
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            numeric = {f"{kind}/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and k != "time"}
            step = fields.get("global_step")
            try:
                self.wandb.log(numeric, step=step if isinstance(step, int) else None)
            except Exception as exc:
                log.warning("wandb.log failed (%s); disabling wandb", exc)
                self.wandb = None

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
            self.jsonl = None
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception:
                pass
            self.wandb = None
