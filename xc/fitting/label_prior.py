"""A label prior at inference, its strength chosen on the validation split:

    score'(x, l) = score(x, l) + beta * log(1 + n_l)

n_l is label l's count among the training points the model learned from (the validation split excluded),
beta is picked from `eval.label_prior.betas` by mean P@k over `eval.ks` on the validation split carved from
the training data (`data.valid_fraction`), and kept only where it beats beta = 0 (the plain model) by more than
one standard error of the paired difference (`choose_beta`). It is one scalar: it moves every label by the same
rule, never a per-dataset table.

Why it exists: how far a sampled loss pushes frequent labels down depends on the negatives, not only on the
objective. Uniform negatives almost never draw a frequent label (80 draws among 10^6 labels), and when they
do, a sampled softmax caps its gradient at probability 1 instead of the (L - k_h) / k_r weight eq. 2 gives
it, so frequent labels stay above their full-softmax level. ASTRA's hard negatives are those same frequent
labels' rows for most queries and push them down for every query that lacks them, as the full softmax does.
With a few points per label, which of the two ranks better by P@k is a property of the data and the
training length, so it is measured, on held-out training points: at 10^6 labels validation chose
beta = 0.75 for ASTRA and -1.5 for uniform negatives, at 10^5 -0.25 for ASTRA, and 0 on the small shipped sets
(docs/hard_negatives.md, docs/accuracy_defaults.md). The form is logit adjustment (Menon et al., ICLR 2021), which fixes
beta < 0 to favour the tail; here the sign is chosen by the data. An ensemble chooses one beta on its members'
pooled validation folds (`choose_for_ensemble`).

Training never sees the prior: it is set on the classifier shard (`ClassifierShard.score_bias`, (rows,)
float32 per rank) after training, where exact search (`xc.eval.inference.ExactSearcher`) and the fusion's model
scores (`xc.fitting.fusion.ModelScorer`) add it, and RUN_DIR/prior.json keeps the choice for `xc.load` and `xc-eval`.
ANN serving (`xc-eval --ann`) serves the plain scores.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from xc.ann.exact import BF16_BLOCK_FLOATS, BLOCK_FLOATS, first_pass_dtype
from xc.ann.long_rows import long_row_split
from xc.ann.row_blocks import row_blocks_pay, topk_in_row_blocks
from xc.ann.shortlist import ShortlistScores, best_k, shortlist_pays
from xc.distributed import broadcast_object
from xc.eval.inference import (LEXICAL_EXACT_EXTRA, ExactSearcher, dense_scores_of, encode_rows, predict, settle_deeper,
                                sharded_topk)
from xc.eval.metrics import evaluate as evaluate_metrics
from xc.eval.metrics import hits_per_point, paired_gain, true_labels
from xc.fitting.knn import labels_csr
from xc.fitting.model_memory import KnownTops
from xc.fsutil import write_json_atomic

log = logging.getLogger(__name__)
PRIOR_FILE = "prior.json"


def training_log_counts(labels, train_ids: np.ndarray | None, num_labels: int) -> torch.Tensor:
    """(num_labels,) float32 log(1 + n_l): label counts over the rows `train_ids` of the training split's
    labels (every row when None)."""
    m = labels_csr(labels, train_ids)
    return torch.from_numpy(np.log1p(np.bincount(m.indices, minlength=num_labels)[:num_labels]).astype(np.float32))


def prior_bias(shard, beta: float, log_counts: torch.Tensor) -> torch.Tensor | None:
    """(num_real_rows,) beta * log_counts over the shard's real rows [lo, lo + num_real_rows), on its device;
    None for beta = 0 (the plain scores, bit for bit)."""
    if beta == 0.0:
        return None
    rows = log_counts[shard.lo:shard.lo + shard.num_real_rows]
    return (float(beta) * rows).to(shard.weight.device)


def install(shard, beta: float, log_counts: torch.Tensor) -> None:
    """Set the shard's score bias to `prior_bias` (beta = 0 clears it)."""
    shard.score_bias = prior_bias(shard, beta, log_counts)


def install_for_run(shard, run_dir, labels, train_ids: np.ndarray | None, num_labels: int,
                    beta: float | None = None) -> float | None:
    """Install the beta recorded in RUN_DIR/prior.json (or `beta`), with counts over the rows `train_ids` of
    the training labels; clears the bias where there is none. Returns the beta installed (None: none)."""
    beta = PriorChoice.read_beta(run_dir) if beta is None else beta
    counts = training_log_counts(labels, train_ids, num_labels) if beta else torch.zeros(0)
    install(shard, beta or 0.0, counts)
    return beta or None


@dataclass
class PriorChoice:
    beta: float
    valid_points: int
    valid_plain: float | None  # mean P@k on validation at beta = 0, in %
    valid_chosen: float | None  # at the chosen beta
    grid: list

    def as_dict(self) -> dict:
        return {"beta": self.beta, "valid_points": self.valid_points, "valid_plain": self.valid_plain,
                "valid_chosen": self.valid_chosen, "counts": "training points outside the validation split",
                "grid": self.grid}

    @staticmethod
    def read_beta(run_dir) -> float | None:
        """The beta training chose (RUN_DIR/prior.json), None where it chose none."""
        path = Path(run_dir) / PRIOR_FILE
        return float(json.loads(path.read_text())["beta"]) if path.exists() else None


class _Found:
    """A searcher whose answer is already known (this rank's candidates), for `sharded_topk`'s merge."""

    def __init__(self, scores: torch.Tensor, ids: torch.Tensor):
        self.scores, self.ids = scores, ids

    def search(self, embeddings: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scores, self.ids


@torch.no_grad()
def topk_per_beta(emb: torch.Tensor, shard, log_counts: torch.Tensor, betas: list[float], k: int,
                  ctx, with_scores: bool = False) -> dict[float, np.ndarray]:
    """{beta: global top-k label ids (M, k)} of queries emb (M, d) under score + beta * log_counts, for every
    beta in one pass: each block of scores is computed once and ranked once per beta (on 500 x 200k blocks the
    product took 0.7 s and a ranking 0.2 s, so 11 betas cost about a third of 11 exact searches). `with_scores`:
    {beta: (scores (M, k), ids (M, k)) tensors} instead."""
    weight = shard.weight[:shard.num_real_rows].to(emb.device)
    bias = log_counts[shard.lo:shard.lo + shard.num_real_rows].to(emb.device)
    n, kk = weight.shape[0], min(k, weight.shape[0])
    # one beta (each epoch's validation): the canonical answer through a first pass in bfloat16 where that is
    # faster (xc/ann/shortlist.py); with several, each would re-score its own shortlist, and the shared float32
    # block is cheaper. Neither depends on the speed probe.
    pays = len(betas) == 1 and shortlist_pays(kk, n, weight.shape[1])
    first_pass = first_pass_dtype(str(weight.device)) if pays else None
    block_floats = BF16_BLOCK_FLOATS if first_pass == torch.bfloat16 else BLOCK_FLOATS
    in_blocks = row_blocks_pay(len(emb), n, block_floats)  # 10^7 rows: a block would hold a query or two
    # bfloat16 rows walked in blocks stay as they are, upcast a block at a time where a pass runs in float32: their
    # float32 copy (10^7 rows of 256: 10 GB) stopped a 10^7-label run at its first validation
    rows = weight if in_blocks and weight.dtype == torch.bfloat16 else weight.float()
    found = {b: ([], []) for b in betas}
    if in_blocks:
        ranked = _ranked_in_row_blocks(emb.float(), rows, bias, betas, kk, block_floats, first_pass)
        for b, (top, local) in zip(betas, ranked):
            found[b][0].append(top)
            found[b][1].append(torch.where(local >= 0, local + shard.lo, -1))
    else:
        shortlist = ShortlistScores(rows, first_pass) if first_pass is not None else None
        chunk = max(1, min(len(emb), block_floats // max(1, n)))
        for start in range(0, len(emb), chunk):
            q = emb[start:start + chunk].float()
            scores = shortlist.products(q) if shortlist else q @ rows.t()
            for b in betas:
                if shortlist:
                    top, local = shortlist.topk(q, scores, kk, b * bias if b else None)
                else:
                    top, local = torch.topk(scores + b * bias if b else scores, kk, dim=1)
                found[b][0].append(top.cpu())
                found[b][1].append((local + shard.lo).cpu())
    out = {}
    for b in betas:
        local_scores = torch.cat(found[b][0]) if found[b][0] else torch.empty(len(emb), 0)
        local_ids = torch.cat(found[b][1]) if found[b][1] else torch.empty(len(emb), 0, dtype=torch.int64)
        top, top_ids = sharded_topk(emb, _Found(local_scores, local_ids), k, ctx)
        out[b] = (top, top_ids) if with_scores else top_ids.numpy()
    return out


def lexical_topk_per_beta(emb: torch.Tensor, shard, inputs, rows: np.ndarray, log_counts: torch.Tensor,
                          betas: list[float], k: int, ctx) -> dict[float, tuple[np.ndarray, np.ndarray]]:
    """{beta: (scores (M, k), global label ids (M, k))} of queries emb (M, d), the dataset rows `rows` of `inputs`, under dense +
    lexical scores + beta * log_counts (model.lexical_features): the dense tops of every beta in one pass
    (`topk_per_beta`, k + LEXICAL_EXACT_EXTRA deep), each completed with the lexical weights as `predict` does
    (the queries' sparse scores computed once for every beta, `LexicalRows.rerank_each`; the queries a beta's
    depth left unsettled ranked deeper under its bias; the shard's own bias restored after)."""
    depth = k + LEXICAL_EXACT_EXTRA
    tops = topk_per_beta(emb, shard, log_counts, betas, depth, ctx, with_scores=True)
    kept, out = shard.score_bias, {}
    emb = emb.cpu()

    def dense_of(beta: float):  # the dense scores under beta's prior, without installing it
        bias = prior_bias(shard, beta, log_counts)
        return lambda ids, e: dense_scores_of(shard, ids, e, bias)

    try:
        batch = inputs(rows)  # the queries' lexical scores: computed once for every beta
        ranked = shard.lexical.rerank_each(batch, emb, [(*tops[b], dense_of(b)) for b in betas], k)
        for b, (top, top_ids, exact) in zip(betas, ranked):
            install(shard, b, log_counts)  # the deeper dense ranking of unsettled queries reads it
            top, top_ids = settle_deeper(shard.lexical, shard, ExactSearcher(shard), inputs, rows, emb, top, top_ids,
                                         exact, k, depth, ctx)
            out[b] = (top.numpy(), top_ids.numpy())
    finally:
        shard.score_bias = kept
    return out


def _ranked_in_row_blocks(emb, rows, bias, betas, k, block_floats, first_pass) -> list[tuple]:
    """[(scores (M, k), local ids (M, k))] per beta, the rows walked in blocks (xc/ann/row_blocks.py). With several
    betas, rows without a training positive (log count 0: nine in ten at 10^7 labels and 10^6 points) score the same
    under every beta: they are ranked once and merged with each beta's ranking of the counted rows. The uncounted
    rows are ranked in place, the counted ones masked by a -inf bias: a copy of them would be nine tenths of the rows
    (4.6 GB at 10^7 labels of 256 in bfloat16) on top of a run's peak."""
    counted = torch.nonzero(bias != 0).flatten()
    # rows long and short (xc/ann/long_rows.py): the short (mostly the uncounted) are read only where they could enter
    if len(betas) == 1 or 2 * len(counted) > len(bias) or ((split := long_row_split(rows)) and len(split.ids) >= k):
        return topk_in_row_blocks(emb, rows, k, [b * bias if b else None for b in betas], block_floats, first_pass)
    only_uncounted = torch.where(bias != 0, float("-inf"), 0.0).to(torch.float32)
    (plain_scores, plain_ids), = topk_in_row_blocks(emb, rows, k, [only_uncounted], block_floats, first_pass)
    out = []
    for scores, ids in topk_in_row_blocks(emb, rows[counted], k, [b * bias[counted] if b else None for b in betas],
                                          block_floats, first_pass):
        ids = torch.where(ids >= 0, counted[ids.clamp_min(0)], -1)
        top, top_ids = best_k(torch.cat([scores, plain_scores], dim=1), torch.cat([ids, plain_ids], dim=1), k)
        out.append((top, torch.where(torch.isneginf(top), -1, top_ids)))
    return out


def per_point_precision(ids: np.ndarray, indptr: np.ndarray, indices: np.ndarray, ks: tuple[int, ...]) -> np.ndarray:
    """(M,) each query's mean over ks of P@k (fractions): its mean is the mean P@k over ks. ids (M, c) label ids,
    best first, -1 pads; the truth as CSR (indptr (M + 1,), indices)."""
    cum = np.cumsum(hits_per_point(ids, indptr, indices).astype(np.float64), axis=1)
    return np.mean([cum[:, k - 1] / k for k in ks], axis=0)


def betas_to_try(lp) -> list[float]:
    """`eval.label_prior.betas` and 0, 0 first, then by |beta|: the order ties are settled in."""
    return sorted(set(float(b) for b in lp.betas) | {0.0}, key=lambda b: (abs(b), b))


def validation_tops(cfg, c, ctx, log_counts: torch.Tensor, betas: list[float],
                    width: int) -> dict[float, tuple[np.ndarray, np.ndarray]]:
    """{beta: (scores (V, width), label ids (V, width))}: the exact ranking of the model's validation rows
    `c.train.valid_ids` under score + beta * log_counts, every beta in one pass (every rank)."""
    rows = c.train.valid_ids
    emb = encode_rows(c.encoder, c.train.split_inputs, rows, cfg.eval.batch_size, ctx).to(ctx.device)
    if getattr(c.shard, "lexical", None) is not None:  # dense + lexical scores (model.lexical_features)
        return lexical_topk_per_beta(emb, c.shard, c.train.split_inputs, rows, log_counts, betas, width, ctx)
    return {b: (top.numpy(), ids.numpy())
            for b, (top, ids) in topk_per_beta(emb, c.shard, log_counts, betas, width, ctx, with_scores=True).items()}


def validation_per_beta(cfg, c, dataset, ctx, log_counts: torch.Tensor, betas: list[float]) -> dict[float, np.ndarray]:
    """{beta: (V,) per-point mean P@k over `eval.ks`} of the model's validation rows `c.train.valid_ids`."""
    return _per_point(cfg, c, dataset, validation_tops(cfg, c, ctx, log_counts, betas, max(cfg.eval.ks)))


def _per_point(cfg, c, dataset, tops: dict) -> dict[float, np.ndarray]:
    """{beta: (V,) per-point mean P@k over `eval.ks`} of validation rankings {beta: (scores, ids)}."""
    truth = true_labels(dataset.train.labels, c.train.valid_ids)
    return {b: per_point_precision(ids, *truth, tuple(cfg.eval.ks)) for b, (_, ids) in tops.items()}


def validation_ranking(cfg, c, dataset, ctx, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """((V,) each validation row's mean P@k over `eval.ks`, scores (V, w), label ids (V, w)) of the model as it is
    now (every rank), w = max(width, max k): the ranking at beta = 0 that the classifier mode's epoch selection
    records after every epoch (xc/eval/epoch_select.py), as deep as the final phase reads it again."""
    ks = tuple(cfg.eval.ks)
    scores, ids = validation_tops(cfg, c, ctx, torch.zeros(0), [0.0], max(width, max(ks)))[0.0]
    return per_point_precision(ids, *true_labels(dataset.train.labels, c.train.valid_ids), ks), scores, ids


def choose_from(per_point: dict[float, np.ndarray], betas: list[float]) -> PriorChoice:
    """The one-standard-error rule (Breiman et al. 1984; Hastie et al., ESL 7.10) with the plain model as the
    simplest: the best beta by mean P@k is taken only when it beats beta = 0 by more than the standard error of
    their paired per-point difference; else beta = 0. On a few hundred validation points the grid's best is often
    noise, and a prior chosen by noise moves every label."""
    plain = per_point[0.0]
    grid, best, best_value, best_se = [], 0.0, -np.inf, 0.0
    for beta in betas:
        value = 100.0 * float(per_point[beta].mean())
        se = paired_gain(per_point[beta], plain)[1]
        grid.append({"beta": beta, "value": round(value, 4), "gain_se": round(se, 4)})
        if value > best_value + 1e-9:  # strictly better: a tie keeps the smaller |beta|
            best, best_value, best_se = beta, value, se
    plain_value = 100.0 * float(plain.mean())
    if best_value - plain_value <= best_se:  # within noise of the plain model: keep it
        best, best_value = 0.0, plain_value
    return PriorChoice(best, len(plain), round(plain_value, 4), round(best_value, 4), grid)


def choose_beta(cfg, c, dataset, ctx, log_counts: torch.Tensor) -> PriorChoice:
    """The beta chosen on the model's validation split (`choose_from`), every rank (the choice is rank 0's);
    the shard's bias is left as it was."""
    return _rank_and_choose(cfg, c, dataset, ctx, log_counts)[1]


def _rank_and_choose(cfg, c, dataset, ctx, log_counts: torch.Tensor,
                     width: int = 0) -> tuple[dict, PriorChoice, dict]:
    """({beta: (V,) per-point figures}, the choice: rank 0's, on every rank, {beta: (scores (V, w), ids (V, w))} the
    validation rankings, w = max(width, max k)) over `betas_to_try`."""
    betas = betas_to_try(cfg.eval.label_prior)
    if ctx.is_main:
        log.info("label prior: ranking %d validation points under %d betas %s", len(c.train.valid_ids), len(betas),
                 betas)
    tops = validation_tops(cfg, c, ctx, log_counts, betas, max(width, max(cfg.eval.ks)))
    per_point = _per_point(cfg, c, dataset, tops)
    return per_point, broadcast_object(choose_from(per_point, betas), ctx), tops


def calibrated_validation(cfg, c, dataset, ctx) -> tuple[np.ndarray, PriorChoice] | None:
    """The model as it would be served, on its validation rows: ((V,) per-point mean P@k under the prior it
    would get, that PriorChoice), every rank (rank 0's choice); None when the prior is off or there is no
    validation split (the plain figures are then what is served). One ranking pass, as `choose_beta`."""
    lp = cfg.eval.label_prior
    if not lp.enabled or c.train.valid_ids is None or not len(c.train.valid_ids):
        return None
    log_counts = training_log_counts(dataset.train.labels, c.train.train_ids, dataset.num_labels)
    if lp.beta is None:
        per_point, choice, _ = _rank_and_choose(cfg, c, dataset, ctx, log_counts)
    else:
        choice = PriorChoice(float(lp.beta), 0, None, None, [])
        per_point = validation_per_beta(cfg, c, dataset, ctx, log_counts, [choice.beta])
    return per_point[choice.beta], choice


def choose_for_ensemble(cfg, models: list, dataset) -> PriorChoice | None:
    """An ensemble's one beta (rank 0, one process; `models` are its members as TrainedModels): each member's
    validation rows ranked by that member with its own training counts, the per-point figures pooled (cross-fitted
    folds: all of them, three times a member's points; a shared split: each point's mean over the members) and
    judged by `choose_from`. Installed on every member and written to RUN_DIR/prior.json; None when the prior
    is off (the members then score plain)."""
    lp = cfg.eval.label_prior
    if not lp.enabled:
        for m in models:
            m.use_prior(False)
        return None
    counts = [training_log_counts(dataset.train.labels, m.components.train.train_ids, dataset.num_labels)
              for m in models]
    if lp.beta is not None:
        choice = PriorChoice(float(lp.beta), 0, None, None, [])
    else:
        betas = betas_to_try(lp)
        parts = [validation_per_beta(m.cfg, m.components, dataset, m.ctx, lc, betas) for m, lc in zip(models, counts)]
        folds = [m.components.train.valid_ids for m in models]
        shared = all(np.array_equal(folds[0], f) for f in folds[1:])
        pooled = {b: np.mean([p[b] for p in parts], 0) if shared else np.concatenate([p[b] for p in parts])
                  for b in betas}
        choice = choose_from(pooled, betas)
    for m, lc in zip(models, counts):
        install(m.shard, choice.beta, lc)
        m.prior_beta = choice.beta or None
    write_json_atomic(os.path.join(cfg.run_dir, PRIOR_FILE), choice.as_dict())
    log.info("label prior of the ensemble: beta %g (chosen on %d pooled validation points: mean P@k %s plain, %s "
             "with it)", choice.beta, choice.valid_points, choice.valid_plain, choice.valid_chosen)
    return choice


def metrics_on_test(cfg, c, ctx) -> dict[str, float]:
    """Metrics of the model as the shard now scores (rank 0; {} elsewhere) on the evaluated test points."""
    n = c.test.num_points if not cfg.eval.max_points else min(cfg.eval.max_points, c.test.num_points)
    _, ids = predict(c.encoder, c.shard, c.test_inputs, np.arange(n, dtype=np.int64), cfg.eval.topk,
                     cfg.eval.batch_size, ctx)
    if not ctx.is_main:
        return {}
    indptr, indices = true_labels(c.test.labels, first=n)
    return evaluate_metrics(ids, indptr, indices, c.inv_propensity, ks=tuple(cfg.eval.ks))


def final_prior_metrics(cfg, c, dataset, ctx, logger, epoch: int, step: int, plain: dict,
                        chosen: PriorChoice | None = None, rank_test: bool = True,
                        known: KnownTops | None = None, width: int = 0) -> dict | None:
    """Choose the prior on validation (or take `eval.label_prior.beta`, or `chosen` where the kept epoch's
    choice already made it, xc/eval/epoch_select.py), install it on the shard, write
    RUN_DIR/prior.json (with the plain model's test figures `plain` as `test_plain`, since metrics.json holds
    what `xc-eval` reproduces: the model under its prior) and return the test metrics under it, on every rank;
    None when the prior is off, has no validation split, or validation keeps beta = 0 (the metrics are then
    `plain` unchanged), or when `rank_test` is False: the fused evaluation that follows ranks the test split with
    the model under its prior (its `model/...` metrics), so ranking it here as well would be the same work twice.
    `known`: the rankings kept of the model as it scored before (`KnownTops`): cleared where a prior is installed,
    then given the validation ranking under the chosen beta, `width` deep, where it was chosen here."""
    lp = cfg.eval.label_prior
    has_valid = c.train.valid_ids is not None and len(c.train.valid_ids) > 0
    if not lp.enabled or (lp.beta is None and not has_valid):
        return None
    start = time.perf_counter()
    log_counts = training_log_counts(dataset.train.labels, c.train.train_ids, dataset.num_labels)
    tops = None
    if chosen is not None:
        choice = chosen
    elif lp.beta is not None:
        choice = PriorChoice(float(lp.beta), 0, None, None, [])
    else:
        choice, tops = _rank_and_choose(cfg, c, dataset, ctx, log_counts, width)[1:]
    chosen_at = time.perf_counter()
    metrics: dict[str, float] | None = None
    if choice.beta != 0.0:
        install(c.shard, choice.beta, log_counts)
        if known is not None:
            known.clear()  # they were of the plain scores
            if tops is not None:
                known.add(c.train.split_inputs, c.train.valid_ids, *tops[choice.beta])
        metrics = metrics_on_test(cfg, c, ctx) if rank_test else None
    if ctx.is_main:
        shown = {k: v for k, v in plain.items() if "/" not in k and k.split("@")[0] in ("P", "PSP", "nDCG")}
        write_json_atomic(os.path.join(cfg.run_dir, PRIOR_FILE),
                          dict(choice.as_dict(), choose_seconds=round(chosen_at - start, 2), test_plain=shown))
        log.info("label prior: beta %g (chosen on %d validation points in %.1fs: mean P@k %s plain, %s with it)",
                 choice.beta, choice.valid_points, chosen_at - start, choice.valid_plain, choice.valid_chosen)
        if metrics is not None:
            logger.event("eval_prior", epoch=epoch, global_step=step, beta=choice.beta, **metrics)
    return None if metrics is None else broadcast_object(metrics, ctx)
