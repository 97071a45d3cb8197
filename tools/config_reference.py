"""The config reference (docs/config.md, docs/config_eval.md), generated from where each option is declared.

Every field of the typed config (xc/config.py, and the ANN schema xc/ann/base.py that `miner.ann` is) is documented
by the comment on the line(s) directly above it and/or the comment trailing it. This tool reads those files with
`ast` and `tokenize` (nothing is imported, so no torch), walks the dataclasses from `XCConfig` by their fields'
types, and writes one Markdown table per section: the option's dotted hydra path, its default, its documentation.

    python tools/config_reference.py            # (re)write the reference pages
    python tools/config_reference.py --check    # exit 1 if a page differs from what would be written
    python tools/config_reference.py --stdout   # print the pages instead

tests/unit/test_config_docs.py runs the check, so a field added or changed without its comment, or a page not
regenerated, fails the unit tests.
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOT_CLASS = ("xc.config", "XCConfig")
COMMAND = "python tools/config_reference.py"

# The top-level sections each page holds, nested sections with them; two pages keep each under 400 lines.
PAGES = {
    "docs/config.md": ("", "data", "model", "sampler", "train"),
    "docs/config_eval.md": ("miner", "eval", "parallel", "logger"),
}


@dataclass(frozen=True)
class Field:
    name: str
    default: str  # as a hydra override would write it; "" for a nested section
    doc: str
    section: tuple[str, str] | None  # (module, class) of a nested dataclass


@dataclass(frozen=True)
class Section:
    path: str  # dotted hydra prefix, "" for the top level
    doc: str  # the class docstring
    fields: tuple[Field, ...]


# -- reading the source ------------------------------------------------------------------------------------------

@cache
def _module(name: str) -> tuple[ast.Module, dict[int, tuple[str, bool]]]:
    """The parsed module and its comments: line -> (text without '#', whether the comment is the whole line)."""
    source = (ROOT / (name.replace(".", "/") + ".py")).read_text()
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            whole = not tok.line[:tok.start[1]].strip()
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), whole)
    return ast.parse(source), comments


def _resolve(module: str, name: str) -> tuple[str, str] | None:
    """(module, class) of the dataclass `name` means in `module`, following aliases and `from xc... import`."""
    tree, _ = _module(module)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, name
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Name)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            return _resolve(module, node.value.id)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("xc"):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _resolve(node.module, alias.name)
    return None


def _doc(comments: dict[int, tuple[str, bool]], node: ast.AnnAssign) -> str:
    """The whole-line comments directly above the field (no blank line between) and any comment trailing it."""
    above, line = [], node.lineno - 1
    while line in comments and comments[line][1]:
        above.insert(0, comments[line][0])
        line -= 1
    trailing = [comments[n][0] for n in range(node.lineno, node.end_lineno + 1) if n in comments and not comments[n][1]]
    return " ".join(part for part in above + trailing if part)


def _render(value: object) -> str:
    """A value as a hydra override writes it: null, true/false, bare strings, [a, b]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list):
        return "[" + ", ".join(_render(v) for v in value) + "]"
    return repr(value)


def _default(node: ast.expr) -> object:
    """The field's default value: a literal, or what `field(default_factory=...)` builds (list, or a lambda's body,
    evaluated with nothing but round and range: the factories are short literal builders)."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "field":
        keywords = {k.arg: k.value for k in node.keywords}
        if "default" in keywords:
            return ast.literal_eval(keywords["default"])
        factory = keywords["default_factory"]
        if isinstance(factory, ast.Lambda):
            body = ast.Expression(factory.body)
            return eval(compile(body, "<default>", "eval"), {"__builtins__": {"round": round, "range": range}})
        if isinstance(factory, ast.Name) and factory.id == "list":
            return []
        return None  # a nested dataclass: its own section
    return ast.literal_eval(node)


def _section_class(module: str, annotation: ast.expr) -> tuple[str, str] | None:
    return _resolve(module, annotation.id) if isinstance(annotation, ast.Name) else None


@cache
def _class(module: str, name: str) -> tuple[str, tuple[Field, ...]]:
    """(docstring, fields) of a dataclass."""
    tree, comments = _module(module)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    fields = []
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            nested = _section_class(module, stmt.annotation)
            default = "" if nested else "(required)" if stmt.value is None else _render(_default(stmt.value))
            fields.append(Field(stmt.target.id, default, _doc(comments, stmt), nested))
    return " ".join((ast.get_docstring(node) or "").split()), tuple(fields)


def dotted(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


def sections(cls: tuple[str, str] = ROOT_CLASS, path: str = "") -> list[Section]:
    """The section of `cls` at `path`, then its nested sections depth-first in field order."""
    doc, fields = _class(*cls)
    out = [Section(path, doc, fields)]
    for f in fields:
        if f.section:
            out += sections(f.section, dotted(path, f.name))
    return out


def options() -> dict[str, Field]:
    """Every option by its dotted path, nested sections included."""
    return {dotted(s.path, f.name): f for s in sections() for f in s.fields}


def undocumented() -> list[str]:
    """Dotted paths of the fields that have no comment where they are declared."""
    return [path for path, f in options().items() if not f.doc]


# -- writing the pages -------------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(section: Section) -> list[str]:
    title = f"`{section.path}`" if section.path else "Top level"
    lines = [f"## {title}", ""] + ([_cell(section.doc), ""] if section.doc else [])
    lines += ["| option | default | doc |", "| --- | --- | --- |"]
    for f in section.fields:
        option = dotted(section.path, f.name)
        default = f"see `{option}`" if f.section else f"`{f.default}`"
        lines.append(f"| `{option}` | {_cell(default)} | {_cell(f.doc)} |")
    return lines + [""]


def _page_of(path: str) -> str:
    """The page listing the section's top level; a top level no page names goes on the last page."""
    top = path.split(".")[0]
    return next((page for page, tops in PAGES.items() if top in tops), list(PAGES)[-1])


def pages() -> dict[str, str]:
    """Page path (relative to the repository) -> its Markdown."""
    others = {page: [p for p in PAGES if p != page] for page in PAGES}
    out = {}
    for page in PAGES:
        see = ", ".join(f"[{Path(p).name}]({Path(p).name})" for p in others[page])
        lines = [f"# Configuration reference ({', '.join(t or 'top level' for t in PAGES[page])})", "",
                 f"Generated by `{COMMAND}` from the comments where each option is declared (xc/config.py; "
                 "`miner.ann` in xc/ann/base.py): edit those and rerun it, never this page; "
                 "tests/unit/test_config_docs.py fails while it is stale. Set any option on the command line by its "
                 f"dotted path (`xc-train train.epochs=3`). Other sections: {see}.", ""]
        for section in sections():
            if _page_of(section.path) == page:
                lines += _table(section)
        out[page] = "\n".join(lines).rstrip("\n") + "\n"
    return out


def stale(only: list[str] | None = None) -> list[str]:
    """The pages (all, or those named) whose file differs from what `pages()` writes."""
    wanted = pages()
    names = only or list(wanted)
    unknown = [n for n in names if n not in wanted]
    if unknown:
        raise SystemExit(f"not a generated page: {', '.join(unknown)} (pages: {', '.join(wanted)})")
    return [n for n in names if not (ROOT / n).is_file() or (ROOT / n).read_text() != wanted[n]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", nargs="*", metavar="PAGE", help="exit 1 if these pages (default: all) are stale")
    parser.add_argument("--stdout", action="store_true", help="print the pages instead of writing them")
    args = parser.parse_args(argv)
    missing = undocumented()
    if missing:
        # a warning here; tests/unit/test_config_docs.py is what fails on it
        print(f"undocumented config fields (comment them where declared): {', '.join(missing)}", file=sys.stderr)
    if args.check is not None:
        names = [Path(n).resolve().relative_to(ROOT).as_posix() for n in args.check]  # as given from any directory
        out_of_date = stale(names)
        for name in out_of_date:
            print(f"{name} is stale: run `{COMMAND}`", file=sys.stderr)
        return 1 if out_of_date else 0
    for name, text in pages().items():
        if args.stdout:
            print(text)
        else:
            (ROOT / name).write_text(text)
            print(f"wrote {name} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
