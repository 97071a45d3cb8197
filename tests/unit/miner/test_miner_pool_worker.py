"""A miner pool's workers end when the process that started the pool dies without shutting it down."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.conftest import REPO

STARTER = r"""
import multiprocessing as mp, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from xc.miner.service import init_pool_worker

if __name__ == "__main__":
    pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"),
                               initializer=init_pool_worker, initargs=(1, os.getpid()))
    print(pool.submit(os.getpid).result(), flush=True)
    os._exit(9)  # killed outright: no shutdown of the pool
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split()[2] != "Z"


def test_pool_worker_exits_when_its_parent_is_killed():
    proc = subprocess.run([sys.executable, "-c", STARTER], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 9, proc.stderr
    worker = int(proc.stdout.split()[0])
    # the worker checks its parent every second; a loaded machine may not schedule it for a while, and without
    # the check it would live on forever
    deadline = time.time() + 60
    while _alive(worker) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(worker), f"pool worker {worker} outlived the process that started it"
