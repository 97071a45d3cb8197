"""Stale label cache vs. full re-encoding vs. partial vs. the target corrector, at equal negative budgets.

Each (dataset, sampler) pair is one `xc.cli.train` run in its own process (XC_THREADS threads), with the same
model, steps and k_hard + k_random negatives; only the label-cache source differs. Reported per run: P@1,
P@5 (exact evaluation: every label re-encoded), the label encodings the cache cost (builds + refreshes),
the fresh encodings of the sampled sets (the same order for every source), and wall-clock seconds.

    PYTHONPATH=$PWD python tools/experiments/lf_staleness.py --datasets synthetic_lf debian_deps \
        --samplers lf_stale lf_exhaustive lf_partial corrector dynamic_tree --refresh-every 25

Samplers not registered in xc.sampling.cache_registry (e.g. dynamic_tree before it lands) are skipped
with a note. Writes tools/results/lf_staleness_<dataset>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # xc and tools.* (tools.plots) of this checkout
RESULTS = REPO / "tools" / "results"
EXPERIMENTS = {"synthetic_lf": "synthetic_lf", "debian_deps": "debian_deps_lf"}


def run_one(dataset: str, sampler: str, args, work: Path) -> dict:
    run_dir = work / f"{dataset}-{sampler}{'-' + args.tag if args.tag else ''}"
    overrides = [f"experiment={EXPERIMENTS[dataset]}", f"sampler={sampler}", f"run_dir={run_dir}",
                 f"data.cache_dir={work / 'cache'}", "train.resume=never", "logger.wandb=disabled",
                 "logger.progress=false", f"train.epochs={args.epochs}", f"sampler.k_hard={args.k_hard}",
                 f"sampler.k_random={args.k_random}", f"sampler.cache_refresh_every={args.refresh_every}",
                 f"sampler.cache_partial_fraction={args.partial_fraction}", f"seed={args.seed}",
                 f"eval.every_epochs={args.epochs}", *args.override]
    if args.max_steps > 0:
        overrides.append(f"train.max_steps={args.max_steps}")
    env = dict(os.environ, XC_THREADS=str(args.threads), PYTHONPATH=str(REPO), WANDB_MODE="disabled")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "xc.cli.train", *overrides], cwd=REPO, env=env, capture_output=True,
                          text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{dataset}/{sampler} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    counts = [e for e in events if e["event"] == "encodings"][-1]
    train = [e for e in events if e["event"] == "train"]
    row = {"dataset": dataset, "sampler": sampler, "P@1": metrics["P@1"], "P@5": metrics["P@5"],
           "R@5": metrics.get("R@5"), "cache_encodings": counts["cache_encodings"],
           "fresh_encodings": counts["fresh_encodings"], "steps": counts["global_step"],
           "wall_seconds": seconds, "steps_per_sec": sum(e["steps_per_sec"] for e in train) / max(1, len(train))}
    for key in ("kl_fresh_corrected", "kl_fresh_stale", "top5_overlap_corrected", "top5_overlap_stale"):
        if train and key in train[-1]:
            row[key] = train[-1][key]
    print(f"{dataset:12s} {sampler:14s} P@1 {row['P@1']:6.2f} P@5 {row['P@5']:6.2f} cache enc {row['cache_encodings']:9d} "
          f"fresh enc {row['fresh_encodings']:9d} {seconds:7.1f}s", flush=True)
    return row


def write_outputs(dataset: str, rows: list[dict], args, skipped: list[str]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"lf_staleness_{dataset}{'_' + args.tag if args.tag else ''}"
    setup = {k: getattr(args, k) for k in ("tag", "epochs", "max_steps", "k_hard", "k_random", "refresh_every",
                                            "partial_fraction", "threads", "seed", "override")}
    stem.with_suffix(".json").write_text(json.dumps({"setup": setup, "skipped": skipped, "runs": rows}, indent=1))
    lines = ["| source | P@1 | P@5 | cache encodings | fresh S encodings | steps | wall s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['sampler']} | {r['P@1']:.2f} | {r['P@5']:.2f} | {r['cache_encodings']:,} | "
                     f"{r['fresh_encodings']:,} | {r['steps']} | {r['wall_seconds']:.0f} |")
    if skipped:
        lines.append(f"\nnot registered, skipped: {', '.join(skipped)}")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    from tools.plots import pyplot  # matplotlib is the `plots` extra: one line where it is missing

    plt = pyplot(__file__)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["cache_encodings"], r["P@1"], s=60)
        ax.annotate(r["sampler"], (r["cache_encodings"], r["P@1"]), textcoords="offset points", xytext=(5, 5))
    ax.set_xscale("log")
    ax.margins(x=0.25, y=0.1)
    ax.set_xlabel("label encodings spent on the cache (log)")
    ax.set_ylabel("P@1 (exact evaluation)")
    ax.set_title(f"{dataset}: cache staleness policies, equal negative budget")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["synthetic_lf", "debian_deps"], choices=sorted(EXPERIMENTS))
    parser.add_argument("--samplers", nargs="+", default=["lf_stale", "lf_exhaustive", "lf_partial", "corrector",
                                                          "dynamic_tree"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=0)
    parser.add_argument("--k-hard", type=int, default=16)
    parser.add_argument("--k-random", type=int, default=64)
    parser.add_argument("--refresh-every", type=int, default=25)
    parser.add_argument("--partial-fraction", type=float, default=0.25)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default=str(REPO / "runs" / "lf_staleness"))
    parser.add_argument("--replot", action="store_true", help="rewrite .md/.png from the existing JSON only")
    parser.add_argument("--tag", default="", help="suffix of the output files (variants of one dataset)")
    parser.add_argument("--override", nargs="*", default=[], help="extra hydra overrides for every run")
    args = parser.parse_args()
    if args.replot:
        for dataset in args.datasets:
            stem = RESULTS / f"lf_staleness_{dataset}{'_' + args.tag if args.tag else ''}"
            saved = json.loads(stem.with_suffix(".json").read_text())
            args.__dict__.update({k: v for k, v in saved["setup"].items()})
            write_outputs(dataset, saved["runs"], args, saved["skipped"])
        return
    from xc.sampling.cache_registry import cache_source_names

    known = set(cache_source_names())
    samplers = [s for s in args.samplers if s in known]
    skipped = [s for s in args.samplers if s not in known]
    if skipped:
        print(f"not registered, skipped: {', '.join(skipped)}", flush=True)
    for dataset in args.datasets:
        rows = [run_one(dataset, s, args, Path(args.work)) for s in samplers]
        write_outputs(dataset, rows, args, skipped)


if __name__ == "__main__":
    main()
