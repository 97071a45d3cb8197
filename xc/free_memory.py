"""The memory this process may still take on its host: the lower of Linux's MemAvailable and what the memory limit of
its cgroup leaves (a container's or a Slurm job's limit: MemAvailable there reports the whole host's memory).

Read by the rules that size what a run holds (xc/models/row_memory.py: the classifier rows' width and precision) and
by the miner before it builds a graph index beside the rows (xc/miner/task.py). Imports nothing of xc: a miner on
another machine reads it too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MEMINFO, PROC_CGROUP, CGROUP_ROOT = "/proc/meminfo", "/proc/self/cgroup", "/sys/fs/cgroup"
NO_LIMIT = 1 << 60  # cgroup v1 says "no limit" with 2^63 - 1 rounded down to a page; no real limit is near it


@dataclass(frozen=True)
class FreeMemory:
    """Free memory in `bytes` and what set the figure (`source`: "MemAvailable", "cgroup v2 limit 16 GiB", ...)."""

    bytes: int
    source: str


def meminfo_available(meminfo: str | Path = MEMINFO) -> int | None:
    """The host memory a new allocation can take without swapping (Linux MemAvailable), or None where unknown."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    """The integer in a cgroup file; None for "max" (no limit), a missing or unreadable file."""
    try:
        text = path.read_text(encoding="ascii").strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _inactive_file(stat: Path, keys: tuple[str, ...]) -> int:
    """Page cache the kernel reclaims first (memory.stat's first of `keys`), counted free as MemAvailable does."""
    try:
        values = dict(line.split()[:2] for line in stat.read_text(encoding="ascii").splitlines() if " " in line)
        return next((int(values[k]) for k in keys if k in values), 0)
    except (OSError, ValueError):
        return 0


def _own_cgroup(proc_cgroup: Path, controller: str | None) -> str | None:
    """The process's cgroup path in /proc/self/cgroup: the v2 one ("0::/path") for `controller` None, else the v1
    hierarchy's holding `controller` ("4:memory:/path")."""
    try:
        lines = proc_cgroup.read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and (parts[1] == "" and parts[0] == "0" if controller is None
                                else controller in parts[1].split(",")):
            return parts[2]
    return None


def _limited_dirs(root: Path, own: str) -> list[Path]:
    """The process's cgroup directory under `root` and its ancestors up to `root`: a limit on any of them binds
    it (Slurm limits the job, the process sits in a step below). Where the path is not under `root` (a container
    with its own cgroup namespace mounts its cgroup as the root), `root` alone."""
    leaf = root / own.lstrip("/")
    if not leaf.is_dir() or ".." in Path(own).parts:
        return [root]
    return [leaf, *[d for d in leaf.parents if d == root or root in d.parents]]


def cgroup_free(proc_cgroup: str | Path = PROC_CGROUP, cgroup_root: str | Path = CGROUP_ROOT
                ) -> tuple[int, int, str] | None:
    """(bytes left, limit, "v2" or "v1") under the tightest memory limit of the process's cgroup or an ancestor's,
    or None where none is set ("max", v1's huge number) or there is no cgroup file system. v2: memory.max less
    memory.current; v1: memory.limit_in_bytes less memory.usage_in_bytes; both count the cgroup's inactive page
    cache (memory.stat) as free, as MemAvailable does. The paths are parameters so that a test can fake a tree."""
    proc_cgroup, root = Path(proc_cgroup), Path(cgroup_root)
    found: list[tuple[int, int, str]] = []
    for version, mount, controller, files, cache_keys in (
            ("v2", root, None, ("memory.max", "memory.current"), ("inactive_file",)),
            ("v1", root / "memory", "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes"),
             ("total_inactive_file", "inactive_file"))):
        own = _own_cgroup(proc_cgroup, controller)
        if own is None or not mount.is_dir():
            continue
        for directory in _limited_dirs(mount, own):
            limit, used = _read_int(directory / files[0]), _read_int(directory / files[1])
            if limit is None or used is None or limit >= NO_LIMIT:
                continue
            used = max(0, used - _inactive_file(directory / "memory.stat", cache_keys))
            found.append((max(0, limit - used), limit, version))
    return min(found) if found else None


def host_memory(meminfo: str | Path = MEMINFO, proc_cgroup: str | Path = PROC_CGROUP,
                cgroup_root: str | Path = CGROUP_ROOT) -> FreeMemory:
    """The host memory this process may still take: the lower of MemAvailable (`meminfo`; the physical total where
    unknown) and what its cgroup's memory limit leaves (`cgroup_free`), with which of them set it."""
    available = meminfo_available(meminfo)
    host = (FreeMemory(available, "MemAvailable") if available is not None else
            FreeMemory(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"))
    limited = cgroup_free(proc_cgroup, cgroup_root)
    if limited is not None and limited[0] < host.bytes:
        return FreeMemory(limited[0], f"cgroup {limited[2]} limit {limited[1] / 2**30:.3g} GiB")
    return host
