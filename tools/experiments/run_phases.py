"""Where a finished run's wall time went, and what it scored: one JSON from its run directory.

    python tools/experiments/run_phases.py RUN_DIR [--wall SECONDS] [--command "xc-train ..."] [--out FILE.json]

Reads RUN_DIR/log.jsonl (the trainer's events) and RUN_DIR/metrics.json (the final test figures). The phases:
  train_steps   the optimizer steps of every epoch (gaps that end in a `train` or `epoch` event)
  boundaries    epoch boundaries: waiting for the next hard negatives and handing them over (gaps that end in a
                `negatives` or `staleness` event)
  validation    each epoch's validation P@k (the gap that ends in a `valid` event)
  checkpoints   writing checkpoints (gaps that end in a `checkpoint` event)
  final         after the last epoch: the final test ranking, the label prior, the kNN vote and the lexical
                ranker's fit and choice (gaps that end in `eval`, `eval_prior`, `eval_fusion`, `select_epoch`)
  other         the rest of the logged span
  startup       --wall minus the logged span: interpreter, imports, data loading and the first batches' set-up
The figures are the run's own clocks (`time` of each event), so they hold on any device.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FINAL_EVENTS = {"eval", "eval_prior", "eval_fusion", "select_epoch"}
METRICS = ("P@1", "P@3", "P@5", "PSP@1", "PSP@3", "PSP@5")


def phases(events: list[dict]) -> dict:
    """Seconds per phase from the trainer's events (each a dict with 'event' and 'time')."""
    out = {"train_steps": 0.0, "boundaries": 0.0, "validation": 0.0, "checkpoints": 0.0, "final": 0.0, "other": 0.0}
    timed = [e for e in events if "time" in e]
    for before, event in zip(timed, timed[1:]):
        gap = event["time"] - before["time"]
        name = event["event"]
        if name in ("train", "epoch"):  # per-window training logs, then the epoch's end
            out["train_steps"] += gap
        elif name in ("negatives", "staleness"):
            out["boundaries"] += gap
        elif name == "valid":
            out["validation"] += gap
        elif name == "checkpoint":
            out["checkpoints"] += gap
        elif name in FINAL_EVENTS:
            out["final"] += gap
        else:
            out["other"] += gap
    out["logged_span"] = timed[-1]["time"] - timed[0]["time"] if timed else 0.0
    return {k: round(v, 3) for k, v in out.items()}  # milliseconds: a toy run's few steps take under 0.05 s


def summarise(run_dir: Path, wall: float | None = None, command: str | None = None) -> dict:
    log = run_dir / "log.jsonl"
    if not log.exists():
        raise SystemExit(f"run_phases: {log} does not exist (is {run_dir} a finished run's directory?)")
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    summary = {"run_dir": str(run_dir), "command": command, "phases_seconds": phases(events)}
    if wall is not None:
        summary["wall_seconds"] = round(wall, 1)
        summary["phases_seconds"]["startup"] = round(wall - summary["phases_seconds"]["logged_span"], 3)
    metrics_path = run_dir / "metrics.json"
    if metrics_path.exists():
        metrics = json.loads(metrics_path.read_text())
        summary["test"] = {k: round(metrics[k], 2) for k in METRICS if k in metrics}
        summary["test_model_alone"] = {k: round(metrics[f"model/{k}"], 2) for k in METRICS if f"model/{k}" in metrics}
    epochs = [e for e in events if e["event"] == "epoch"]
    summary["epochs"] = len(epochs)
    summary["steps"] = epochs[-1]["global_step"] if epochs else 0
    summary["valid_per_epoch"] = [e["valid"] for e in events if e["event"] == "valid"]
    fusion = next((e["fusion"] for e in events if e["event"] == "eval_fusion"), None)
    if fusion:
        summary["fusion"] = {k: fusion[k] for k in ("lambda", "k", "space", "temperature", "gamma", "valid_fused",
                                                    "choose_seconds") if k in fusion}
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--wall", type=float, help="the run's wall seconds, measured by whoever launched it")
    parser.add_argument("--command", help="the command that made the run (recorded as given)")
    parser.add_argument("--machine", type=Path, help="a device.json to embed (tools/gpu_check.sh writes one)")
    parser.add_argument("--out", type=Path, help="write the JSON here (else standard output)")
    args = parser.parse_args(argv)
    summary = summarise(args.run_dir, args.wall, args.command)
    if args.machine and args.machine.exists():
        summary = {"machine": json.loads(args.machine.read_text()), **summary}
    text = json.dumps(summary, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text if not args.out else json.dumps({k: summary.get(k) for k in ("wall_seconds", "test", "phases_seconds")}))


if __name__ == "__main__":
    sys.exit(main())
