"""`xc-train`'s closing line: the run's wall time as the docs quote it."""

from xc.cli.train import wall_clock


def test_wall_clock_reads_as_the_docs_write_it():
    assert wall_clock(42.46) == "42.5s"
    assert wall_clock(59.96) == "1m00s"
    assert wall_clock(60.0) == "1m00s"
    assert wall_clock(303.6) == "5m04s"
    assert wall_clock(3723.0) == "1h02m03s"


def test_miner_ray_without_ray_installed_stops_in_one_line_before_anything_is_written(tmp_path):
    """`xc-train miner=ray` where Ray is not installed (hidden here: `import ray` raises ImportError) names the
    extra that installs it, exits 2, and leaves no run directory behind."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    run_dir = tmp_path / "run"
    code = "import sys; sys.modules['ray'] = None; from xc.cli.train import main; main()"
    proc = subprocess.run([sys.executable, "-c", code, "miner=ray", f"run_dir={run_dir}", "logger.wandb=disabled",
                           f"data.cache_dir={tmp_path / 'cache'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "XC_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == ['error: miner=ray needs Ray, which is not installed: pip install -e ".[ray]" (in the xc checkout)']
    assert not run_dir.exists() and not (tmp_path / "cache").exists()  # stopped before the data and the run
