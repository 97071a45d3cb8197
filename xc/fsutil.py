"""Small filesystem helpers shared by everything that publishes files atomically."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: str | Path) -> None:
    """Flush a directory entry (after a rename into it), so the rename survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
