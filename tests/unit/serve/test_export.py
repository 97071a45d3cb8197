"""Publishing an export (xc/serve/export.py): the destination rules, the rename that never leaves half an export,
and the one-line refusals of what cannot be exported. Trained runs: tests/integration/test_export.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from xc.cli.export import main as export_main
from xc.errors import XCError
from xc.serve.export import FORMAT, MANIFEST, VERSION, check_destination, export_model, is_export, publish


def _fake_export(folder: Path, marker: str) -> dict:
    """What `publish` is handed: a writer of a complete (if tiny) export."""
    (folder / "payload.txt").write_text(marker)
    manifest = {"format": FORMAT, "version": VERSION, "files": {}}
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
