"""A run directory is xc's or refused before anything is written (xc/run/guard.py `check_run_dir_is_ours`)."""

from __future__ import annotations

import os
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


@pytest.mark.parametrize("marker", ["identity.json", "checkpoints", "members", ".lock", "heartbeat"])
def test_new_empty_and_xc_run_folders_are_accepted(tmp_path, marker):
    assert check_run_dir_is_ours(tmp_path / "new") is None and not (tmp_path / "new").exists()  # nothing made
    assert check_run_dir_is_ours(tmp_path) is None  # empty
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError):  # a user's file alone: refused ...
        check_run_dir_is_ours(tmp_path)
    (tmp_path / marker).mkdir() if "." not in marker else (tmp_path / marker).write_text("{}")
    assert check_run_dir_is_ours(tmp_path) is None  # ... and accepted once xc's own marker is there


def test_xc_train_into_a_users_folder_stops_and_leaves_it_untouched(tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    files = {"config.json": '{"mine": 1}', "metrics.json": "[]", "log.jsonl": "my log\n"}
    for name, text in files.items():
        (user / name).write_text(text)
    env = {**os.environ, "XC_DATA": str(SHARED_DATA), "XC_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "xc.cli.train", f"run_dir={user}", "logger.wandb=disabled",
                           f"data.cache_dir={tmp_path / 'cache'}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "error: config run_dir:" in proc.stderr and "config.json, log.jsonl, metrics.json" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in user.iterdir()) == sorted(files)
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
    assert str(info.value) == f"could not write the lock {tmp_path / '.lock'}: no space left on the device"
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
    assert str(info.value) == f"could not create the run directory {tmp_path / 'run'}: read-only file system"
