"""Per-step training time against the number of labels L: ASTRA negatives vs exact full BCE.

    .venv/bin/python tools/bench/bench_step.py --phases                # L = 1e4 .. 1e7 (full BCE to 1e6); d = 64
    .venv/bin/python tools/bench/bench_step.py --labels 10000 100000 --steps 20 --out tools/results/x.json
    .venv/bin/python tools/bench/bench_step.py --device cuda --phases --labels 100000 1000000 10000000 100000000 \
        --samplers astra --out tools/results/bench_step_gpu.json  # per-phase breakdown (ASTRA Table 3)
    XC_THREADS=1 .venv/bin/python tools/bench/bench_step.py --labels 1000000 100000000 --samplers astra \
        --classifier-dtype auto --steps 10 --warmup 2 --out tools/results/bench_step_1e8_auto.json
        # the rows' precision by the defaults' rule: float32 at 10^6, bfloat16 + stochastic rounding at 10^8 (12.8 GB)

Every configuration runs in this one process, one after another, with the same batch size and the
same encoder, so the figures compare as ratios (the machines are noisy; absolute times only mean
something with the device named). Hard-negative tables are filled with random label ids: a step's cost
does not depend on which ids they are, and exact mining at 1e6 labels would dominate the run.
Writes a JSON of figures and a PNG plot.
"""

from __future__ import annotations

import argparse
import atexit
import json
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from xc.config import XCConfig, build_config, to_dict
from xc.data import load_dataset
from xc.distributed import init_distributed
from xc.distributed.host_threads import host_threads
from xc.sampling import HardNegativeSet, StepKey
from xc.train.modes.classifier.step import shard_rows
from xc.train.plan import resolve_run
from xc.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # xc and tools.* (tools.plots) of this checkout


def scratch_dir(prefix: str) -> str:
    """A run folder for a benchmark's trainer, removed when the process exits: nothing of it is a result."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def make_stepper(sampler: str, num_labels: int, args, cache: str, static_shapes: str = "auto"):
    """A trainer for (sampler, L, train.static_shapes) and a function that runs and times one optimizer step of it."""
    cfg = build_config({
        "run_dir": scratch_dir("xc-bench-"), "seed": 0,
        "data": {"cache_dir": cache, "synthetic": {"num_train": args.num_train, "num_test": 100,
                                                    "num_labels": num_labels, "num_features": 20000}},
        "model": {"embed_dim": args.dim, "classifier_dtype": args.classifier_dtype,
                  # bfloat16 rows without fp32 masters are stochastically rounded (model.classifier_rounding: auto)
                  "classifier_master_fp32": getattr(args, "master", True) and getattr(args, "rounding", "auto")
                  != "stochastic", "classifier_rounding": getattr(args, "rounding", "auto")},
        "sampler": {"name": sampler, "k_hard": args.k_hard, "k_random": args.k_random, "k_pos": 8},
        "train": {"batch_size": args.batch_size, "resume": "never", "warmup_steps": 0, "device": args.device,
                  "amp": args.amp, "profile_phases": args.phases,
                  "device_batches": {"auto": None, "on": True, "off": False}[args.device_batches],
                  "static_shapes": static_shapes},
        "logger": {"wandb": "disabled", "progress": False, "jsonl": False},
    })
    ctx = init_distributed(device=args.device)
    dataset = load_dataset("synthetic", None, f"{cache}/synthetic", to_dict(cfg.data.synthetic))
    trainer = Trainer(resolve_run(cfg, ctx, dataset), ctx, dataset)
    return stepper(trainer, ctx, args.k_hard), trainer


def prime_sampler(trainer: Trainer, k_hard: int) -> None:
    """Give the trainer's sampler what it has after a refresh: random hard-negative tables (a step's cost does
    not depend on which ids they hold) or, for adaptive samplers (MIDX, LSH), their per-shard index."""
    c = trainer.mode.c
    if c.sampler is not None and c.sampler.wants_hard_negatives:
        rng = np.random.default_rng(0)
        k = c.layout.split_count(k_hard, "sampler.k_hard")
        # each shard's table holds ids of its own label range, as the miner writes them
        tables = {s: (c.layout.shard_range(s)[0] + rng.integers(0, c.layout.real_count(s), (c.train.num_rows, k)))
                  .astype(np.int32) for s in c.my_shards}
        c.sampler.update(1, HardNegativeSet(tables, 1, 0, 0))
    elif c.sampler is not None:
        c.sampler.update(1, None, shard_rows(c), 0)


def stepper(trainer: Trainer, ctx, k_hard: int):
    """A function that runs and times one optimizer step of `trainer` (batch preparation inline, so the
    `data` phase is the whole host-side assembly): returns (wall seconds, CPU seconds of this process)."""
    prime_sampler(trainer, k_hard)
    c = trainer.mode.c
    order = np.random.default_rng(1).permutation(c.train.num_rows)
    counter = iter(range(1 << 30))

    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)

    def step() -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) of one optimizer step."""
        i = next(counter)
        rows = order[(i * c.micro_batch) % (len(order) - c.micro_batch):][:c.micro_batch]
        sync()
        start, cpu = time.perf_counter(), time.process_time()
        trainer.mode.timer.start()
        batch = trainer.mode.preparer(i, rows, StepKey(0, 1, i))
        trainer.mode.timer.mark("data")
        trainer.step_batch(batch, True)
        trainer.mode.timer.end_step()
        sync()
        return time.perf_counter() - start, time.process_time() - cpu

    return step


def time_all(configs: list[tuple[str, int, str]], args) -> list[dict]:
    """Every (sampler, L, train.static_shapes) of `configs`, timed round-robin (see `time_round_robin`)."""
    steppers = {cfg: make_stepper(cfg[0], cfg[1], args, args.cache, cfg[2]) for cfg in configs}
    out = time_round_robin(steppers, args.warmup, args.steps)
    for row, ((sampler, num_labels, shapes), (_, trainer)) in zip(out, steppers.items()):
        model = trainer.cfg.model  # the precision the run resolved (model.classifier_dtype: auto reads free memory)
        row.update(sampler=sampler, num_labels=num_labels, static_shapes=shapes,
                   classifier_dtype=model.classifier_dtype, classifier_rounding=model.classifier_rounding,
                   classifier_master_fp32=model.classifier_master_fp32)
    # every trainer above is alive at once: this is the peak with all of them resident
    out_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for row in out:
        row["peak_rss_all_gb"] = round(out_peak / 1e9, 2)
    return out


def time_round_robin(steppers: dict, warmup: int, steps: int) -> list[dict]:
    """One step of every configuration per round, so that background load on a shared machine hits all of
    them alike and the ratios stay meaningful. `steppers` maps a key to (step function, trainer); returns one
    row of figures per key, in order."""
    times: dict = {cfg: [] for cfg in steppers}
    for round_idx in range(warmup + steps):
        if round_idx == warmup:
            for _, trainer in steppers.values():
                trainer.mode.timer.window()  # drop the warm-up steps' phase times
        for cfg, (step, _) in steppers.items():
            elapsed = step()
            if round_idx >= warmup:
                times[cfg].append(elapsed)
    out = []
    for key, values in times.items():
        steady, cpu = np.array(values).T
        # CPU seconds (one thread, XC_THREADS=1) are far less sensitive than wall seconds to other jobs
        # on a shared machine; both are reported and both give ratios.
        row = {"median_step_s": float(np.median(steady)),
               "mean_step_s": float(steady.mean()), "p90_step_s": float(np.quantile(steady, 0.9)),
               "median_step_cpu_s": float(np.median(cpu))}
        phases = steppers[key][1].mode.timer.window()
        if phases is not None:  # --phases: mean seconds per step of each phase (synchronised on CUDA)
            row["phase_seconds"] = phases
            # the host's share of the step: batch assembly (positives, uniform/hard draws, masking, inputs)
            row["data_share"] = phases.get("data", 0.0) / max(sum(phases.values()), 1e-12)
        row["cpu_per_wall"] = row["median_step_cpu_s"] / max(row["median_step_s"], 1e-12)
        out.append(row)
    return out


def plot(results: list[dict], path: Path) -> None:
    from tools.plots import pyplot  # matplotlib is the `plots` extra: one line where it is missing

    plt = pyplot(__file__)

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


def ratio_tables(results: list[dict], samplers: list[str], key: str) -> dict:
    """Each sampler's `key` over its value at its smallest L, and full BCE over ASTRA at each shared L."""
    ratios = {}
    for sampler in samplers:
        rows = [r for r in results if r["sampler"] == sampler]
        if not rows:
            continue
        base = min(rows, key=lambda r: r["num_labels"])[key]
        ratios[sampler] = {str(r["num_labels"]): r[key] / base for r in rows}
    by = {(r["sampler"], r["num_labels"]): r[key] for r in results}
    shared = sorted(n for (s, n) in by if s == "full" and ("astra", n) in by)
    if shared:
        ratios["full_over_astra"] = {str(n): by[("full", n)] / by[("astra", n)] for n in shared}
    return ratios


PHASES = ["data", "h2d", "encoder_forward", "classifier_forward", "loss", "backward", "optimizer"]


def plot_phases(results: list[dict], path: Path) -> None:
    """Stacked bars of the mean seconds per step of each phase (ASTRA Table 3), one bar per (sampler, L)."""
    from tools.plots import pyplot  # matplotlib is the `plots` extra: one line where it is missing

    plt = pyplot(__file__)

    rows = [r for r in results if "phase_seconds" in r]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for ax, rows_here, title in ((axes[0], [r for r in rows if r["sampler"] != "full"], "sampled (ms, linear)"),
                                 (axes[1], [r for r in rows if r["sampler"] == "full"], "full BCE (ms)")):
        bottom = np.zeros(len(rows_here))
        for i, phase in enumerate(PHASES):
            vals = np.array([1000 * r["phase_seconds"].get(phase, 0.0) for r in rows_here])
            ax.bar(range(len(rows_here)), vals, bottom=bottom, label=phase, color=plt.get_cmap("tab10")(i))
            bottom += vals
        ax.set_xticks(range(len(rows_here)))
        ax.set_xticklabels([f"{r['sampler']}\nL={r['num_labels']:.0e}" for r in rows_here], fontsize=8)
        ax.set_ylabel("mean ms per step")
        ax.set_title(f"per-phase step time, {title}")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", type=int, nargs="+", default=[10_000, 100_000, 1_000_000, 10_000_000])
    parser.add_argument("--full-max-labels", type=int, default=1_000_000,
                        help="full BCE is timed only up to this L (its B x L scores and gradients take 3 GB at 1e6)")
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
    parser.add_argument("--classifier-dtype", choices=["auto", "float32", "bfloat16", "float16"], default="float32",
                        help="model.classifier_dtype (auto: the memory rule of xc/defaults/)")
    parser.add_argument("--master", action=argparse.BooleanOptionalAction, default=True,
                        help="model.classifier_master_fp32 for bfloat16/float16 rows")
    parser.add_argument("--rounding", choices=["auto", "nearest", "stochastic"], default="auto",
                        help="model.classifier_rounding; stochastic (bfloat16 rows without masters) implies --no-master")
    parser.add_argument("--device-batches", choices=["auto", "on", "off"], default="auto",
                        help="train.device_batches: auto = on with CUDA (xc/train/modes/classifier/device_batches.py); "
                             "on also runs it on a CPU")
    parser.add_argument("--static-shapes", choices=["auto", "on", "off"], nargs="+", default=["auto"],
                        help="train.static_shapes: batch assembly with fixed shapes (auto = on with CUDA); several "
                             "values time each, round-robin (ratios and plots take the first)")
    parser.add_argument("--phases", action="store_true",
                        help="also time each phase of a step (train.profile_phases; adds a sync per phase on CUDA)")
    args = parser.parse_args()
    # the threads a training rank gets (xc/distributed/host_threads.py): $XC_THREADS, else all cores, at most 2 on a GPU
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    torch.set_num_threads(host_threads(XCConfig(), mining=False, device_type="cuda" if cuda else "cpu")[0])

    # One round-robin over every (sampler, L): background load hits all of them alike, so every ratio
    # below (across L and across samplers) is taken within one run. Full BCE materialises B x L scores
    # and gradients, so it stops at --full-max-labels.
    configs = [(sampler, n, shapes) for shapes in args.static_shapes for sampler in args.samplers for n in args.labels
               if sampler != "full" or n <= args.full_max_labels]
    everything = time_all(configs, args)
    results = [r for r in everything if r["static_shapes"] == args.static_shapes[0]]
    for r in everything:
        print(f"L={r['num_labels']:>11,}  {r['sampler']:6s}  static shapes {r['static_shapes']:4s}  "
              f"median {1000 * r['median_step_s']:8.1f} ms/step "
              f"(cpu {1000 * r['median_step_cpu_s']:8.1f} ms)  rows {r['classifier_dtype']} "
              f"({r['classifier_rounding']} rounding)")
        if "phase_seconds" in r:
            print("    " + "  ".join(f"{k} {1000 * v:.2f}" for k, v in r["phase_seconds"].items()) + "  (ms)")
    ratios, cpu_ratios = ratio_tables(results, args.samplers, "median_step_s"), ratio_tables(results, args.samplers, "median_step_cpu_s")
    times = {(r["sampler"], r["num_labels"], r["static_shapes"]): r["median_step_s"] for r in everything}
    if "on" in args.static_shapes and "off" in args.static_shapes:  # the fixed-shape assembly's step over the dynamic
        ratios["static_on_over_off"] = {f"{s}/{n}": times[(s, n, "on")] / times[(s, n, "off")]
                                        for s, n, shapes in times if shapes == "on"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    report = {"settings": vars(args), "machine": {"cpu": platform.processor() or platform.machine(),
                                                  "threads": torch.get_num_threads(), "device": device,
                                                  "torch": torch.__version__},
              "results": everything, "ratios_vs_smallest_L": ratios, "cpu_ratios_vs_smallest_L": cpu_ratios}
    out.write_text(json.dumps(report, indent=1))
    plot(results, out.with_suffix(".png"))
    if args.phases:
        plot_phases(results, out.with_name(out.stem + "_phases.png"))
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
