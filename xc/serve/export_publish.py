"""Publishing an export folder: which destination may be written or replaced, and the swap that never leaves half
an export, a user's file lost, or a staging folder behind.

* DIR must be new, empty, or an earlier export holding nothing but what its manifest names (its files, their
  folders and export.json). A file of the user's inside an earlier export (notes beside the model) stops the export
  in one line naming it: replacing the folder would delete it.
* The export is written into a hidden sibling `.DIR.xc-export-PID`, flushed, then renamed to DIR (an earlier export
  moved aside first and removed after), with Ctrl-C and SIGTERM held off for the two renames. Whatever fails before
  (a failed check, a full disk, an unwritable parent, Ctrl-C) removes the sibling and leaves DIR as it was.
* A storage failure (no space, quota, file too large, read-only, permission) is one line naming DIR and the cause.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
from pathlib import Path

from xc.errors import XCError
from xc.fsutil import pid_alive, storage_error
from xc.serve.export_files import MANIFEST, is_export

STAGING, REPLACED = "xc-export", "xc-replaced"
# folders xc itself adds to an export after it is written (`--ann --save-index`: serving/<backend>/, at the top and
# in a member's folder): indexes of the model being replaced, rebuilt for the new one, so they go with it
XC_ADDED = ("serving",)


def foreign_entries(dest: Path) -> list[str]:
    """What lies in the earlier export `dest` that its manifest does not name (files, links, other folders), as
    paths relative to `dest`, sorted; every entry when the manifest lists no files."""
    try:
        files = json.loads((dest / MANIFEST).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        files = None
    named = set(files) if isinstance(files, dict) else set()
    folders = {"/".join(n.split("/")[:i]) for n in named for i in range(1, n.count("/") + 1)}
    out = []
    for root, dirs, names in os.walk(dest):  # links are not followed: a link is itself an entry
        rel = Path(root).relative_to(dest)
        for name in dirs + names:
            path = (rel / name).as_posix()
            entry = Path(root) / name
            if (name == MANIFEST and rel == Path(".")) or (name in dirs and name in XC_ADDED and
                                                           (rel == Path(".") or rel.as_posix() in folders)):
                continue
            if entry.is_symlink() or not (path in folders if name in dirs else path in named):
                out.append(path + ("/" if name in dirs and not entry.is_symlink() else ""))
        dirs[:] = [d for d in dirs if (rel / d).as_posix() in folders and not (Path(root) / d).is_symlink()]
    return sorted(out)


def is_mount_point(path: Path) -> bool:
    """Whether `path` is where a file system is mounted, a bind mount of a folder of the same file system included
    (which `os.path.ismount` cannot tell: same device as its parent); read from /proc/self/mountinfo on Linux."""
    if os.path.ismount(path):
        return True
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as table:
            points = [line.split()[4] for line in table if len(line.split()) > 4]
    except OSError:
        return False
    target = os.path.realpath(path)
    # the kernel writes a space, tab, newline or backslash in a path as an octal escape (\040)
    return any(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point) == target for point in points)


def check_destination(dest: Path) -> None:
    """Refuse, in one line, a `dest` that is a file, a non-empty folder `xc-export` did not write, or an earlier
    export that holds files of someone else's (replacing it would delete them)."""
    if dest.exists() and not dest.is_dir():
        raise XCError(f"{dest} is a file; name a folder for the export")
    if dest.is_dir() and is_mount_point(dest):
        # the export is published (and an earlier one set aside) by renaming folders, which a mount point refuses
        # (EBUSY): said before anything is written, not after the whole export was staged
        raise XCError(f"{dest} is a mount point, which xc-export cannot replace (it publishes by renaming a finished "
                      "folder into place); name a folder inside it")
    if not dest.is_dir() or not any(dest.iterdir()):
        return
    if not is_export(dest):
        raise XCError(f"{dest} is not empty and not an earlier export; name a new or empty folder")
    extra = foreign_entries(dest)
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise XCError(f"{dest} is an earlier export that also holds {extra[0]}{more}, which xc-export did not write: "
                      "replacing the export would delete it; move it out or name another folder")


def _storage(exc: BaseException, dest: Path) -> BaseException:
    where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
    return storage_error(exc, f"could not write the export {dest}{where}",
                         "nothing was published (an earlier export there is as it was): free some space, fix the "
                         "folder's permissions, or name another folder")


def _hold_signals():
    """Block Ctrl-C and SIGTERM (delivered when `_release` unblocks them), so the two renames happen both or neither;
    returns the mask to restore (None off the main thread, where signals are not delivered anyway)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def _release(before) -> None:
    if before is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _sweep(dest: Path) -> None:
    """Remove the staging and replaced siblings an export killed mid-way left (its process is gone)."""
    for left in dest.parent.glob(f".{dest.name}.xc-*-*"):
        kind, _, pid = left.name[len(dest.name) + 2:].rpartition("-")
        if kind in (STAGING, REPLACED) and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(left, ignore_errors=True)


def publish(dest: Path, write) -> dict:
    """write(folder) into a hidden sibling of `dest`, then rename it to `dest` (an earlier export there is replaced;
    see the module docstring). Returns what `write` returns."""
    dest = dest.absolute()
    check_destination(dest)
    tmp = dest.parent / f".{dest.name}.{STAGING}-{os.getpid()}"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        _sweep(dest)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        result = write(tmp)
        for path in [*tmp.rglob("*"), tmp]:  # on disk before the rename makes them the export
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        check_destination(dest)  # again: the folder may have been filled while the export was written
        held = _hold_signals()
        try:
            _swap(tmp, dest)
        except BaseException:
            _release(held)
            raise
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        error = _storage(exc, dest)
        if error is exc:
            raise
        raise error from None
    try:
        _release(held)  # a Ctrl-C pressed during the renames arrives here, the export complete
    except KeyboardInterrupt as exc:
        exc.published = True
        raise
    return result


def _swap(tmp: Path, dest: Path) -> None:
    if dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()
    if not dest.exists():
        os.rename(tmp, dest)
        return
    old = dest.parent / f".{dest.name}.{REPLACED}-{os.getpid()}"  # the earlier export: aside, then removed
    os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)
