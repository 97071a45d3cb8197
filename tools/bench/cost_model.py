"""A cost model of xc fitted to the measured per-shard figures, checked on held-out points, projected to 1e8/1e9 labels.

    .venv/bin/python tools/bench/cost_model.py                     # reads tools/results/*.json, measures snapshot writes
    .venv/bin/python tools/bench/cost_model.py --no-snapshot       # reuse the snapshot figures already in the JSON

Inputs (each written by its own tool; docs/benchmarks.md has the commands):
  bench_step.json        ASTRA step time against L (CPU seconds of one thread: robust to a shared machine)
  bench_memory.json      peak RSS against L, G = 1 (fitted; the largest L held out)
  bench_memory_world.json  peak RSS per rank at G = 1, 2, 4 (held out: predicted from the G = 1 fit at L / G)
  bench_ann_scale.json   index build and search CPU seconds per shard against L (fitted)
  bench_ann.json         the same at L = 1e6 (held out: not fitted, only predicted)
Snapshot writes (the trainer's W.shard*.npy through xc.handoff.Stage: np.save, fsync, checksum) are
timed here at a few sizes.

Every fit leaves out the largest measured point and predicts it (`checks` in the JSON): a model that
only interpolates would hide where it breaks. Fitted forms:
  step(L_r)        = a + b * log10(L_r)           (no O(L) term: the step touches B*(k_p+k_h+k_r) rows;
                                                   the log term is the memory hierarchy: rows fall out of cache)
  memory(L_r)      = a + b * L_r                  (b: bytes per label per rank)
  build_cpu(L_r)   = c * L_r^beta                 (graph indexes: about L log L)
  search_cpu(L_r)  = c * L_r^beta per query       (about log L for graphs)
  snapshot(L_r)    = bytes: 4 d L_r (+ 4 d N queries); seconds = bytes / throughput
Writes tools/results/cost_model.json and .png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # xc and tools.* (tools.plots) of this checkout
RESULTS = REPO / "tools" / "results"


def fit_log(xs, ys):
    b, a = np.polyfit(np.log10(xs), ys, 1)
    return {"form": "a + b*log10(L)", "a": float(a), "b": float(b)}


def fit_lin(xs, ys):
    b, a = np.polyfit(np.asarray(xs, float), ys, 1)
    return {"form": "a + b*L", "a": float(a), "b": float(b)}


def fit_pow(xs, ys):
    beta, logc = np.polyfit(np.log(xs), np.log(ys), 1)
    return {"form": "c*L^beta", "c": float(np.exp(logc)), "beta": float(beta)}


def predict(model: dict, x: float) -> float:
    if model["form"] == "a + b*log10(L)":
        return model["a"] + model["b"] * np.log10(x)
    if model["form"] == "a + b*L":
        return model["a"] + model["b"] * x
    return model["c"] * x ** model["beta"]


def check(name: str, model: dict, x: float, measured: float) -> dict:
    pred = float(predict(model, x))
    return {"quantity": name, "labels_per_shard": x, "predicted": pred, "measured": float(measured),
            "ratio_measured_over_predicted": float(measured / pred)}


def step_model(checks: list) -> dict:
    rows = sorted((r for r in json.loads((RESULTS / "bench_step.json").read_text())["results"] if r["sampler"] == "astra"),
                  key=lambda r: r["num_labels"])
    key = "median_step_cpu_s" if "median_step_cpu_s" in rows[0] else "median_step_s"
    xs, ys = [r["num_labels"] for r in rows], [r[key] for r in rows]
    model = fit_log(xs[:-1], ys[:-1])
    checks.append(check(f"ASTRA step seconds ({key})", model, xs[-1], ys[-1]))
    linear = fit_lin(xs, ys)
    return {"fit": model, "points": dict(zip(map(str, xs), ys)), "key": key,
            "linear_slope_ns_per_label": 1e9 * linear["b"]}


def memory_model(checks: list) -> dict:
    report = json.loads((RESULTS / "bench_memory.json").read_text())
    pts = sorted(((p["num_labels"] / p["world_size"], r["peak_rss_bytes"], p["world_size"])
                  for p in report["points"] for r in p["ranks"]))
    single = [(x, y) for x, y, g in pts if g == 1]
    held = single[-1]
    model = fit_lin([x for x, _ in single[:-1]], [y for _, y in single[:-1]])
    checks.append(check("peak RSS bytes per rank, G=1", model, held[0], held[1]))
    world = RESULTS / "bench_memory_world.json"  # G = 1, 2, 4 at fixed L: predicted from the G = 1 fit at L / G
    if world.exists():
        for p in json.loads(world.read_text())["points"]:
            peak = max(r["peak_rss_bytes"] for r in p["ranks"])
            checks.append(check(f"peak RSS bytes per rank, L={p['num_labels']:.0e} G={p['world_size']} (fit: G=1)",
                                model, p["num_labels"] / p["world_size"], peak))
    return {"fit": model, "bytes_per_label": model["b"], "expected_bytes_per_label": report["expected_bytes_per_label"]}


def ann_models(checks: list) -> dict:
    scale = json.loads((RESULTS / "bench_ann_scale.json").read_text())["results"]
    held_out = {r["backend"]: r for r in json.loads((RESULTS / "bench_ann.json").read_text())["results"]
                if r["labels"] == 1_000_000}
    out = {}
    for backend in sorted({r["backend"] for r in scale if r["backend"] != "exact"}):
        rows = sorted((r for r in scale if r["backend"] == backend), key=lambda r: r["labels"])
        xs = [r["labels"] for r in rows]
        build = fit_pow(xs, [max(r["build_cpu_s"], 1e-3) for r in rows])
        search = fit_pow(xs, [r["search_cpu_s"] / r["queries"] for r in rows])
        mem = fit_lin(xs, [r["memory_bytes"] for r in rows])
        recall = {str(r["labels"]): r[next(k for k in r if k.startswith("recall@"))] for r in rows}
        out[backend] = {"build_cpu_s": build, "search_cpu_s_per_query": search, "memory_bytes": mem, "recall": recall}
        if backend in held_out:
            h = held_out[backend]
            checks.append(check(f"{backend} build CPU seconds", build, h["labels"], h["build_cpu_s"]))
            checks.append(check(f"{backend} search CPU seconds per query", search, h["labels"], h["search_cpu_s"] / h["queries"]))
            checks.append(check(f"{backend} index bytes", mem, h["labels"], h["memory_bytes"]))
    return out


def snapshot_model(sizes: list[int], dim: int, checks: list) -> dict:
    """Time Stage.write_array (np.save + fsync + checksum) of (L, d) float32 rows; fit bytes/s on all but the largest."""
    from xc.handoff import Stage

    secs = []
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:
        for n in sizes:
            rows = np.random.default_rng(0).standard_normal((n, dim), dtype=np.float32)
            stage = Stage(Path(tmp), f"gen-{n}")
            start = time.perf_counter()
            stage.write_array("W.shard0.npy", rows)
            secs.append(time.perf_counter() - start)
            stage.abandon()
            del rows
    nbytes = [4 * dim * n for n in sizes]
    model = fit_lin(nbytes[:-1], secs[:-1])
    checks.append(check("snapshot write seconds (x = bytes)", model, nbytes[-1], secs[-1]))
    return {"fit_seconds_vs_bytes": model, "points": {str(n): s for n, s in zip(sizes, secs)},
            "throughput_bytes_per_s": 1.0 / model["b"] if model["b"] > 0 else None}


def project(models: dict, dim: int, batch: int, queries_per_label: float) -> list[dict]:
    """Per-shard figures at 1e7, 1e8, 1e9 labels for a few (G trainer shards, M miner cores)."""
    rows = []
    for labels in (10**7, 10**8, 10**9):
        for shards in (8, 64, 512):
            per_shard = labels / shards
            for backend, ann in models["ann"].items():
                if backend == "faiss_ivf":
                    continue
                for cores in (64, 512):
                    n_queries = queries_per_label * labels
                    build = predict(ann["build_cpu_s"], per_shard)
                    search = predict(ann["search_cpu_s_per_query"], per_shard) * n_queries  # every query, every shard
                    refresh_wall = (shards * build + shards * search) / cores
                    step = predict(models["step"]["fit"], per_shard)
                    epoch = n_queries / batch * step  # data-parallel over G ranks: B is the global batch
                    rows.append({
                        "labels": labels, "shards": shards, "miner_cores": cores, "backend": backend,
                        "labels_per_shard": per_shard,
                        "row_bytes_per_shard_fp32": 4 * dim * per_shard,
                        "host_peak_bytes_per_shard": predict(models["memory"]["fit"], per_shard),
                        "index_bytes_per_shard": predict(ann["memory_bytes"], per_shard),
                        "snapshot_bytes_per_shard": 4 * dim * per_shard,
                        "step_cpu_s": step, "epoch_s_at_measured_step": epoch,
                        "build_cpu_s_per_shard": build, "search_cpu_s_all_queries_per_shard": search,
                        "refresh_wall_s": refresh_wall, "refresh_over_epoch": refresh_wall / epoch,
                    })
    return rows


def plot(report: dict, path: Path) -> None:
    from tools.plots import pyplot  # matplotlib is the `plots` extra: one line where it is missing

    plt = pyplot(__file__)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    xs = np.logspace(4, 9, 50)
    ax = axes[0]
    for backend, ann in report["ann"].items():
        line, = ax.plot(xs, [predict(ann["build_cpu_s"], x) for x in xs], "-", label=f"{backend} build (fit)")
        pts = ann.get("measured_build", {})
        ax.plot([float(k) for k in pts], list(pts.values()), "o", color=line.get_color())
    for c in report["checks"]:
        if "build CPU" in c["quantity"]:
            ax.plot([c["labels_per_shard"]], [c["measured"]], "k*", ms=12)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("labels per shard")
    ax.set_ylabel("index build CPU seconds")
    ax.set_title("index build (dots fitted, stars held out)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    ax = axes[1]
    pts = report["step"]["points"]
    ax.plot([float(k) for k in pts], [1000 * v for v in pts.values()], "o", label="measured ASTRA step")
    ax.plot(xs, [1000 * predict(report["step"]["fit"], x) for x in xs], "-", label="fit (last point held out)")
    ax.set_xscale("log")
    ax.set_xlabel("labels per shard")
    ax.set_ylabel("ms per step (CPU, 1 thread)")
    ax.set_ylim(0, None)
    ax.set_title("step time per shard")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    ax = axes[2]
    proj = [r for r in report["projection"] if r["backend"] == "diskann" and r["miner_cores"] == 512]
    for shards in sorted({r["shards"] for r in proj}):
        sel = [r for r in proj if r["shards"] == shards]
        ax.plot([r["labels"] for r in sel], [r["refresh_over_epoch"] for r in sel], "o-", label=f"{shards} shards")
    ax.axhline(1.0, color="red", ls=":", lw=1, label="refresh = one epoch")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("labels L")
    ax.set_ylabel("DiskANN refresh time / epoch time")
    ax.set_title("projected: 512 miner cores, N = L queries")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--queries-per-label", type=float, default=1.0,
                    help="training queries N per label for the projection (XC datasets: about 1-4)")
    ap.add_argument("--snapshot-sizes", type=int, nargs="+", default=[100_000, 300_000, 1_000_000, 4_000_000])
    ap.add_argument("--no-snapshot", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "cost_model.json"))
    args = ap.parse_args()
    out = Path(args.out)
    checks: list[dict] = []
    report = {"step": step_model(checks), "memory": memory_model(checks), "ann": ann_models(checks)}
    for backend, ann in report["ann"].items():
        rows = [r for r in json.loads((RESULTS / "bench_ann_scale.json").read_text())["results"] if r["backend"] == backend]
        ann["measured_build"] = {str(r["labels"]): r["build_cpu_s"] for r in rows}
    if args.no_snapshot and out.exists():
        report["snapshot"] = json.loads(out.read_text())["snapshot"]
        checks += [c for c in json.loads(out.read_text())["checks"] if c["quantity"].startswith("snapshot")]
    else:
        report["snapshot"] = snapshot_model(args.snapshot_sizes, args.dim, checks)
    report["checks"] = checks
    report["projection"] = project(report, args.dim, args.batch_size, args.queries_per_label)
    report["settings"] = vars(args)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    for c in checks:
        print(f"{c['quantity']:60s} at {c['labels_per_shard']:>12,.0f}: predicted {c['predicted']:.4g}, "
              f"measured {c['measured']:.4g} (x{c['ratio_measured_over_predicted']:.2f})")


if __name__ == "__main__":
    main()
