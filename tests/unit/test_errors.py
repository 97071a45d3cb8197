"""xc/errors.py: a feature whose optional package (a pip extra) is missing says so in one line naming the extra."""

from __future__ import annotations

import sys

import pytest

from xc.errors import MissingExtraError, XCError, require_extra


def test_a_missing_module_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed: `import ray` raises ImportError
    with pytest.raises(MissingExtraError) as info:
        require_extra("ray", "Ray", "ray", "miner=ray")
    message = str(info.value)
    assert isinstance(info.value, XCError)  # the CLIs print it as `error: ...` and exit 2
    assert message.startswith("miner=ray needs Ray, which is not installed")
    assert 'pip install -e ".[ray]"' in message and "\n" not in message


def test_a_module_that_never_existed_is_missing_too():
    with pytest.raises(MissingExtraError, match=r"\.\[plots\]"):
        require_extra("xc_no_such_module", "matplotlib", "plots", "the figure")


def test_an_installed_module_passes_without_being_imported(monkeypatch):
    monkeypatch.delitem(sys.modules, "tomllib", raising=False)
    require_extra("tomllib", "tomllib", "none", "a test")
    assert "tomllib" not in sys.modules  # found, not imported: the check is cheap where the import is not
