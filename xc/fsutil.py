"""Small filesystem helpers shared by everything that publishes files atomically."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import zlib
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator

import xxhash

from xc.errors import XCError

# Storage failures a user fixes outside xc (free space, permissions, a read-only mount, a file size limit): said in
# one line. EFBIG is a file over `ulimit -f` (Python ignores SIGXFSZ, so the write fails instead of killing the
# process) or over the file system's largest file.
STORAGE_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                  errno.EFBIG: "file too large (over the file size limit, ulimit -f, or the file system's largest "
                               "file)",
                  errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                  errno.EPERM: "operation not permitted"}


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (one owned by another user counts as alive). A zombie, exited but not
    yet reaped by its parent (a SIGKILLed torchrun rank for a moment), counts as gone: it holds nothing any more."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel below
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_dir(path: str | Path) -> None:
    """Flush a directory entry (after a rename into it), so the rename survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The digest a handoff manifest records of each file, taken of the bytes as they are written (`HashingWriter`):
# xxh3_128 runs at about 30 GB/s on one core here, sha256 at about 1.9 (0.7 on the training hosts), so hashing a
# 2.6 GB snapshot costs about 0.1 s instead of a second read and 1.4-3.7 s. Against accidental damage (a torn or
# bit-flipped file) a 128-bit non-cryptographic hash is what a checksum must be; nobody forges a run's own files.
FILE_HASH = "xxh3_128"
FILE_HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}  # the digests a reader can verify


def hash_file(path: str | Path, algo: str = FILE_HASH, chunk: int = 1 << 22) -> str:
    """Hex digest (`algo`, a FILE_HASHES key) of a file, read in 4 MiB blocks."""
    digest = FILE_HASHES[algo]()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks (older manifests and checkpoint metadata record it)."""
    return hash_file(path, "sha256", chunk)


class HashingWriter:
    """A binary file's `write` that also hashes everything written (`algo`, FILE_HASH by default), so the digest
    needs no second read of the file: np.save, raw bytes and streamed blocks all write through it. `hexdigest()` is
    what `hash_file` gives for the file once written."""

    def __init__(self, handle, algo: str = FILE_HASH):
        self.handle, self.algo, self.digest = handle, algo, FILE_HASHES[algo]()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()

    def hexdigest(self) -> str:
        return self.digest.hexdigest()


def crc32_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """CRC-32 of a file as 8 hex digits, read in 4 MiB blocks (checkpoint metadata records it)."""
    value = 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            value = zlib.crc32(block, value)
    return f"{value:08x}"


def sampled_digest(path: str | Path, digest, spans: Iterable[tuple[int, int]], chunk: int = 1 << 22) -> str:
    """Hex digest of `digest` (a hashlib object, already fed whatever the caller hashes first, e.g. the size) updated
    with the bytes of `path` at each (offset, length) of `spans`, in order, read in 4 MiB blocks (a span past the
    end of the file gives what is there). The caller chooses the spans: a few samples make a cheap check of a large
    file (the dataset cache's checksums, a run's data fingerprint), one span (0, size) the whole file."""
    with open(path, "rb") as handle:
        for offset, length in spans:
            handle.seek(offset)
            while length > 0 and (block := handle.read(min(length, chunk))):
                digest.update(block)
                length -= len(block)
    return digest.hexdigest()


@contextlib.contextmanager
def exclusive_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` for the block: processes that build the same thing once (torchrun ranks
    converting one dataset) take turns, and the first builds while the others wait and then find it built. The file
    is created if missing and never deleted (deleting races with a waiter); the kernel releases the lock when the
    block exits or the process dies. flock is node-local on many network file systems."""
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def write_atomic(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """`write(handle)` into a temporary file beside `path`, then a rename: a reader never sees half a file, and a
    write that fails (a full disk, Ctrl-C) leaves `path` as it was and no temporary file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_json_atomic(path: str | Path, obj) -> None:
    """Write JSON (indent 1) through `write_atomic`."""
    import json

    write_atomic(path, lambda handle: handle.write(json.dumps(obj, indent=1).encode()))


def storage_failure(exc: BaseException) -> str | None:
    """The cause in words when `exc` (or an exception it was raised from or during) is a storage failure of
    STORAGE_ERRNOS, else None. torch.save reports a full disk as a RuntimeError ("unexpected pos") raised while
    handling the OSError, so the chain is searched."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
            return STORAGE_ERRNOS[exc.errno]
        if "No space left on device" in str(exc):
            return STORAGE_ERRNOS[errno.ENOSPC]
        code = re.search(r"\(os error (\d+)\)", str(exc))  # Rust's io::Error, as safetensors reports it
        if code and int(code.group(1)) in STORAGE_ERRNOS:
            return STORAGE_ERRNOS[int(code.group(1))]
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def storage_error(exc: BaseException, what: str, fix: str) -> BaseException:
    """One line for a storage failure (`storage_failure`): an XCError "`what`: cause; `fix`", e.g. "could not write
    the lock /runs/a/.lock: read-only file system; ...". Any other exception is returned as it is, to be re-raised."""
    cause = storage_failure(exc)
    return exc if cause is None else XCError(f"{what}: {cause}; {fix}")
