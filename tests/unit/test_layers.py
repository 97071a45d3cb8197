"""xc's packages in one declared order, lowest first (tools/package_map.py LAYERS): a module imports only from its
own package or one below, read from every import (absolute, relative, function-level)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def layers():
    """tools/package_map.py as a module (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location("package_map", ROOT / "tools" / "package_map.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_no_module_imports_a_layer_above_its_own(layers):
    assert layers.upward_imports() == []


def test_every_package_and_top_level_module_has_a_layer_and_a_place_in_the_picture(layers):
    xc = ROOT / "xc"
    units = {p.stem for p in xc.glob("*.py") if p.stem != "__init__"} | {"xc"}
    units |= {p.name for p in xc.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert units == set(layers.LAYERS)
    drawn = [u for _, row in layers.TIERS for u in row]
    assert drawn == layers.LAYERS  # the picture's rows read in the order itself


def test_a_planted_upward_import_is_found(layers, tmp_path):
    """The check itself: a copy of two layers where the lower one imports the upper one, relatively and inside a
    function, beside a type-only import that never runs and a downward one."""
    root = tmp_path / "xc"
    (root / "run").mkdir(parents=True)
    (root / "train").mkdir()
    for d in (root, root / "run", root / "train"):
        (d / "__init__.py").write_text("")
    (root / "train" / "optim.py").write_text("from xc.run import resume\n")
    (root / "run" / "resume.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from xc.train import optim\n\n"
        "def f():\n    from ..train.optim import lr\n    return lr\n")
    assert layers.upward_imports(root) == ["xc/run/resume.py:6: run -> train"]
