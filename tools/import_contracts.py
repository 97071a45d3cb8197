"""Two import-linter contract types for what its built-in ones cannot say, registered in pyproject.toml's
[tool.importlinter] `contract_types` (`lint-imports` run from the repository root finds this file: it puts the working
directory on sys.path).

- external_submodule: which of xc's modules may import a submodule of an external package (`torch.distributed`).
  The built-in forbidden contract forbids whole external packages only (the graph keeps `torch`, not
  `torch.distributed`), so this one takes the graph's import sites of the package (line numbers, type-only ones
  included or not as the graph was built) and reads the statements at those lines for the names they bring in.
- acyclic_modules: no cycle in the module graph at all. The built-in acyclic_siblings contract compares the children
  of each package with each other, so it misses a cycle through a package's own __init__.py (xc/data/__init__.py
  imports xc.data.cache, which imports a name from xc.data).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import grimp
from importlinter import Contract, ContractCheck, fields, output


def _module_file(module: str) -> Path:
    """The source file of a module of the graph, found from its top-level package without importing either."""
    root, *rest = module.split(".")
    base = Path(importlib.util.find_spec(root).submodule_search_locations[0]).joinpath(*rest)
    package = base / "__init__.py"
    return package if package.is_file() else base.with_suffix(".py")


def _names_imported(statement: ast.stmt) -> set[str]:
    """Every dotted name an import statement can bind or load: `from torch import distributed` names both `torch`
    and `torch.distributed`, `import torch.distributed.nn` names `torch.distributed.nn`."""
    if isinstance(statement, ast.Import):
        return {alias.name for alias in statement.names}
    if isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
        return {statement.module} | {f"{statement.module}.{alias.name}" for alias in statement.names}
    return set()


class ExternalSubmoduleContract(Contract):
    """Only `allowed_importers` (and their descendants) import any of `modules`, submodules of external packages
    such as `torch.distributed`, or anything below them. Needs include_external_packages = true."""

    type_name = "external_submodule"

    modules = fields.ListField(subfield=fields.StringField())
    allowed_importers = fields.ListField(subfield=fields.ModuleExpressionField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        allowed = {str(expression) for expression in self.allowed_importers}  # type: ignore[attr-defined]
        offenders = []
        for forbidden in self.modules:  # type: ignore[attr-defined]
            root = forbidden.split(".")[0]
            if root not in graph.modules:
                continue  # nothing imports the package at all
            for importer in sorted(graph.find_modules_that_directly_import(root)):
                if any(importer == a or importer.startswith(a + ".") for a in allowed):
                    continue
                lines = {d["line_number"] for d in graph.get_import_details(importer=importer, imported=root)}
                tree = ast.parse(_module_file(importer).read_text(encoding="utf-8"))
                for node in ast.walk(tree):
                    if getattr(node, "lineno", None) in lines and any(
                            name == forbidden or name.startswith(forbidden + ".") for name in _names_imported(node)):
                        offenders.append((importer, node.lineno, forbidden))
        return ContractCheck(kept=not offenders, metadata={"offenders": sorted(offenders)})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for importer, line, forbidden in check.metadata["offenders"]:
            output.print_error(f"{importer} imports {forbidden} (l.{line})", bold=False)
        output.new_line()


class AcyclicModulesContract(Contract):
    """No module of `packages` (or below) reaches itself through the imports of the graph."""

    type_name = "acyclic_modules"

    packages = fields.ListField(subfield=fields.ModuleExpressionField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        cycles: dict[frozenset[str], tuple[str, ...]] = {}
        for package in (str(expression) for expression in self.packages):  # type: ignore[attr-defined]
            modules = {package} | graph.find_descendants(package)
            for importer in sorted(modules):
                for imported in sorted(graph.find_modules_directly_imported_by(importer) & modules):
                    back = graph.find_shortest_chain(importer=imported, imported=importer)
                    if back:  # importer -> imported -> ... -> importer: each cycle once, by its members
                        cycles.setdefault(frozenset(back), (importer, *back))
        return ContractCheck(kept=not cycles, metadata={"cycles": sorted(cycles.values())})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for cycle in check.metadata["cycles"]:
            output.print_error(" -> ".join(cycle), bold=False)
        output.new_line()
