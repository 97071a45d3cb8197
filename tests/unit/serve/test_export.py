"""Publishing an export (xc/serve/export.py): the destination rules, the rename that never leaves half an export,
and the one-line refusals of what cannot be exported. Trained runs: tests/integration/test_export.py."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from xc.cli.export import main as export_main
from xc.errors import XCError
from xc.serve.export import FORMAT, MANIFEST, VERSION, check_destination, export_model, is_export, publish


def _fake_export(folder: Path, marker: str) -> dict:
    """What `publish` is handed: a writer of a complete (if tiny) export."""
    (folder / "payload.txt").write_text(marker)
    manifest = {"format": FORMAT, "version": VERSION, "files": {"payload.txt": {}}}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return manifest


def test_a_new_or_empty_folder_is_written_and_an_earlier_export_replaced(tmp_path):
    dest = tmp_path / "deep" / "export"
    publish(dest, lambda f: _fake_export(f, "first"))
    assert is_export(dest) and (dest / "payload.txt").read_text() == "first"
    publish(dest, lambda f: _fake_export(f, "second"))
    assert (dest / "payload.txt").read_text() == "second"
    empty = tmp_path / "empty"
    empty.mkdir()
    publish(empty, lambda f: _fake_export(f, "third"))
    assert (empty / "payload.txt").read_text() == "third"
    # an export killed mid-way leaves a hidden sibling: the next export into that folder removes it
    (tmp_path / "deep" / ".export.xc-export-999999999").mkdir()
    publish(dest, lambda f: _fake_export(f, "fourth"))
    # no temporary or replaced sibling is left behind
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["export"]


def test_a_failed_write_leaves_the_earlier_export_as_it_was(tmp_path):
    dest = tmp_path / "export"
    publish(dest, lambda f: _fake_export(f, "kept"))

    def crash(folder: Path):
        (folder / "payload.txt").write_text("half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        publish(dest, crash)
    assert (dest / "payload.txt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_users_folder_or_file_is_refused_in_one_line(tmp_path, capsys):
    users = tmp_path / "notes"
    users.mkdir()
    (users / "todo.txt").write_text("mine")
    with pytest.raises(XCError, match="not empty and not an earlier export"):
        check_destination(users)
    with pytest.raises(XCError, match="not empty and not an earlier export"):
        publish(users, lambda f: _fake_export(f, "x"))
    assert [p.name for p in users.iterdir()] == ["todo.txt"] and (users / "todo.txt").read_text() == "mine"
    a_file = tmp_path / "file.bin"
    a_file.write_bytes(b"1")
    with pytest.raises(XCError, match="is a file"):
        check_destination(a_file)

    run = tmp_path / "run"
    run.mkdir()
    assert export_main([str(run), str(users)]) == 2  # refused before the run is even loaded
    err = capsys.readouterr().err
    assert err == f"error: {users} is not empty and not an earlier export; name a new or empty folder\n"
    assert export_main([str(run), str(run)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_xc_export_is_a_console_script():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["xc-export"] == "xc.cli.export:main"
    assert any(dep.startswith("safetensors==") for dep in pyproject["project"]["dependencies"])


def test_text_encoder_and_dual_runs_are_refused_in_one_line(tmp_path):
    dual = SimpleNamespace(run_dir=tmp_path, mode="dual", text_encoder=True,
                           cfg=SimpleNamespace(model=SimpleNamespace(encoder="transformer")))
    with pytest.raises(XCError) as err:
        export_model(dual, tmp_path / "out")
    assert "model.mode=dual" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_users_file_inside_an_earlier_export_is_never_deleted(tmp_path):
    dest = tmp_path / "export"
    publish(dest, lambda f: _fake_export(f, "first"))
    (dest / "NOTES.md").write_text("my notes")
    with pytest.raises(XCError) as info:
        publish(dest, lambda f: _fake_export(f, "second"))
    assert "holds NOTES.md" in str(info.value) and "\n" not in str(info.value)
    assert (dest / "NOTES.md").read_text() == "my notes" and (dest / "payload.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no staging folder left
    (dest / "NOTES.md").unlink()
    (dest / "serving").mkdir()  # xc's own saved ANN index (--save-index): replaced with the export
    publish(dest, lambda f: _fake_export(f, "third"))
    assert (dest / "payload.txt").read_text() == "third" and not (dest / "serving").exists()


@pytest.mark.parametrize("failure", [OSError(errno.EROFS, "Read-only file system"),
                                     OSError(errno.EFBIG, "File too large"),
                                     OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_every_failure_leaves_the_earlier_export_and_no_staging_folder(tmp_path, failure):
    dest = tmp_path / "export"
    publish(dest, lambda f: _fake_export(f, "kept"))

    def failing(folder: Path):
        (folder / "payload.txt").write_text("half")
        raise failure

    with pytest.raises(XCError if isinstance(failure, OSError) else KeyboardInterrupt) as info:
        publish(dest, failing)
    if isinstance(failure, OSError):
        assert str(info.value).startswith(f"could not write the export {dest}") and "\n" not in str(info.value)
    assert (dest / "payload.txt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_an_unwritable_parent_is_one_line(tmp_path, monkeypatch):
    real_mkdir = Path.mkdir

    def mkdir(self, *a, **k):
        if self == tmp_path / "locked":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(XCError, match="permission denied"):
        publish(tmp_path / "locked" / "export", lambda f: _fake_export(f, "x"))
    assert list(tmp_path.iterdir()) == []


def test_a_mount_point_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """An export on its own mount (a read-only bind mount, a container volume) cannot be renamed aside (EBUSY): the
    whole export was staged, then an OSError traceback. Now one line before a byte is written."""
    dest = tmp_path / "export"
    publish(dest, lambda f: _fake_export(f, "kept"))
    import xc.serve.export_publish as export_publish

    monkeypatch.setattr(export_publish, "is_mount_point", lambda p: Path(p) == dest)
    with pytest.raises(XCError) as info:
        publish(dest, lambda f: pytest.fail("written into a mount point"))
    assert str(info.value) == (f"{dest} is a mount point, which xc-export cannot replace (it publishes by renaming "
                               "a finished folder into place); name a folder inside it")
    assert (dest / "payload.txt").read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_bind_mount_of_a_folder_is_known_as_a_mount_point(tmp_path, monkeypatch):
    """os.path.ismount misses a bind mount of a folder of the same file system; /proc/self/mountinfo lists it."""
    import builtins
    import io

    from xc.serve.export_publish import is_mount_point

    spaced = tmp_path / "my exports" / "bibtex"
    spaced.mkdir(parents=True)
    line = f"99 27 259:1 /src {str(spaced).replace(' ', chr(92) + '040')} ro,relatime - ext4 /dev/root rw\n"
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: io.StringIO(line) if f == "/proc/self/mountinfo"
                        else real_open(f, *a, **k))
    assert is_mount_point(spaced) and not is_mount_point(tmp_path)
    assert is_mount_point(Path("/proc"))  # a file system of its own: os.path.ismount says so


def test_ctrl_c_during_xc_export_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    import xc.serve.load

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setattr(xc.serve.load, "load", interrupted)
    assert export_main([str(run), str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("xc-export interrupted before anything was published")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_run_still_training_is_refused_unless_allowed(tmp_path, capsys, caplog):
    import socket
    import subprocess
    import sys

    from xc.serve.export import refuse_running

    run = tmp_path / "run"
    run.mkdir()
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / ".lock").write_text(json.dumps({"pid": trainer.pid, "host": socket.gethostname(), "started": 0}))
        assert export_main([str(run), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is still training" in err and "fusion.json, prior.json, calibration.json" \
            in err and "--allow-running" in err
        with caplog.at_level("WARNING"):
            refuse_running(run, allow=True)
        assert "still training" in caplog.text
    finally:
        trainer.kill()
        trainer.wait()
    refuse_running(run)  # its trainer gone: the lock is stale, the run finished or died


def test_a_file_size_limit_is_one_line_and_leaves_no_staging_folder(tmp_path):
    """`ulimit -f` for real (RLIMIT_FSIZE in a child, SIGXFSZ ignored as Python does): EFBIG, said in one line."""
    import resource
    import signal
    import subprocess
    import sys

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))

    code = ("import sys; from xc.errors import XCError; from xc.serve.export import publish; from pathlib import Path\n"
            "try:\n    publish(Path(sys.argv[1]), lambda f: (f / 'big.bin').write_bytes(bytes(100_000)))\n"
            "except XCError as exc:\n    print(exc)")
    # no bytecode written under the limit: Python would rename a truncated .pyc into __pycache__
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "export")], preexec_fn=limit, env=env,
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"could not write the export {tmp_path / 'export'}") and "file too large" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_rust_io_error_is_a_storage_failure():
    from xc.fsutil import storage_failure

    assert storage_failure(Exception("Error while serializing: I/O error: File too large (os error 27)")) \
        .startswith("file too large")
    assert storage_failure(Exception("I/O error: No such file (os error 2)")) is None
