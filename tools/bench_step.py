"""Per-step training time against the number of labels L: ASTRA negatives vs exact full BCE.

    .venv/bin/python tools/bench_step.py                         # L = 1e4, 1e5, 1e6; d = 64
    .venv/bin/python tools/bench_step.py --labels 10000 100000 --steps 20 --out tools/results/x.json
    .venv/bin/python tools/bench_step.py --device cuda --phases --labels 100000 1000000 10000000 100000000 \
        --samplers astra --out tools/results/bench_step_gpu.json  # per-phase breakdown (ASTRA Table 3)

Every configuration runs in this one process, one after another, with the same batch size and the
same encoder, so the figures compare as ratios (the machines are noisy; absolute times only mean
something with the device named). Hard-negative tables are filled with random label ids: a step's cost
does not depend on which ids they are, and exact mining at 1e6 labels would dominate the run.
Writes a JSON of figures and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from xc.config import build_config, to_dict
from xc.data import load_dataset
from xc.distributed import init_distributed
from xc.sampling import HardNegativeSet, StepKey
from xc.trainer import Trainer


def make_stepper(sampler: str, num_labels: int, args, cache: str):
    """A trainer for (sampler, L) and a function that runs and times one optimizer step of it."""
    cfg = build_config({
        "run_dir": tempfile.mkdtemp(prefix="xc-bench-"), "seed": 0,
        "data": {"cache_dir": cache, "synthetic": {"num_train": args.num_train, "num_test": 100,
                                                    "num_labels": num_labels, "num_features": 20000}},
        "model": {"embed_dim": args.dim, "classifier_dtype": args.classifier_dtype},
        "sampler": {"name": sampler, "k_hard": args.k_hard, "k_random": args.k_random, "k_pos": 8},
        "train": {"batch_size": args.batch_size, "resume": "never", "warmup_steps": 0, "device": args.device,
                  "amp": args.amp, "profile_phases": args.phases},
        "logger": {"wandb": "disabled", "progress": False, "jsonl": False},
    })
    ctx = init_distributed(device=args.device)
    dataset = load_dataset("synthetic", None, f"{cache}/synthetic", to_dict(cfg.data.synthetic))
    trainer = Trainer(cfg, ctx, dataset)
    c = trainer.c
    if c.sampler is not None and c.sampler.wants_hard_negatives:
        rng = np.random.default_rng(0)
        k = c.layout.split_count(args.k_hard, "sampler.k_hard")
        tables = {s: rng.integers(0, num_labels, (c.train.num_rows, k), dtype=np.int32) for s in c.my_shards}
        c.sampler.update(1, HardNegativeSet(tables, 1, 0, 0))
    order = np.random.default_rng(1).permutation(c.train.num_rows)
    counter = iter(range(1 << 30))

    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)

    def step() -> float:
        i = next(counter)
        rows = order[(i * c.micro_batch) % (len(order) - c.micro_batch):][:c.micro_batch]
        sync()
        start = time.perf_counter()
        trainer.timer.start()
        batch = trainer.preparer(i, rows, StepKey(0, 1, i))
        trainer.timer.mark("data")
        trainer._micro_step(batch, last_of_step=True)
        trainer.timer.end_step()
        sync()
        return time.perf_counter() - start

    return step, trainer


def time_all(configs: list[tuple[str, int]], args) -> list[dict]:
    """Round-robin timing: one step of every configuration per round, so that background load on a
    shared machine hits all of them alike and the ratios stay meaningful."""
    steppers = {cfg: make_stepper(cfg[0], cfg[1], args, args.cache) for cfg in configs}
    times: dict[tuple[str, int], list[float]] = {cfg: [] for cfg in configs}
    for round_idx in range(args.warmup + args.steps):
        if round_idx == args.warmup:
            for _, trainer in steppers.values():
                trainer.timer.window()  # drop the warm-up steps' phase times
        for cfg, (step, _) in steppers.items():
            elapsed = step()
            if round_idx >= args.warmup:
                times[cfg].append(elapsed)
    out = []
    for (sampler, num_labels), values in times.items():
        steady = np.array(values)
        row = {"sampler": sampler, "num_labels": num_labels, "median_step_s": float(np.median(steady)),
               "mean_step_s": float(steady.mean()), "p90_step_s": float(np.quantile(steady, 0.9))}
        phases = steppers[(sampler, num_labels)][1].timer.window()
        if phases is not None:  # --phases: mean seconds per step of each phase (synchronised on CUDA)
            row["phase_seconds"] = phases
        out.append(row)
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for sampler in sorted({r["sampler"] for r in results}):
        rows = [r for r in results if r["sampler"] == sampler]
        ax.plot([r["num_labels"] for r in rows], [1000 * r["median_step_s"] for r in rows], "o-", label=sampler)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("number of labels L")
    ax.set_ylabel("median step time (ms)")
    ax.set_title("per-step time vs L (d=64, same batch)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--samplers", nargs="+", default=["astra", "full"])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--k-hard", type=int, default=16)
    parser.add_argument("--k-random", type=int, default=64)
    parser.add_argument("--num-train", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cache", default=".cache/xc-bench")
    parser.add_argument("--out", default="tools/results/bench_step.json")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu",
                        help="where the step runs (cpu by default, so earlier figures stay comparable)")
    parser.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none", help="train.amp")
    parser.add_argument("--classifier-dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--phases", action="store_true",
                        help="also time each phase of a step (train.profile_phases; adds a sync per phase on CUDA)")
    args = parser.parse_args()
    if os.environ.get("XC_THREADS"):
        torch.set_num_threads(int(os.environ["XC_THREADS"]))

    results = []
    for sampler in args.samplers:  # each sampler's L values are timed round-robin against each other
        results += time_all([(sampler, n) for n in args.labels], args)
    for r in results:
        print(f"L={r['num_labels']:>11,}  {r['sampler']:6s}  median {1000 * r['median_step_s']:8.1f} ms/step")
        if "phase_seconds" in r:
            print("    " + "  ".join(f"{k} {1000 * v:.2f}" for k, v in r["phase_seconds"].items()) + "  (ms)")
    smallest = min(args.labels)
    ratios = {}
    for sampler in args.samplers:
        base = next(r["median_step_s"] for r in results if r["sampler"] == sampler and r["num_labels"] == smallest)
        ratios[sampler] = {str(r["num_labels"]): r["median_step_s"] / base for r in results if r["sampler"] == sampler}
    if "astra" in args.samplers and "full" in args.samplers:
        ratios["full_over_astra"] = {
            str(n): next(r["median_step_s"] for r in results if r["sampler"] == "full" and r["num_labels"] == n)
            / next(r["median_step_s"] for r in results if r["sampler"] == "astra" and r["num_labels"] == n)
            for n in args.labels}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.cuda.get_device_name() if cuda else "cpu"
    report = {"settings": vars(args), "machine": {"cpu": platform.processor() or platform.machine(),
                                                  "threads": torch.get_num_threads(), "device": device,
                                                  "torch": torch.__version__},
              "results": results, "ratios_vs_smallest_L": ratios}
    out.write_text(json.dumps(report, indent=1))
    plot(results, out.with_suffix(".png"))
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
