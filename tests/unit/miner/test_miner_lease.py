"""One miner per run (xc/miner/lease.py): a second miner is refused with its holder named; dead, silent and
earlier-trainer holders are taken over; a miner that lost its lease publishes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from xc.config import MinerConfig
from xc.handoff import handoff_root, list_generations
from xc.miner.lease import MinerAttachedError, MinerLease, lease_path
from xc.miner.service import MinerLostLeaseError, MinerService


def _fake_holder(run_dir, **fields):
    path = lease_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    holder = {"kind": "xc-miner", "host": "elsewhere", "pid": 12345, "started": time.time(), "token": "t0"} | fields
    path.write_text(json.dumps(holder))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_second_miner_is_refused_naming_the_holder(tmp_path):
    with MinerLease(tmp_path, "xc-miner"):
        with pytest.raises(MinerAttachedError) as err:
            MinerLease(tmp_path, "xc-miner").acquire()
        text = str(err.value)
        assert str(lease_path(tmp_path)) in text and f"pid {os.getpid()}" in text and "Stop that xc-miner" in text
        with pytest.raises(MinerAttachedError, match="train with miner=external"):
            MinerLease(tmp_path, "trainer").acquire()
    assert not lease_path(tmp_path).exists()  # released on exit
    MinerLease(tmp_path, "xc-miner").acquire().release()  # and free again


def test_xc_miner_is_refused_by_a_trainer_mining_in_process(tmp_path):
    with MinerLease(tmp_path, "trainer"):
        with pytest.raises(MinerAttachedError, match=r"drives its own miner \(miner=pool or miner=ray\)"):
            MinerLease(tmp_path, "xc-miner").acquire()
        # a trainer's own pool taking over an earlier life of the same run (torchrun restart) is allowed
        with MinerLease(tmp_path, "trainer") as again:
            assert again.held()


@pytest.mark.parametrize("case", ["dead pid here", "silent other host", "unreadable"])
def test_stale_leases_are_taken_over(tmp_path, case, caplog):
    if case == "dead pid here":
        import socket

        _fake_holder(tmp_path, host=socket.gethostname(), pid=_dead_pid())
    elif case == "silent other host":
        path = _fake_holder(tmp_path)
        old = time.time() - 120
        os.utime(path, (old, old))
    else:
        lease_path(tmp_path).parent.mkdir(parents=True)
        lease_path(tmp_path).write_text('{"kind": "xc-mi')
    with MinerLease(tmp_path, "xc-miner", stale_s=60) as lease:
        assert lease.held()
    assert "taking over the miner lease" in caplog.text


def test_a_live_holder_on_another_host_is_not_taken_over(tmp_path):
    _fake_holder(tmp_path)  # renewed just now; its pid cannot be checked from here
    with pytest.raises(MinerAttachedError, match="elsewhere"):
        MinerLease(tmp_path, "xc-miner").acquire()


def test_heartbeat_renews_the_lease(tmp_path):
    with MinerLease(tmp_path, "xc-miner", heartbeat_s=0.05, stale_s=1.0):
        old = time.time() - 30
        os.utime(lease_path(tmp_path), (old, old))
        time.sleep(0.3)
        assert time.time() - lease_path(tmp_path).stat().st_mtime < 1.0


def test_a_miner_that_lost_its_lease_publishes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    lease = MinerLease(run_dir, "xc-miner").acquire()
    try:
        lease_path(run_dir).write_text(json.dumps({"kind": "xc-miner", "pid": 1, "host": "h", "token": "other"}))
        service = MinerService(run_dir, MinerConfig(workers=1), lease)
        with pytest.raises(MinerLostLeaseError, match="another miner took"):
            service.mine(1)
        with pytest.raises(MinerLostLeaseError):
            service.serve()
    finally:
        lease.release()
    assert lease_path(run_dir).exists()  # the new holder's lease is left alone
    assert list_generations(handoff_root(run_dir) / "negatives") == []
