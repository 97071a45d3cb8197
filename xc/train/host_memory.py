"""glibc's allocator told to keep freed blocks for reuse instead of handing them back to the kernel.

A training step allocates and frees the same few large tensors every time (the gathered classifier rows and
their gradient, the pool's scores, the feature table's gathered rows: 2-30 MB each on debian-deps). glibc serves
blocks above its mmap threshold (128 KiB at start, raised as blocks are freed) with fresh mappings and returns
them on free, and trims the heap's top above its trim threshold; each reuse then faults in new, zeroed pages
(transparent huge pages: 2 MiB zeroed at a time). On the 2-core CPU host a debian-deps step spent 6-9% of its CPU
time in the kernel zeroing pages (`perf`: clear_page_erms under do_huge_pmd_anonymous_page), more as the run went
on. With blocks up to 32 MiB kept in the heap and its top trimmed only above 512 MiB, the pages are faulted once.
The price is at most the trim threshold of freed memory held per process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit hosts
TRIM_THRESHOLD = 512 << 20


def keep_freed_blocks() -> bool:
    """Set glibc's mmap and trim thresholds (module docstring); False (nothing changed) off glibc, or where
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ are set in the environment (the user's own choice wins)."""
    if not sys.platform.startswith("linux") or any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_",
                                                                              "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
