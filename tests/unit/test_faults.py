"""The tests' fault injection (xc/faults.py): one `Faults` object built from the XC_FAULT_* variables at a
process's entry, a no-op by default, and no other module reading those variables."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest

from xc.faults import NO_FAULTS, Faults

XC = Path(__file__).resolve().parents[2] / "xc"

# each variable, a value a test would set, and the field it must land in with that value
VARIABLES = [
    ("XC_FAULT_KILL_AT_STEP", "7", "kill_at_step", 7),
    ("XC_FAULT_KILL_RANK", "1", "kill_rank", 1),
    ("XC_FAULT_NAN_AT_STEP", "10", "nan_at_step", 10),
    ("XC_FAULT_NAN_KIND", "grad", "nan_kind", "grad"),
    ("XC_FAULT_NAN_RANK", "1", "nan_rank", 1),
    ("XC_FAULT_SNAPSHOT_ENOSPC", "1", "snapshot_enospc", True),
    ("XC_FAULT_SIGNAL_AT_STEP", "6", "signal_at_step", 6),
    ("XC_FAULT_SIGNAL_AT_EPOCH_END", "2", "signal_at_epoch_end", 2),
    ("XC_FAULT_SIGNAL_IN_FINAL_PHASE", "1", "signal_in_final_phase", True),
    ("XC_FAULT_SIGNAL", "INT", "signal_name", "INT"),
    ("XC_FAULT_SIGNAL_RANK", "1", "signal_rank", 1),
    ("XC_FAULT_SIGNAL_TARGET", "parent", "signal_target", "parent"),
    ("XC_FAULT_MINER_HANG", "1", "miner_hang", True),
    ("XC_FAULT_MINER_DELAY_S", "8", "miner_delay_s", 8.0),
    ("XC_FAULT_MINER_KILL", "1", "miner_kill", True),
    ("XC_FAULT_MINER_ENOSPC", "1", "miner_enospc", True),
    ("XC_FAULT_RAY_MARK_DIR", "/tmp/marks", "ray_mark_dir", "/tmp/marks"),
    ("XC_FAULT_RAY_TASK_DELAY_S", "3", "ray_task_delay_s", 3.0),
]


def test_an_empty_environment_injects_nothing():
    assert Faults.from_env({}) == NO_FAULTS == Faults()
    unrelated = {"PATH": "/usr/bin", "XC_THREADS": "4", "XC_FAULT_SNAPSHOT_ENOSPC": "0",
                 "XC_FAULT_RAY_TASK_DELAY_S": ""}  # what each of these means when set so: off
    assert Faults.from_env(unrelated) == NO_FAULTS


@pytest.mark.parametrize("variable, value, name, expected", VARIABLES, ids=[v[0] for v in VARIABLES])
def test_each_variable_sets_its_field_and_only_it(variable, value, name, expected):
    faults = Faults.from_env({variable: value})
    assert getattr(faults, name) == expected
    assert faults == dataclasses.replace(NO_FAULTS, **{name: expected})  # every other field stays off


def test_every_field_has_its_variable():
    fields = {f.name for f in dataclasses.fields(Faults) if f.init}
    assert fields == {name for _, _, name, _ in VARIABLES}


def test_a_fault_object_travels_to_a_worker_process_intact():
    faults = Faults.from_env({variable: value for variable, value, _, _ in VARIABLES})
    assert pickle.loads(pickle.dumps(faults)) == faults


def test_the_signal_fires_once_per_trigger(monkeypatch):
    sent = []
    faults = Faults(signal_at_step=3, signal_at_epoch_end=1, signal_rank=1)
    monkeypatch.setattr(Faults, "_send", lambda self: sent.append(self))
    faults.maybe_signal(3, rank=0)  # another rank: nothing
    faults.maybe_signal(2, rank=1)
    assert sent == []
    faults.maybe_signal(3, rank=1)
    faults.maybe_signal(3, rank=1)
    faults.maybe_signal(1, rank=1, at="epoch_end")
    faults.maybe_signal(1, rank=1, at="epoch_end")
    assert len(sent) == 2
    for count in range(10):
        NO_FAULTS.maybe_signal(count, rank=0)
        NO_FAULTS.maybe_signal(count, rank=0, at="epoch_end")
    assert len(sent) == 2


def _fault_strings(path: Path) -> list[tuple[int, str | None]]:
    """(line, enclosing function or None) of each string literal naming an XC_FAULT_ variable in `path`, docstrings
    left out (they may name a variable to document it)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Constant) and isinstance(child.value, str) and "XC_FAULT_" in child.value \
                    and id(child) not in docstrings:
                found.append((child.lineno, function))
            visit(child, inner)

    visit(tree, None)
    return found


def test_only_faults_from_env_reads_the_fault_variables():
    """Guards against a module that reads an XC_FAULT_ variable itself (at import time, or in its hot path): the
    entry points build a Faults once and pass it on."""
    stray, in_from_env = [], 0
    for path in sorted(XC.rglob("*.py")):
        where = path.relative_to(XC.parent).as_posix()
        for line, function in _fault_strings(path):
            if where == "xc/faults.py" and function == "from_env":
                in_from_env += 1
            else:
                stray.append(f"{where}:{line}")
    assert not stray, f"XC_FAULT_ variables read outside Faults.from_env: {stray}"
    assert in_from_env == len(VARIABLES)  # the walk saw from_env's reads


def test_the_walk_finds_a_stray_read(tmp_path):
    module = tmp_path / "stray.py"
    module.write_text('"""Reads XC_FAULT_X (a docstring: allowed)."""\nimport os\n\n\n'
                      'def f():\n    return os.environ.get("XC_FAULT_X")\n\n\nLATE = f"XC_FAULT_{1}"\n')
    assert _fault_strings(module) == [(6, "f"), (9, None)]
