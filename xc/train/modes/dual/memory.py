"""kNN fusion (instance memory, xc/fitting/memory.py) for dual-encoder runs.

The classifier path fuses its classifier scores with a kNN vote; here the "classifier" is the label
tower's exact encodings g(text_l) (+ the free vector w_l), computed once after training, so the same
evaluator chooses lambda, k and the space on the validation split carved from the training points and
reports the fused model, the plain model (`model/...`) and the vote (`knn/...`). The rows live in a
ClassifierShard over this rank's label range, so scoring stays sharded.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from xc.data.inputs import InputFn, TrainingView, validation_split
from xc.fitting.final_eval import ServedScores, final_fused_metrics
from xc.fitting.model_memory import ModelMemory
from xc.models.classifier import ClassifierShard


def dual_model_memory(cfg, dataset, encoder: torch.nn.Module, shard: ClassifierShard, train_inputs: InputFn,
                      test_inputs: InputFn, inv_propensity: np.ndarray | None, ctx) -> ModelMemory:
    """A dual run's side of fusion: the query tower as the encoder, the label rows as the classifier, the
    training texts as the memory with the run's validation split (data.valid_fraction, held out in training)."""
    train_ids, valid_ids = validation_split(cfg.data, dataset.train.num_points, cfg.seed)
    view = TrainingView(dataset.train, train_inputs, point_ids=train_ids, valid_ids=valid_ids)
    # no lexical ranker (xc/fitting/ranker.py) in the dual mode: measured with the bag-of-words classifier only
    eval_cfg = replace(cfg.eval, ranker=replace(cfg.eval.ranker, enabled=False))
    return ModelMemory(eval_cfg, cfg.sampler.loss, encoder, shard, view, test_inputs, inv_propensity, dataset, ctx)


def label_rows_shard(tables: list[tuple[int, torch.Tensor]], lo: int, hi: int, num_labels: int,
                     device: torch.device) -> ClassifierShard:
    """A ClassifierShard over [lo, hi) whose rows are the encoded label tables [(global lo_s, (n_s, d))];
    padding rows stay zero."""
    dim = tables[0][1].shape[1] if tables else 1
    shard = ClassifierShard(lo, hi, num_labels, dim, 0.0, 0, device)  # init std 0: every row starts at zero
    for s_lo, table in tables:
        shard.weight[s_lo - lo:s_lo - lo + table.shape[0]] = table.to(device)
    return shard


def fused_dual_metrics(mode, dataset, epoch: int, global_step: int) -> tuple[dict | None, ServedScores | None]:
    """The dual mode's final metrics with kNN fusion and its served scores (None, None when fusion is off or has no
    validation split); writes RUN_DIR/fusion.json like the classifier path. `mode`:
    xc.train.modes.dual.mode.DualMode."""
    cfg, ctx = mode.cfg, mode.ctx
    fresh = mode.eval_tables is not None and mode.eval_tables[0] == global_step
    tables = mode.eval_tables[1] if fresh else mode.label_tables()
    shard = label_rows_shard(tables, mode.lo, mode.hi, dataset.num_labels, ctx.device)
    memory = dual_model_memory(cfg, dataset, mode.towers.query, shard, mode.train_inputs, mode.test_inputs,
                               mode.inv_prop, ctx)
    mode.towers.eval()
    return final_fused_metrics(cfg, memory, dataset, mode.logger, epoch, global_step)
