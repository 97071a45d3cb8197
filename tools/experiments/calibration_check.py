"""How well a finished run's calibrated probabilities (RUN_DIR/calibration.json) match what happens on its test split:
over the served top 20 of every test point, the Brier score, the expected calibration error (10 equal-width bins of
p, each weighted by its labels) and the mean p beside the share of those labels that are relevant; then the same
for the map `xc/cli/calibrate.py` fits when it loads the run (`--reloaded`: its fallback, the validation rows served
by the reloaded run with the other training points as the kNN memory) and for a map fitted on the validation rows
served with every training point as the memory (`--self-in-memory`: each row is then its own nearest neighbour).

    XC_THREADS=2 python tools/experiments/calibration_check.py RUN_DIR [--reloaded] [--self-in-memory] [--out F.json]

The run's own calibration.json is left as it was.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np


def agreement(probs: np.ndarray, hits: np.ndarray) -> dict[str, float]:
    """Brier score, expected calibration error (10 bins), mean probability and hit rate of probabilities (n,) and
    their outcomes hits (n,) bool."""
    outcome = hits.astype(np.float64)
    bins = np.minimum((probs * 10).astype(np.int64), 9)
    ece = sum(abs(probs[bins == b].mean() - outcome[bins == b].mean()) * np.sum(bins == b)
              for b in range(10) if np.any(bins == b)) / len(probs)
    return {"brier": round(float(np.mean((probs - outcome) ** 2)), 5), "ece": round(float(ece), 4),
            "mean_p": round(float(probs.mean()), 4), "hit_rate": round(float(outcome.mean()), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--reloaded", action="store_true",
                        help="also fit the map as xc-calibrate does from the reloaded run, and report it beside")
    parser.add_argument("--self-in-memory", action="store_true",
                        help="also fit a map on the validation rows served with every training point (themselves "
                             "included) as the kNN memory, and report it beside")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from xc.cli import calibrate
    from xc.serve.calibration import CALIBRATION_FILE, CANDIDATES, Calibration, precision_recall, relevance

    run = Path(args.run_dir)
    maps = {"calibration.json": Calibration.read(run)}
    if args.reloaded:
        with tempfile.TemporaryDirectory() as tmp:
            kept = Path(tmp) / CALIBRATION_FILE
            shutil.copy(run / CALIBRATION_FILE, kept)
            try:
                calibrate.calibrate_run(run)  # rewrites RUN_DIR/calibration.json: put back below
                maps["reloaded"] = Calibration.read(run)
            finally:
                shutil.copy(kept, run / CALIBRATION_FILE)
    if args.self_in_memory:
        scores, hits, num_true, fused, _ = calibrate.held_out_scores(calibrate._held_out(run),
                                                                     memory=lambda model, rows: None)
        maps["self in memory"] = calibrate._fit(scores, hits, num_true, fused)
    model = calibrate.load_run(run)
    test = model.dataset.test
    rows = np.arange(test.num_points, dtype=np.int64)
    preds = model.predict(calibrate.split_block(model.dataset, "test", rows), k=min(CANDIDATES, model.num_labels))
    hits = relevance(preds.ids, test.labels, rows)
    finite = np.isfinite(preds.scores)
    out = {"run": str(run), "test_points": int(len(rows)), "labels_scored": int(finite.sum())}
    for name, cal in maps.items():
        probs = cal(preds.scores)
        best = precision_recall(probs, hits, int(test.labels.indptr[-1]), cal.best_p)
        out[name] = dict(agreement(probs[finite], hits[finite]), best_p=cal.best_p,
                         **{f"best_{k}": round(v, 2) for k, v in best.items()})
        print(f"{name}: " + "  ".join(f"{k} {v}" for k, v in out[name].items()))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
