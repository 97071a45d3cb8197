"""The GPU suite only runs on a GPU host; what it borrows from the CPU suite must still exist here.

tests/gpu imports helpers from other test modules inside its test functions; a moved or renamed helper
would only surface on the device. This parses those imports and resolves each one on the CPU.
"""
import ast
import importlib
from pathlib import Path

import pytest

GPU_TESTS = sorted((Path(__file__).resolve().parents[1] / "gpu").glob("test_*.py"))


def _borrowed(path: Path) -> list[tuple[str, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
            found += [(node.module, alias.name) for alias in node.names]
    return found


def test_the_gpu_suite_borrows_from_other_test_modules():
    assert GPU_TESTS and any(_borrowed(path) for path in GPU_TESTS)


@pytest.mark.parametrize("module,name", sorted({pair for path in GPU_TESTS for pair in _borrowed(path)}))
def test_every_helper_the_gpu_suite_borrows_exists(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"
