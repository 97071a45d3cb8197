"""A picture of xc's packages in their layer order and the imports between them.

    python tools/package_map.py                  # writes tools/results/package_map.png, prints the edges

The order is the layers contract of pyproject.toml's [tool.importlinter], which `lint-imports` checks
(tests/unit/test_import_contracts.py); the imports come from import-linter's graph (grimp): absolute and relative,
at module level and inside functions. docs/design.md shows the picture.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# rows of the picture, bottom first; read left to right, bottom to top they are the contract's order
TIERS = [("foundations", ["errors", "faults", "fsutil", "free_memory", "arrays", "shards"]),
         ("search, config", ["ann", "config_checks", "config"]),
         ("data, models, parallelism, the miner", ["handoff", "data", "distributed", "models", "sampling", "miner"]),
         ("the run, evaluation, fitting, rules", ["datasets", "run", "eval", "fitting", "defaults"]),
         ("training", ["refresh", "train"]),
         ("serving", ["serve", "ensemble"]),
         ("entry points", ["cli", "xc"])]


def layers(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The layers contract's order, lowest first, then "xc": the facade xc/__init__.py, which may import anything."""
    contracts = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["type"] == "layers" and c.get("containers") == ["xc"]]
    return [*reversed(contract["layers"]), "xc"]


def unit_of(module: str) -> str:
    """The layer a module belongs to: its package under xc/, or the top-level module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "xc"


def unit_imports() -> Counter:
    """(importing unit, imported unit) -> how many module-to-module imports of xc's own code cross between them."""
    import grimp  # lazy: the dev extra; --help works without it

    graph = grimp.build_graph("xc", cache_dir=None)
    return Counter((unit_of(a), unit_of(b)) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
                   if unit_of(a) != unit_of(b))


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
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "package_map.png")
    args = parser.parse_args()
    order = layers()
    drawn = [u for _, row in TIERS for u in row]
    if drawn != order:
        raise SystemExit(f"error: the picture's rows {drawn} are not the layers contract's order {order} "
                         "(pyproject.toml [tool.importlinter]): update TIERS")
    edges = unit_imports()
    for (a, b), n in sorted(edges.items(), key=lambda e: (order.index(e[0][0]), order.index(e[0][1]))):
        print(f"{a} -> {b}: {n}")
    draw(edges, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
