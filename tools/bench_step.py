"""Per-step training time against the number of labels L: ASTRA negatives vs exact full BCE.

    .venv/bin/python tools/bench_step.py                         # L = 1e4, 1e5, 1e6; d = 64
    .venv/bin/python tools/bench_step.py --labels 10000 100000 --steps 20 --out tools/results/x.json

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
        "model": {"embed_dim": args.dim},
        "sampler": {"name": sampler, "k_hard": args.k_hard, "k_random": args.k_random, "k_pos": 8},
        "train": {"batch_size": args.batch_size, "resume": "never", "warmup_steps": 0},
        "logger": {"wandb": "disabled", "progress": False, "jsonl": False},
    })
    ctx = init_distributed()
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

    def step() -> float:
        i = next(counter)
        rows = order[(i * c.micro_batch) % (len(order) - c.micro_batch):][:c.micro_batch]
        start = time.perf_counter()
        trainer._micro_step(trainer.preparer(i, rows, StepKey(0, 1, i)), last_of_step=True)
        return time.perf_counter() - start

    return step


def time_all(configs: list[tuple[str, int]], args) -> list[dict]:
    """Round-robin timing: one step of every configuration per round, so that background load on a
    shared machine hits all of them alike and the ratios stay meaningful."""
    steppers = {cfg: make_stepper(cfg[0], cfg[1], args, args.cache) for cfg in configs}
    times: dict[tuple[str, int], list[float]] = {cfg: [] for cfg in configs}
    for round_idx in range(args.warmup + args.steps):
        for cfg, step in steppers.items():
            elapsed = step()
            if round_idx >= args.warmup:
                times[cfg].append(elapsed)
    out = []
    for (sampler, num_labels), values in times.items():
        steady = np.array(values)
        out.append({"sampler": sampler, "num_labels": num_labels, "median_step_s": float(np.median(steady)),
                    "mean_step_s": float(steady.mean()), "p90_step_s": float(np.quantile(steady, 0.9))})
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
    args = parser.parse_args()
    if os.environ.get("XC_THREADS"):
        torch.set_num_threads(int(os.environ["XC_THREADS"]))

    results = []
    for sampler in args.samplers:  # each sampler's L values are timed round-robin against each other
        results += time_all([(sampler, n) for n in args.labels], args)
    for r in results:
        print(f"L={r['num_labels']:>9,}  {r['sampler']:6s}  median {1000 * r['median_step_s']:8.1f} ms/step")
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
    report = {"settings": vars(args), "machine": {"cpu": platform.processor() or platform.machine(),
                                                  "threads": torch.get_num_threads(), "device": "cpu"},
              "results": results, "ratios_vs_smallest_L": ratios}
    out.write_text(json.dumps(report, indent=1))
    plot(results, out.with_suffix(".png"))
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
