"""Time to quality against L: P@1 / oracle P@1 against wall time, ASTRA against uniform-only negatives.

    python tools/experiments/scale_quality.py --labels 10000 100000 --samplers astra uniform \
        --out tools/results/scale_quality.json                    # 2-core CPU: about 1.5 hours
    python tools/experiments/scale_quality.py --labels 1000000 --samplers astra uniform --threads 2 \
        --extra miner=pool miner.workers=1 --out tools/results/scale_quality_1e6.json   # the 10^6 run of docs/hard_negatives.md

One learnable family of synthetic sets (xc/data/synthetic.py), scaled with L: ``points_per_label`` * L training
points (2 by default: the shipped synthetic default, 20k points for 10^4 labels), 2L features at most 200k
(every label's signature of 8 features stays distinct), 5,000 test points, Zipf(1) labels, 10% of the
generating labels dropped (the oracle's P@1 is about 90). Each (L, sampler) trains with the defaults
(`xc-train`, data-derived epochs, rows, table) and an evaluation after every epoch (the model alone: kNN
fusion off, so the curve is the trainer's); the curve's time is the wall time since the run started,
evaluation included; a run's `final` is its metrics.json (the model under the label prior chosen on validation,
`xc/fitting/label_prior.py`; the plain model's figures as `plain/...`). Uniform-only uses the same number of negatives per query (k_hard + k_random) and the
same sampled softmax. Runs go one after another in this process's machine (compare as ratios).
`--families 8 4` generates the confusable-label variant (labels in families of 8 sharing 4 of their 8 signature
features, `data.synthetic.family_size` / `family_shared`); `--xor` the non-linear family (twin labels told apart
only by which halves of their signatures co-occur, `data.synthetic.xor_pairs`: no model linear in the features
separates twins). Writes a JSON of the curves and a PNG (P@1 / oracle
against minutes).

`--collect KEY=RUN_DIR ...` reads runs trained by plain `xc-train` commands instead (the regime tables of
docs/hard_negatives.md, whose runs keep the kNN fusion so that they can be compared as served): the same curves,
wall split and refresh events, the oracle from the run's own data cache, no training.
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


def data_name(num_labels: int, zipf_alpha: float, families: tuple[int, int] = (1, 0), xor: bool = False) -> str:
    name = f"scale-{num_labels}" if zipf_alpha == 1.0 else f"scale-{num_labels}-zipf{zipf_alpha:g}"
    name = name if families[0] == 1 else f"{name}-fam{families[0]}x{families[1]}"
    return f"{name}-xor" if xor else name


def data_overrides(num_labels: int, points_per_label: float, cache: str, zipf_alpha: float = 1.0,
                   families: tuple[int, int] = (1, 0), xor: bool = False) -> list[str]:
    return [f"data.name={data_name(num_labels, zipf_alpha, families, xor)}", f"data.cache_dir={cache}",
            f"data.synthetic.num_labels={num_labels}",
            f"data.synthetic.num_train={int(points_per_label * num_labels)}",
            f"data.synthetic.num_features={min(2 * num_labels, 200_000)}", "data.synthetic.num_test=5000",
            *([f"data.synthetic.zipf_alpha={zipf_alpha:g}"] if zipf_alpha != 1.0 else []),
            *([f"data.synthetic.family_size={families[0]}", f"data.synthetic.family_shared={families[1]}"]
              if families[0] > 1 else []),
            *(["data.synthetic.xor_pairs=1"] if xor else [])]


SAMPLERS = {
    "astra": ["sampler=astra"],  # the default: hard negatives (the miner by its rule: sync on a CPU host) + uniform
    "pool": ["sampler=astra", "miner=pool", "miner.workers=1"],  # ASTRA with the asynchronous CPU pool
    # uniform-only: as many negatives per query (k_hard + k_random: UniformSampler adds them), the same loss
    "uniform": ["sampler=uniform", "sampler.loss=softmax"],
}


def live_events(events: list[dict]) -> list[dict]:
    """A run's log as if it had never been interrupted: where an attempt resumed from a checkpoint, the earlier
    attempts' events after that checkpoint (work it redid) are dropped and the clock is stopped from the checkpoint
    until the resumed attempt began, so `time` counts only the run's own wall time (its restart included)."""
    kept: list[dict] = []
    offset = 0.0
    for event in events:
        if event.get("event") == "attempt" and event.get("resumed_from") and kept:
            step = event.get("superseded_after_step", event.get("global_step"))
            last = max((i for i, e in enumerate(kept)
                        if e.get("event") == "checkpoint" and e.get("global_step") == step), default=None)
            if last is None:  # no checkpoint event at that step: keep what happened up to it
                last = max((i for i, e in enumerate(kept) if e.get("global_step", 0) <= step), default=0)
            kept = kept[:last + 1]
            offset = event["time"] - kept[-1]["time"]
        kept.append({**event, "time": event["time"] - offset})
    return kept


def curve(run_dir: Path) -> dict:
    """The run's evaluations (seconds since its start, epoch, P@1/3/5 of the model alone), its final metrics, and
    where its wall time went: training steps, waits for negatives (the synchronous miner's mining included),
    the final phase (after the last checkpoint: epoch choice, label prior, fusion, test)."""
    events = live_events([json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()
                          if line.strip()])
    start = next(e["time"] for e in events if e["event"] == "attempt")
    points = [{"seconds": round(e["time"] - start, 1), "epoch": e["epoch"],
               **{k: e.get(k) for k in ("P@1", "P@3", "P@5")}} for e in events if e["event"] == "eval"]
    recalls = [e.get("recall") for e in events if e["event"] == "negatives" and e.get("recall") is not None]
    finished = (run_dir / "metrics.json").exists()
    final = json.loads((run_dir / "metrics.json").read_text()) if finished else {"P@1": points[-1]["P@1"]}
    checkpoints = [e["time"] for e in events if e["event"] == "checkpoint"]
    split = {"steps": round(sum(e.get("train_seconds", 0.0) for e in events if e["event"] == "epoch"), 1),
             "waits": round(sum(e.get("waited_s", 0.0) for e in events if e["event"] == "refresh"), 1),
             "final_phase": round(max(e["time"] for e in events) - checkpoints[-1], 1)
             if finished and checkpoints else None}
    refresh = [{k: e.get(k) for k in ("epoch", "waited_s", "refreshed_share", "age_mean_steps", "lag", "recall")}
               for e in events if e["event"] == "refresh"]
    return {"points": points, "miner_recall": recalls, "final": final, "finished": finished, "split": split,
            "refresh": refresh}


def at_time(points: list[dict], seconds: float) -> dict | None:
    """The newest evaluation made by `seconds` into the run (None before the first)."""
    made = [p for p in points if p["seconds"] <= seconds]
    return made[-1] if made else None


def equal_time(runs: dict) -> list[dict]:
    """Each pair of runs of one L compared at the shorter one's last evaluation: each run's newest model then."""
    rows, keys = [], sorted(runs)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            if a.split()[0] != b.split()[0] or not runs[a]["points"] or not runs[b]["points"]:
                continue
            t = min(runs[a]["points"][-1]["seconds"], runs[b]["points"][-1]["seconds"])
            rows.append({"a": a, "b": b, "seconds": t, "a_eval": at_time(runs[a]["points"], t),
                         "b_eval": at_time(runs[b]["points"], t)})
    return rows


def oracle_p1(cache: str, name: str) -> float:
    meta = next((Path(cache) / name).glob("*/meta.json"))
    return float(json.loads(meta.read_text())["meta"]["oracle_p1"])


def plot(report: dict, out: Path) -> None:
    from tools.plots import pyplot  # matplotlib is the `plots` extra: one line where it is missing

    plt = pyplot(__file__)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, run in report["runs"].items():
        xs = [p["seconds"] / 60 for p in run["points"]]
        ys = [p["P@1"] / run["oracle_p1"] for p in run["points"]]
        ax.plot(xs, ys, marker="o", label=key)
    ax.axhline(0.9, ls=":", c="grey")
    ax.set_xlabel("wall minutes (training + evaluations)")
    ax.set_ylabel("P@1 / oracle P@1")
    ax.set_title(report.get("title") or "time to quality, synthetic family (2 points per label)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--labels", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--samplers", nargs="+", default=["astra", "uniform"], choices=sorted(SAMPLERS))
    ap.add_argument("--points-per-label", type=float, default=2.0)
    ap.add_argument("--zipf-alpha", type=float, default=1.0,
                    help="label popularity exponent; 0.5 gives every label of 10^6 about 5 positives at 2 points per "
                         "label (a learnable tail), 1.0 (the default) leaves most of the tail with 0-1")
    ap.add_argument("--families", type=int, nargs=2, default=[1, 0], metavar=("SIZE", "SHARED"),
                    help="confusable labels: families of SIZE labels sharing SHARED of their 8 signature features "
                         "(xc/data/synthetic.py); 1 0 (the default) = none")
    ap.add_argument("--xor", action="store_true",
                    help="the non-linear family: twin labels told apart only by which halves of their signatures "
                         "co-occur (data.synthetic.xor_pairs, xc/data/synthetic.py)")
    ap.add_argument("--concurrent", action="store_true",
                    help="train the samplers of one L side by side (each on --threads threads), so that their wall "
                         "times are measured under the same load: the equal-time comparison on a shared machine")
    ap.add_argument("--threads", type=int, default=2,
                    help="XC_THREADS for each run; 0 = unset (every core, less a local miner pool's while it mines)")
    ap.add_argument("--cache", default=str(REPO / ".cache" / "xc-scale"))
    ap.add_argument("--runs", default="/tmp/xc-scale-runs")
    ap.add_argument("--extra", nargs="*", default=[], help="more xc-train overrides for every run")
    ap.add_argument("--out", type=Path, default=REPO / "tools" / "results" / "scale_quality.json")
    ap.add_argument("--title", help="the PNG's title (default: the family at 2 points per label)")
    ap.add_argument("--collect", nargs="+", metavar="KEY=RUN_DIR",
                    help="report runs trained elsewhere (KEY names the run in the report, e.g. 'L=1e+06 pool'), "
                         "then exit: no training")
    ap.add_argument("--reuse", action="store_true",
                    help="collect a run already there (finished, or stopped: its evaluations so far), do not train")
    args = ap.parse_args()
    report = {"command": " ".join(sys.argv), "title": args.title, "runs": {}}
    if args.out.exists():  # add to an earlier report (one L at a time)
        report["runs"] = json.loads(args.out.read_text()).get("runs", {})
    if args.collect:
        collect(args.collect, report, args.out)
        return
    families = tuple(args.families)
    env = {**os.environ, "XC_THREADS": str(args.threads) if args.threads else ""}  # "": xc-train's rule
    for num_labels in args.labels:
        name = data_name(num_labels, args.zipf_alpha, families, args.xor)
        jobs = []
        for sampler in args.samplers:
            tag = "" if args.zipf_alpha == 1.0 else f" zipf {args.zipf_alpha:g}"
            tag += "" if families[0] == 1 else f" fam {families[0]}x{families[1]}"
            tag += " xor" if args.xor else ""
            key = f"L={num_labels:.0e} {sampler}{tag}"
            run_dir = Path(args.runs) / f"{num_labels}-{sampler}{tag.replace(' ', '-')}"
            cmd = [sys.executable, "-m", "xc.cli.train",
                   *data_overrides(num_labels, args.points_per_label, args.cache, args.zipf_alpha, families, args.xor),
                   *SAMPLERS[sampler], f"run_dir={run_dir}", "train.resume=never", "eval.every_epochs=1",
                   "eval.knn_fusion.enabled=false", "logger.wandb=disabled", *args.extra]
            jobs.append((key, run_dir, cmd))
        rss = {}
        if args.reuse:
            jobs_to_run = [job for job in jobs if not (job[1] / "log.jsonl").exists()]
        else:
            jobs_to_run = jobs
        began = time.time()
        if args.concurrent and len(jobs_to_run) > 1:
            rss = train_side_by_side(jobs_to_run, env, args.cache, name)
        else:
            for key, _, cmd in jobs_to_run:
                rss.update(train_side_by_side([(key, None, cmd)], env, args.cache, name))
        for key, run_dir, cmd in jobs:
            run = curve(run_dir)
            run.update(oracle_p1=oracle_p1(args.cache, name), overrides=cmd[3:], peak_rss_gb=rss.get(key),
                       wall_seconds=run["points"][-1]["seconds"] if run["points"] else round(time.time() - began, 1))
            report["runs"][key] = run
            print(key, "P@1", run["final"]["P@1"], "oracle", run["oracle_p1"], "seconds", run["wall_seconds"],
                  flush=True)
        report["equal_time"] = equal_time(report["runs"])
        args.out.write_text(json.dumps(report, indent=1))
    plot(report, args.out.with_suffix(".png"))


def collect(pairs: list[str], report: dict, out: Path) -> None:
    """Add each KEY=RUN_DIR's curve to `report` (the oracle read from the data cache its config.json names), write
    the JSON and the PNG."""
    for pair in pairs:
        key, _, run_dir = pair.rpartition("=")  # the key may hold "=" ("L=1e+06 pool"), a path seldom does
        if not key or not run_dir:
            raise SystemExit(f"--collect {pair!r}: expected KEY=RUN_DIR")
        run_dir = Path(run_dir)
        data = json.loads((run_dir / "config.json").read_text())["data"]
        run = curve(run_dir)
        run.update(oracle_p1=oracle_p1(data["cache_dir"], data["name"]), run_dir=str(run_dir),
                   wall_seconds=run["points"][-1]["seconds"] if run["points"] else None)
        report["runs"][key] = run
        print(key, "P@1", run["final"]["P@1"], "oracle", run["oracle_p1"], "seconds", run["wall_seconds"], flush=True)
    report["equal_time"] = equal_time(report["runs"])
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))


def train_side_by_side(jobs: list, env: dict, cache: str, name: str) -> dict[str, float]:
    """Run the jobs' xc-train commands at once ({key: peak RSS in GB} of each trainer process). The first one
    alone until it has generated the dataset into the cache, so that the others read it rather than race it."""
    procs = {}
    for i, (key, _, cmd) in enumerate(jobs):
        print(key, " ".join(cmd[2:]), flush=True)
        procs[subprocess.Popen(cmd, cwd=REPO, env=env).pid] = key
        while i == 0 and len(jobs) > 1 and not list((Path(cache) / name).glob("*/meta.json")):
            time.sleep(2.0)
    rss = {}
    while procs:
        pid, status, usage = os.wait4(-1, 0)
        key = procs.pop(pid, None)
        if key is None:
            continue
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{key}: xc-train exited with {os.waitstatus_to_exitcode(status)}")
        rss[key] = round(usage.ru_maxrss / 2**20, 2)  # KiB -> GiB
    return rss


if __name__ == "__main__":
    main()
