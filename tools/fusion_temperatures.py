"""The kNN fusion of finished runs re-chosen on validation at one model temperature at a time.

    python tools/fusion_temperatures.py RUN_DIR [RUN_DIR ...] [--temperatures 1 2 4 8 16] [--out FILE.json]

For each run (a single model or an ensemble's RUN_DIR) and each T, the grid of spaces, k and lambda is
searched on the run's validation split (its cross-fitted folds for an ensemble) with the model's
probabilities at scores / T, and the test figures of that choice are reported beside the validation value;
the default grid (eval.knn_fusion.temperatures) takes the best validation value over its Ts. Nothing is
retrained: the same checkpoints, only the final fusion differs. Figures: docs/accuracy.md ("The model's
temperature in the fusion"), tools/results/fusion_temperature.json.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np


def memory_of(run_dir: Path):
    """(the run's fusion evaluator, its dataset): an EnsembleMemory for an ensemble, else a MemoryEvaluation."""
    import xc
    from xc.ensemble_memory import EnsembleMemory
    from xc.ensemble_serving import load_members
    from xc.memory_eval import MemoryEvaluation

    members = run_dir / "members"
    if members.is_dir():
        models = load_members(run_dir, len(list(members.iterdir())), "cpu")
        return EnsembleMemory(models, models[0].dataset), models[0].dataset
    model = xc.load(run_dir)
    return MemoryEvaluation(model.cfg, model.components, model.dataset, model.ctx), model.dataset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--temperatures", nargs="+", type=float, default=[1.0, 2.0, 4.0, 8.0, 16.0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    report = {}
    for run in args.runs:
        memory, dataset = memory_of(run)
        base, rows, per_t = memory.fc, np.arange(dataset.test.num_points, dtype=np.int64), []
        for t in args.temperatures:
            memory.fc = replace(base, temperatures=[t], lam=None)
            choice, tried = memory.choose_on_validation()
            metrics = memory.test_metrics(choice, rows)
            per_t.append(dict(choice.as_dict(), valid_meanPk=round(100 * max(x["value"] for x in tried), 3),
                              **{f"test_{k}": round(metrics[k], 2) for k in ("P@1", "P@3", "P@5", "PSP@1", "PSP@5")}))
            print(run, json.dumps(per_t[-1]), flush=True)
        report[str(run)] = per_t
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
