"""Where Ray is not installed, `miner=ray`'s driver and `xc-miner --ray` say so in one line naming the `ray` extra."""

from __future__ import annotations

import sys

import pytest

from xc.config import MinerConfig
from xc.errors import MissingExtraError
from xc.miner import cli
from xc.miner.ray_pool import connect


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed


LINE = 'needs Ray, which is not installed: pip install -e ".[ray]" (in the xc checkout)'


def test_connect_names_the_extra(no_ray):
    with pytest.raises(MissingExtraError, match=r'^miner=ray needs Ray, .*pip install -e "\.\[ray\]"'):
        connect(MinerConfig(mode="ray"))


@pytest.mark.parametrize("flag", [["--ray"], ["--ray-address", "auto"]])
def test_xc_miner_ray_is_one_line_before_it_reads_the_run(no_ray, tmp_path, capsys, flag):
    run_dir = tmp_path / "run"  # not a run directory: without the check xc-miner stops on that
    assert cli.main(["--run-dir", str(run_dir), "--once", *flag]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: xc-miner --ray {LINE}"]
    assert not run_dir.exists()
