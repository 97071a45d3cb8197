"""Time to accuracy: test P@1 against wall seconds for xc runs, each library's single point beside them.

    .venv/bin/python tools/experiments/time_to_accuracy.py --run bibtex=runs/bibtex-astra --run delicious=runs/delicious-astra \
        --run debian_deps=runs/debian_deps-astra --peers tools/results/peers.json --out tools/results/time_to_accuracy

Reads what a run already logs (`RUN_DIR/log.jsonl`): each epoch's test evaluation of the model alone (`eval`
events) is a point of the curve, at the seconds since the run's `attempt` event (after the data is loaded);
the final figure, fused and with the label prior as served (`metrics.json`), is the star at the time of the last
logged event. An ensemble (`RUN_DIR/members/m*/`) draws one curve per member, each on the ensemble's clock.
Peers (`tools/experiments/bench_peers.py`'s JSON) are one point each: P@1 at their training seconds. Writes one PNG per
data name and a JSON of every point (`OUT.json`, `OUT_<data>.png`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # xc and tools.* (tools.plots) of this checkout


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]


def run_points(run_dir: Path) -> dict:
    """{"curves": [[(seconds, P@1), ...] per model], "final": (seconds, P@1)} of a single run or an ensemble."""
    members = sorted((run_dir / "members").glob("m*")) if (run_dir / "members").is_dir() else []
    logs = [_events(m) for m in members] or [_events(run_dir)]
    start = min(e["time"] for log in logs for e in log if e["event"] == "attempt")
    end = max(log[-1]["time"] for log in logs)
    if members and (run_dir / "log.jsonl").exists():
        end = max(end, _events(run_dir)[-1]["time"])
    curves = [[(round(e["time"] - start, 1), round(e["P@1"], 2)) for e in log if e["event"] == "eval" and "P@1" in e]
              for log in logs]
    final = json.loads((run_dir / "metrics.json").read_text())["P@1"]
    return {"curves": curves, "final": (round(end - start, 1), round(final, 2)), "members": len(members) or 1}


def peer_points(peers_json: Path, data: str) -> dict[str, tuple[float, float]]:
    report = json.loads(peers_json.read_text())
    return {r["peer"]: (r["mean"]["train_s"], r["mean"]["P@1"]) for r in report["results"] if r["data"] == data}


def plot(data: str, xc: dict, peers: dict, path: Path) -> None:
    from tools.plots import pyplot  # matplotlib is the `plots` extra: one line where it is missing

    plt = pyplot(__file__)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, curve in enumerate(xc["curves"]):
        if curve:
            label = "xc, model alone per epoch" + (f" (member {i + 1})" if xc["members"] > 1 else "")
            ax.plot(*zip(*curve), marker=".", lw=1, label=label if i == 0 or xc["members"] == 1 else None,
                    color="tab:blue", alpha=1.0 if i == 0 else 0.5)
    ax.scatter(*xc["final"], marker="*", s=160, color="tab:blue", zorder=3, label="xc defaults (as served)")
    colors = ("tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    for (name, (sec, p1)), marker, color in zip(sorted(peers.items()), "osD^v", colors):
        ax.scatter(max(sec, 0.1), p1, marker=marker, s=45, color=color, label=name.replace("_", " "), zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel("wall seconds (log)")
    ax.set_ylabel("test P@1")
    ax.set_title(f"{data}: P@1 against training time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, metavar="DATA=RUN_DIR",
                        help="a finished xc run and the data name its peers are listed under (repeatable)")
    parser.add_argument("--peers", default="tools/results/peers.json", help="tools/experiments/bench_peers.py's JSON")
    parser.add_argument("--out", default="tools/results/time_to_accuracy", help="OUT.json and OUT_<data>.png")
    parser.add_argument("--note", default="", help="a line recorded with the points (machine, threads)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join(sys.argv), "note": args.note, "data": {}}
    for spec in args.run:
        data, sep, run_dir = spec.partition("=")
        if not sep or not (Path(run_dir) / "metrics.json").exists():
            parser.error(f"--run {spec}: expected DATA=RUN_DIR of a finished run (with metrics.json)")
        xc = run_points(Path(run_dir))
        peers = peer_points(Path(args.peers), data)
        png = out.with_name(f"{out.name}_{data}.png")
        plot(data, xc, peers, png)
        report["data"][data] = {"xc": xc, "peers": peers, "png": str(png)}
        best = max(peers.items(), key=lambda kv: kv[1][1]) if peers else None
        print(f"{data}: xc {xc['final'][1]:.2f} P@1 in {xc['final'][0]:.0f} s"
              + (f"; best library {best[0]} {best[1][1]:.2f} in {best[1][0]:.1f} s" if best else "") + f" -> {png}")
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
