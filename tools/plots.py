"""The benchmarks' figures: matplotlib's pyplot drawing off-screen (Agg), or, where matplotlib is missing, one line
naming the extra that installs it. Every script here writes its JSON results before it draws, so they are kept.

    from tools.plots import pyplot      # a script in tools/bench/ or tools/experiments/ (it puts the checkout
    plt = pyplot(__file__)              # on sys.path); a script in tools/ itself imports `plots` directly
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xc.errors import MissingExtraError, require_extra  # noqa: E402


def shown_path(script: str) -> str:
    """The script's path from the checkout's root (tools/bench/bench_step.py) where it lies in the checkout."""
    try:
        return Path(script).resolve().relative_to(REPO).as_posix()
    except ValueError:
        return script


def pyplot(script: str):
    """matplotlib.pyplot with the Agg backend (no display needed); SystemExit with one line naming the `plots`
    extra where matplotlib is not installed. `script`: the calling script's path, named in that line."""
    try:
        require_extra("matplotlib", "matplotlib", "plots", f"the figure of {shown_path(script)}")
    except MissingExtraError as exc:
        raise SystemExit(f"error: {exc}") from None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
