"""Atomic, per-rank checkpoints under <run_dir>/checkpoints/.

Layout of one checkpoint: `step-00001234/` holding `rank{r}.pt` per rank (torch tensors and plain
Python values only, loaded with weights_only=True), `rank{r}.hard.npz` (the hard negatives in use) and
`meta.json`, written last. A checkpoint is written into `step-….tmp/` and renamed only after every rank
has finished, so a crash never leaves something that looks complete. Readers trust only directories
whose meta.json lists every file with its size.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xc.errors import CheckpointError

log = logging.getLogger(__name__)
_PREFIX = "step-"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_rank_files(run_dir: str | Path, global_step: int, rank: int, state: dict[str, Any],
                     hard_tables: dict[int, np.ndarray] | None) -> Path:
    """Every rank: write its own files into the step's temporary directory."""
    tmp_dir = checkpoint_root(run_dir) / f"{_PREFIX}{global_step:08d}.tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    _fsync_write(tmp_dir / f"rank{rank}.pt", lambda h: torch.save(state, h))
    if hard_tables:
        arrays = {f"shard{s}": np.asarray(t) for s, t in hard_tables.items()}
        _fsync_write(tmp_dir / f"rank{rank}.hard.npz", lambda h: np.savez(h, **arrays))
    return tmp_dir


def publish(run_dir: str | Path, global_step: int, world_size: int, meta: dict[str, Any], keep: int) -> Path:
    """Rank 0, after a barrier: record every file's size in meta.json, rename into place, prune."""
    root = checkpoint_root(run_dir)
    tmp_dir = root / f"{_PREFIX}{global_step:08d}.tmp"
    final = root / f"{_PREFIX}{global_step:08d}"
    files = {p.name: p.stat().st_size for p in sorted(tmp_dir.iterdir()) if not p.name.endswith(".part")}
    for rank in range(world_size):
        if f"rank{rank}.pt" not in files:
            raise CheckpointError(f"{tmp_dir}: rank {rank} wrote no state; not publishing")
    body = dict(meta, global_step=global_step, world_size=world_size, files=files)
    _fsync_write(tmp_dir / "meta.json", lambda h: h.write(json.dumps(body, indent=1).encode()))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp_dir, final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Published checkpoint directories, oldest first (half-written .tmp ones are ignored)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(_PREFIX) and not p.name.endswith(".tmp")]
    return sorted(found, key=lambda p: p.name)


def validate(path: Path) -> dict[str, Any]:
    """meta.json of a checkpoint after checking every listed file exists with its recorded size."""
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{meta_path}: unreadable checkpoint metadata ({exc})") from exc
    for name, size in meta.get("files", {}).items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            raise CheckpointError(f"{file}: missing or truncated (expected {size} bytes)")
    return meta


def latest_valid(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that validates; older ones are tried when newer ones are damaged."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, validate(path)
        except CheckpointError as exc:
            log.warning("skipping damaged checkpoint: %s", exc)
    return None


def load_rank(path: Path, rank: int) -> tuple[dict[str, Any], dict[int, np.ndarray] | None]:
    """This rank's state (weights_only: no pickle from the run directory) and hard-negative tables."""
    try:
        state = torch.load(path / f"rank{rank}.pt", map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for damaged archives
        raise CheckpointError(f"{path / f'rank{rank}.pt'}: cannot load ({exc})") from exc
    hard_path = path / f"rank{rank}.hard.npz"
    tables = None
    if hard_path.exists():
        with np.load(hard_path, allow_pickle=False) as npz:
            tables = {int(name[len("shard"):]): npz[name] for name in npz.files}
    return state, tables


def load_classifier_rows(path: Path, meta: dict[str, Any], lo: int, hi: int) -> torch.Tensor:
    """Classifier rows [lo, hi) stitched from whichever rank files of the checkpoint hold them.

    Lets a checkpoint written by G ranks be read by a different number of processes (evaluation,
    prediction) as long as the label layout (num_label_shards, hence padded row ranges) is the same.
    """
    rows: torch.Tensor | None = None
    covered = 0
    for rank in range(meta["world_size"]):
        state = torch.load(path / f"rank{rank}.pt", map_location="cpu", weights_only=True)["classifier"]
        a, b = max(lo, state["lo"]), min(hi, state["hi"])
        if a >= b:
            continue
        weight = state["weight"]
        if rows is None:
            rows = torch.zeros(hi - lo, weight.shape[1], dtype=weight.dtype)
        rows[a - lo:b - lo] = weight[a - state["lo"]:b - state["lo"]]
        covered += b - a
    if rows is None or covered != hi - lo:
        raise CheckpointError(f"{path}: its rank files do not cover label rows [{lo}, {hi})")
    return rows
