"""glibc's mmap and trim thresholds set for a training process (xc/train/host_memory.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# Where a fresh process's first 8 MiB block comes from: the heap (below the program break) or a mapping of its own.
PROBE = """
import ctypes, sys
from xc.train.host_memory import keep_freed_blocks
done = keep_freed_blocks() if sys.argv[1] == "call" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
block = libc.malloc(8 << 20)
print(done, "heap" if block < libc.sbrk(0) else "mapped")
"""


def _probe(how: str, **env) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}).stdout
    return out.split()


def test_blocks_of_a_few_megabytes_come_from_the_heap_once_set():
    """glibc maps an 8 MiB block afresh (and unmaps it on free: each reuse faults in zeroed pages); after the
    call it is served from the heap, where freed blocks are kept for the next step."""
    assert _probe("plain") == ["None", "mapped"]
    assert _probe("call") == ["True", "heap"]


def test_the_users_own_malloc_settings_win():
    assert _probe("call", MALLOC_MMAP_THRESHOLD_="65536") == ["False", "mapped"]
