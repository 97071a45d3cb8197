"""Ensembles: M models trained with different seeds, their label probabilities averaged, then kNN-fused once.

    xc-train experiment=bibtex                       # 4,392 training points: 3 members by default
    xc-train data=delicious train.ensemble=3         # any data: M members
    xc-train experiment=bibtex train.ensemble=1      # one model

What the field's strongest systems do on small data: AttentionXML and LightXML report ensembles of 3 models,
Parabel averages 3 trees, SLEEC 15 learners. A single xc model on a few thousand points peaks early and its
seeds spread by more than a point of P@1 (Bibtex: 63.6 to 65.3); averaging 3 removes much of that variance.

Member m trains in RUN_DIR/members/m{m}/ as a complete run of its own (lock, checkpoints, resume, its kNN
fusion chosen on validation), with seed = seed + m and the split seed of the ensemble (`data.split_seed`).
Cross-fitted (`train.ensemble_split=crossfit`, the default), member m holds out validation fold m of that
seed (`data.valid_fold`; fold 0 is the single model's split, so member 0 is exactly the model
`train.ensemble=1` trains): the folds are disjoint, so the members together train on every point, and the
ensemble's fusion is chosen on all M folds, each point scored by the one member that never saw it (with that
member's training points as the kNN memory, and a lexical ranker trained on those points, xc/fitting/memory.py). The
label prior (xc/fitting/label_prior.py) is chosen the same way, once for the ensemble on the pooled folds, and applied
to every member before the fusion is chosen. `shared`: every
member holds out the same split, and the averaged members are judged on it. When all have finished, rank 0 loads them (xc/fitting/memory.py): a
label's score is the mean of the members' probabilities, fused once with the kNN vote over every training
point, lambda, k and the space chosen as above (RUN_DIR/fusion.json, as for one model). The ensemble's
validation P@k is logged beside each member's (RUN_DIR/ensemble.json), so what it buys is measured on
held-out points, never on test.

Why cross-fit: on a few thousand points the 10% a single model holds out costs it about a point of P@1
(Bibtex, members trained on every point with a fixed fusion: model alone 63.7 against 62.9 on the split),
and which points are held out moves test P@1 by more than a point; disjoint folds give every point to the
ensemble and three times the held-out points to the fusion's choice, at no extra training.

The rule (`train.ensemble: null`): SMALL_DATA_MEMBERS members when the training split (after the validation
points are carved out) has at most SMALL_DATA_POINTS points, else 1. It reads the data's size, not the clock, so a
run trains the same models on every machine; the size stands for the cost. Up to 50,000 points one model trains in
minutes (debian-deps' 41,080: 3 to 5.5 minutes on 2 CPU cores, under 2 on one GPU), so three cost a quarter of an
hour at most. As served, the three cross-fitted members were ahead of their member 0 (the single model) on Bibtex,
Delicious and debian-deps and level on the synthetic main job, already at its generating model's P@1
(docs/accuracy_defaults.md, "Ensembles"): debian-deps +0.29 to +0.62 P@1, which takes it level with or ahead of
Omikuji Bonsai. Above it a run's time would triple where single models are slower and
steadier; `train.ensemble=3` asks for the ensemble at any size.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path

import numpy as np

from xc.config import XCConfig, to_dict
from xc.data.inputs import validation_split
from xc.distributed import DistContext, broadcast_object
from xc.errors import CheckpointError, ConfigError, XCError
from xc.fitting.label_prior import choose_for_ensemble
from xc.fitting.final_eval import ServedScores, fusion_record, pairs_hard_negatives, served_scores
from xc.fitting.memory import FusionEvaluator
from xc.fitting.model_memory import ModelMemory
from xc.fitting.ranker import LexicalRanker, RankerParams
from xc.fsutil import write_json_atomic
from xc.run import checkpoint as ckpt
from xc.run.checkpoint import load_every_hard_table
from xc.run.guard import archive_previous_run
from xc.run.runlog import RunLogger
from xc.serve.ensemble import ENSEMBLE_FILE, MEMBERS_DIR, load_members, member_dir

log = logging.getLogger("xc.ensemble")

SMALL_DATA_POINTS, SMALL_DATA_MEMBERS = 50_000, 3


def resolve_members(cfg: XCConfig, num_points: int) -> tuple[int, str]:
    """(members, why): `train.ensemble` when set, else the rule (module docstring)."""
    kept, valid = validation_split(cfg.data, num_points, cfg.seed)
    if cfg.train.ensemble is not None:
        members = cfg.train.ensemble
        if members < 1:
            raise ConfigError("train.ensemble", f"must be >= 1 (models averaged), got {members}")
        if members > 1 and cfg.model.mode != "classifier":
            raise ConfigError("train.ensemble", "ensembles train classifier-mode models only (model.mode=classifier)")
        if members > 1 and cfg.model.lexical_features:
            raise ConfigError("train.ensemble", "an ensemble averages its members' dense scores; models with lexical "
                              "weights (model.lexical_features) train one at a time (train.ensemble=1)")
        if members > 1 and not len(valid):
            raise ConfigError("train.ensemble", "an ensemble needs a validation split (data.valid_fraction > 0): "
                              "each member's kNN fusion and the ensemble's validation figures are made on it")
        _check_folds(cfg, num_points, members)
        return members, "train.ensemble"
    if cfg.model.mode != "classifier" or not len(valid):
        return 1, "dual mode, or no validation split"
    if cfg.model.lexical_features:
        return 1, "lexical weights (model.lexical_features) train one model at a time"
    if len(kept) <= SMALL_DATA_POINTS:
        try:
            _check_folds(cfg, num_points, SMALL_DATA_MEMBERS)
        except ConfigError:
            return 1, f"{SMALL_DATA_MEMBERS} validation folds do not fit in {num_points} points"
        return SMALL_DATA_MEMBERS, f"{len(kept)} training points <= {SMALL_DATA_POINTS}"
    return 1, f"{len(kept)} training points > {SMALL_DATA_POINTS}"


def _check_folds(cfg: XCConfig, num_points: int, members: int) -> None:
    """Cross-fitting needs one disjoint validation fold per member, with points left to train on: the last
    member's split is carved (the folds before it with it), and a refusal is reported with the fix."""
    if members < 2 or cfg.train.ensemble_split != "crossfit":
        return
    last = member_config(cfg, members - 1)
    try:
        validation_split(last.data, num_points, last.seed)
    except ConfigError as exc:
        raise ConfigError("train.ensemble", f"{members} cross-fitted members need {members} disjoint validation "
                          f"folds ({exc}): lower data.valid_fraction or train.ensemble, or pass "
                          "train.ensemble_split=shared") from exc


def check_run_layout(cfg: XCConfig, members: int) -> None:
    """Rank 0, before anything is written: one run directory holds one model or one ensemble, never both, so
    a changed default or `train.ensemble` can never bury a run's checkpoints under another's. With
    `train.resume=never` an ensemble archives the previous run (a single model's guard does the same)."""
    run_dir = Path(cfg.run_dir)
    if cfg.train.resume == "never":
        if members > 1:
            archive_previous_run(run_dir, "train.resume=never")
        return
    if members > 1 and cfg.train.resume == "must" and not (run_dir / MEMBERS_DIR).is_dir():
        raise CheckpointError(f"train.resume=must but {run_dir} holds no ensemble ({MEMBERS_DIR}/) to resume")
    if members > 1 and ckpt.list_checkpoints(run_dir):
        raise CheckpointError(
            f"{run_dir} holds the checkpoints of a single model, and this run trains an ensemble of {members}: pass "
            "train.ensemble=1 to resume that model, another run_dir= for the ensemble, or train.resume=never to "
            "move the old run to archive/")
    if members == 1 and (run_dir / MEMBERS_DIR).is_dir():
        raise CheckpointError(
            f"{run_dir} holds an ensemble ({run_dir / MEMBERS_DIR}), and this run trains one model: pass "
            "train.ensemble=N to resume the ensemble, another run_dir= for the model, or train.resume=never to "
            "move the old run to archive/")


def member_config(cfg: XCConfig, m: int) -> XCConfig:
    """Member m's config: its own run directory and seed; the ensemble's split seed, and validation fold m
    when cross-fitted (fold 0 when shared), so member 0 is the single model of the ensemble's config."""
    # train.resume=must holds for the ensemble (check_run_layout); members not started yet start afresh
    resume = "auto" if cfg.train.resume == "must" else cfg.train.resume
    fold = cfg.data.valid_fold + (m if cfg.train.ensemble_split == "crossfit" else 0)
    # an ensemble averages its members' dense scores: the lexical weights' rule (null) gives its members none
    lexical = cfg.model.lexical_features or 0
    return replace(cfg, name=f"{cfg.name}-m{m}", run_dir=str(member_dir(cfg.run_dir, m)), seed=cfg.seed + m,
                   data=replace(cfg.data, split_seed=cfg.data.valid_seed(cfg.seed), valid_fold=fold),
                   train=replace(cfg.train, ensemble=1, resume=resume),
                   model=replace(cfg.model, lexical_features=lexical))


def member_records(run_dir: str | Path, members: int) -> list[dict]:
    """Each member's final metrics (metrics.json) and fusion choice (fusion.json, where it has one)."""
    out = []
    for m in range(members):
        d = member_dir(run_dir, m)
        try:
            metrics = json.loads((d / "metrics.json").read_text())
        except (OSError, ValueError) as exc:
            raise XCError(f"{d / 'metrics.json'}: member {m} has not finished (re-run xc-train to resume it): {exc}")
        fusion = json.loads((d / "fusion.json").read_text()) if (d / "fusion.json").exists() else {}
        out.append({"metrics": metrics, "fusion": fusion})
    return out


def _trained_ranker(member, ranker_cfg):
    """A loader of the lexical ranker the member's own run trained (its RUN_DIR/ranker/, kept where its fusion chose
    it) where that run fitted it as this evaluation would (the same fitting settings): a cross-fitted fold's ranker
    is that member's, trained on its points with its hard negatives; None otherwise."""
    choice, own = member.fusion, member.cfg.eval.ranker
    same_fit = (RankerParams.of(own), own.hard_negatives) == (RankerParams.of(ranker_cfg), ranker_cfg.hard_negatives)
    if choice is None or not choice.gamma or not same_fit:
        return None
    return lambda: LexicalRanker.load(member.run_dir, choice.ranker_parts)


def evaluate_members(cfg: XCConfig, members: int,
                     device: str) -> tuple[dict[str, float], dict, dict, ServedScores | None]:
    """(test metrics, fusion record, ensemble record, the served scores the calibration is fitted on) of the finished
    members averaged and fused once (xc/fitting/memory.py), the fusion chosen on their shared validation split, or
    each member's own fold; rank 0, one process."""
    models = load_members(cfg.run_dir, members, device)
    prior = choose_for_ensemble(cfg, models, models[0].dataset)  # one beta on the pooled folds, on every member
    dataset = models[0].dataset
    # the command line's evaluation settings (fusion grids, the ranker), not the ones each member stored: a finished
    # ensemble re-run with eval.* overrides is judged as asked, as a single model is
    wants_tables = pairs_hard_negatives(cfg.eval.ranker)
    memories = [ModelMemory.of(replace(m.cfg, eval=cfg.eval), m.components, dataset, m.ctx,
                               hard_tables=load_every_hard_table(m.checkpoint, m.meta) if wants_tables else None)
                for m in models]
    for m, member in zip(models, memories):
        member.trained_ranker = _trained_ranker(m, cfg.eval.ranker)
    memory = FusionEvaluator(memories, dataset)
    start = time.perf_counter()
    choice, tried = memory.choose_on_validation()
    if choice.gamma:  # the lexical ranker fused at test, served from RUN_DIR/ranker/ (xc/serve/ensemble.py)
        memory.ranker.save(cfg.run_dir, memory.ctx.rank, memory.ctx.world_size)
    chosen_at = time.perf_counter()
    test = models[0].dataset.test
    n = test.num_points if not cfg.eval.max_points else min(cfg.eval.max_points, test.num_points)
    rows = np.arange(n, dtype=np.int64)
    metrics = memory.test_metrics(choice, rows)
    served = served_scores(memory, choice, rows, 0.0 if prior is None else prior.beta)
    valid_points = int(sum(len(v) for v in memory.validation_folds()))
    fusion = fusion_record(choice, tried, valid_points, chosen_at - start, time.perf_counter() - chosen_at)
    records = member_records(cfg.run_dir, members)
    for m, rec in enumerate(records):
        metrics.update({f"m{m}/{k}": v for k, v in rec["metrics"].items() if "/" not in k and k.split("@")[0] in ("P", "PSP")})
    ensemble = {"members": members, "split": cfg.train.ensemble_split, "dirs": [str(member_dir(cfg.run_dir, m)) for m in range(members)],
                "seeds": [cfg.seed + m for m in range(members)], "valid_points": valid_points,
                "valid": fusion["valid_fused"], "valid_model": fusion["valid_model"],
                "valid_members": [rec["fusion"].get("valid_fused") for rec in records],
                "valid_members_model": [rec["fusion"].get("valid_model") for rec in records],
                "prior_beta": None if prior is None else prior.beta,
                "test": {k: v for k, v in metrics.items() if "/" not in k}}
    return metrics, fusion, ensemble, served


def train_ensemble(cfg: XCConfig, ctx: DistContext, dataset, members: int,
                   train_member: Callable[[XCConfig], dict]) -> tuple[dict[str, float], ServedScores | None]:
    """Train (or resume, or find finished) every member in turn, then average and fuse them (rank 0) and write
    RUN_DIR/fusion.json and ensemble.json; returns the ensemble's test metrics on every rank and, on rank 0, its
    served scores (xc/fitting/final_eval.py; None elsewhere). `train_member` gets
    member_config's config (the one place a member's config is derived) and resolves it as a single model's run
    is (xc.train.plan.resolve_run)."""
    for m in range(members):
        mcfg = member_config(cfg, m)
        if ctx.is_main:
            log.info("ensemble member %d/%d (seed %d) in %s", m + 1, members, mcfg.seed, mcfg.run_dir)
        train_member(mcfg)
    metrics: dict[str, float] = {}
    served = None
    if ctx.is_main:  # the other ranks wait in the broadcast below
        metrics, fusion, record, served = evaluate_members(cfg, members, str(ctx.device))
        write_json_atomic(os.path.join(cfg.run_dir, "fusion.json"), fusion)
        write_json_atomic(os.path.join(cfg.run_dir, ENSEMBLE_FILE), record)
        logger = RunLogger(cfg.logger, cfg.run_dir, cfg.name, ctx.rank, to_dict(cfg))  # log.jsonl (+ wandb)
        logger.event("eval_ensemble", members=members, fusion={k: v for k, v in fusion.items() if k != "grid"},
                     valid=record["valid"], valid_members=record["valid_members"], **metrics)
        logger.close()
        shown = lambda xs: ", ".join("-" if v is None else f"{v:.2f}" for v in xs)  # noqa: E731
        log.info("ensemble of %d, fused once (lambda %.2f, k %d, %s space, temperature %g): validation P@k %.2f "
                 "(members %s); test P@1 %.2f (members %s), models averaged %.2f", members, fusion["lambda"],
                 fusion["k"], fusion["space"], fusion["temperature"], record["valid"] or 0.0,
                 shown(record["valid_members"]), metrics["P@1"], shown(metrics[f"m{m}/P@1"] for m in range(members)),
                 metrics["model/P@1"])
    return broadcast_object(metrics, ctx), served
