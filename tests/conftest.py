"""Shared fixtures: where the real benchmark data lives and how to run the CLI as a user would."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.time_limits import limit_slow_tests

REPO = Path(__file__).resolve().parents[1]
# Tests use tiny tensors: one intra-op thread avoids OpenMP spin-waits that slow them down many-fold
# on a small, busy machine.
torch.set_num_threads(1)


def pytest_report_header(config) -> str:
    """The free space where tests write: a CI log then says at once when a failure is a full disk."""
    tmp = Path(tempfile.gettempdir())
    free = shutil.disk_usage(tmp).free
    return f"xc: {free / 2**30:.1f} GiB free in {tmp}"


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` get a longer time limit (tests/time_limits.py). Tests marked `gpu` run wherever CUDA is
    present and are skipped, saying why, everywhere else."""
    limit_slow_tests(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SHARED_DATA = Path(os.environ.get("XC_DATA", REPO.parent / "shared" / "data"))


def shared_dataset(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_dir():
        pytest.skip(f"benchmark data {path} not present")
    return path


def ranked(metrics: dict) -> dict:
    """A run's metrics less the thresholds' figures (`thr@...`): training reports those from its calibration
    (xc/cli/calibrate.py); xc-eval reproduces the rankings' metrics."""
    return {k: v for k, v in metrics.items() if not k.startswith("thr@")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cli(args: list[str], cwd: Path, nproc: int = 1, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `xc.cli.train` (under torchrun when nproc > 1) with hydra overrides; raises with the output on failure.
    One model per run unless the test asks for an ensemble (the default trains 3 on small data)."""
    if not any(a.startswith("train.ensemble=") for a in args):
        args = [*args, "train.ensemble=1"]
    full_env = {**os.environ, "XC_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
                "XC_DATA": str(SHARED_DATA), **(env or {})}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={free_port()}", "-m", "xc.cli.train", *args]
    else:
        cmd = [sys.executable, "-m", "xc.cli.train", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def load_final_state(run_dir: Path, world_size: int) -> dict[str, torch.Tensor]:
    """Encoder tensors and the full classifier matrix (shards concatenated) of the newest checkpoint."""
    ckpts = sorted((run_dir / "checkpoints").glob("step-*[0-9]"))
    assert ckpts, f"no checkpoint in {run_dir}"
    states = [torch.load(ckpts[-1] / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
    out = {f"encoder.{k}": v for k, v in states[0]["encoder"].items()}
    out["classifier"] = torch.cat([s["classifier"]["weight"] for s in states])
    if states[0].get("lexical") is not None:  # model.lexical_features
        out["lexical"] = torch.cat([s["lexical"]["values"]["weight"] for s in states])
        out["lexical_support"] = torch.cat([s["lexical"]["support"] for s in states])
    return out


@pytest.fixture(scope="module")
def package_map():
    """tools/package_map.py as a module (tools/ is no package): the picture's rows and the layers contract's order."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("package_map", REPO / "tools" / "package_map.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and the like look their module up while it loads
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
