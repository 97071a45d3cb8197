"""pyproject.toml declares what xc imports, and the optional parts stay optional: Ray (`miner=ray`) and matplotlib
(the benchmarks' figures) are extras, so a plain `pip install -e .` is lean and still trains."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """'ray==2.60.0' -> 'ray'; names compared as PyPI does (case, '-', '_' and '.' alike)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[=<>!~\[; ]", requirement, maxsplit=1)[0]).lower()


CORE = {_name(r) for r in PROJECT["dependencies"]}
EXTRAS = {extra: {_name(r) for r in reqs} for extra, reqs in PROJECT["optional-dependencies"].items()}


def _third_party_imports() -> dict[str, list[str]]:
    """Top-level name of every non-stdlib, non-xc module imported anywhere in xc/ -> 'path:line' of each import."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "xc").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "xc" and top not in sys.stdlib_module_names:
                    found.setdefault(top, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_ray_and_matplotlib_are_extras_and_omegaconf_is_declared():
    assert "ray" not in CORE and "matplotlib" not in CORE
    assert EXTRAS["ray"] == {"ray"} and EXTRAS["plots"] == {"matplotlib"}
    assert "omegaconf" in CORE  # xc/cli imports it itself; hydra-core bringing it is no promise
    omegaconf_pin = next(r for r in PROJECT["dependencies"] if _name(r) == "omegaconf")
    assert omegaconf_pin == f"omegaconf=={importlib.metadata.version('omegaconf')}"  # the one hydra-core brings


def test_every_package_xc_imports_is_a_declared_dependency():
    """An import of an undeclared package works only while something else happens to install it."""
    distributions = importlib.metadata.packages_distributions()
    allowed = CORE | EXTRAS["cpu"] | EXTRAS["gpu"] | EXTRAS["ray"]
    undeclared = {name: where for name, where in _third_party_imports().items()
                  if not {_name(d) for d in distributions.get(name, [name])} & allowed}
    assert undeclared == {}, f"imported by xc but not in pyproject.toml's dependencies: {undeclared}"


def test_xc_imports_ray_only_in_the_ray_miner_and_matplotlib_nowhere():
    imports = _third_party_imports()
    assert "matplotlib" not in imports
    assert {where.split(":")[0] for where in imports["ray"]} == {"xc/miner/ray_pool.py"}
    # ... and there only inside functions: importing the module (or xc) needs no Ray
    tree = ast.parse((REPO / "xc/miner/ray_pool.py").read_text(encoding="utf-8"))
    module_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [n for n in module_level if any(a.name.split(".")[0] == "ray" for a in n.names)
                or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "ray")]
