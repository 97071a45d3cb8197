"""Imports of xc's own modules sit at the top of each module; one left inside a function says why on its line:
`# lazy: <reason>` (an import cycle, a heavy or optional dependency kept off a light module's path such as `import
xc` or a CLI's --help, a test that patches the module's attribute at call time). The imports are read with
tools/package_map.py's reader (absolute and relative, `if TYPE_CHECKING:` blocks left out)."""

from __future__ import annotations

import ast
from pathlib import Path

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


def unmarked_lazy_imports(package_map, root: Path) -> list[str]:
    """'path:line: source' for each function-level import of an xc module without a `# lazy: <reason>` comment."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent).as_posix()
        source = path.read_text(encoding="utf-8")
        inside = _function_level_lines(ast.parse(source))
        rows = source.splitlines()
        lines = {line for name, line in package_map.runtime_imports(path, package_map.module_name(path, root))
                 if line in inside and (name == "xc" or name.startswith("xc."))}
        for line in sorted(lines):
            _, mark, reason = rows[line - 1].partition("# lazy:")
            if not (mark and reason.strip()):
                found.append(f"{where}:{line}: {rows[line - 1].strip()}")
    return found


def test_every_function_level_import_of_xc_says_why_it_is_lazy(package_map):
    found = unmarked_lazy_imports(package_map, ROOT / "xc")
    assert not found, ("hoist these imports to the module's top, or say why one must stay in its function with a "
                       "`# lazy: <reason>` comment on its line:\n" + "\n".join(found))


def test_the_check_finds_an_unmarked_import(package_map, tmp_path):
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
    found = unmarked_lazy_imports(package_map, tmp_path / "xc")
    assert [f.split(": ")[0] for f in found] == ["xc/data/formats.py:7", "xc/data/formats.py:9",
                                                 "xc/data/formats.py:13"]
