"""Sampler ablation: train one model per sampler on the same data with the same negative budget.

    .venv/bin/python tools/experiments/ablation.py --preset delicious --epochs 5
    .venv/bin/python tools/experiments/ablation.py --preset synthetic100k
    .venv/bin/python tools/experiments/ablation.py --preset delicious --samplers uniform astra midx_rq -- train.lr_classifier=16

Every sampler gets k_hard + k_random negatives per query (the preset's budget): the hard-only
samplers (hard, ehard) spend all of it on stored hard negatives, ASTRA and the curriculum split it as
the preset does, everything else draws it from its own proposal. Each run evaluates after every
epoch; the table gives the final P@1/3/5 and the training seconds per epoch (training and negative
refresh, evaluation excluded), and the plot P@1 against cumulative training seconds. Runs go one
after another in subprocesses (`python -m xc.cli.train`), so each sees the same machine.
Writes tools/results/ablation_<preset>.json, .md and .png.
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

PRESETS = {
    "delicious": ["experiment=delicious"],
    # 10^5 labels, generated: 60k training points, ~5 labels each, power-law label frequencies.
    "synthetic100k": ["data.name=synthetic100k", "data.synthetic.num_train=60000", "data.synthetic.num_test=5000",
                      "data.synthetic.num_labels=100000", "data.synthetic.num_features=20000",
                      "model.embed_dim=64", "train.batch_size=256", "sampler.k_hard=32", "sampler.k_random=128",
                      "train.lr_classifier=16"],
    # 2x10^4 labels, generated: small enough that full BCE converges in CPU minutes, so ASTRA's
    # P@1-vs-time curve can be compared with full BCE's *converged* P@1 (ASTRA's Figure 2).
    "synthetic20k": ["data.name=synthetic20k", "data.synthetic.num_train=40000", "data.synthetic.num_test=5000",
                     "data.synthetic.num_labels=20000", "data.synthetic.num_features=20000",
                     "model.embed_dim=64", "train.batch_size=256", "sampler.k_hard=32", "sampler.k_random=128"],
}
ALL = ["uniform", "hard", "astra", "curriculum", "midx_pq", "midx_rq", "lsh_embedding", "lsh_label", "inbatch",
       "snm", "popularity", "full",
       # the loss family matters as much as the sampler: the BCE baselines with sampled softmax too
       "uniform@softmax", "astra@softmax", "full@softmax"]
# What each sampler needs beyond the preset to keep the budget equal (k_hard + k_random in total).
BUDGET = {"hard": lambda kh, kr: [f"sampler.k_hard={kh + kr}", "sampler.k_random=0"],
          "ehard": lambda kh, kr: [f"sampler.k_hard={kh + kr}", "sampler.k_random=0"],
          "curriculum": lambda kh, kr: ["sampler.curriculum_epochs=3"]}
SETTLE = {"snm": lambda kh, kr: [f"sampler.snm_pool={8 * (kh + kr)}"]}


def _budget(overrides: list[str]) -> tuple[int, int]:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return int(cfg.sampler.k_hard), int(cfg.sampler.k_random)


def run_one(entry: str, base: list[str], run_dir: Path, timeout: int) -> dict:
    """entry = a sampler preset name, optionally `name@loss` to train it with the other loss family."""
    sampler, _, loss = entry.partition("@")
    kh, kr = _budget([*base])
    extra = BUDGET.get(sampler, lambda *_: [])(kh, kr) + SETTLE.get(sampler, lambda *_: [])(kh, kr)
    if loss:
        extra.append(f"sampler.loss={loss}")
    args = [*base, f"sampler={sampler}", *extra, f"run_dir={run_dir}", "eval.every_epochs=1",
            "train.resume=never", "logger.wandb=disabled", "logger.progress=false"]
    # sampler= must come before the preset's sampler.* values take effect: hydra applies group choices
    # first and then every dotted override, whatever their order on the line.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "xc.cli.train", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"sampler": entry, "error": (proc.stderr or proc.stdout)[-1500:], "args": args}
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    epochs = [e for e in events if e["event"] == "epoch"]
    evals = [e for e in events if e["event"] == "eval"]
    elapsed, curve = 0.0, []
    for ep in epochs:
        elapsed += ep["boundary_seconds"] + ep["train_seconds"]
        match = [e for e in evals if e["epoch"] == ep["epoch"] + 1]
        if match:
            curve.append({"epoch": ep["epoch"] + 1, "train_seconds": elapsed, "P@1": match[-1]["P@1"]})
    final = evals[-1]
    return {"sampler": entry, "loss": loss or _loss_of(sampler), "args": args, "P@1": final["P@1"], "P@3": final["P@3"], "P@5": final["P@5"],
            "seconds_per_epoch": elapsed / max(1, len(epochs)), "train_seconds": elapsed, "wall_seconds": wall,
            "budget": kh + kr, "curve": curve}


def _loss_of(sampler: str) -> str:
    text = (REPO / "conf" / "sampler" / f"{sampler}.yaml").read_text()
    return "softmax" if "loss: softmax" in text else "bce"


def write_table(results: list[dict], path: Path, title: str, command: str) -> None:
    lines = [f"### {title}", "", f"`{command}`", "",
             "| sampler | loss | P@1 | P@3 | P@5 | s/epoch (train + refresh) |", "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['sampler']} | | failed | | | |")
            continue
        loss = r.get("loss") or _loss_of(r["sampler"].partition("@")[0])
        lines.append(f"| {r['sampler']} | {loss} | {r['P@1']:.2f} | {r['P@3']:.2f} | {r['P@5']:.2f} | {r['seconds_per_epoch']:.1f} |")
    path.write_text("\n".join(lines) + "\n")


def plot(results: list[dict], path: Path, title: str) -> None:
    from tools.plots import pyplot  # matplotlib is the `plots` extra: one line where it is missing

    plt = pyplot(__file__)

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.get_cmap("tab20").colors
    for i, r in enumerate(results):
        if "curve" not in r or not r["curve"]:
            continue
        loss = r.get("loss") or _loss_of(r["sampler"].partition("@")[0])
        ax.plot([p["train_seconds"] for p in r["curve"]], [p["P@1"] for p in r["curve"]],
                "o-" if loss == "softmax" else "s--", ms=3, color=colors[i % len(colors)],
                label=f"{r['sampler']} ({loss})", lw=2.2 if r["sampler"].startswith(("astra", "full")) else 1.2)
    ax.set_xscale("log")
    ax.set_xlabel("cumulative training seconds (evaluation excluded)")
    ax.set_ylabel("P@1")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="synthetic100k")
    parser.add_argument("--samplers", nargs="+", default=ALL,
                        help="sampler presets; name@loss trains one with the other loss (e.g. uniform@softmax)")
    parser.add_argument("--append", action="store_true", help="add to the preset's existing results")
    parser.add_argument("--replot", action="store_true", help="only redraw the table and plot from the JSON")
    parser.add_argument("--epochs", type=int, default=None, help="override train.epochs for every run")
    parser.add_argument("--runs-dir", default="runs/ablation")
    parser.add_argument("--out-dir", default="tools/results")
    parser.add_argument("--timeout", type=int, default=7200)
    parser.add_argument("overrides", nargs="*", help="extra hydra overrides applied to every run")
    args = parser.parse_args()
    base = [*PRESETS[args.preset], *args.overrides]
    if args.epochs is not None:
        base.append(f"train.epochs={args.epochs}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"ablation_{args.preset}"
    if args.replot:
        saved = json.loads(stem.with_suffix(".json").read_text())
        title = f"Sampler ablation, {args.preset} (equal negatives per query)"
        plot(saved["results"], stem.with_suffix(".png"), title)
        return
    results = []
    if args.append and stem.with_suffix(".json").exists():
        done = set(args.samplers)
        results = [r for r in json.loads(stem.with_suffix(".json").read_text())["results"] if r["sampler"] not in done]
    for sampler in args.samplers:
        r = run_one(sampler, base, Path(args.runs_dir) / args.preset / sampler, args.timeout)
        results.append(r)
        shown = r.get("error", "").splitlines()[-1:] if "error" in r else f"P@1 {r['P@1']:.2f}  {r['seconds_per_epoch']:.1f} s/epoch"
        print(f"{sampler:14s} {shown}", flush=True)
        stem.with_suffix(".json").write_text(json.dumps({"preset": args.preset, "base": base, "results": results}, indent=1))
    command = "python tools/experiments/ablation.py --preset " + args.preset + (f" --epochs {args.epochs}" if args.epochs else "")
    title = f"Sampler ablation, {args.preset} (equal negatives per query)"
    write_table(results, stem.with_suffix(".md"), title, command)
    plot(results, stem.with_suffix(".png"), title)


if __name__ == "__main__":
    main()
