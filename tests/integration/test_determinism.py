"""A run's figures depend on the seed, the data and the config alone: not on the launcher, the run or cache
directory, or the speed probe that picks how rankings are computed (xc/ann/exact.py, xc/ann/shortlist.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SHARED_DATA, run_cli, shared_dataset
from tests.integration.test_records import ARGS, _write_sources

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

# 256-wide rows over debian-deps' 37,960 labels: every top-5 ranking (the model's, the label prior's) goes through
# a shortlist (xc.ann.shortlist.shortlist_pays), the path whose first pass the speed probe chooses
WIDE = ["model.embed_dim=256", "eval.ranker.enabled=true"]


def test_launcher_directories_and_speed_probe_leave_the_figures_alone(tmp_path):
    _write_sources(shared_dataset("debian-deps"), tmp_path / "src")
    common = ["data=debian_deps", *ARGS, *WIDE, "data.kind=lf_raw", f"data.path={tmp_path / 'src' / 'lf'}",
              "data.name=deb-small"]
    # xc-train's console script with bfloat16 first passes, in one pair of directories
    env = {**os.environ, "XC_THREADS": "1", "WANDB_MODE": "disabled", "XC_DATA": str(SHARED_DATA),
           "XC_BF16_PRODUCTS": "on"}
    script = subprocess.run([str(Path(sys.executable).parent / "xc-train"), *common, "train.ensemble=1",
                             f"data.cache_dir={tmp_path / 'cache-a'}", f"run_dir={tmp_path / 'run a'}"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert script.returncode == 0, script.stdout[-2000:] + script.stderr[-2000:]
    # `python -m xc.cli.train` with float32 first passes, in another
    run_cli([*common, f"data.cache_dir={tmp_path / 'cache-b'}", f"run_dir={tmp_path / 'b'}"], cwd=REPO,
            env={"XC_BF16_PRODUCTS": "off"}, timeout=900)
    a, b = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("run a", "b"))
    assert a == b and a["P@1"] > 0
    assert (tmp_path / "run a" / "calibration.json").read_text() == (tmp_path / "b" / "calibration.json").read_text()
