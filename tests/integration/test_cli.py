"""The commands end to end, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, ranked, run_cli

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

TINY = ["data.synthetic.num_train=3000", "data.synthetic.num_test=400", "data.synthetic.num_labels=800",
        "data.synthetic.num_features=2000", "train.epochs=2", "train.batch_size=128", "logger.progress=false",
        "train.warmup_steps=5", "train.ensemble=1"]


def _run(args, **kw):
    env = dict(os.environ, XC_THREADS="1", **kw.pop("env", {}))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_train_logs_evaluates_and_resumes_as_complete(tmp_path):
    run_dir = tmp_path / "run"
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    # wandb in its default offline mode: must work without any key or network
    proc = run_cli([*TINY, cache, f"run_dir={run_dir}", "logger.wandb=offline"], cwd=REPO,
                   env={"WANDB_MODE": "offline"})
    assert "final P@1=" in proc.stdout
    assert "since xc-train started" in proc.stdout.split("final P@1=")[1]  # the run prints its time after its figures
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert {"P@1", "P@3", "P@5", "nDCG@5", "PSP@5", "PSnDCG@5", "R@5"} <= metrics.keys()
    assert metrics["P@1"] > 30  # learns: popularity alone gives far less on this data
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    kinds = {e["event"] for e in events}
    assert {"train", "negatives", "staleness", "eval", "checkpoint"} <= kinds
    train_events = [e for e in events if e["event"] == "train"]
    assert any(e["hard_generation"] == 1 and e["hard_age_steps"] is not None for e in train_events)
    # host CPU seconds per step beside wall seconds: positive, and per step, not per window
    assert all(0 < e["cpu_sec_per_step"] < 50 * e["sec_per_step"] + 1 for e in train_events)

    again = run_cli([*TINY, cache, f"run_dir={run_dir}", "logger.wandb=disabled"], cwd=REPO)
    assert "already complete" in again.stdout

    evaluated = _run(["-m", "xc.cli.evaluate", str(run_dir), "--predictions", str(tmp_path / "p.npz")])
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads((run_dir / "eval.json").read_text()) == ranked(metrics)

    # Serving with per-shard DiskANN indexes over the classifier: close to exact inference.
    served = _run(["-m", "xc.cli.evaluate", str(run_dir), "--ann", "diskann", "--out", str(tmp_path / "ann.json")])
    assert served.returncode == 0, served.stderr
    ann = json.loads((tmp_path / "ann.json").read_text())
    # ANN serving is of the plain model (no label prior, no kNN fusion): its exact figures are the last evaluation's
    last_eval = [e for e in events if e["event"] == "eval"][-1]
    assert ann["exact/P@5"] == last_eval["P@5"]
    assert ann["ann_recall@5"] > 90 and abs(ann["P@5"] - ann["exact/P@5"]) < 1.0, ann


def test_console_scripts_start(tmp_path):
    """The installed entry points (not only `python -m`) find the configs and parse arguments."""
    bin_dir = os.path.dirname(sys.executable)
    proc = subprocess.run([os.path.join(bin_dir, "xc-train"), "--cfg", "job"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sampler:" in proc.stdout and "name: astra" in proc.stdout
    for tool in ("xc-eval", "xc-data", "xc-miner"):
        proc = subprocess.run([os.path.join(bin_dir, tool), "--help"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "usage" in proc.stdout, (tool, proc.stderr)


def test_mistyped_key_is_named(tmp_path):
    proc = _run(["-m", "xc.cli.train", "+train.epoch=3", f"run_dir={tmp_path}"])
    assert proc.returncode == 2
    assert "config train.epoch: unknown key (did you mean 'train.epochs'?)" in proc.stderr


def test_malformed_data_names_file_line_and_field(tmp_path):
    data = tmp_path / "bad"
    data.mkdir()
    (data / "train.txt").write_text("2 5 3\n0,1 0:1.0 3:2.0\n0,7 1:1.0\n")
    (data / "test.txt").write_text("1 5 3\n2 4:1.0\n")
    proc = _run(["-m", "xc.cli.train", "data=bibtex", f"data.path={data}", f"data.cache_dir={tmp_path / 'c'}",
                 f"run_dir={tmp_path / 'run'}"])
    assert proc.returncode == 2
    assert f"{data / 'train.txt'}:3: label id" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_config_json_is_the_config_the_run_used(tmp_path):
    """config.json holds the config with every data rule resolved, the one the checkpoints record and the run
    trained with; config.requested.json beside it the config as given (null where a rule decides)."""
    run_dir = tmp_path / "run"
    run_cli([*[a for a in TINY if not a.startswith("train.batch_size")], f"data.cache_dir={tmp_path / 'cache'}",
             f"run_dir={run_dir}", "logger.wandb=disabled"], cwd=REPO)
    used = json.loads((run_dir / "config.json").read_text())
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert used == json.loads((newest / "meta.json").read_text())["config"]
    asked = json.loads((run_dir / "config.requested.json").read_text())
    assert asked["train"]["batch_size"] is None and isinstance(used["train"]["batch_size"], int)  # the data's rule
    assert asked["run_dir"] == used["run_dir"] and asked["seed"] == used["seed"]
