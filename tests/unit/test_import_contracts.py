"""The import rules between xc's packages are import-linter contracts in pyproject.toml's [tool.importlinter] (the
layer order, what the refresh path, eval/ and fitting/ may reach, where torch.distributed is imported, no cycles).
`lint-imports` keeps them on the repository, and breaks each one on a copy where a module imports what it may not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]["contracts"]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the tree at `root` (its pyproject.toml, its xc/, its tools/import_contracts.py): the
    working directory comes first on its sys.path, so `xc` there is the one checked, not the installed one."""
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"})


def test_every_contract_is_kept():
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in proc.stdout


def test_the_refresh_path_contract_names_every_other_unit_of_xc():
    """A miner on another machine needs only the run directory: every unit of xc is either on the refresh path (a
    source of its contract) or forbidden to it, so a new package is placed on one side or the other."""
    (layers,) = [c["layers"] for c in CONTRACTS if c["type"] == "layers"]
    (refresh,) = [c for c in CONTRACTS if c["name"].startswith("The refresh path")]
    sources = {m.removeprefix("xc.") for m in refresh["source_modules"]}
    forbidden = {m.removeprefix("xc.") for m in refresh["forbidden_modules"]}
    assert not sources & forbidden and sources | forbidden == set(layers)


def test_the_picture_draws_the_contracts_order(package_map):
    """tools/package_map.py reads the order from the layers contract; its picture's rows read in that order."""
    assert [u for _, row in package_map.TIERS for u in row] == package_map.layers()
    assert package_map.layers()[0] == "errors" and package_map.layers()[-2:] == ["cli", "xc"]


# (file under xc/, code appended to it, a line the linter's report must hold): each breaks one contract, and
# together they break every one
PLANTED = [
    # a lower layer imports a higher one, relatively and inside a function
    ("run/lock.py", "\ndef _planted():\n    from ..train import trainer\n", "xc.run.lock -> xc.train.trainer"),
    # a type-only import counts too (import-linter's default, kept)
    ("datasets.py", "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from xc.serve import model\n",
     "xc.datasets -> xc.serve.model"),
    # the facade, imported from inside xc
    ("cli/export.py", "\ndef _planted():\n    from xc import fit\n", "xc.cli.export -> xc (l."),
    # the miner reaches the data layer (below it in the order, but off the refresh path)
    ("miner/params.py", "\ndef _planted():\n    from xc.data import sparse\n", "xc.miner.params -> xc.data.sparse"),
    ("eval/metrics.py", "\ndef _planted():\n    import xc.miner.lease\n", "xc.eval.metrics -> xc.miner.lease"),
    ("fitting/lbfgs.py", "\ndef _planted():\n    from xc.miner import task\n", "xc.fitting.lbfgs -> xc.miner.task"),
    ("models/rounding.py", "\ndef _planted():\n    from torch import distributed\n",
     "xc.models.rounding imports torch.distributed"),
    # a cycle between siblings (xc.data.cache imports xc.data.sparse) and one through xc/data/__init__.py
    ("data/sparse.py", "\ndef _planted():\n    from .cache import load_dataset\n", "- .sparse -> .cache"),
    ("data/formats.py", "\ndef _planted():\n    from xc.data import load_dataset\n",
     "-> xc.data.formats -> xc.data\n"),  # a cycle's line ends where it began
]


def test_a_planted_forbidden_import_breaks_its_contract(tmp_path):
    """The contracts can fail: a copy of xc with one forbidden import per rule breaks all of them, and the report
    names each planted import."""
    shutil.copytree(REPO / "xc", tmp_path / "xc", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    (tmp_path / "tools").mkdir()
    shutil.copy(REPO / "tools" / "import_contracts.py", tmp_path / "tools")
    for name, code, _ in PLANTED:
        with open(tmp_path / "xc" / name, "a", encoding="utf-8") as f:
            f.write(code)
    report = lint_imports(tmp_path)
    assert report.returncode == 1, report.stdout + report.stderr
    assert f"Contracts: 0 kept, {len(CONTRACTS)} broken." in report.stdout, report.stdout
    missing = [line for _, _, line in PLANTED if line not in report.stdout]
    assert not missing, f"not in the report: {missing}\n{report.stdout}"


def test_a_package_outside_the_order_breaks_the_layers_contract(tmp_path):
    """Every package of xc has its place in the order (exhaustive): a new one that is not named fails."""
    shutil.copytree(REPO / "xc", tmp_path / "xc", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    (tmp_path / "tools").mkdir()
    shutil.copy(REPO / "tools" / "import_contracts.py", tmp_path / "tools")
    (tmp_path / "xc" / "newpkg").mkdir()
    (tmp_path / "xc" / "newpkg" / "__init__.py").write_text("")
    report = lint_imports(tmp_path)
    assert report.returncode == 1 and "xc.newpkg" in report.stdout, report.stdout
