"""The run log's events carry the process's memory: a run's log says which phase set its peak."""

import json
import sys

import numpy as np
import pytest

from xc.config import LoggerConfig
from xc.run.runlog import RunLogger, memory_gib

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and ru_maxrss in KiB: Linux")


def test_memory_follows_an_allocation_and_the_peak_stays():
    before = memory_gib()
    block = np.ones(256 << 20, np.uint8)  # 0.25 GiB, every page touched
    during = memory_gib()
    assert during["rss_gib"] - before["rss_gib"] > 0.2
    assert during["peak_rss_gib"] >= during["rss_gib"] - 1e-3
    del block
    after = memory_gib()
    assert after["rss_gib"] < during["rss_gib"] - 0.2  # freed (glibc returns a block this large at once)
    assert after["peak_rss_gib"] >= during["rss_gib"] - 1e-3  # the peak is kept


def test_every_event_carries_the_memory_fields(tmp_path):
    logger = RunLogger(LoggerConfig(wandb="disabled"), str(tmp_path), "t", rank=0, config={})
    logger.event("epoch", epoch=1, global_step=10)
    logger.close()
    record = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert record["event"] == "epoch" and record["global_step"] == 10
    assert 0 < record["rss_gib"] <= record["peak_rss_gib"]
