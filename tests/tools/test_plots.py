"""tools/plots.py: the benchmarks draw through it, so a missing matplotlib is one line naming the `plots` extra."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"


def test_without_matplotlib_a_figure_is_one_line_naming_the_extra():
    code = f"import sys; sys.modules['matplotlib'] = None; sys.path.insert(0, {str(TOOLS)!r}); " \
           f"import plots; plots.pyplot({str(TOOLS / 'bench' / 'bench_step.py')!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: the figure of tools/bench/bench_step.py needs matplotlib, which is not installed: "
        'pip install -e ".[plots]" (in the xc checkout)']


def test_with_matplotlib_it_is_pyplot_drawing_off_screen():
    sys.path.insert(0, str(TOOLS))
    try:
        import plots

        plt = plots.pyplot(__file__)
    finally:
        sys.path.remove(str(TOOLS))
    import matplotlib

    assert plt.__name__ == "matplotlib.pyplot" and matplotlib.get_backend().lower() == "agg"


def test_every_tool_that_plots_draws_through_plots_py():
    """No script imports matplotlib or its pyplot itself (a submodule such as matplotlib.ticker after `pyplot()` is
    fine: by then matplotlib is known to be there)."""
    direct = re.compile(r"^\s*(import matplotlib\s*$|import matplotlib\.pyplot|from matplotlib import pyplot)", re.M)
    found = [path.name for path in sorted(TOOLS.rglob("*.py"))
             if path.name != "plots.py" and direct.search(path.read_text())]
    assert found == []
    assert len([path for path in TOOLS.rglob("*.py") if "plt = pyplot(__file__)" in path.read_text()]) >= 10
