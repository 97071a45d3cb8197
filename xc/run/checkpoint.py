"""Atomic, per-rank checkpoints under <run_dir>/checkpoints/.

Layout of one checkpoint: `step-00001234/` holding `rank{r}.pt` per rank (torch tensors and plain
Python values only, loaded with weights_only=True), `rank{r}.hard.npz` (the hard negatives in use) and
`meta.json`, written last. A checkpoint is written into `step-….tmp/` and renamed only after every rank
has finished, so a crash never leaves something that looks complete. Readers trust only directories
whose meta.json lists every file with its size and CRC-32: a truncated, missing or bit-flipped file
makes the checkpoint invalid, and `latest_valid` falls back to the previous one, saying which file.
The CRC-32 is taken of the bytes as they are written (no second read); against accidental damage it is what a
checksum must be, and a sha256 read back was about 1 s of each 660 MB debian-deps checkpoint on 2 cores (py-spy).
Checkpoints whose meta.json records sha256 digests are still verified by them.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import re
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xc.errors import CheckpointError
from xc.fsutil import crc32_file, sha256_file, storage_failure

log = logging.getLogger(__name__)
_PREFIX = "step-"
_ASIDE = ".old-"  # step-N.old-<pid>.tmp: a published checkpoint set aside before it is deleted
SELECTION_FILE = "selection.json"  # the epoch a finished run kept (xc/eval/epoch_select.py)


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | Path, global_step: int) -> Path:
    """Where the checkpoint of `global_step` is published."""
    return checkpoint_root(run_dir) / f"{_PREFIX}{global_step:08d}"


class _Crc32Writer:
    """A binary file's `write` that also runs the CRC-32 of everything written (torch.save and np.savez write
    through it). `crc` is the 8-hex-digit form `crc32_file` gives."""

    def __init__(self, handle):
        self.handle, self.value = handle, 0

    def write(self, data) -> int:
        self.value = zlib.crc32(data, self.value)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()

    @property
    def crc(self) -> str:
        return f"{self.value:08x}"


def _fsync_write(path: Path, write) -> str:
    """Write through `path`.part and a rename; returns the bytes' CRC-32. On a storage failure (disk full,
    read-only, permission) the part file is removed and a CheckpointError says where and why in one line."""
    tmp = path.with_name(path.name + ".part")
    try:
        with open(tmp, "wb") as handle:
            writer = _Crc32Writer(handle)
            write(writer)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        return writer.crc
    except (OSError, RuntimeError) as exc:
        cause = storage_failure(exc)
        if cause is None:
            raise
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write the checkpoint file {path}: {cause}; the previous checkpoint is "
                              "intact: make room (or make the folder writable) and run the same command to resume "
                              "from it") from None


def write_rank_files(run_dir: str | Path, global_step: int, rank: int, state: dict[str, Any],
                     hard_tables: dict[int, np.ndarray] | None) -> dict[str, str]:
    """Every rank: write its own files into the step's temporary directory; returns their CRC-32 (taken as
    they are written), for rank 0 to record in meta.json."""
    tmp_dir = checkpoint_root(run_dir) / f"{_PREFIX}{global_step:08d}.tmp"
    try:
        tmp_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if storage_failure(exc) is None:
            raise
        raise CheckpointError(f"could not create {tmp_dir}: {storage_failure(exc)}; make room (or make the folder "
                              "writable) and run the same command to resume from the previous checkpoint") from None
    crcs = {f"rank{rank}.pt": _fsync_write(tmp_dir / f"rank{rank}.pt", lambda h: torch.save(state, h))}
    if hard_tables:
        arrays = {f"shard{s}": np.asarray(t) for s, t in hard_tables.items()}
        buffer = io.BytesIO()  # np.savez wants a seekable file; the tables are a few MB
        np.savez(buffer, **arrays)
        crcs[f"rank{rank}.hard.npz"] = _fsync_write(tmp_dir / f"rank{rank}.hard.npz",
                                                    lambda h: h.write(buffer.getbuffer()))
    else:  # a file of an earlier, crashed attempt at this step must not be taken for ours
        (tmp_dir / f"rank{rank}.hard.npz").unlink(missing_ok=True)
    return crcs


def sweep_partial(run_dir: str | Path) -> list[str]:
    """Remove half-written `step-*.tmp` directories (left by a crash); call only when no rank is writing,
    i.e. at start-up, so a file of a dead attempt can never be published by a later one."""
    root = checkpoint_root(run_dir)
    removed = []
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if not (path.name.startswith(_PREFIX) and path.name.endswith(".tmp")):
                continue
            if _ASIDE in path.name and _put_back(path):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    if removed:
        log.info("removed %d unpublished checkpoint director%s left by a crash: %s", len(removed),
                 "y" if len(removed) == 1 else "ies", ", ".join(sorted(removed)))
    return removed


def _put_back(aside: Path) -> bool:
    """A checkpoint set aside (`_set_aside`) whose step has no published checkpoint any more, and which still
    validates, is published again: its replacement never arrived."""
    final = aside.with_name(aside.name.split(_ASIDE)[0])
    if final.exists():
        return False
    try:
        validate(aside)
    except CheckpointError:
        return False
    os.replace(aside, final)
    log.info("put back checkpoint %s, set aside by an attempt that died before publishing its replacement", final.name)
    return True


RANK_FILE = re.compile(r"^rank(\d+)\.(pt|hard\.npz)$")


def publish(run_dir: str | Path, global_step: int, world_size: int, meta: dict[str, Any], keep: int,
            crc32: dict[str, str] | None = None, protect: int | None = None) -> Path:
    """Rank 0, after every rank wrote: record every file's size (and CRC-32) in meta.json, rename into
    place, prune all but the newest `keep` and the checkpoint of step `protect` (the best epoch so far,
    xc/eval/epoch_select.py). Only this run's rank files are listed (never a stray file of an earlier attempt)."""
    root = checkpoint_root(run_dir)
    tmp_dir = root / f"{_PREFIX}{global_step:08d}.tmp"
    final = step_dir(run_dir, global_step)
    files = {p.name: p.stat().st_size for p in sorted(tmp_dir.iterdir())
             if (m := RANK_FILE.match(p.name)) and int(m.group(1)) < world_size}
    for rank in range(world_size):
        if f"rank{rank}.pt" not in files:
            raise CheckpointError(f"{tmp_dir}: rank {rank} wrote no state; not publishing")
    body = dict(meta, global_step=global_step, world_size=world_size, files=files)
    if crc32 is not None:
        missing = sorted(set(files) - set(crc32))
        if missing:
            raise CheckpointError(f"{tmp_dir}: no checksum reported for {', '.join(missing)}; not publishing")
        body["crc32"] = {name: crc32[name] for name in files}
    _fsync_write(tmp_dir / "meta.json", lambda h: h.write(json.dumps(body, indent=1).encode()))
    try:
        # the same step written twice (a timed checkpoint, then the epoch's): the old one set aside, deleted after
        aside = _set_aside(final) if final.exists() else None
        os.replace(tmp_dir, final)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    except OSError as exc:
        if storage_failure(exc) is None:
            raise
        raise CheckpointError(f"could not publish the checkpoint {final} (renaming {tmp_dir.name} into place): "
                              f"{storage_failure(exc)}; the previous checkpoint is intact: make room (or make the "
                              "folder writable) and run the same command to resume from it") from None
    kept = None if protect is None else step_dir(run_dir, protect).name
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        if old.name != kept:
            shutil.rmtree(_set_aside(old), ignore_errors=True)
    return final


def _set_aside(path: Path) -> Path:
    """A published checkpoint renamed out of discovery's sight (one atomic step) before it is deleted, so that a
    death at any moment leaves it whole or unlisted: deleted in place, a process killed mid-way (a job's SIGTERM
    arrives twice, once through torchrun) left a published directory without its meta.json (the kill-anywhere
    soak, tools/probes/soak.py). The start-up sweep puts back one whose step has no other checkpoint (a death between
    setting it aside and publishing its replacement) and removes the rest."""
    aside = path.with_name(f"{path.name}{_ASIDE}{os.getpid()}.tmp")
    os.replace(path, aside)
    return aside


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Published checkpoint directories, oldest first (half-written .tmp ones are ignored)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(_PREFIX) and not p.name.endswith(".tmp")]
    return sorted(found, key=lambda p: p.name)


def validate(path: Path, checksum: bool = True) -> dict[str, Any]:
    """meta.json of a checkpoint after checking that every rank's state file is listed and every listed
    file exists with its recorded size and (when recorded, and `checksum`) CRC-32, or sha256 where an older
    meta.json recorded that."""
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        files, world_size = meta["files"], int(meta["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{meta_path}: unreadable checkpoint metadata ({exc!r})") from exc
    for rank in range(world_size):
        if f"rank{rank}.pt" not in files:
            raise CheckpointError(f"{path / f'rank{rank}.pt'}: missing from meta.json (written by {world_size} ranks)")
    crcs, digests = meta.get("crc32") or {}, meta.get("sha256") or {}
    for name, size in files.items():
        if not RANK_FILE.match(name):
            raise CheckpointError(f"{meta_path}: lists {name!r}, which is not a checkpoint file name")
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (meta.json lists {size} bytes)")
        if file.stat().st_size != size:
            raise CheckpointError(f"{file}: truncated or overwritten ({file.stat().st_size} bytes, expected {size})")
        if checksum and name in crcs and crc32_file(file) != crcs[name]:
            raise CheckpointError(f"{file}: CRC-32 does not match meta.json (corrupted)")
        if checksum and name not in crcs and name in digests and sha256_file(file) != digests[name]:
            raise CheckpointError(f"{file}: sha256 does not match meta.json (corrupted)")
    return meta


class CheckpointRemoved(CheckpointError):
    """A checkpoint vanished (pruned by a trainer still running) while a reader looked at it (xc/run/readers.py)."""


def latest_valid(run_dir: str | Path, check=validate) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that validates; older ones are tried when newer ones are damaged. check(path) -> meta:
    `validate`, or a reader's, which holds the files first (xc/run/readers.py) and raises CheckpointRemoved for one
    pruned meanwhile: then None, for the reader to choose again among the newer ones."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, check(path)
        except CheckpointRemoved:
            return None  # pruned meanwhile, so newer ones were published: the reader lists them again
        except CheckpointError as exc:
            log.warning("skipping damaged checkpoint %s, trying the previous one: %s", path.name, exc)
    return None


def latest_loadable(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that validates and whose every rank state loads (memory-mapped, weights_only: cheap,
    and no pickle runs); a checkpoint that fails for any reason (a damaged file, a foreign pickle whose checksum was
    recomputed) is skipped with a warning naming the file and the reason, and the previous one tried."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            meta = validate(path)
            for name in sorted(meta["files"]):
                if name.endswith(".pt"):
                    load_state_file(path / name, mmap=True)
            return path, meta
        except CheckpointError as exc:
            log.warning("skipping damaged checkpoint %s, trying the previous one: %s", path.name, exc)
    return None


def final_checkpoint(run_dir: str | Path, check=validate) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint that is a run's model: the epoch RUN_DIR/selection.json kept (xc/eval/epoch_select.py) when
    that selection was made at the newest valid checkpoint, else the newest valid checkpoint. A selection
    made before the run trained further is stale and ignored; a kept checkpoint that fails to validate is
    reported and the newest used. check: as for `latest_valid`."""
    newest = latest_valid(run_dir, check)
    file = Path(run_dir) / SELECTION_FILE
    if newest is None or not file.exists():
        return newest
    try:
        selection = json.loads(file.read_text())
        last, kept = int(selection["last"]["global_step"]), int(selection["kept"]["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s is unreadable (%r); using the newest checkpoint", file, exc)
        return newest
    if last != int(newest[1]["global_step"]) or kept == last:
        return newest
    path = step_dir(run_dir, kept)
    try:
        return path, check(path)
    except CheckpointError as exc:
        log.warning("the kept epoch's checkpoint %s is unusable, using the newest instead: %s", path.name, exc)
        return newest


def prune_finished(run_dir: str | Path) -> list[Path]:
    """A finished run's checkpoints other than the one it serves (`final_checkpoint`) and the newest, removed (each
    set aside first, as `publish` prunes: a death leaves it whole or unlisted). The newest stays because it is what
    a rerun resumes from and what dates the epoch selection; it also holds the optimizer state a raised
    train.epochs trains on with. Returns the removed checkpoints; a run without a valid checkpoint is left as it is."""
    check = functools.cache(validate)  # final_checkpoint looks for the newest again: its checksums are read once
    newest = latest_valid(run_dir, check)
    served = final_checkpoint(run_dir, check)
    if newest is None or served is None:
        return []
    keep = {newest[0].name, served[0].name}
    removed = [path for path in list_checkpoints(run_dir) if path.name not in keep]
    for path in removed:
        shutil.rmtree(_set_aside(path), ignore_errors=True)
    return removed


def load_rank(path: Path, rank: int, mmap: bool = False) -> tuple[dict[str, Any], dict[int, np.ndarray] | None]:
    """This rank's state (weights_only: no pickle from the run directory) and hard-negative tables; `mmap`: the
    tensors mapped from the file, read only where they are copied out."""
    state = load_state_file(path / f"rank{rank}.pt", mmap=mmap)
    return state, load_hard_tables(path, rank)


def load_state_file(file: Path, mmap: bool = False) -> dict[str, Any]:
    """A rank's state: tensors and plain values only (weights_only=True refuses any other pickle)."""
    import warnings

    try:
        with warnings.catch_warnings():  # torch warns about a foreign pickle's protocol before refusing it
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # torch raises several types for damaged or unsafe archives
        text = str(exc)
        if "Weights only load failed" in text:  # torch goes on to advise an unsafe load: never here
            text = "it holds Python objects that xc never writes; refused without running them"
        raise CheckpointError(f"{file}: cannot load ({type(exc).__name__}: {text.splitlines()[0][:300]})") from exc


# Pages of a mapped checkpoint handed back to the kernel after every block this large is copied (copy_mapped).
COPY_BLOCK_BYTES = 64 << 20
_MADV_DONTNEED = 4  # Linux <sys/mman.h>


def copy_mapped(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` (any device and dtype; the same shape) for a `src` mapped from a checkpoint file by
    `load_state_file(mmap=True)`, holding at most COPY_BLOCK_BYTES of its pages resident at a time.

    Why: a mapped page, once read, counts in the process's resident memory until the mapping goes, so copying a whole
    mapped tensor holds the live tensor and the file's copy of it at once. At 10^7 labels the epoch choice's reload of
    the rows (10^7 x 256 in bfloat16, 4.8 GiB) and the lexical weights (2.4 GiB) took the trainer from 12 to 19.6 GiB.
    Each copied block's whole pages are dropped from this process (madvise MADV_DONTNEED): the mapping is a private
    one of the file that nothing writes, so a dropped page reads back from the file if it is touched again (the
    masters' copy reads `src` twice). Elsewhere than Linux, or for a tensor that is not one contiguous CPU block of a
    file's mapping (`_mapped_from_file`), a plain copy."""
    if not (sys.platform.startswith("linux") and src.device.type == "cpu" and src.is_contiguous() and src.dim() > 0
            and src.numel() * src.element_size() > COPY_BLOCK_BYTES and _mapped_from_file(src)):
        dst.copy_(src)
        return
    import ctypes
    import mmap

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    row_bytes = max(1, src[0].numel() * src.element_size())
    rows = max(1, COPY_BLOCK_BYTES // row_bytes)
    released = -(-src.data_ptr() // page) * page  # the first whole page of src: the one before may hold other data
    for a in range(0, src.shape[0], rows):
        b = min(src.shape[0], a + rows)
        dst[a:b].copy_(src[a:b])
        done = (src.data_ptr() + b * row_bytes) // page * page
        if done > released:
            madvise(released, done - released, _MADV_DONTNEED)  # a failure only leaves the pages resident
            released = done


def _mapped_from_file(tensor: torch.Tensor) -> bool:
    """Whether the tensor's first and last bytes lie in one mapping of a file (/proc/self/maps): only such pages may be
    let go, as they read back from the file; an anonymous tensor's (a re-split resume's rows) would read back as zeros."""
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size() - 1
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= first < hi:
                    return last < hi and len(fields) == 6 and fields[5].startswith("/")
    except (OSError, ValueError, IndexError):
        pass
    return False


def load_hard_tables(path: Path, rank: int) -> dict[int, np.ndarray] | None:
    """Rank `rank`'s hard-negative tables {shard: (N, k) int32}, or None if it had none."""
    hard_path = path / f"rank{rank}.hard.npz"
    if not hard_path.exists():
        return None
    try:
        with np.load(hard_path, allow_pickle=False) as npz:
            return {int(name[len("shard"):]): npz[name] for name in npz.files}
    except Exception as exc:
        raise CheckpointError(f"{hard_path}: cannot load ({type(exc).__name__}: {exc})") from exc


def load_every_hard_table(path: Path, meta: dict[str, Any]) -> dict[int, np.ndarray] | None:
    """Every rank's hard-negative tables of the checkpoint {shard: (N, k) int32} (a finished run read in one
    process: an ensemble member's negatives for the lexical ranker), or None if it had none."""
    tables: dict[int, np.ndarray] = {}
    for rank in range(int(meta.get("world_size", 1))):
        tables.update(load_hard_tables(path, rank) or {})
    return tables or None


def load_classifier_rows(path: Path, meta: dict[str, Any], lo: int, hi: int,
                         num_labels: int | None = None, key: str = "weight",
                         section: str = "classifier", out: torch.Tensor | None = None) -> torch.Tensor:
    """Classifier rows [lo, hi) stitched from whichever rank files of the checkpoint hold them; into `out`
    ((hi - lo, d), any device and dtype: a live shard's rows) where given, else a new tensor of the stored dtype.
    Copied out of the mapped files block by block (copy_mapped), so at most one block of a file is resident.

    key "weight" reads the stored rows, "master" their fp32 master copies (rank files without masters
    give their stored rows, in float32). section: the rank state's entry holding the rows ("classifier";
    "free" for the dual mode's free vectors).

    Global label id l is row l in every label layout (padding only ever follows the last real label),
    so a checkpoint written by G ranks with any num_label_shards can be read by a different number of
    processes with a different layout: rows are matched by label id. With `num_labels` given, rows at
    or beyond it are padding and stay zero; every real row must be found.
    """
    real_hi = hi if num_labels is None else min(hi, num_labels)
    rows: torch.Tensor | None = out
    if out is not None:
        out[max(0, real_hi - lo):].zero_()  # padding rows
    covered = 0
    for rank in range(meta["world_size"]):
        state = load_state_file(path / f"rank{rank}.pt", mmap=True)[section]
        weight = state[key] if key in state else state["weight"]
        if rows is None:
            rows = torch.zeros(hi - lo, weight.shape[1], dtype=weight.dtype if key in state else torch.float32)
        a, b = max(lo, state["lo"]), min(real_hi, state["hi"])
        if a >= b:
            continue
        copy_mapped(rows[a - lo:b - lo], weight[a - state["lo"]:b - state["lo"]])
        covered += b - a
    if rows is None or covered != max(0, real_hi - lo):
        raise CheckpointError(f"{path}: its rank files do not cover label rows [{lo}, {real_hi})")
    return rows
