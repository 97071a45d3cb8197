"""tools/experiments/scale_quality.py --collect: runs trained by plain xc-train commands are reported with their
curves, the oracle of their own data cache, their wall split and refresh events, and compared at equal wall time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

SCRIPT = REPO / "tools" / "experiments" / "scale_quality.py"


def _fake_run(root: Path, name: str, evals: list[tuple[float, float]], waited: float) -> Path:
    """A run directory as xc-train leaves it: config.json naming the data cache, log.jsonl with an evaluation
    (seconds, P@1) per epoch, a refresh event, a checkpoint and metrics.json."""
    run_dir, cache = root / name, root / "cache"
    (cache / "regime" / "synthetic-0").mkdir(parents=True, exist_ok=True)
    (cache / "regime" / "synthetic-0" / "meta.json").write_text(json.dumps({"meta": {"oracle_p1": 90.0}}))
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"data": {"name": "regime", "cache_dir": str(cache)}}))
    t0 = 1000.0
    events = [{"event": "attempt", "time": t0}]
    for epoch, (seconds, p1) in enumerate(evals):
        events += [{"event": "epoch", "time": t0 + seconds - 1, "train_seconds": seconds - 1.0},
                   {"event": "refresh", "time": t0 + seconds - 1, "epoch": epoch, "waited_s": waited},
                   {"event": "eval", "time": t0 + seconds, "epoch": epoch + 1, "P@1": p1, "P@3": p1 / 2,
                    "P@5": p1 / 3},
                   {"event": "checkpoint", "time": t0 + seconds}]
    events.append({"event": "done", "time": t0 + evals[-1][0] + 30})
    (run_dir / "log.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    (run_dir / "metrics.json").write_text(json.dumps({"P@1": evals[-1][1] + 1}))
    return run_dir


def test_collect_reports_runs_trained_elsewhere_and_compares_them_at_equal_time(tmp_path):
    fast = _fake_run(tmp_path, "uniform", [(100, 50.0), (200, 60.0), (300, 65.0)], waited=0.0)
    slow = _fake_run(tmp_path, "pool", [(120, 52.0), (250, 70.0), (380, 75.0)], waited=2.5)
    out = tmp_path / "report.json"
    subprocess.run([sys.executable, str(SCRIPT), "--collect", f"L=1e+06 uniform={fast}",
                    f"L=1e+06 pool={slow}", "--out", str(out)], check=True, capture_output=True, text=True)
    report = json.loads(out.read_text())
    pool = report["runs"]["L=1e+06 pool"]
    assert [p["P@1"] for p in pool["points"]] == [52.0, 70.0, 75.0]
    assert pool["oracle_p1"] == 90.0 and pool["final"]["P@1"] == 76.0 and pool["wall_seconds"] == 380
    assert pool["split"] == {"steps": 119 + 249 + 379, "waits": 7.5, "final_phase": 30.0}
    # equal time: the shorter run's last evaluation (300 s), against the other's newest model by then (epoch 2)
    (row,) = report["equal_time"]
    assert row["seconds"] == 300
    assert {row["a"]: row["a_eval"]["epoch"], row["b"]: row["b_eval"]["epoch"]} == {
        "L=1e+06 pool": 2, "L=1e+06 uniform": 3}
    assert out.with_suffix(".png").stat().st_size > 0


def test_collect_names_a_malformed_pair(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--collect", "no-run-dir",
                           "--out", str(tmp_path / "r.json")], capture_output=True, text=True)
    assert proc.returncode != 0 and "expected KEY=RUN_DIR" in proc.stderr


def test_a_resumed_run_counts_its_own_wall_time_and_drops_the_work_it_redid():
    from tools.experiments.scale_quality import live_events

    first = [{"event": "attempt", "time": 0.0, "global_step": 0, "resumed_from": None},
             {"event": "eval", "time": 100.0, "global_step": 10, "epoch": 1, "P@1": 50.0},
             {"event": "checkpoint", "time": 110.0, "global_step": 10},
             {"event": "eval", "time": 200.0, "global_step": 20, "epoch": 2, "P@1": 40.0},  # then the run was killed
             {"event": "train", "time": 210.0, "global_step": 21}]
    # resumed two hours later from the checkpoint of step 10: the clock stands still from 110 s to the restart
    second = [{"event": "attempt", "time": 7310.0, "global_step": 10, "resumed_from": "ck-10",
               "superseded_after_step": 10},
              {"event": "eval", "time": 7400.0, "global_step": 20, "epoch": 2, "P@1": 40.0},
              {"event": "checkpoint", "time": 7410.0, "global_step": 20}]
    live = live_events(first + second)
    assert [(e["event"], e["time"]) for e in live] == [
        ("attempt", 0.0), ("eval", 100.0), ("checkpoint", 110.0), ("attempt", 110.0), ("eval", 200.0),
        ("checkpoint", 210.0)]
