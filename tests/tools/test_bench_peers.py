"""tools/bench_peers.py: a peer's process does not outlive the benchmark that spawned it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_peer_dies_with_the_benchmark_that_spawned_it(tmp_path):
    # the benchmark's process spawns a "peer" that would sleep for a minute, prints its pid, and is then killed
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing as mp, os, sys, time
        sys.path.insert(0, {str(REPO / "tools")!r})
        from bench_peers import die_with_parent

        def peer(parent):
            die_with_parent(parent)
            time.sleep(60)

        if __name__ == "__main__":
            proc = mp.get_context("spawn").Process(target=peer, args=(os.getpid(),))
            proc.start()
            time.sleep(3)  # the peer is up and has asked to die with its parent
            print(proc.pid, flush=True)
            time.sleep(60)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # alive beside its parent
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            if Path(f"/proc/{child}/stat").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
                break  # a zombie: dead, waiting to be reaped by init
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the peer outlived its killed benchmark")
    finally:
        parent.kill()
