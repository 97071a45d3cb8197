"""The GPU path's device-agnostic parts, end to end on CPU: prefetching changes nothing, a compiled encoder trains
as the eager one, bf16 autocast with bf16 classifier rows and fp32 masters trains, phase timings are logged, fp16
is refused off CUDA, and faiss_gpu mines and serves through its CPU fallback."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, SHARED_DATA, load_final_state, run_cli

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

TINY = ["data.name=gpu-path", "data.synthetic.num_train=1500", "data.synthetic.num_test=300",
        "data.synthetic.num_labels=600", "data.synthetic.num_features=2000", "model.embed_dim=32",
        "train.batch_size=64", "train.warmup_steps=3", "train.log_every=5", "logger.wandb=disabled",
        "logger.progress=false", "train.resume=never", "sampler.k_hard=8", "sampler.k_random=24",
        "sampler.start_epoch=1", "train.ensemble=1"]


def _events(run_dir, kind):
    lines = (run_dir / "log.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


@pytest.mark.parametrize("extra", [
    # draws ahead on the thread (hard negatives from epoch 1, gradient accumulation), stopped mid-epoch
    ["sampler=astra", "train.grad_accum=2", "train.epochs=2", "train.max_steps=16"],
    # needs the step's embeddings: only inputs and positives are prefetched, negatives drawn in the step
    ["sampler=snm", "sampler.snm_pool=64", "train.epochs=1"],
], ids=["astra", "snm"])
def test_prefetch_gives_identical_weights(tmp_path, extra):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    inline, ahead = tmp_path / "inline", tmp_path / "ahead"
    run_cli([*TINY, *extra, cache, f"run_dir={inline}", "train.prefetch=false"], cwd=REPO)
    run_cli([*TINY, *extra, cache, f"run_dir={ahead}", "train.prefetch=true"], cwd=REPO)
    a, b = load_final_state(inline, 1), load_final_state(ahead, 1)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert [e["loss"] for e in _events(inline, "train")] == [e["loss"] for e in _events(ahead, "train")]
    assert all("phase_seconds" not in e for e in _events(ahead, "train"))  # profiling is off by default


def test_compiled_encoder_trains_as_the_eager_one(tmp_path):
    """train.compile=true runs the encoder's training forward through torch.compile: the same steps to float
    tolerance (fused kernels reorder sums), and checkpoints keep the module's own state-dict names. (Dropout masks
    differ: compiled kernels draw them from their own generator.)"""
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    # no dropout: compiled kernels draw their masks from another generator
    args = [*TINY, cache, "model=dense", "model.dropout=0.0", "train.epochs=1", "train.max_steps=8"]
    run_cli([*args, f"run_dir={eager}"], cwd=REPO)
    run_cli([*args, f"run_dir={compiled}", "train.compile=true"], cwd=REPO)
    a, b = load_final_state(eager, 1), load_final_state(compiled, 1)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_bf16_amp_with_bf16_rows_masters_phases_and_faiss_gpu_fallback(tmp_path):
    run_dir = tmp_path / "bf16"
    proc = run_cli([*TINY, f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}", "train.epochs=2",
                    "train.amp=bf16", "model.classifier_dtype=bfloat16", "train.profile_phases=true",
                    "miner.ann.backend=faiss_gpu"], cwd=REPO)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["P@1"] > 60, metrics  # learns: 68.3 here, as fp32 rows without autocast (68.0)

    # the checkpoint holds bf16 rows and their fp32 masters; the rows are the masters' rounding
    ckpt = sorted((run_dir / "checkpoints").glob("step-*[0-9]"))[-1]
    clf = torch.load(ckpt / "rank0.pt", weights_only=True)["classifier"]
    assert clf["weight"].dtype == torch.bfloat16 and clf["master"].dtype == torch.float32
    assert torch.equal(clf["weight"], clf["master"].to(torch.bfloat16))
    assert not torch.equal(clf["master"], clf["weight"].float())  # masters kept what bf16 rounds away

    # per-phase timings (ASTRA Table 3) on every train event, averaged over its window
    phases = {"data", "h2d", "encoder_forward", "classifier_forward", "loss", "backward", "optimizer"}
    train = _events(run_dir, "train")
    assert train and all(set(e["phase_seconds"]) == phases for e in train)
    assert all(v >= 0 for e in train for v in e["phase_seconds"].values())
    assert all(e["phase_seconds"]["backward"] > 0 for e in train)

    # faiss_gpu mined the hard negatives through its CPU fallback, saying so
    assert "falling back to faiss CPU" in proc.stdout + proc.stderr
    (mined,) = _events(run_dir, "negatives")
    assert all(s["recall"] == 1.0 for s in mined["shards"])  # flat IP fallback: exact
    # ... and serves: `xc-eval --ann faiss_gpu`
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled")
    served = subprocess.run([sys.executable, "-m", "xc.cli.evaluate", str(run_dir), "--ann", "faiss_gpu", "--out",
                             str(tmp_path / "ann.json")], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert served.returncode == 0, served.stderr
    ann = json.loads((tmp_path / "ann.json").read_text())
    assert ann["ann_recall@5"] == 100.0 and ann["P@5"] == ann["exact/P@5"]

    # A checkpoint trained with fp16 autocast (on a GPU) still evaluates on a CPU: the encoder runs in fp32.
    meta_path = ckpt / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["train"]["amp"] = "fp16"
    meta_path.write_text(json.dumps(meta))
    evaluated = subprocess.run([sys.executable, "-m", "xc.cli.evaluate", str(run_dir), "--out", str(tmp_path / "e.json")],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr
    assert abs(json.loads((tmp_path / "e.json").read_text())["P@1"] - metrics["P@1"]) < 2.0


def test_fp16_is_refused_on_cpu(tmp_path):
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "xc.cli.train", *TINY, f"data.cache_dir={tmp_path / 'cache'}",
                           f"run_dir={tmp_path / 'run'}", "train.amp=fp16", "train.device=cpu"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert "train.amp" in proc.stderr and "fp16 autocast needs a CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_gpu_check_dry_run_runs_every_measurement_on_the_cpu(tmp_path):
    """tools/gpu_check.sh --dry-run: every command of the GPU check, at toy sizes on the CPU, writes its JSON
    naming the device, so the script that runs on a GPU host is known to work before the host is there."""
    out = tmp_path / "gpu-check"
    # TMPDIR: the script's work folder (data, runs, caches; hundreds of MB) goes beside `out`, removed with it
    env = {**os.environ, "XC_DATA": str(SHARED_DATA), "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "failed or skipped: none" in proc.stdout
    assert json.loads((out / "device.json").read_text())["device"] == "cpu"
    for name in ("step_b64", "encoder", "ann"):
        report = json.loads((out / f"{name}.json").read_text())
        device = report["machine"].get("device", report["machine"].get("gpu", "cpu"))
        assert device in ("cpu", None, "none"), (name, report["machine"])
    steps = json.loads((out / "step_b64.json").read_text())["results"]
    assert {r["num_labels"] for r in steps} == {1000, 10000} and all(r["median_step_s"] > 0 for r in steps)
    # train.static_shapes on and off, round-robin in one process, each with its phases
    static = json.loads((out / "step_b256_static.json").read_text())["results"]
    assert sorted(r["static_shapes"] for r in static) == ["off", "on"], static
    assert all(r["median_step_s"] > 0 and r["phase_seconds"]["data"] > 0 for r in static)
    encoder = json.loads((out / "encoder.json").read_text())["results"]
    assert [r["amp"] for r in encoder] == ["none", "bf16"] and all(r["train_queries_per_s"] > 0 for r in encoder)
    for name in ("dual", "dual_shared"):
        dual = json.loads((out / f"{name}.json").read_text())
        assert dual["machine"]["device"] == "cpu" and dual["steps"] == 4 and dual["epoch_seconds"] > 0, dual
    shared, per_query = (json.loads((out / f"{n}.json").read_text())["encodings"]["fresh_encodings"]
                         for n in ("dual_shared", "dual"))
    assert 0 < shared < per_query  # one uniform draw per batch encodes fewer labels than one per query
    accuracy = json.loads((out / "accuracy_main.json").read_text())
    assert accuracy["machine"]["device"] == "cpu" and accuracy["test"]["P@1"] > 0 and accuracy["steps"] == 8
    phases = accuracy["phases_seconds"]
    assert phases["train_steps"] > 0 and phases["final"] > 0 and 0 < phases["logged_span"] <= accuracy["wall_seconds"]
    learn = json.loads((out / "learn.json").read_text())["runs"]
    assert len(learn) == 1 and next(iter(learn.values()))["final"]["P@1"] > 0


def test_run_phases_attributes_each_gap_to_the_event_that_ends_it():
    """tools/experiments/run_phases.py: hand-computed phases of a short event log (two epochs, one refresh, the
    final choices)."""
    spec = importlib.util.spec_from_file_location("run_phases", REPO / "tools" / "experiments" / "run_phases.py")
    run_phases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_phases)
    times = [("attempt", 0.0), ("train", 4.0), ("epoch", 5.0), ("valid", 5.5), ("checkpoint", 6.0),
             ("negatives", 9.0), ("staleness", 9.5), ("epoch", 14.5), ("eval", 15.0), ("select_epoch", 15.0),
             ("eval_prior", 17.0), ("eval_fusion", 27.0)]
    phases = run_phases.phases([{"event": name, "time": t} for name, t in times])
    assert phases == {"train_steps": 10.0, "boundaries": 3.5, "validation": 0.5, "checkpoints": 0.5, "final": 12.5,
                      "other": 0.0, "logged_span": 27.0}
