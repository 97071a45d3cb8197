"""Every test runs under a time limit (pyproject.toml's pytest `timeout`, signal method; tests marked slow get
tests/time_limits.py's SLOW_FACTOR times it): a hung test fails, naming the limit, and the run goes on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

HANGS = '''
import time
import pytest

def test_hangs():
    time.sleep(600)

@pytest.mark.slow
def test_a_slow_test_may_run_past_the_default_limit():
    time.sleep(2)
'''


def test_a_hung_test_fails_with_the_limit_named_and_a_slow_one_gets_longer(tmp_path):
    """The repository's pytest settings (timeout method, an xdist worker as the suite runs) with the limit cut to
    1 s: the hung test fails at 1 s rather than at the end of its 600 s sleep, the run goes on, and the slow-marked
    one, given 6 s, passes after its 2."""
    (tmp_path / "test_hangs.py").write_text(HANGS)
    cmd = [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path),
           "-p", "no:cacheprovider", "-p", "tests.time_limits", "-n", "1", "-o", "timeout=1", "test_hangs.py"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_TIMEOUT", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)  # < the sleep
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Timeout (>1.0s) from pytest-timeout" in out, out
    assert "FAILED test_hangs.py::test_hangs" in out and "1 failed, 1 passed" in out, out
