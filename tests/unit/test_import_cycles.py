"""No import cycles: the module graph of xc (every import, function-level ones included, relative ones resolved)
has no cycle, so each module can be read, tested and moved with what it imports and nothing that imports it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

XC = Path(__file__).resolve().parents[2] / "xc"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the xc modules it imports (a `from pkg import name` counts pkg, and pkg.name where that is a module)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                submodules = [f"{base}.{alias.name}" for alias in node.names]
                # `from . import arff` needs the package only as a namespace; `from xc.data import load_dataset`
                # runs the package's __init__ for a name it defines: an edge to it
                targets = submodules if all(m in modules for m in submodules) else [base, *submodules]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    found = cycles(import_graph(XC))
    assert not found, f"import cycles: {[sorted(c) for c in found]}"
    assert len(import_graph(XC)) > 50  # the walk saw the package


def test_the_checker_finds_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "xc" / "data"
    pkg.mkdir(parents=True)
    (tmp_path / "xc" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "formats.py").write_text("def f():\n    from .arff import g\n")
    (pkg / "arff.py").write_text("from .formats import f\n")
    (pkg / "sparse.py").write_text("import numpy\n")
    assert cycles(import_graph(tmp_path / "xc")) == [{"xc.data.formats", "xc.data.arff"}]
