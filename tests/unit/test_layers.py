"""xc's packages in one declared order, lowest first (tools/package_map.py LAYERS): a module imports only from its
own package or one below, read from every import (absolute, relative, function-level)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_imports_a_layer_above_its_own(package_map):
    assert package_map.upward_imports() == []


def test_every_package_and_top_level_module_has_a_layer_and_a_place_in_the_picture(package_map):
    xc = ROOT / "xc"
    units = {p.stem for p in xc.glob("*.py") if p.stem != "__init__"} | {"xc"}
    units |= {p.name for p in xc.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert units == set(package_map.LAYERS)
    drawn = [u for _, row in package_map.TIERS for u in row]
    assert drawn == package_map.LAYERS  # the picture's rows read in the order itself


def test_a_planted_upward_import_is_found(package_map, tmp_path):
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
    assert package_map.upward_imports(root) == ["xc/run/resume.py:6: run -> train"]
