"""What a miner core-second costs training when the miner shares the trainer's cores (a CPU-only host).

    .venv/bin/python tools/bench/bench_host_share.py                                   # 10^6 labels, about 12 minutes
    .venv/bin/python tools/bench/bench_host_share.py --labels 100000 --steps 600 --out /tmp/share.json

On a host where the asynchronous miner pool has no cores of its own (a 2-core machine), every second
it mines is taken from training. This measures the exchange rate, per thread policy, on the real 10^6-label step
(`tools/experiments/scale_quality.py`'s synthetic set, uniform negatives, the default model) beside a stand-in for the miner:
one process running the clustered search's inner loop on one thread (a cluster's 1,024 queries x 8,192 candidate
rows, d = 128, then each query's top-128: `xc/ann/clustered.py`), the work that dominates a generation.

Policies (trainer threads / OpenMP wait policy / the miner's CPU priority):
- `alone`: 2 threads, spinning waits (libgomp's default), no miner: the reference step.
- `pool`: what `miner=pool` does now: the trainer drops to 1 thread while the pool mines on the other core.
- `alone_passive`, `idle_passive`: 2 threads with OMP_WAIT_POLICY=PASSIVE (idle threads sleep instead of spinning),
  alone and beside a miner at SCHED_IDLE, which then runs only on what the trainer leaves idle.
- `idle_spin`: 2 spinning threads beside a SCHED_IDLE miner: spinning threads leave it almost nothing.

Per policy: seconds and CPU-seconds per step (steps after `--warmup`), the miner's cores (its rate over its rate
alone), and `cost_per_miner_core_second`: training seconds lost per core-second mined, (1 - t_alone / t) / cores,
against the `alone` step. Writes JSON. Run it alone on the machine; compare the policies as ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.experiments.scale_quality import data_overrides  # noqa: E402

# name: (trainer threads, OMP_WAIT_POLICY or "", miner priority: none | normal | idle)
POLICIES = {
    "alone": (2, "", "none"),
    "pool": (1, "", "normal"),
    "alone_passive": (2, "PASSIVE", "none"),
    "idle_passive": (2, "PASSIVE", "idle"),
    "idle_spin": (2, "", "idle"),
}

MINER_LOAD = r"""
import os, signal, sys, time
import torch
torch.set_num_threads(1)
if sys.argv[1] == "idle":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
queries, rows = torch.randn(1024, 128), torch.randn(128, 8192)
count, start = 0, time.perf_counter()
def report(*_):
    print(count / (time.perf_counter() - start), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, report)
deadline = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
while not deadline or time.perf_counter() - start < deadline:
    torch.topk(queries @ rows, 128, dim=1)
    count += 1
report()
"""


def miner_load(priority: str, seconds: float = 0.0) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", MINER_LOAD, priority, str(seconds)], env=env,
                            stdout=subprocess.PIPE, text=True)


def train_steps(run_dir: Path, args, threads: int, wait_policy: str, priority: str) -> dict:
    """Run the trainer to --steps (the miner load started once --warmup steps are done); its per-step figures."""
    env = dict(os.environ, XC_THREADS=str(threads))
    env.pop("OMP_WAIT_POLICY", None)
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    cmd = [sys.executable, "-m", "xc.cli.train",
           *data_overrides(args.labels, 2.0, args.cache), "sampler=uniform", "sampler.loss=softmax",
           f"run_dir={run_dir}", "train.resume=never", "eval.every_epochs=0", "eval.knn_fusion.enabled=false",
           "eval.label_prior.enabled=false", "logger.wandb=disabled", "logger.progress=false",
           f"train.max_steps={args.steps}", "train.log_every=50"]
    trainer = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = run_dir / "log.jsonl"
    miner = None

    def steps_done() -> int:
        if not log.exists():
            return 0
        done = [json.loads(line)["global_step"] for line in log.read_text().splitlines() if '"train"' in line]
        return max(done, default=0)

    try:
        while steps_done() < args.steps:
            if trainer.poll() is not None:
                raise SystemExit(f"the trainer exited ({trainer.returncode}) before step {args.steps}: {cmd}")
            if miner is None and priority != "none" and steps_done() >= args.warmup:
                miner = miner_load(priority)
            time.sleep(0.5)
    finally:
        trainer.send_signal(signal.SIGKILL)  # the final evaluation is not measured
        trainer.wait()
        rate = None
        if miner is not None:
            miner.send_signal(signal.SIGTERM)
            rate = float(miner.communicate()[0].strip() or "nan")
    events = [json.loads(line) for line in log.read_text().splitlines() if '"train"' in line]
    kept = [e for e in events if e["event"] == "train" and e["global_step"] > args.warmup + 50]
    return {"sec_per_step": sum(e["sec_per_step"] for e in kept) / len(kept),
            "cpu_sec_per_step": sum(e["cpu_sec_per_step"] for e in kept) / len(kept), "miner_rate": rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--labels", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--warmup", type=int, default=250, help="steps before the miner load starts and figures count")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--cache", default=str(REPO / ".cache" / "xc-scale"))
    ap.add_argument("--runs", default="/tmp/xc-host-share")
    ap.add_argument("--out", type=Path, default=REPO / "tools" / "results" / "host_share_1e6.json")
    args = ap.parse_args()
    solo = miner_load("normal", seconds=15.0)
    solo_rate = float(solo.communicate()[0])
    report = {"command": " ".join(sys.argv), "labels": args.labels, "miner_rate_alone": solo_rate, "policies": {}}
    for name in args.policies:
        threads, wait_policy, priority = POLICIES[name]
        figures = train_steps(Path(args.runs) / name, args, threads, wait_policy, priority)
        figures.update(threads=threads, omp_wait_policy=wait_policy or "default (spin)", miner=priority)
        figures["miner_cores"] = figures["miner_rate"] / solo_rate if figures["miner_rate"] else 0.0
        report["policies"][name] = figures
        print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}, flush=True)
    reference = report["policies"].get("alone", {}).get("sec_per_step")
    for figures in report["policies"].values():
        if reference and figures["miner_cores"]:
            lost = 1.0 - reference / figures["sec_per_step"]
            figures["cost_per_miner_core_second"] = lost / figures["miner_cores"]
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v.get("cost_per_miner_core_second") for k, v in report["policies"].items()}))


if __name__ == "__main__":
    main()
