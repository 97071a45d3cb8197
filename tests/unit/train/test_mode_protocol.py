"""Both training modes implement the protocol the Trainer uses (xc/train/modes/protocol.py): every method with
the protocol's parameters, every attribute set in the mode's constructor."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from xc.train.modes import protocol
from xc.train.modes.classifier import ClassifierMode
from xc.train.modes.dual import DualMode
from xc.train.trainer import Trainer

GROUPS = (protocol.Stepping, protocol.Evaluation, protocol.CheckpointState)
COUNTERS = {"epoch", "micro", "global_step", "skipped_steps", "last_metrics"}


def _members(group) -> tuple[dict, set[str]]:
    """({method name: its parameter names}, {attribute names}) the group declares itself."""
    methods = {name: list(inspect.signature(fn).parameters) for name, fn in vars(group).items()
               if callable(inspect.getattr_static(group, name)) and not name.startswith("_")
               or isinstance(inspect.getattr_static(group, name), staticmethod)}
    attributes = set(getattr(group, "__annotations__", {}))
    return methods, attributes


def _assigned_in_init(cls) -> set[str]:
    """Names the class's __init__ assigns as self.<name> (possibly in tuple assignments)."""
    tree = ast.parse(inspect.getsource(cls))
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for target in (n.targets if isinstance(n, ast.Assign) else [n.target])
            for t in ast.walk(target) if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"}


@pytest.mark.parametrize("mode", [ClassifierMode, DualMode], ids=["classifier", "dual"])
def test_each_mode_implements_every_group_of_the_protocol(mode):
    assigned = _assigned_in_init(mode)
    for group in GROUPS:
        methods, attributes = _members(group)
        assert methods, group
        for name, params in methods.items():
            assert hasattr(mode, name), f"{mode.__name__} lacks {group.__name__}.{name}"
            assert list(inspect.signature(getattr(mode, name)).parameters) == params, (
                f"{mode.__name__}.{name}{inspect.signature(getattr(mode, name))} against the protocol's {params}")
        missing = attributes - assigned
        assert not missing, f"{mode.__name__}.__init__ does not set {sorted(missing)} ({group.__name__})"


@pytest.mark.parametrize("mode", [ClassifierMode, DualMode], ids=["classifier", "dual"])
def test_no_mode_resolves_a_config_of_its_own(mode):
    """A mode is built from the run's plan (xc.train.plan.resolve_run, called once by the entry point): it has no
    way of its own to make one."""
    assert not hasattr(mode, "plan") and not hasattr(protocol.Mode, "plan")


def test_the_protocol_covers_what_the_trainer_calls_on_its_mode():
    """Every `mode.X` / `self.mode.X` in the Trainer and its lifecycle helpers is a protocol member (or the
    classifier's step_batch, named in the protocol's docstring)."""
    declared = set()
    for group in GROUPS:
        methods, attributes = _members(group)
        declared |= set(methods) | attributes
    called = set()
    for path in (Path(inspect.getfile(Trainer)), Path(inspect.getfile(Trainer)).with_name("lifecycle.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and (
                    isinstance(node.value, ast.Name) and node.value.id == "mode"
                    or isinstance(node.value, ast.Attribute) and node.value.attr == "mode"):
                called.add(node.attr)
    assert called, "the walk found no calls"
    assert called - declared <= {"step_batch"}, sorted(called - declared)


def test_a_mode_missing_a_member_is_found():
    class Partial:
        def start(self, logger):
            return None  # one of Mode's members, the others missing

    assert not isinstance(Partial(), protocol.Mode)
    methods, _ = _members(protocol.Stepping)
    assert "micro_step" in methods and methods["micro_step"] == ["self", "micro", "key", "last_of_step", "global_step"]


def test_nothing_attaches_attributes_to_a_trainer_after_construction():
    """The Trainer takes what it needs in its constructor (identity, the stop control, its heartbeat): no code
    outside the class assigns `trainer.<name> = ...`, but for the loop's counters, which its lifecycle helpers
    (xc/train/lifecycle.py) advance."""
    root = Path(inspect.getfile(Trainer)).parents[1]
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:  # `trainer.x = ...`, also inside tuple targets (not `trainer.x.y = ...`)
                for t in [target, *(target.elts if isinstance(target, ast.Tuple) else [])]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "trainer" \
                            and t.attr not in COUNTERS:
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno}: trainer.{t.attr}")
    assert not found, found
