"""The one-way import rules between packages: the miner, the ANN backends and the hand-off contract import only
config, errors, file and array helpers, hand-off and ANN code (and xc/faults.py, the tests' fault injection),
never the trainer, the models, the data layer or torch.distributed, so a miner on another machine needs only the run
directory; xc/eval/ (metrics, inference, epoch selection) never reaches what is fitted after training (xc/fitting/:
kNN, fusion, the ranker, the label prior), and neither reaches training, the refresh path, ensembles or serving,
which build on them; and collectives are called in xc/distributed/ only. Checked on the source (every `import`,
function-level ones included, followed
through xc's own modules)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

XC = Path(__file__).resolve().parents[2] / "xc"
ALLOWED = {"xc.arrays", "xc.config", "xc.config_checks", "xc.errors", "xc.fsutil", "xc.handoff", "xc.ann", "xc.miner",
           "xc.faults"}


def _file(module: str) -> Path | None:
    path = XC.parent.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (type-only imports are never executed)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from xc.ann import base`
    return found


def _closure(starts: list[str]) -> tuple[set[str], set[str]]:
    """(xc modules reached, external imports seen) from the given modules, through xc's own imports."""
    seen, external, todo = set(), set(), list(starts)
    while todo:
        module = todo.pop()
        if module in seen or _file(module) is None:
            continue
        seen.add(module)
        for name in _imports(_file(module)):
            if name == "xc" or name.startswith("xc."):
                todo.append(name)
            else:
                external.add(name)
    return seen, external


def test_the_refresh_path_imports_only_config_handoff_and_ann():
    starts = [f"xc.miner.{p.stem}" for p in (XC / "miner").glob("*.py")]
    starts += [f"xc.ann.{p.stem}" for p in (XC / "ann").glob("*.py")] + ["xc.handoff"]
    reached, external = _closure(starts)
    outside = sorted(m for m in reached if not any(m == a or m.startswith(a + ".") for a in ALLOWED))
    assert not outside, f"the miner/ANN/hand-off code reaches {outside}"
    assert not any(e == "torch.distributed" or e.startswith("torch.distributed.") for e in external)
    assert {"xc.miner.service", "xc.ann.diskann_backend", "xc.handoff"} <= reached  # the walk saw them


# what xc/fitting/ may not reach: the layers above it (type-only imports under TYPE_CHECKING are allowed); xc/eval/
# may not reach xc/fitting/ either
FITTING_FORBIDDEN = ("xc.train", "xc.refresh", "xc.miner", "xc.ensemble", "xc.serve", "xc.cli")
EVAL_FORBIDDEN = ("xc.fitting", *FITTING_FORBIDDEN)


def test_eval_reaches_no_layer_above_it():
    reached, _ = _closure([f"xc.eval.{p.stem}" for p in (XC / "eval").glob("*.py")])
    above = sorted(m for m in reached if any(m == f or m.startswith(f + ".") for f in EVAL_FORBIDDEN))
    assert not above, f"xc/eval/ reaches {above}"
    assert {"xc.eval.metrics", "xc.eval.inference", "xc.eval.epoch_select"} <= reached


def test_fitting_reaches_no_layer_above_it():
    reached, _ = _closure([f"xc.fitting.{p.stem}" for p in (XC / "fitting").glob("*.py")])
    above = sorted(m for m in reached if any(m == f or m.startswith(f + ".") for f in FITTING_FORBIDDEN))
    assert not above, f"xc/fitting/ reaches {above}"
    assert {"xc.fitting.fusion", "xc.fitting.memory", "xc.fitting.ranker", "xc.eval.inference"} <= reached


def test_a_type_only_import_is_not_a_runtime_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from xc.train.trainer import T\n"
                    "else:\n    from xc.train.step import S\ndef f():\n    import xc.refresh\n")
    assert _imports(path) >= {"xc.train.step", "xc.refresh"} and "xc.train.trainer" not in _imports(path)


def test_the_rule_catches_a_forbidden_import(tmp_path, monkeypatch):
    """The checker itself: a module that imports the trainer is reported (so the test above can fail)."""
    fake = tmp_path / "xc"
    (fake / "miner").mkdir(parents=True)
    (fake / "miner" / "bad.py").write_text("def f():\n    from xc.train.trainer import Trainer\n")
    (fake / "train").mkdir()
    (fake / "train" / "trainer.py").write_text("import torch.distributed\n")
    monkeypatch.setattr(sys.modules[__name__], "XC", fake)
    reached, external = _closure(["xc.miner.bad"])
    assert "xc.train.trainer" in reached and "torch.distributed" in external


def test_collectives_go_through_xc_distributed_only():
    """Every process-group call (all-reduce, gathers, barriers, broadcasts) is made in xc/distributed/, so that
    what crosses ranks is written in one place; every other module calls its helpers."""
    offenders = sorted(str(path.relative_to(XC.parent)) for path in XC.rglob("*.py")
                       if "distributed" not in path.relative_to(XC).parts[:1]
                       and any(name == "torch.distributed" or name.startswith("torch.distributed.")
                               for name in _imports(path)))
    assert not offenders, f"torch.distributed imported outside xc/distributed/: {offenders}"
    assert any(name == "torch.distributed" for name in _imports(XC / "distributed" / "comm.py"))  # the walk sees it


# The package facade is an entry point beside the commands: `xc.fit` is xc-train called from Python.
FACADE = {"xc/__init__.py": {"xc.cli.fit", "xc.cli.fit.fit"}}


def test_nothing_imports_the_command_line_layer():
    """xc/cli/ (xc-train, xc-eval, xc-predict, xc-baseline, xc.fit) sits on top: no other module of xc imports it,
    except the package facade's `xc.fit`."""
    def offends(path: Path) -> bool:
        allowed = FACADE.get(str(path.relative_to(XC.parent)), set())
        return any((name == "xc.cli" or name.startswith("xc.cli.")) and name not in allowed for name in _imports(path))

    offenders = sorted(str(path.relative_to(XC.parent)) for path in XC.rglob("*.py")
                       if path.relative_to(XC).parts[0] != "cli" and offends(path))
    assert not offenders, f"xc.cli imported by {offenders}"
