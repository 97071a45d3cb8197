"""xc's packages in their declared layer order, the imports between them, and a picture of both.

    python tools/package_map.py                  # writes tools/results/package_map.png, prints the edges
    python tools/package_map.py --check          # exit 1 on an import that climbs the order (what the test runs)

A module may import only from its own package or one lower in LAYERS. Every import is read from the source:
absolute and relative, at module level and inside functions (only those under `if TYPE_CHECKING:`, which never
run, are left out). tests/unit/test_layers.py holds the code to this; docs/design.md shows the picture.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

XC = Path(__file__).resolve().parents[1] / "xc"

# lowest first; "xc" is the facade (xc/__init__.py), which may import anything
LAYERS = ["errors", "faults", "fsutil", "arrays", "shards", "ann", "config_checks", "config", "handoff", "data",
          "distributed", "models", "sampling", "miner", "datasets", "run", "eval", "fitting", "defaults", "refresh",
          "train", "serve", "ensemble", "cli", "xc"]
# rows of the picture, bottom first (the order inside a row is LAYERS')
TIERS = [("foundations", ["errors", "faults", "fsutil", "arrays", "shards"]),
         ("search, config", ["ann", "config_checks", "config"]),
         ("data, models, parallelism, the miner", ["handoff", "data", "distributed", "models", "sampling", "miner"]),
         ("the run, evaluation, fitting, rules", ["datasets", "run", "eval", "fitting", "defaults"]),
         ("training", ["refresh", "train"]),
         ("serving", ["serve", "ensemble"]),
         ("entry points", ["cli", "xc"])]


def unit_of(module: str) -> str:
    """The layer a module belongs to: its package under xc/, or the top-level module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "xc"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path, module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import that can run: absolute or relative, at any depth."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found, todo = [], [ast.parse(path.read_text(encoding="utf-8"))]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            if isinstance(child, ast.Import):
                found += [(alias.name, child.lineno) for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")
                    base = parts[:len(parts) - child.level + 1]
                    name = ".".join(base + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                found.append((name, child.lineno))
            todo.append(child)
    return found


def unit_imports(root: Path = XC) -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, 'path:line') for every import of xc's own code across units."""
    out = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        here = unit_of(module)
        for name, line in runtime_imports(path, module):
            if name == "xc" or name.startswith("xc."):
                there = unit_of(name) if name != "xc" else "xc"
                if there != here:
                    out.append((here, there, f"{path.relative_to(root.parent)}:{line}"))
    return out


def upward_imports(root: Path = XC) -> list[str]:
    """'path:line: a -> b' for every import of a layer above the importing module's (or of one not declared)."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    return [f"{where}: {here} -> {there}" for here, there, where in unit_imports(root)
            if here not in rank or there not in rank or rank[there] > rank[here]]


def draw(edges: Counter, out: Path) -> None:
    """The tiers as rows of boxes, bottom first, and one grey line per imported pair (wider: more imports); imports
    of the foundations (errors, file and array helpers, which nearly every module imports) are left out."""
    from plots import pyplot  # matplotlib is the `plots` extra: one line where it is missing

    plt = pyplot(__file__)

    where = {}
    fig, ax = plt.subplots(figsize=(12, 7.5))
    for row, (title, units) in enumerate(TIERS):
        ax.text(-0.6, row, title, ha="right", va="center", fontsize=9, color="#555555")
        for col, unit in enumerate(units):
            x = col * 1.6
            where[unit] = (x, row)
            ax.text(x, row, unit if unit != "xc" else "xc (facade)", ha="center", va="center", fontsize=10,
                    bbox=dict(boxstyle="round,pad=0.35", facecolor="#dbe8f6", edgecolor="#336699"), zorder=3)
    for (a, b), n in edges.items():
        if b in TIERS[0][1]:
            continue
        (xa, ya), (xb, yb) = where[a], where[b]
        ax.annotate("", xy=(xb, yb), xytext=(xa, ya), zorder=1,
                    arrowprops=dict(arrowstyle="-|>", color="#999999", alpha=0.45, lw=0.4 + 0.15 * min(n, 12),
                                    shrinkA=12, shrinkB=12, connectionstyle="arc3,rad=0.08"))
    ax.set_xlim(-4.2, 8.6)
    ax.set_ylim(-0.7, len(TIERS) - 0.3)
    ax.axis("off")
    ax.set_title("xc's packages, lowest layer at the bottom: an arrow is an import, always downward or to the left "
                 "(tools/package_map.py; imports of the foundations not drawn)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only check the order; exit 1 on an upward import")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "package_map.png")
    args = parser.parse_args()
    bad = upward_imports()
    for line in bad:
        print(f"upward import: {line}", file=sys.stderr)
    if args.check:
        return 1 if bad else 0
    edges = Counter((a, b) for a, b, _ in unit_imports())
    for (a, b), n in sorted(edges.items(), key=lambda e: (LAYERS.index(e[0][0]), LAYERS.index(e[0][1]))):
        print(f"{a} -> {b}: {n}")
    draw(edges, args.out)
    print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
