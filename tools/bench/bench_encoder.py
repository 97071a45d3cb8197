"""Training and encoding throughput (queries/s) of a text encoder under each precision, on real data.

    .venv/bin/python tools/bench/bench_encoder.py --device cuda            # MiniLM classifier on debian-deps, fp32 vs bf16
    .venv/bin/python tools/bench/bench_encoder.py --steps 3 --warmup 1 --batch-size 8 --max-len 16   # a CPU smoke run

Each precision (`train.amp`) gets its own trainer over the same data and configuration (by default the
`experiment=debian_deps` preset: MiniLM, ASTRA negatives with random hard-negative tables); their steps are
timed round-robin in this one process, so the ratio bf16 / fp32 is taken under the same load. Reported per
precision: training queries/s (batch / median optimizer step, batch preparation inline) with the step's
phases, and encoding queries/s (the encoder alone under `torch.no_grad`, as evaluation and mining encode).
Writes a JSON naming the device.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from xc.cli.baseline import _compose
from xc.config import XCConfig
from xc.train.modes.classifier.batches import to_device_prepared
from xc.datasets import load_configured_dataset
from xc.distributed import init_distributed
from xc.distributed.host_threads import host_threads
from xc.sampling import StepKey
from xc.train.plan import resolve_run
from xc.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # xc and tools.* (tools.plots) of this checkout

from tools.bench.bench_step import scratch_dir, stepper, time_round_robin  # noqa: E402


def build_trainer(args, amp: str, dataset=None) -> tuple[Trainer, object, object]:
    """(trainer, dist context, dataset) for the preset under `amp`; the dataset is loaded once and shared."""
    amp, _, compiled = amp.partition("+")
    overrides = [*args.overrides, f"train.amp={amp}", f"train.compile={compiled == 'compile'}",
                 f"train.batch_size={args.batch_size}",
                 f"train.device={args.device}", "train.resume=never",
                 "train.profile_phases=true", f"run_dir={scratch_dir('xc-bench-enc-')}",
                 "logger.wandb=disabled", "logger.progress=false", "logger.jsonl=false"]
    if args.data:
        overrides.append(f"data.path={args.data}")
    if args.max_len:
        overrides.append(f"data.max_len={args.max_len}")
    cfg = _compose(overrides)
    ctx = init_distributed(device=args.device)
    dataset = dataset if dataset is not None else load_configured_dataset(cfg)
    return Trainer(resolve_run(cfg, ctx, dataset), ctx, dataset), ctx, dataset


def encode_rate(trainer: Trainer, batch_size: int, batches: int) -> float:
    """Queries/s of the encoder alone (no_grad, eval mode) over `batches` batches of training inputs."""
    c, device = trainer.mode.c, trainer.ctx.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    order = np.random.default_rng(2).permutation(c.train.num_rows)
    c.encoder.eval()
    seconds = []
    with torch.no_grad():
        for i in range(batches + 1):
            rows = order[(i * batch_size) % (len(order) - batch_size):][:batch_size]
            inputs = to_device_prepared(trainer.mode.preparer(i, rows, StepKey(0, 1, i)), device, True)
            sync()
            start = time.perf_counter()
            c.encoder(inputs)
            sync()
            if i:  # the first batch warms the kernels up
                seconds.append(time.perf_counter() - start)
    c.encoder.train()
    return batch_size / float(np.median(seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overrides", nargs="*", default=["experiment=debian_deps"],
                        help="xc-train overrides naming the configuration (default: the debian_deps preset)")
    parser.add_argument("--data", default=os.environ.get("XC_DEBIAN_DEPS"),
                        help="data.path (default: the preset's, ../shared/data/debian-deps)")
    parser.add_argument("--amp", nargs="+", default=["none", "bf16"],
                        help="train.amp values; AMP+compile (e.g. bf16+compile) also sets train.compile=true")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=None, help="data.max_len: tokens per text (default: the preset's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--out", default=str(REPO / "tools" / "results" / "bench_encoder.json"))
    args = parser.parse_args()
    # the threads a training rank gets (xc/distributed/host_threads.py): $XC_THREADS, else all cores, at most 2 on a GPU
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    torch.set_num_threads(host_threads(XCConfig(), mining=False, device_type="cuda" if cuda else "cpu")[0])

    steppers, dataset = {}, None
    for amp in args.amp:
        trainer, ctx, dataset = build_trainer(args, amp, dataset)
        steppers[amp] = (stepper(trainer, ctx, trainer.cfg.sampler.k_hard), trainer)
    rows = time_round_robin(steppers, args.warmup, args.steps)
    results = []
    for (amp, (_, trainer)), row in zip(steppers.items(), rows):
        row.update(amp=amp, train_queries_per_s=args.batch_size / row["median_step_s"],
                   encode_queries_per_s=encode_rate(trainer, args.batch_size, max(args.steps // 2, 2)))
        results.append(row)
        print(f"amp={amp:5s} train {row['train_queries_per_s']:9.1f} q/s ({1000 * row['median_step_s']:.1f} ms/step)"
              f"  encode {row['encode_queries_per_s']:9.1f} q/s")
    ratios = {}
    if len(results) > 1:
        base = results[0]
        ratios = {r["amp"]: {"train": r["train_queries_per_s"] / base["train_queries_per_s"],
                             "encode": r["encode_queries_per_s"] / base["encode_queries_per_s"]} for r in results[1:]}
        print("over " + base["amp"] + ": " + json.dumps(ratios))
    cuda = next(iter(steppers.values()))[1].ctx.device.type == "cuda"
    report = {"settings": vars(args),
              "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__},
              "results": results, "ratios_vs_first_amp": ratios}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
