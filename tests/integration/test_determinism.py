"""A run's figures depend on the seed, the data and the config alone: not on the launcher, the run or cache
directory, the machine's load, or the speed probe that picks how rankings are computed (xc/ann/exact.py,
xc/ann/shortlist.py)."""

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


# A small synthetic run of the defaults' code paths (about 10 s on one core): hard negatives from the first epoch,
# the kept-epoch choice, the label prior, the lexical ranker and the kNN fusion
SMALL = ["data.synthetic.num_train=3000", "data.synthetic.num_test=400", "data.synthetic.num_labels=600",
         "data.synthetic.num_features=2000", "train.epochs=2", "train.batch_size=128", "train.warmup_steps=5",
         "model.hidden_dims=[64]", "sampler.start_epoch=0", "train.ensemble=1", "logger.wandb=disabled",
         "logger.progress=false", "eval.ranker.gamma=1.0"]


def _weights_digest(run_dir: Path) -> str:
    """sha256 over every tensor of the newest checkpoint's rank file, in name order: bit-identical weights only."""
    import hashlib

    import torch

    newest = sorted((run_dir / "checkpoints").glob("step-*[0-9]"))[-1]
    state = torch.load(newest / "rank0.pt", weights_only=True)
    digest = hashlib.sha256()

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{prefix}.{key}", value[key])
        elif isinstance(value, torch.Tensor):
            digest.update(prefix.encode())
            digest.update(value.contiguous().view(torch.uint8).numpy().tobytes() if value.numel() else b"")

    walk("", {k: state[k] for k in ("encoder", "classifier") if k in state})
    return digest.hexdigest()


def _train(args: list[str], run_dir: Path, launcher: str, env: dict) -> None:
    cmd = ([str(Path(sys.executable).parent / "xc-train")] if launcher == "script"
           else [sys.executable, "-m", "xc.cli.train"])
    proc = subprocess.run([*cmd, *args, f"run_dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def _own_threads_env() -> dict:
    """The environment a user's run sees: no XC_THREADS, so the run takes every core it may run on (what a CPU hog
    competes for: torch's intra-op threads get descheduled mid-reduction)."""
    env = {k: v for k, v in os.environ.items() if k != "XC_THREADS"}
    return {**env, "WANDB_MODE": "disabled", "PYTHONHASHSEED": "random"}


@pytest.mark.parametrize("miner", [[], ["miner=pool", "miner.workers=1", "miner.ann.backend=exact",
                                        "miner.late_policy=wait"]], ids=["sync", "pool-wait"])
def test_a_cpu_hog_beside_the_run_leaves_figures_and_weights_alone(tmp_path, miner):
    """The same small run alone and beside busy loops on every core: metrics.json, selection.json and the final
    weights bit for bit. `pool-wait`: an asynchronous miner whose generations arrive at load-dependent times, handed
    over at the epoch boundary it was scheduled for (miner.late_policy=wait; its query window is every row)."""
    args = [*SMALL, *miner, f"data.cache_dir={tmp_path / 'cache'}"]
    env = _own_threads_env()
    _train(args, tmp_path / "alone", "module", env)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        _train(args, tmp_path / "loaded", "module", env)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    for name in ("metrics.json", "selection.json"):
        a, b = (json.loads((tmp_path / run / name).read_text()) for run in ("alone", "loaded"))
        assert a == b, name
    assert json.loads((tmp_path / "alone" / "metrics.json").read_text())["P@1"] > 0
    assert _weights_digest(tmp_path / "alone") == _weights_digest(tmp_path / "loaded")


def test_xc_train_and_python_m_give_the_same_figures_on_a_small_run(tmp_path):
    """The console script and `python -m xc.cli.train` (another sys.argv[0], another working directory's view of
    the same paths): metrics.json, calibration.json and the final weights bit for bit."""
    args = [*SMALL, f"data.cache_dir={tmp_path / 'cache'}"]
    env = _own_threads_env()
    _train(args, tmp_path / "script", "script", env)
    _train(args, tmp_path / "module", "module", env)
    for name in ("metrics.json", "calibration.json"):
        assert (tmp_path / "script" / name).read_text() == (tmp_path / "module" / name).read_text(), name
    assert _weights_digest(tmp_path / "script") == _weights_digest(tmp_path / "module")
