"""A reader's hold on a checkpoint of a run that may still be training (xc-eval, xc-predict, xc.load).

A trainer prunes its older checkpoints as it publishes new ones (`train.keep_checkpoints`, xc/run/checkpoint.py
`publish`), and a checkpoint is a directory of several files (meta.json, rank{r}.pt, rank{r}.hard.npz): a reader that
chose one could find it gone before it had read every file (measured: 6 of 11 `xc-eval` runs beside a trainer
checkpointing every 5 steps failed with "cannot load (FileNotFoundError …)"). So a reader first *holds* the files it
chose, and loads only from what it holds; no cooperation of the trainer (an old one included) is needed:

* hard links of every file, in a private folder `checkpoints/.readers/<pid>@<host>-<random>/step-N/` on the same
  filesystem: pruning then removes the names, never the data, and the links go when the read ends;
* where links cannot be made (a run directory the reader may not write, a filesystem without hard links), open
  descriptors of every file, reached through symlinks to /proc/<pid>/fd in a private folder of the system's temporary
  directory (Linux); elsewhere the files are read in place, as before.

The held files are validated against their meta.json (sizes, checksums), as `validate` does for the trainer. A
checkpoint removed before all its files were held is chosen again (the newest valid one), up to a few times, said in
one log line; a reader killed outright leaves its folder, which the next reader sweeps once its pid is dead (a folder
of another host after two days). Checkpoint discovery looks only at `step-*` names, so the folder is never mistaken
for a checkpoint, and the trainer's start-up sweep (`sweep_partial`, `step-*.tmp` only) leaves it alone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from xc.errors import CheckpointError
from xc.fsutil import pid_alive
from xc.handoff import host_name
from xc.run import checkpoint as ckpt
from xc.run.checkpoint import CheckpointRemoved

log = logging.getLogger("xc.run.checkpoint")

READERS_DIR = ".readers"
_FOLDER = re.compile(r"^(\d+)@([A-Za-z0-9._]+)-")
OTHER_HOST_STALE_S = 2 * 86400  # a folder of another host's reader (its pid cannot be checked here) is swept after


@dataclass
class Held:
    """A checkpoint held for reading: `path` is the checkpoint chosen (its name and place: what to report and compare
    with the run), `meta` its validated meta.json, `files` a directory holding the very same files, which no pruning
    can take away (what to load from; `path` itself where nothing could be held)."""

    path: Path
    meta: dict[str, Any]
    files: Path


_ACTIVE: dict[tuple[int, str], Held] = {}  # held by (thread, checkpoint): a nested read in that thread reuses the hold


def sweep_stale_readers(root: Path) -> list[str]:
    """Remove the folders of readers that died (their pid dead on this host; another host's after two days) under a
    checkpoints/.readers folder `root`; returns their names."""
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    here = host_name()
    for entry in entries:
        match = _FOLDER.match(entry.name)
        if not match:
            continue
        pid, host = int(match.group(1)), match.group(2)
        try:
            old = time.time() - entry.stat().st_mtime > OTHER_HOST_STALE_S
        except OSError:
            continue
        if (pid != os.getpid() and not pid_alive(pid)) if host == here else old:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def _listed(files: Path) -> list[str]:
    """The rank files the meta.json in `files` lists (plain checkpoint file names only: `validate` rejects others)."""
    try:
        listed = json.loads((files / "meta.json").read_text())["files"]
        return [name for name in listed if ckpt.RANK_FILE.match(name)]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # validate says what is wrong with it


class _Holder:
    """The holds one read takes while it chooses: {checkpoint: (private folder, files dir, open descriptors)}."""

    def __init__(self):
        self.holds: dict[Path, tuple[Path | None, Path, list[int]]] = {}
        self.removed: list[str] = []

    def check(self, path: Path) -> dict[str, Any]:
        """`validate` for a reader: hold every file of `path`, then validate what is held (CheckpointRemoved when
        the checkpoint vanished first). Messages name the checkpoint's own files, not the private copies."""
        self.release(path)
        try:
            self.holds[path] = self._link(path)
        except FileNotFoundError:  # the checkpoint (or checkpoints/ itself) went while it was being linked
            pass
        except OSError:  # no hard links here (permissions, read-only mount, filesystem): descriptors instead
            self.holds[path] = self._open(path)
        try:
            if path not in self.holds:
                raise CheckpointError(f"{path}: vanished")
            return ckpt.validate(self.holds[path][1])
        except CheckpointError as exc:
            files = self.holds[path][1] if path in self.holds else path
            self.release(path)
            if _gone(path):
                self.removed.append(path.name)
                raise CheckpointRemoved(f"{path}: removed before it could be read") from None
            raise CheckpointError(str(exc).replace(str(files), str(path))) from None

    def _link(self, path: Path) -> tuple[Path | None, Path, list[int]]:
        """Hard links of meta.json and every file it lists, in a private folder beside the checkpoints."""
        root = path.parent / READERS_DIR
        sweep_stale_readers(root)
        for tries in range(3):
            try:
                root.mkdir(exist_ok=True)
                private = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}@{host_name()}-", dir=root))
                break
            except FileNotFoundError:  # another reader removed the empty root meanwhile (or checkpoints/ is gone)
                if tries == 2 or not path.parent.is_dir():
                    raise
        files = private / path.name
        try:
            files.mkdir()
            _link_one(path / "meta.json", files / "meta.json")
            for name in _listed(files):
                _link_one(path / name, files / name)
        except OSError:
            _remove(private)
            raise
        return private, files, []

    def _open(self, path: Path) -> tuple[Path | None, Path, list[int]]:
        """Open descriptors of meta.json and every file it lists, reached by symlinks to /proc/<pid>/fd/<fd> (which
        open the very file even once it is unlinked) in a private folder of the system's temporary directory."""
        proc = Path(f"/proc/{os.getpid()}/fd")
        if not proc.is_dir():  # not Linux: read in place, as before
            return None, path, []
        private = Path(tempfile.mkdtemp(prefix="xc-reader-"))
        files, fds = private / path.name, []
        files.mkdir()

        def hold(name: str) -> None:
            try:
                fds.append(os.open(path / name, os.O_RDONLY))
            except FileNotFoundError:
                return  # validate names it (or finds the checkpoint removed)
            os.symlink(proc / str(fds[-1]), files / name)

        hold("meta.json")
        for name in _listed(files):
            hold(name)
        return private, files, fds

    def release(self, path: Path) -> None:
        private, _, fds = self.holds.pop(path, (None, None, []))
        for fd in fds:
            os.close(fd)
        if private is not None:
            _remove(private)

    def release_all(self, but: Path | None = None) -> None:
        for path in [p for p in self.holds if p != but]:
            self.release(path)


def _remove(private: Path) -> None:
    """Remove a private folder, and checkpoints/.readers with it when no other reader is in it."""
    shutil.rmtree(private, ignore_errors=True)
    if private.parent.name == READERS_DIR:
        try:
            private.parent.rmdir()
        except OSError:
            pass


def _link_one(source: Path, target: Path) -> None:
    """A hard link; a file missing from a checkpoint that is still there is left for validate to name."""
    try:
        os.link(source, target)
    except FileNotFoundError:
        if not source.parent.is_dir():
            raise


def _gone(path: Path) -> bool:
    """Whether the checkpoint was removed (after its files failed to validate): pruning removes a directory's files
    one by one, so a directory still there is looked at again a moment later before it is called damaged."""
    if not path.is_dir():
        return True
    time.sleep(0.1)
    return not path.is_dir()


def _key(path: Path) -> tuple[int, str]:
    return threading.get_ident(), os.path.abspath(path)


@contextmanager
def reading(run_dir: str | Path, checkpoint: str | Path | None = None, attempts: int = 5) -> Iterator[Held]:
    """Hold `checkpoint`, or the run's model (`final_checkpoint`) where none is named, for as long as the block
    runs; yields a Held (load from `.files`, report `.path`). A checkpoint pruned before it was held is chosen again
    (the newest valid), up to `attempts` times, said in one log line; a named one is never swapped. Holds are
    released when the block ends, by an exception too."""
    if checkpoint is not None and _key(Path(checkpoint)) in _ACTIVE:  # a nested read (xc-eval's dual mode)
        yield _ACTIVE[_key(Path(checkpoint))]
        return
    holder = _Holder()
    try:
        held = _choose(Path(run_dir), checkpoint, attempts, holder)
        _ACTIVE[_key(held.path)] = held
        try:
            yield held
        finally:
            _ACTIVE.pop(_key(held.path), None)
    finally:
        holder.release_all()


def _choose(run_dir: Path, checkpoint: str | Path | None, attempts: int, holder: _Holder) -> Held:
    for _ in range(attempts):
        before = len(holder.removed)
        if checkpoint is not None:
            path = Path(checkpoint)
            if not path.is_dir():
                ckpt.validate(path)  # a mistyped path: validate's own words
            try:
                found = path, holder.check(path)
            except CheckpointRemoved:
                raise CheckpointError(f"{path} was removed while it was being opened (pruned by the trainer still "
                                      f"running in {run_dir}?): name a newer checkpoint, or leave out the checkpoint "
                                      "to read the newest") from None
        else:
            found = ckpt.final_checkpoint(run_dir, check=holder.check)
        if found is not None:
            path, meta = found
            holder.release_all(but=path)
            if holder.removed:
                log.warning("%s removed by the trainer still running in %s before %s could be read; read %s instead",
                            ", ".join(holder.removed), run_dir, "it" if len(holder.removed) == 1 else "they",
                            path.name)
            return Held(path, meta, holder.holds[path][1] if path in holder.holds else path)
        if len(holder.removed) == before:
            raise CheckpointError(f"{run_dir}/checkpoints holds no valid checkpoint")
    keep = _keep_checkpoints(run_dir)
    raise CheckpointError(f"could not read a checkpoint of {run_dir}: the trainer still running there pruned "
                          f"{', '.join(holder.removed)} before each could be read; run it again, or train with a "
                          f"higher train.keep_checkpoints (now {keep}) so that a checkpoint lives longer")


def _keep_checkpoints(run_dir: Path) -> str:
    try:
        return str(json.loads((run_dir / "config.json").read_text())["train"]["keep_checkpoints"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"
