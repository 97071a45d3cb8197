"""A run directory is xc's or refused before anything is written (xc/run/guard.py `check_run_dir_is_ours`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SHARED_DATA
from xc.errors import ConfigError
from xc.run.guard import check_run_dir_is_ours


@pytest.mark.parametrize("where", ["root", "home", "checkout"])
def test_root_home_and_the_checkout_are_refused(where, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    path = {"root": Path("/"), "home": tmp_path / "home", "checkout": REPO}[where]
    with pytest.raises(ConfigError) as info:
        check_run_dir_is_ours(path)
    assert info.value.key == "run_dir" and {"root": "root", "home": "home directory", "checkout": "checkout"}[where] \
        in str(info.value)


def test_a_folder_of_the_users_files_is_refused_naming_them(tmp_path):
    for name in ("config.json", "metrics.json", "log.jsonl", "notes.txt"):
        (tmp_path / name).write_text("mine")
    with pytest.raises(ConfigError) as info:
        check_run_dir_is_ours(tmp_path)
    assert "config.json, log.jsonl, metrics.json, notes.txt" in str(info.value)


IDENTITY = '{"version": 1, "data": {"num_labels": 5}, "config": {"model.embed_dim": 8}}'
LOCK = '{"pid": 1, "host": "h", "started": 0.0}'
# What xc itself writes (path -> content; a path ending in / is a folder), one marker each.
XC_MARKERS = {".xc-run": "{}", "identity.json": IDENTITY, ".lock": LOCK, ".lock.stale-42": LOCK,
              "checkpoints/step-00000003/meta.json": "{}", "members/m0/identity.json": IDENTITY,
              "members/m1/.xc-run": "{}", "archive/20260101T000000Z/identity.json": IDENTITY}
# Names a user's own folder may hold too: they are no sign of an xc run.
LOOKALIKES = {"archive/": None, "handoff/": None, "checkpoints/": None, "heartbeat/": None, "members/": None,
              "label_cache/": None, "ensemble.json": "{}", "identity.json": '{"mine": true}',
              ".lock": "my lock", "checkpoints/step-00000003/notes.txt": "mine", "archive/old/config.json": "{}"}


def _make(root: Path, name: str, content: str | None) -> None:
    path = root / name
    if content is None:
        path.mkdir(parents=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


@pytest.mark.parametrize("marker", sorted(XC_MARKERS))
def test_new_empty_and_xc_run_folders_are_accepted(tmp_path, marker):
    assert check_run_dir_is_ours(tmp_path / "new") is None and not (tmp_path / "new").exists()  # nothing made
    assert check_run_dir_is_ours(tmp_path) is None  # empty
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError):  # a user's file alone: refused ...
        check_run_dir_is_ours(tmp_path)
    _make(tmp_path, marker, XC_MARKERS[marker])
    assert check_run_dir_is_ours(tmp_path) is None  # ... and accepted once xc's own marker is there


@pytest.mark.parametrize("lookalike", sorted(LOOKALIKES))
def test_a_users_folder_with_a_subfolder_named_like_xcs_is_still_refused(tmp_path, lookalike):
    """A folder of the user's config.json and metrics.json with an archive/ (handoff/, checkpoints/, ...) of its own
    used to count as an xc run: xc-train resumed it, exit 0, and overwrote both files."""
    for name in ("config.json", "metrics.json"):
        (tmp_path / name).write_text("mine")
    _make(tmp_path, lookalike, LOOKALIKES[lookalike])
    with pytest.raises(ConfigError) as info:
        check_run_dir_is_ours(tmp_path)
    message = str(info.value)
    assert "holds no xc run" in message and "config.json" in message and "metrics.json" in message


def test_taking_the_lock_marks_the_folder_first_so_a_crashed_start_is_still_ours(tmp_path):
    from xc.run.lock import RunLock

    lock = RunLock(tmp_path / "run")
    lock.acquire()
    lock.release()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".xc-run"]
    (tmp_path / "run" / "handoff").mkdir()  # what a start that died before identity.json may leave
    (tmp_path / "run" / "config.json").write_text("{}")
    assert check_run_dir_is_ours(tmp_path / "run") is None


@pytest.mark.parametrize("subfolder", [None, "archive"])
def test_xc_train_into_a_users_folder_stops_and_leaves_it_untouched(tmp_path, subfolder):
    user = tmp_path / "mine"
    user.mkdir()
    files = {"config.json": '{"mine": 1}', "metrics.json": "[]", "log.jsonl": "my log\n"}
    if subfolder:  # a folder of the user's named like one of xc's (archive/, handoff/, checkpoints/)
        files[f"{subfolder}/notes.txt"] = "old notes"
    for name, text in files.items():
        (user / name).parent.mkdir(exist_ok=True)
        (user / name).write_text(text)
    env = {**os.environ, "XC_DATA": str(SHARED_DATA), "XC_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "xc.cli.train", f"run_dir={user}", "logger.wandb=disabled",
                           f"data.cache_dir={tmp_path / 'cache'}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "error: config run_dir:" in proc.stderr and "config.json, log.jsonl, metrics.json" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(str(p.relative_to(user)) for p in user.rglob("*") if p.is_file()) == sorted(files)
    assert all((user / name).read_text() == text for name, text in files.items())


def test_a_full_disk_while_writing_a_checkpoint_is_one_line_and_leaves_no_part_file(tmp_path, monkeypatch):
    """torch.save on a full disk raises a RuntimeError ("unexpected pos") during the OSError: one CheckpointError
    naming the file and the cause, and the half-written .part is gone."""
    import errno

    import torch

    from xc.run import checkpoint as ckpt
    from xc.errors import CheckpointError

    real_save = torch.save

    def full_disk_save(obj, handle):
        class Full:
            written = 0

            def write(self, data):
                Full.written += len(data)
                if Full.written > 4096:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return handle.write(data)

            def flush(self):
                handle.flush()

        real_save(obj, Full())

    monkeypatch.setattr(ckpt.torch, "save", full_disk_save)
    with pytest.raises(CheckpointError) as info:
        ckpt.write_rank_files(tmp_path, 8, 0, {"w": torch.zeros(100_000)}, None)
    assert "rank0.pt: no space left on the device" in str(info.value) and "\n" not in str(info.value)
    tmp_dir = tmp_path / "checkpoints" / "step-00000008.tmp"
    assert not list(tmp_dir.glob("*.part")) and not (tmp_dir / "rank0.pt").exists()


def test_a_lock_that_cannot_be_written_leaves_no_lock_file(tmp_path, monkeypatch):
    import errno

    from xc.errors import XCError
    from xc.run.lock import RunLock

    def no_space(fd, me):
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RunLock, "_write", staticmethod(no_space))
    with pytest.raises(XCError) as info:
        RunLock(tmp_path).acquire()
    assert str(info.value).startswith(f"could not write the lock {tmp_path / '.lock'}: no space left on the device; ")
    assert not (tmp_path / ".lock").exists()


def test_a_full_disk_at_the_lock_first_gives_back_a_crashs_unpublished_checkpoint(tmp_path, monkeypatch):
    import errno

    from xc.run.lock import RunLock

    leftover = tmp_path / "checkpoints" / "step-00000012.tmp"
    leftover.mkdir(parents=True)
    (leftover / "rank0.pt.part").write_bytes(b"x" * 1000)
    real_write, calls = RunLock._write, []

    def full_until_swept(fd, me):
        calls.append(leftover.exists())
        if leftover.exists():
            os.close(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, me)

    monkeypatch.setattr(RunLock, "_write", staticmethod(full_until_swept))
    lock = RunLock(tmp_path)
    lock.acquire()
    assert lock.held and calls == [True, False] and not leftover.exists()
    lock.release()
    assert not (tmp_path / ".lock").exists()


def test_a_read_only_run_directory_is_one_line(tmp_path, monkeypatch):
    import errno

    from xc.errors import XCError
    from xc.run.lock import RunLock

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(XCError) as info:
        RunLock(tmp_path / "run").acquire()
    assert str(info.value).startswith(f"could not create the run directory {tmp_path / 'run'}: read-only file system; ")


STORAGE_FAILURES = {"EROFS": "read-only file system", "EACCES": "permission denied", "ENOSPC": "no space left",
                    "EDQUOT": "disk quota exceeded"}


def _failing_os_open(monkeypatch, errno_name: str, where: str) -> None:
    """os.open fails with `errno_name` for paths ending in `where` (tests run as root, who ignores permissions)."""
    import errno

    real_open = os.open

    def failing(path, *args, **kwargs):
        if str(path).endswith(where):
            code = getattr(errno, errno_name)
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing)


@pytest.mark.parametrize("errno_name", sorted(STORAGE_FAILURES))
def test_an_existing_run_on_a_read_only_or_full_disk_stops_at_the_lock_in_one_line(tmp_path, monkeypatch, errno_name):
    """The run directory exists (mkdir succeeds), only the lock's create fails: this was hydra's "Error executing
    job" and an OSError traceback from xc/run/lock.py."""
    from xc.errors import XCError
    from xc.run.lock import RunLock

    (tmp_path / "identity.json").write_text(IDENTITY)
    _failing_os_open(monkeypatch, errno_name, ".lock")
    with pytest.raises(XCError) as info:
        RunLock(tmp_path).acquire()
    message = str(info.value)
    assert message.startswith(f"could not write the lock {tmp_path / '.lock'}: {STORAGE_FAILURES[errno_name]}")
    assert "run_dir=" in message and "\n" not in message
    assert not (tmp_path / ".lock").exists() and not (tmp_path / ".xc-run").exists()


def test_a_stale_lock_on_a_read_only_mount_is_one_line(tmp_path, monkeypatch):
    import errno

    from xc.errors import XCError
    from xc.run.lock import RunLock

    host = socket.gethostname()  # this host, and a pid that cannot be alive: a stale lock
    (tmp_path / ".lock").write_text(json.dumps({"pid": 999999999, "host": host, "started": 0}))

    def read_only(src, dst):
        raise OSError(errno.EROFS, "Read-only file system", str(src))

    monkeypatch.setattr(os, "replace", read_only)
    with pytest.raises(XCError) as info:
        RunLock(tmp_path).acquire()
    assert str(info.value).startswith(f"could not take over the stale lock {tmp_path / '.lock'}: read-only file system")


@pytest.mark.parametrize("errno_name", ["EROFS", "ENOSPC"])
def test_metrics_that_cannot_be_written_are_printed_first_and_stop_in_one_line(tmp_path, monkeypatch, capsys,
                                                                               errno_name):
    import errno
    from types import SimpleNamespace

    from xc.cli.train import _report
    from xc.errors import XCError

    real_write = Path.write_text

    def failing(self, *args, **kwargs):
        if self.name == "metrics.json":
            code = getattr(errno, errno_name)
            raise OSError(code, os.strerror(code), str(self))
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing)
    with pytest.raises(XCError) as info:
        _report(SimpleNamespace(run_dir=str(tmp_path)), {"P@1": 91.25})
    assert str(info.value).startswith(f"could not write {tmp_path / 'metrics.json'}: {STORAGE_FAILURES[errno_name]}")
    assert "P@1=91.25" in capsys.readouterr().out  # the figures are not lost
