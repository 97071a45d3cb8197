"""Small filesystem helpers shared by everything that publishes files atomically."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def fsync_dir(path: str | Path) -> None:
    """Flush a directory entry (after a rename into it), so the rename survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks (manifests and checkpoint metadata record it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
