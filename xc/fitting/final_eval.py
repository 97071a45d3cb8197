"""A run's final evaluation with kNN fusion (xc/fitting/memory.py): whether it applies, the choice on validation,
the test metrics, what RUN_DIR/fusion.json and log.jsonl record of them, and the served scores of the held-out and
test rows that the score calibration (xc/cli/calibrate.py) is fitted and reported on."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace

import numpy as np

from xc.distributed import broadcast_object
from xc.eval.metrics import hits_per_point, true_labels
from xc.fitting.fusion import FusionChoice
from xc.fitting.label_prior import PriorChoice
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


@dataclass(frozen=True)
class ServedScores:
    """The fused ranking as served, top `width` labels a row best first, of the held-out validation rows (V of the
    training split) and of the evaluated test rows (T): scores (V or T, width) float (-inf at pads) and whether each
    label is one of the row's (hits, same shape, bool), with the rows' relevant-label counts (`valid_true`,
    `test_true`: those outside the top count as missed); `prior_beta` the label prior the model scored under.
    The held-out rows are ranked with the points that trained the model as the kNN memory, as the fusion was chosen:
    served with every training point as memory, a validation row's nearest neighbour is itself and votes for its
    own labels, which no served query has."""

    width: int
    prior_beta: float
    valid_scores: np.ndarray
    valid_hits: np.ndarray
    valid_true: int
    test_scores: np.ndarray
    test_hits: np.ndarray
    test_true: int


def served_scores(memory: FusionEvaluator, choice: FusionChoice, test_rows: np.ndarray,
                  prior_beta: float) -> ServedScores | None:
    """The `ServedScores` of an evaluation whose choice was made on held-out rows and whose test metrics were taken
    (`FusionEvaluator.choose_on_validation`, `test_metrics`); None where the choice was fixed (no held-out grid).
    Served with `choice`, the candidates are those `xc.load(...).predict(k)` ranks for k <= width."""
    if memory.validation_grid is None or memory.test_candidates is None:
        return None
    valid_rows, grid = memory.validation_grid
    cands = grid[(choice.space, choice.k)].at_temperature(choice.temperature)
    if choice.gamma:
        cands = replace(cands, ranked=memory.validation_ranked[(choice.space, choice.k)])
    width = memory.width
    valid_scores, valid_ids = cands.fuse(choice.lam, width, choice.gamma)
    test_scores, test_ids = memory.test_candidates.fuse(choice.lam, width, choice.gamma)
    valid_truth = true_labels(memory.dataset.train.labels, valid_rows)
    test_truth = true_labels(memory.dataset.test.labels, test_rows)
    return ServedScores(width, float(prior_beta), valid_scores, hits_per_point(valid_ids, *valid_truth),
                        len(valid_truth[1]), test_scores, hits_per_point(test_ids, *test_truth), len(test_truth[1]))


def evaluate_with_memory(model: ModelMemory, dataset, rows: np.ndarray,
                         run_dir=None) -> tuple[dict, dict, ServedScores | None]:
    """(metrics, fusion record, the served scores) of one model's final evaluation; metrics are {} off rank 0.
    Where the choice fuses the lexical ranker, each rank saves its part under RUN_DIR/ranker/ (`run_dir` given)."""
    start = time.perf_counter()
    memory = FusionEvaluator([model], dataset)
    choice, tried = memory.choose_on_validation()
    if choice.gamma and run_dir is not None:
        memory.ranker.save(run_dir, model.ctx.rank, model.ctx.world_size)
    chosen_at = time.perf_counter()
    metrics = memory.test_metrics(choice, rows)
    valid_points = len(model.train.valid_ids)
    record = fusion_record(choice, tried, valid_points, chosen_at - start, time.perf_counter() - chosen_at)
    beta = 0.0 if model.scorer.shard.score_bias is None or run_dir is None else PriorChoice.read_beta(run_dir) or 0.0
    served = served_scores(memory, choice, rows, beta)
    if model.ctx.is_main:
        log.info("kNN fusion: lambda %.2f, k %d, %s space, model at temperature %g (chosen on %d validation points "
                 "in %.1fs); P@1 fused %.2f, model %.2f, kNN %.2f", choice.lam, choice.k, choice.space,
                 choice.temperature, valid_points, chosen_at - start, metrics.get("P@1", 0.0),
                 metrics.get("model/P@1", 0.0), metrics.get("knn/P@1", 0.0))
    return metrics, record, served


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


def final_fused_metrics(cfg, model: ModelMemory, dataset, logger, epoch: int,
                        step: int) -> tuple[dict | None, ServedScores | None]:
    """(a run's final metrics with kNN fusion, on every rank, the served scores `ServedScores`) when fusion is on and
    has a validation split (or a fixed lambda); (None, None) otherwise. The choice and its grid go to
    RUN_DIR/fusion.json, the metrics to log.jsonl as an `eval_fusion` event. `cfg`: the run's config (eval settings
    and run_dir)."""
    ctx = model.ctx
    if not fusion_applies(cfg.eval, model.train.valid_ids, dataset.train.num_points):
        return None, None
    test = dataset.test
    n = test.num_points if not cfg.eval.max_points else min(cfg.eval.max_points, test.num_points)
    metrics, record, served = evaluate_with_memory(model, dataset, np.arange(n, dtype=np.int64), cfg.run_dir)
    if ctx.is_main:
        write_json_atomic(os.path.join(cfg.run_dir, "fusion.json"), record)
        logger.event("eval_fusion", epoch=epoch, global_step=step,
                     fusion={k: v for k, v in record.items() if k != "grid"}, **metrics)
    return broadcast_object(metrics, ctx), served
