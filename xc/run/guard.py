"""Deciding what a run directory may be used for, before anything is written into it.

`xc-train` resumes the run in its run directory by default. `guard_run_dir` (rank 0, after the data
is loaded and before config.json, log.jsonl or wandb are touched) decides between

* resume: the stored run identity (xc/run/identity.py) matches this run's, or nothing is stored;
* refuse: a checkpoint exists but was trained on other data or another model. One line names every
  difference with both values and says how to go on (another `run_dir=`, or `train.resume=never`);
* archive, then start afresh: `train.resume=never`, or a different identity with no checkpoint to
  lose. The previous run's files (checkpoints, metrics, logs, config, identity, hand-off directory)
  move to `RUN_DIR/archive/<UTC timestamp>/`, so a fresh run never mixes its checkpoints with an old
  run's (whose higher step numbers used to win the pruning and delete the new run's checkpoint).

Every rank gets rank 0's decision, or its error (`xc.distributed.on_rank0`), so all ranks stop with
the same line.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from xc.run import checkpoint as ckpt
from xc.run import identity as rid
from xc.config import XCConfig
from xc.errors import CheckpointError, ConfigError

log = logging.getLogger("xc.run")

ARCHIVE_DIR = "archive"
ENSEMBLE_MEMBERS = "members"  # an ensemble's runs, one a member (xc/ensemble/members.py)
# the config as the user gave it (null: a data rule decides), beside config.json, the config the run used
REQUESTED_CONFIG = "config.requested.json"
# What belongs to one run; everything else in the run directory (the lock, the archive, files of the
# user's) stays where it is.
RUN_FILES = ("checkpoints", "handoff", "label_cache", "metrics.json", "eval.json", "log.jsonl", "config.json",
             REQUESTED_CONFIG, rid.IDENTITY_FILE, "wandb", "heartbeat", "fault-kill-fired", "fusion.json", "predictions.npz",
             "members", "ensemble.json", "prior.json", "ranker")  # members, ensemble.json: an ensemble's (xc/ensemble/members.py)


def _is_lock_file(path: Path) -> bool:
    """A lock xc's RunLock wrote (a crash between taking the lock and writing the run marker leaves one)."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(holder, dict) and {"pid", "host", "started"} <= set(holder)


def holds_xc_run(path: Path, depth: int = 0) -> bool:
    """Whether the folder holds a run that xc wrote. Only what xc alone writes counts, checked by content where a
    user's file could share the name: config.json, metrics.json, log.jsonl and even folders named archive/,
    handoff/ or checkpoints/ are names a user's own files have too, so they prove nothing (a folder of them used to
    be taken for a run, resumed and overwritten). Counted:

    * the run marker, written right after the lock, before anything else (xc/run/identity.py RUN_MARKER);
    * an identity.json of xc's layout (runs from before the marker);
    * a lock (or a stale one set aside) of RunLock's layout: a start that died before it wrote the marker;
    * a published checkpoint's meta.json (`checkpoints/step-*/`): runs from before identity.json;
    * an ensemble member (`members/*/`) or an archived run (`archive/*/`) that is itself an xc run's."""
    if (path / rid.RUN_MARKER).is_file() or rid.holds_identity(path):
        return True
    if any(_is_lock_file(lock) for lock in path.glob(".lock*") if lock.name == ".lock" or
           lock.name.startswith(".lock.stale-")):
        return True
    if any((step / "meta.json").is_file() for step in ckpt.list_checkpoints(path)):
        return True
    if depth == 0:
        for inner in (ENSEMBLE_MEMBERS, ARCHIVE_DIR):
            if (path / inner).is_dir() and any(sub.is_dir() and holds_xc_run(sub, depth + 1)
                                               for sub in (path / inner).iterdir()):
                return True
    return False


def check_run_dir_is_ours(run_dir: str | Path) -> None:
    """Refuse, before anything is written, a run directory that is the filesystem's root, the home directory or xc's
    own checkout, or a folder that holds files but no xc run (`holds_xc_run`; the files found are named in the
    error): a run there would overwrite or archive files that are not its own."""
    path = Path(run_dir).expanduser().resolve()
    checkout = Path(__file__).resolve().parents[2]
    forbidden = {Path(path.anchor): "the filesystem's root", Path.home().resolve(): "the home directory"}
    if (checkout / "pyproject.toml").is_file():
        forbidden[checkout] = "xc's own checkout"
    if path in forbidden:
        raise ConfigError("run_dir", f"{path} is {forbidden[path]}: give a folder of its own (e.g. runs/NAME)")
    if not path.is_dir():
        return
    names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in path.iterdir())
    if not names or holds_xc_run(path):
        return
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    raise ConfigError("run_dir", f"{path} is not empty and holds no xc run (found {shown}); nothing was written: "
                      "give a new or empty folder")


def _has_previous_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_FILES if name != "fault-kill-fired")


def archive_previous_run(run_dir: str | Path, why: str) -> Path | None:
    """Move the previous run's files to RUN_DIR/archive/<timestamp>/; returns that directory (None if
    there was nothing to move)."""
    run_dir = Path(run_dir)
    if not _has_previous_run(run_dir):
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run_dir / ARCHIVE_DIR / stamp
    suffix = 1
    while target.exists():
        target, suffix = run_dir / ARCHIVE_DIR / f"{stamp}-{suffix}", suffix + 1
    target.mkdir(parents=True)
    for name in RUN_FILES:
        if (run_dir / name).exists():
            shutil.move(str(run_dir / name), str(target / name))
    rid.write_run_marker(run_dir, fresh=True)  # a new run: its checkpoints carry another run id than the archived
    log.warning("%s: moved the previous run's files to %s", why, target)
    return target


def guard_run_dir(cfg: XCConfig, dataset) -> dict:
    """Rank 0: check this run against the one stored in cfg.run_dir, archive or refuse (see the module
    docstring); returns this run's identity. Writes nothing unless it archives."""
    run_dir = Path(cfg.run_dir)
    identity = rid.run_identity(cfg, dataset)
    if cfg.train.resume == "never":
        archive_previous_run(run_dir, "train.resume=never")
        return identity
    stored = rid.stored_identity(run_dir)
    diffs = rid.differences(stored, identity) if stored is not None else []
    if not diffs:
        return identity
    if ckpt.list_checkpoints(run_dir):
        shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
        raise CheckpointError(
            f"run directory {run_dir} holds checkpoints of another run: {shown}. Pass another run_dir= for this "
            "run, or train.resume=never to move the old run to archive/ and start afresh")
    archive_previous_run(run_dir, f"{run_dir} held files of another run without a checkpoint ({diffs[0]})")
    return identity
