"""THE trainer <-> miner contract: numbered, immutable generations under <run_dir>/handoff/.

    handoff/static/         positives.indptr.npy (N+1,) int64, positives.indices.npy (nnz,) int64, manifest.json
    handoff/snapshots/gen-000003/   W.shard{s}.npy (n_s, d) float32 per label shard, Q.npy (N, d) float32, manifest.json
                                    (bfloat16 rows: W.shard{s}.npy holds their (n_s, d) uint16 bit patterns and
                                    the manifest entry says dtype "bfloat16")
    handoff/negatives/gen-000003/   neg.shard{s}.int32 raw (N, k) int32 global label ids (-1 = none), manifest.json
    handoff/control/stop    a request for miners to exit

Rules: a generation is staged in `<name>.tmp-<pid>@<host>-<rand>/`, every array is flushed and fsynced, the
manifest (file sizes and xxh3_128 digests, taken of the bytes as they are written: no second read) is written
last, and the directory is renamed into place in one step. Manifests of format_version 1 record sha256 digests;
readers still verify them by those. Readers trust only a renamed directory whose manifest checks out; nothing published is ever
modified. File names in manifests are plain names resolved inside the generation directory, so a
manifest can never point outside the run directory. Pure numpy + json: the miner imports this.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xc.arrays import csr_rows
from xc.errors import XCError
from xc.fsutil import FILE_HASH, FILE_HASHES, HashingWriter, fsync_dir, hash_file, pid_alive, storage_error

FORMAT_VERSION = 2  # 2: entries record an xxh3_128 digest; 1: a sha256 one
READABLE_VERSIONS = (1, FORMAT_VERSION)
WRITE_CHUNK = 1 << 23  # bytes hashed then written at a time: hashed while they are still in the CPU's cache
BF16 = "bfloat16"  # a manifest entry's dtype for bfloat16 rows stored as their uint16 bit patterns
_GEN = re.compile(r"^gen-(\d{6})$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class HandoffError(XCError):
    """A generation that is missing, incomplete, corrupt, or points outside the run directory."""


class HandoffStorageError(XCError):
    """A generation could not be written for lack of storage (EROFS, EACCES, ENOSPC, EDQUOT): one line naming the
    file and the fix; nothing of the generation is published (its stage is abandoned)."""


def storage_failed(exc: BaseException, path: str | Path) -> BaseException:
    """A HandoffStorageError for a storage failure while writing `path` of a generation (`xc.fsutil.storage_error`),
    or `exc` itself for any other failure (to be re-raised as it is)."""
    if isinstance(exc, HandoffStorageError):
        return exc
    if "snapshots" in Path(path).parts:
        what, then = "the refresh snapshot file", "run the same command to resume from the newest checkpoint"
    else:
        what, then = "the hard negatives", "the trainer keeps the negatives it has"
    error = storage_error(exc, f"could not write {what} {path}", "the run's handoff/ folder needs free space and "
                          f"write permission: free space (or fix its permissions or quota) and {then}; nothing of this "
                          "generation was published")
    return exc if error is exc else HandoffStorageError(str(error))


def handoff_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "handoff"


def gen_name(generation: int) -> str:
    return f"gen-{generation:06d}"


class Stage:
    """A private staging directory for one generation; `publish` makes it visible atomically.

    A writer that dies leaves only a `*.tmp-*` directory, which no reader looks at and `sweep_stale`
    removes later.
    """

    def __init__(self, parent: Path, name: str, path: Path | None = None):
        self.parent, self.name = parent, name
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.path = path or Path(tempfile.mkdtemp(prefix=f"{name}.tmp-{os.getpid()}@{host_name()}-", dir=parent))
        except OSError as exc:  # a storage failure is one line (HandoffStorageError)
            raise storage_failed(exc, parent / name) from None

    def write_array(self, filename: str, array: np.ndarray, raw: bool = False) -> dict[str, Any]:
        """Write `array` as .npy (the bytes np.save writes) or raw bytes when `raw`, hashing them as they go, fsync,
        and describe it for the manifest."""
        path = self.path / filename
        array = np.ascontiguousarray(array)
        try:
            with open(path, "wb") as handle:
                writer = HashingWriter(handle)
                if not raw:
                    np.lib.format.write_array_header_1_0(writer, np.lib.format.header_data_from_array_1_0(array))
                write_bytes(writer, array)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise storage_failed(exc, path) from None
        return describe(path, array.shape, array.dtype, writer.hexdigest())

    def write_blocks(self, filename: str, shape: tuple[int, int], dtype: str, blocks) -> dict[str, Any]:
        """Write a (n, d) .npy from `blocks`, an iterable of contiguous row blocks in order, fsync, and describe it
        for the manifest: the file never exists whole in memory. `dtype` "bfloat16" (numpy has none): the blocks
        are uint16 bit patterns, the .npy says uint16 and the manifest entry "bfloat16"."""
        path = self.path / filename
        stored = np.dtype(np.uint16) if dtype == BF16 else np.dtype(dtype)
        written = 0
        try:
            with open(path, "wb") as handle:
                writer = HashingWriter(handle)
                np.lib.format.write_array_header_1_0(writer, {"descr": np.lib.format.dtype_to_descr(stored),
                                                              "fortran_order": False, "shape": tuple(shape)})
                for block in blocks:
                    block = np.ascontiguousarray(block)
                    if block.dtype != stored or block.shape[1:] != tuple(shape[1:]):
                        raise ValueError(f"{filename}: a block of {block.dtype} {block.shape} in a {dtype} {shape}")
                    write_bytes(writer, block)
                    written += block.shape[0]
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise storage_failed(exc, path) from None
        if written != shape[0]:
            raise ValueError(f"{filename}: {written} rows written of {shape[0]}")
        return dict(describe(path, shape, stored, writer.hexdigest()), dtype=dtype)

    def publish(self, manifest: dict[str, Any]) -> Path:
        """Write manifest.json last, then rename the directory to its final name."""
        body = dict(manifest, format_version=FORMAT_VERSION)
        tmp = self.path / "manifest.json.part"
        final = self.parent / self.name
        try:
            with open(tmp, "w") as handle:
                json.dump(body, handle, indent=1)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path / "manifest.json")
            if final.exists():
                raise HandoffError(f"{final} is already published; generations are immutable")
            os.replace(self.path, final)
        except OSError as exc:
            raise storage_failed(exc, tmp if not (self.path / "manifest.json").exists() else final) from None
        fsync_dir(self.parent)  # published by now: a failure here must not say otherwise
        return final

    def abandon(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def write_bytes(writer: HashingWriter, array: np.ndarray) -> None:
    """Write a C-contiguous `array`'s bytes through `writer`, WRITE_CHUNK bytes at a time (no copy of them)."""
    flat = array.reshape(-1).view(np.uint8)
    for start in range(0, flat.shape[0], WRITE_CHUNK):
        writer.write(flat[start:start + WRITE_CHUNK])


def describe(path: Path, shape, dtype, digest: str | None = None) -> dict[str, Any]:
    """A manifest entry: file name, shape, dtype, size and the FILE_HASH `digest` of the file's bytes (taken as
    they were written, `HashingWriter`; read back from `path` when not given)."""
    return {"file": path.name, "shape": [int(s) for s in shape], "dtype": np.dtype(dtype).name,
            "bytes": path.stat().st_size, FILE_HASH: digest if digest is not None else hash_file(path)}


def entry_hash(entry: dict[str, Any], where: Path) -> str:
    """The algorithm of the digest a manifest entry records (a FILE_HASHES key: xxh3_128, or sha256 in a
    format_version 1 manifest)."""
    algo = next((a for a in FILE_HASHES if isinstance(entry.get(a), str)), None)
    if algo is None:
        raise HandoffError(f"{where}/manifest.json: the entry of {entry.get('file')!r} records no digest "
                           f"({' or '.join(FILE_HASHES)}); the generation cannot be verified")
    return algo


def _resolve(directory: Path, entry: dict[str, Any]) -> Path:
    """The file a manifest entry names, refusing anything but a plain name inside `directory`."""
    name = entry.get("file", "")
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", ".."):
        raise HandoffError(f"{directory}/manifest.json: file name {name!r} is not a plain name inside the generation")
    path = (directory / name).resolve()
    if path.parent != directory.resolve():
        raise HandoffError(f"{directory}/manifest.json: {name!r} resolves outside the generation directory")
    return path


def verify_entry(directory: Path, entry: dict[str, Any], checksum: bool = True) -> Path:
    path = _resolve(directory, entry)
    if not path.is_file():
        raise HandoffError(f"{path}: listed in the manifest but missing")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise HandoffError(f"{path}: {size} bytes, manifest says {entry['bytes']} (truncated or overwritten)")
    algo = entry_hash(entry, directory)
    if checksum and hash_file(path, algo) != entry[algo]:
        raise HandoffError(f"{path}: {algo} does not match the manifest (corrupted)")
    return path


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise HandoffError(f"{path}: missing (generation not published)") from exc
    except (OSError, ValueError) as exc:
        raise HandoffError(f"{path}: unreadable ({exc})") from exc
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise HandoffError(f"{path}: format_version {manifest.get('format_version')} is not one this xc reads "
                           f"({' or '.join(map(str, READABLE_VERSIONS))}): written by another version of xc")
    return manifest


def list_generations(parent: Path) -> list[int]:
    """Published generation numbers under `parent`, ascending (staging directories ignored)."""
    if not parent.is_dir():
        return []
    return sorted(int(m.group(1)) for p in parent.iterdir() if (m := _GEN.match(p.name)) and p.is_dir())


def prune(parent: Path, keep: int, protect: set[int] = frozenset()) -> None:
    """Delete all but the newest `keep` generations (never one in `protect`, e.g. the one in use)."""
    gens = list_generations(parent)
    for gen in gens[:-keep] if keep > 0 else []:
        if gen not in protect:
            shutil.rmtree(parent / gen_name(gen), ignore_errors=True)


def drop_generations(run_dir: str | Path) -> int:
    """Every snapshot and negatives generation of a finished run, removed (the static positives and control/ stay:
    an external miner reads `trainer-done` there). Each is first renamed to a stage name of this process, so a death
    midway leaves only what `sweep_stale` clears, never a published generation with files missing. -> how many."""
    root, here, dropped = handoff_root(run_dir), host_name(), 0
    for parent in (root / "snapshots", root / "negatives"):
        for gen in list_generations(parent):
            path = parent / gen_name(gen)
            aside = path.with_name(f"{path.name}.tmp-{os.getpid()}@{here}-done")
            os.replace(path, aside)
            shutil.rmtree(aside, ignore_errors=True)
            dropped += 1
    return dropped


def host_name() -> str:
    """This host's name as it may appear in a staging directory's name (no '-' or '@': they delimit)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


_STAGING = re.compile(r"^gen-\d{6}\.tmp-(\d+)(?:@([A-Za-z0-9._]+))?-")


def sweep_stale(parent: Path, sole_writer: bool = False) -> None:
    """Remove staging directories of crashed writers: those of a pid dead on this host and, when the caller is
    `sole_writer` of `parent` (the miner lease's holder for negatives/), every one but this process's own:
    a writer on another host cannot be checked by pid, and only the sole writer knows it is gone."""
    if not parent.is_dir():
        return
    me, here = os.getpid(), host_name()
    for path in parent.iterdir():
        match = _STAGING.match(path.name)
        if not match:
            continue
        pid, host = int(match.group(1)), match.group(2) or here
        if host == here:
            dead = pid != me and not pid_alive(pid)
        else:
            dead = sole_writer
        if dead:
            shutil.rmtree(path, ignore_errors=True)




# --------------------------------------------------------------------------- typed views


@dataclass
class Snapshot:
    """A published snapshot: classifier rows per shard and query embeddings, as memmaps."""

    directory: Path
    manifest: dict[str, Any]

    @property
    def generation(self) -> int:
        return int(self.manifest["generation"])

    def shard_dtype(self, shard: int) -> str:
        """"float32", or "bfloat16" where `shard_rows` returns bit patterns."""
        return self._shard_entry(shard).get("dtype", "float32")

    def shard_rows(self, shard: int) -> np.ndarray:
        """(n_s, d) memmap of a shard's rows: float32, or for a bfloat16 entry (`shard_dtype`) their uint16 bit
        patterns (xc.ann.bf16_rows.bf16_from_bits views them as a bfloat16 tensor, without a copy)."""
        entry = self._shard_entry(shard)
        path = _resolve(self.directory, entry)
        rows = np.load(path, mmap_mode="r")
        expected = np.uint16 if entry.get("dtype") == BF16 else np.dtype(entry.get("dtype", "float32"))
        if rows.dtype != expected or list(rows.shape) != list(entry["shape"]):
            raise HandoffError(f"{path}: holds {rows.dtype} {list(rows.shape)}, the manifest says "
                               f"{entry.get('dtype')} {entry['shape']}")
        return rows

    def _shard_entry(self, shard: int) -> dict[str, Any]:
        return next(e for e in self.manifest["shards"] if e["shard"] == shard)

    def queries(self) -> np.ndarray:
        """(n, d) float32: the embeddings of the training queries this generation mines (`query_rows`)."""
        return np.load(_resolve(self.directory, self.manifest["queries"]), mmap_mode="r")

    def query_rows(self) -> np.ndarray | None:
        """(n,) int64 training-row ids of the queries, in Q's order; None where Q holds every row in order."""
        return window_rows(self.manifest.get("query_rows"))


def window_rows(window: dict[str, int] | None) -> np.ndarray | None:
    """The training rows of a slice window {"start", "count", "num_rows"}: (count,) int64 ids start, start + 1,
    ... modulo num_rows (a rotation over the rows); None for no window (every row)."""
    if window is None:
        return None
    start, count, total = int(window["start"]), int(window["count"]), int(window["num_rows"])
    if not (0 <= start < total and 0 < count <= total):
        raise HandoffError(f"query window {window}: needs 0 <= start < num_rows and 0 < count <= num_rows")
    return (start + np.arange(count, dtype=np.int64)) % total


def positives_of_rows(indptr: np.ndarray, indices: np.ndarray,
                      rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The positives CSR (indptr (n+1,), indices) of training rows `rows` (n,), in that order (None: all)."""
    return (indptr, indices) if rows is None else csr_rows(indptr, indices, rows)


def open_snapshot(run_dir: str | Path, generation: int, checksum: bool = True) -> Snapshot:
    directory = handoff_root(run_dir) / "snapshots" / gen_name(generation)
    manifest = read_manifest(directory)
    for entry in [*manifest["shards"], manifest["queries"]]:
        verify_entry(directory, entry, checksum)
    return Snapshot(directory, manifest)


def open_negatives(run_dir: str | Path, generation: int, shards: list[int] | range,
                   checksum: bool = True) -> tuple[dict[int, np.ndarray], dict[str, Any]]:
    """Memmapped (N, k) int32 tables of the requested shards from a verified negatives generation."""
    directory = handoff_root(run_dir) / "negatives" / gen_name(generation)
    manifest = read_manifest(directory)
    by_shard = {e["shard"]: e for e in manifest["shards"]}
    tables = {}
    for shard in shards:
        if shard not in by_shard:
            raise HandoffError(f"{directory}/manifest.json: no negatives for shard {shard}")
        entry = by_shard[shard]
        path = verify_entry(directory, entry, checksum)
        rows, k = entry["shape"]
        if entry["dtype"] != "int32" or entry["bytes"] != rows * k * 4:
            raise HandoffError(f"{path}: expected {rows}x{k} int32 ({rows * k * 4} bytes), manifest says {entry}")
        tables[shard] = np.memmap(path, dtype=np.int32, mode="r", shape=(rows, k))
    return tables, manifest


def write_static_positives(run_dir: str | Path, indptr: np.ndarray, indices: np.ndarray) -> None:
    """The training rows' positive labels (CSR), published once per run for miners to exclude."""
    parent = handoff_root(run_dir)
    if (parent / "static" / "manifest.json").exists():
        return
    stage = Stage(parent, "static")
    entries = {"indptr": stage.write_array("positives.indptr.npy", indptr.astype(np.int64)),
               "indices": stage.write_array("positives.indices.npy", indices.astype(np.int64))}
    try:
        stage.publish({"kind": "positives", **entries})
    except HandoffError:
        stage.abandon()  # another rank or an earlier attempt of this run published it first


def read_static_positives(run_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
    directory = handoff_root(run_dir) / "static"
    manifest = read_manifest(directory)
    indptr = np.load(verify_entry(directory, manifest["indptr"]), mmap_mode="r")
    indices = np.load(verify_entry(directory, manifest["indices"]), mmap_mode="r")
    return indptr, indices


def request_stop(run_dir: str | Path, reason: str) -> None:
    control = handoff_root(run_dir) / "control"
    control.mkdir(parents=True, exist_ok=True)
    (control / "stop").write_text(reason)


def stop_requested(run_dir: str | Path) -> str | None:
    """The stop request's text ("stop requested" for an empty file, as `touch` makes), or None."""
    path = handoff_root(run_dir) / "control" / "stop"
    try:
        return path.read_text().strip() or "stop requested"
    except FileNotFoundError:
        return None
