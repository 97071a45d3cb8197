"""The benchmarks' figures: matplotlib's pyplot drawing off-screen (Agg), or, where matplotlib is missing, one line
naming the extra that installs it. Every script here writes its JSON results before it draws, so they are kept.

    from plots import pyplot            # tools/ is on sys.path when a script here runs
    plt = pyplot(__file__)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xc.errors import MissingExtraError, require_extra  # noqa: E402


def pyplot(script: str):
    """matplotlib.pyplot with the Agg backend (no display needed); SystemExit with one line naming the `plots`
    extra where matplotlib is not installed. `script`: the calling script's path, named in that line."""
    try:
        require_extra("matplotlib", "matplotlib", "plots", f"the figure of tools/{Path(script).name}")
    except MissingExtraError as exc:
        raise SystemExit(f"error: {exc}") from None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
