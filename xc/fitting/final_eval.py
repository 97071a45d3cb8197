"""A run's final evaluation with kNN fusion (xc/fitting/memory.py): whether it applies, the choice on validation,
the test metrics, and what RUN_DIR/fusion.json and log.jsonl record of them."""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from xc.distributed import broadcast_object
from xc.fitting.fusion import FusionChoice
from xc.fitting.memory import FusionEvaluator
from xc.fitting.model_memory import ModelMemory
from xc.fsutil import write_json_atomic

log = logging.getLogger(__name__)


def fusion_record(choice: FusionChoice, tried: list, valid_points: int, choose_seconds: float,
                  test_seconds: float) -> dict:
    """What RUN_DIR/fusion.json holds: the choice, validation P@k of the plain and the fused model, the grid."""
    at_zero = [t["value"] for t in tried if t["lambda"] == 0.0]
    return dict(choice.as_dict(), valid_points=int(valid_points),
                valid_model=round(100 * at_zero[0], 3) if at_zero else None,
                valid_fused=round(100 * max(t["value"] for t in tried), 3) if tried else None, grid=tried,
                choose_seconds=round(choose_seconds, 2), test_seconds=round(test_seconds, 2))


def evaluate_with_memory(model: ModelMemory, dataset, rows: np.ndarray, run_dir=None) -> tuple[dict, dict]:
    """(metrics, fusion record) of one model's final evaluation; metrics are {} off rank 0. Where the choice fuses
    the lexical ranker, each rank saves its part under RUN_DIR/ranker/ (`run_dir` given)."""
    start = time.perf_counter()
    memory = FusionEvaluator([model], dataset)
    choice, tried = memory.choose_on_validation()
    if choice.gamma and run_dir is not None:
        memory.ranker.save(run_dir, model.ctx.rank, model.ctx.world_size)
    chosen_at = time.perf_counter()
    metrics = memory.test_metrics(choice, rows)
    valid_points = len(model.train.valid_ids)
    record = fusion_record(choice, tried, valid_points, chosen_at - start, time.perf_counter() - chosen_at)
    if model.ctx.is_main:
        log.info("kNN fusion: lambda %.2f, k %d, %s space, model at temperature %g (chosen on %d validation points "
                 "in %.1fs); P@1 fused %.2f, model %.2f, kNN %.2f", choice.lam, choice.k, choice.space,
                 choice.temperature, valid_points, chosen_at - start, metrics.get("P@1", 0.0),
                 metrics.get("model/P@1", 0.0), metrics.get("knn/P@1", 0.0))
    return metrics, record


def pairs_hard_negatives(ranker_cfg) -> bool:
    """Whether the lexical ranker will pair the model's hard negatives: only then are the tables gathered from the
    ranks or read from members' checkpoints."""
    return bool(ranker_cfg.enabled and ranker_cfg.hard_negatives > 0)


def fusion_applies(eval_cfg, valid_ids, train_points: int, quiet: bool = False) -> bool:
    """Whether a run's final evaluation fuses: fusion on, a validation split to choose on (or a fixed lambda), and
    at most `eval.knn_fusion.max_train_points` training points (logged where it is skipped for them)."""
    fc = eval_cfg.knn_fusion
    if not fc.enabled or (fc.lam is None and (valid_ids is None or not len(valid_ids))):
        return False
    if fc.max_train_points and train_points > fc.max_train_points:
        if not quiet:
            log.info("kNN fusion skipped: %d training points exceed eval.knn_fusion.max_train_points=%d",
                     train_points, fc.max_train_points)
        return False
    return True


def final_fused_metrics(cfg, model: ModelMemory, dataset, logger, epoch: int, step: int) -> dict | None:
    """A run's final metrics with kNN fusion, on every rank, when fusion is on and has a validation split (or
    a fixed lambda); None otherwise. The choice and its grid go to RUN_DIR/fusion.json, the metrics to
    log.jsonl as an `eval_fusion` event. `cfg`: the run's config (eval settings and run_dir)."""
    ctx = model.ctx
    if not fusion_applies(cfg.eval, model.train.valid_ids, dataset.train.num_points):
        return None
    test = dataset.test
    n = test.num_points if not cfg.eval.max_points else min(cfg.eval.max_points, test.num_points)
    metrics, record = evaluate_with_memory(model, dataset, np.arange(n, dtype=np.int64), cfg.run_dir)
    if ctx.is_main:
        write_json_atomic(os.path.join(cfg.run_dir, "fusion.json"), record)
        logger.event("eval_fusion", epoch=epoch, global_step=step,
                     fusion={k: v for k, v in record.items() if k != "grid"}, **metrics)
    return broadcast_object(metrics, ctx)
