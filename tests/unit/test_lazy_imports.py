"""Imports of xc's own modules sit at the top of each module; one left inside a function says why on its line:
`# lazy: <reason>` (an import cycle, a heavy or optional dependency kept off a light module's path such as `import
xc` or a CLI's --help, a test that patches the module's attribute at call time). Which lines import xc's own modules
comes from import-linter's graph (grimp: absolute and relative, `if TYPE_CHECKING:` blocks left out)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]


def _function_level_lines(tree: ast.AST) -> set[int]:
    """First lines of the import statements inside a function (at any depth)."""
    lines, todo = set(), [(tree, False)]
    while todo:
        node, inside = todo.pop()
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                lines.add(child.lineno)
            todo.append((child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))))
    return lines


def _module_file(root: Path, module: str) -> Path:
    path = root.parent.joinpath(*module.split("."))
    return path / "__init__.py" if (path / "__init__.py").is_file() else path.with_suffix(".py")


def xc_import_lines(root: Path) -> dict[Path, set[int]]:
    """file -> the lines where it imports one of xc's own modules. `root` is the package folder that `import xc`
    finds (grimp locates the package by name)."""
    graph = grimp.build_graph("xc", exclude_type_checking_imports=True, cache_dir=None)
    found: dict[Path, set[int]] = {}
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            details = graph.get_import_details(importer=importer, imported=imported)
            found.setdefault(_module_file(root, importer), set()).update(d["line_number"] for d in details)
    return found


def unmarked_lazy_imports(root: Path) -> list[str]:
    """'path:line: source' for each function-level import of an xc module without a `# lazy: <reason>` comment."""
    found = []
    for path, imports in sorted(xc_import_lines(root).items()):
        where = path.relative_to(root.parent).as_posix()
        source = path.read_text(encoding="utf-8")
        inside = _function_level_lines(ast.parse(source))
        rows = source.splitlines()
        lines = imports & inside
        for line in sorted(lines):
            _, mark, reason = rows[line - 1].partition("# lazy:")
            if not (mark and reason.strip()):
                found.append(f"{where}:{line}: {rows[line - 1].strip()}")
    return found


def test_every_function_level_import_of_xc_says_why_it_is_lazy():
    found = unmarked_lazy_imports(ROOT / "xc")
    assert not found, ("hoist these imports to the module's top, or say why one must stay in its function with a "
                       "`# lazy: <reason>` comment on its line:\n" + "\n".join(found))


def test_the_check_finds_an_unmarked_import(tmp_path, monkeypatch):
    """The check itself: a function-level import of xc, absolute or relative (first line of a multi-line one), is
    reported unless it carries a reason; module-level, type-only and third-party imports are not its business."""
    pkg = tmp_path / "xc" / "data"
    pkg.mkdir(parents=True)
    (tmp_path / "xc" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "formats.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from xc.errors import XCError\n"                                    # 2: module level
        "if TYPE_CHECKING:\n"
        "    from xc.train import trainer\n"                                 # 4: never runs
        "def f():\n"
        "    import numpy\n"                                                 # 6: not xc
        "    from .arff import g\n"                                          # 7: unmarked
        "    from xc.ann import exact  # lazy: loads torch\n"                # 8: marked
        "    from xc.ann import (  # lazy:\n"                                # 9: a mark without a reason
        "        base)\n"
        "    class C:\n"
        "        def m(self):\n"
        "            from xc.errors import (\n"                              # 13: unmarked, nested, multi-line
        "                XCError)  # lazy: not on the first line\n")
    (tmp_path / "xc" / "late.py").write_text("def f():\n    import xc.data  # lazy: a reason\n")
    (tmp_path / "xc" / "errors.py").write_text("class XCError(Exception):\n    pass\n")
    (pkg / "arff.py").write_text("def g():\n    pass\n")
    (tmp_path / "xc" / "ann").mkdir()
    for name in ("__init__", "exact", "base"):
        (tmp_path / "xc" / "ann" / f"{name}.py").write_text("")
    monkeypatch.delitem(sys.modules, "xc", raising=False)  # grimp finds the package by name: this copy
    monkeypatch.syspath_prepend(str(tmp_path))
    found = unmarked_lazy_imports(tmp_path / "xc")
    assert [f.split(": ")[0] for f in found] == ["xc/data/formats.py:7", "xc/data/formats.py:9",
                                                 "xc/data/formats.py:13"]
