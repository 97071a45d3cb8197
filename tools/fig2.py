"""ASTRA's Figure 2 on our data: P@1 against cumulative training seconds for ASTRA and the full loss.

    .venv/bin/python tools/fig2.py                                   # from tools/results/ablation_*.json
    .venv/bin/python tools/fig2.py --inputs tools/results/ablation_synthetic20k.json --out tools/results/fig2_20k.json

Reads the curves `tools/ablation.py` records (P@1 after every epoch, training seconds with the negative
refresh, evaluation excluded) and, for each loss family present (BCE: astra vs full; softmax:
astra@softmax vs full@softmax), reports the full loss's final P@1, the first time ASTRA comes within
`--tolerance` points of it, and that time as a fraction of the full loss's total training time.
Both runs of a pair ran on the same generated dataset, one after the other (see the ablation JSON's
`base`), so wall seconds compare only as well as the machine's load allowed.
Writes a JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PAIRS = {"bce": ("astra", "full"), "softmax": ("astra@softmax", "full@softmax")}


def reach(curve: list[dict], target: float) -> float | None:
    """Seconds at the first evaluation with P@1 >= target, or None."""
    return next((p["train_seconds"] for p in curve if p["P@1"] >= target), None)


def analyse(path: Path, tolerance: float) -> list[dict]:
    data = json.loads(path.read_text())
    runs = {r["sampler"]: r for r in data["results"] if "curve" in r and r["curve"]}
    out = []
    for loss, (fast, full) in PAIRS.items():
        if fast not in runs or full not in runs:
            continue
        f, a = runs[full], runs[fast]
        final, total = f["curve"][-1]["P@1"], f["curve"][-1]["train_seconds"]
        t = reach(a["curve"], final - tolerance)
        out.append({"preset": data["preset"], "loss": loss, "full_final_p1": final, "full_train_seconds": total,
                    "astra_final_p1": a["curve"][-1]["P@1"], "astra_train_seconds": a["curve"][-1]["train_seconds"],
                    "astra_seconds_to_within_tolerance": t, "fraction_of_full_time": None if t is None else t / total,
                    "tolerance_points": tolerance, "curves": {fast: a["curve"], full: f["curve"]}, "base": data["base"]})
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.3), squeeze=False)
    for ax, r in zip(axes[0], rows):
        for name, curve in r["curves"].items():
            style = "s--" if name.startswith("full") else "o-"
            ax.plot([p["train_seconds"] for p in curve], [p["P@1"] for p in curve], style, label=name)
        ax.axhline(r["full_final_p1"] - r["tolerance_points"], color="grey", ls=":", lw=1,
                   label=f"full's final P@1 - {r['tolerance_points']:g}")
        if r["astra_seconds_to_within_tolerance"] is not None:
            ax.axvline(r["astra_seconds_to_within_tolerance"], color="tab:blue", ls=":", lw=1)
            ax.set_title(f"{r['preset']}, {r['loss']}: ASTRA within {r['tolerance_points']:g} pt at "
                         f"{100 * r['fraction_of_full_time']:.0f}% of full's time", fontsize=9)
        else:
            ax.set_title(f"{r['preset']}, {r['loss']}: ASTRA not within {r['tolerance_points']:g} pt", fontsize=9)
        ax.set_xscale("log")
        ax.set_xlabel("cumulative training seconds (refresh included, evaluation excluded)")
        ax.set_ylabel("P@1")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", nargs="+", default=["tools/results/ablation_synthetic20k.json",
                                                     "tools/results/ablation_synthetic100k.json"])
    ap.add_argument("--tolerance", type=float, default=1.0)
    ap.add_argument("--out", default="tools/results/fig2.json")
    args = ap.parse_args()
    rows = [r for p in args.inputs if Path(p).exists() for r in analyse(Path(p), args.tolerance)]
    out = Path(args.out)
    out.write_text(json.dumps(rows, indent=1))
    plot(rows, out.with_suffix(".png"))
    for r in rows:
        t = r["astra_seconds_to_within_tolerance"]
        print(f"{r['preset']:14s} {r['loss']:8s} full final P@1 {r['full_final_p1']:.2f} in {r['full_train_seconds']:.0f}s; "
              f"ASTRA final {r['astra_final_p1']:.2f}; within {r['tolerance_points']:g} pt at "
              + ("never" if t is None else f"{t:.0f}s ({100 * r['fraction_of_full_time']:.0f}% of full's time)"))


if __name__ == "__main__":
    main()
