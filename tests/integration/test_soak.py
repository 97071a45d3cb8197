"""tools/probes/soak.py, a few kills: a 2-rank run with a pool miner killed at random moments (SIGKILL or SIGTERM, the
whole job, one rank or the miner's worker) and resumed each time ends bit-identical to an uninterrupted run, no
job hangs or leaves a process behind, and nothing half-written is ever published or read. The full soak
(50 kills, docs/reliability.md) runs the same tool."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)


def test_a_run_killed_anywhere_resumes_and_ends_bit_identical(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "tools/probes/soak.py", "--kills", "4", "--seed", "3", "--epochs", "1",
                           "--workdir", str(tmp_path / "work"), "--out", str(out)],
                          cwd=REPO, env={**os.environ, "XC_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["kills"] == 4, proc.stdout
    assert summary["resumed_bit_identical"] == 4, proc.stdout
    assert summary["hangs"] == summary["tracebacks"] == summary["problems"] == 0, proc.stdout
    assert summary["max_difference"] == 0.0 and summary["runs_identical"] == summary["runs"], proc.stdout
    assert all(run["finished"] for run in report["runs"])
