"""`xc.load`: whatever a run directory or an export folder holds, restored for inference.

A folder `xc-export` wrote (DIR/export.json: safetensors and JSON, nothing unpickled) loads through
`xc.serve.export`; an ensemble run (RUN_DIR/ensemble.json) as an `EnsembleModel` (xc/serve/ensemble.py); any
other run directory as a `TrainedModel` (xc/serve/model.py) of its kept checkpoint or the one named.
"""

from __future__ import annotations

from pathlib import Path

from xc.errors import XCError
from xc.serve.ensemble import ENSEMBLE_FILE, MEMBERS_DIR, EnsembleModel
from xc.serve.export import MANIFEST, load_export
from xc.serve.model import TrainedModel


def load(run_dir, checkpoint=None, device: str = "cpu", batch_size: int | None = None):
    """The model of `run_dir` (see the module docstring); `checkpoint` a checkpoint directory of a single model."""
    if (Path(run_dir) / MANIFEST).exists():
        return load_export(run_dir, checkpoint, device=device, batch_size=batch_size)
    refuse_unfinished_ensemble(run_dir)
    if (Path(run_dir) / ENSEMBLE_FILE).exists():
        if checkpoint is not None:
            raise XCError(f"{run_dir} is an ensemble: each member has its own checkpoints; load one member with "
                          f"xc.load('{Path(run_dir) / MEMBERS_DIR / 'm0'}', checkpoint=...)")
        return EnsembleModel(run_dir, device=device, batch_size=batch_size)
    return TrainedModel(run_dir, checkpoint, device=device, batch_size=batch_size)


def refuse_unfinished_ensemble(run_dir) -> None:
    """An ensemble run directory whose members have not all finished has nothing to serve as a whole yet:
    say so (and what to do) instead of "no valid checkpoint"."""
    run_dir = Path(run_dir)
    if (run_dir / MEMBERS_DIR).is_dir() and not (run_dir / ENSEMBLE_FILE).exists():
        raise XCError(f"{run_dir} holds an ensemble whose members have not all finished (no ensemble.json yet): "
                      f"xc-train resumes it; a finished member loads alone, e.g. {run_dir / MEMBERS_DIR / 'm0'}")
