"""Ensembles: M models trained with different seeds, their (kNN-fused) label probabilities averaged.

    xc-train experiment=bibtex                       # 4,392 training points: 3 members by default
    xc-train data=delicious train.ensemble=3         # any data: M members
    xc-train experiment=bibtex train.ensemble=1      # one model

What the field's strongest systems do on small data: AttentionXML and LightXML report ensembles of 3 models,
Parabel averages 3 trees, SLEEC 15 learners. A single xc model on a few thousand points peaks early and its
seeds spread by more than a point of P@1 (Bibtex: 63.6 to 65.3); averaging 3 removes much of that variance.

Member m trains in RUN_DIR/members/m{m}/ as a complete run of its own (lock, checkpoints, resume, its kNN
fusion chosen on validation): seed = seed + m, on the validation split of the ensemble's own seed
(`data.split_seed`), so every member trains on the same points and is judged on the same held-out ones, and
member 0 is exactly the single model `train.ensemble=1` would train. Each member writes the fused candidates
of every validation and test point (`eval.save_predictions`); a label's ensemble score is the mean over members
of its fused probability (0 where a member did not propose it). The ensemble's validation P@k is logged beside
each member's, so what the averaging buys is measured on held-out points, never on test.

The rule (`train.ensemble: null`): SMALL_DATA_MEMBERS members when the training split (after the validation
points are carved out) has at most SMALL_DATA_POINTS points, else 1. Below that size one model trains in a
few CPU minutes, so the ensemble costs minutes; above it, single models are both slower and steadier.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path

import numpy as np

from xc.config import XCConfig
from xc.distributed import DistContext, broadcast_object
from xc.errors import ConfigError, XCError
from xc.fsutil import write_json_atomic

log = logging.getLogger("xc.ensemble")

MEMBERS_DIR = "members"
ENSEMBLE_FILE = "ensemble.json"
SMALL_DATA_POINTS, SMALL_DATA_MEMBERS = 10_000, 3


def resolve_members(cfg: XCConfig, num_points: int) -> tuple[int, str]:
    """(members, why): `train.ensemble` when set, else the rule (module docstring)."""
    from xc.data.inputs import split_validation

    kept, valid = split_validation(num_points, cfg.data.valid_fraction, cfg.data.valid_max_points,
                                   cfg.data.valid_seed(cfg.seed))
    if cfg.train.ensemble is not None:
        members = cfg.train.ensemble
        if members < 1:
            raise ConfigError("train.ensemble", f"must be >= 1 (models averaged), got {members}")
        if members > 1 and cfg.model.mode != "classifier":
            raise ConfigError("train.ensemble", "ensembles train classifier-mode models only (model.mode=classifier)")
        if members > 1 and not len(valid):
            raise ConfigError("train.ensemble", "an ensemble needs a validation split (data.valid_fraction > 0): "
                              "each member's kNN fusion and the ensemble's validation figures are made on it")
        return members, "train.ensemble"
    if cfg.model.mode != "classifier" or not len(valid):
        return 1, "one model (dual mode, or no validation split)"
    if len(kept) <= SMALL_DATA_POINTS:
        return SMALL_DATA_MEMBERS, f"{len(kept)} training points <= {SMALL_DATA_POINTS}"
    return 1, f"{len(kept)} training points > {SMALL_DATA_POINTS}"


def check_run_layout(cfg: XCConfig, members: int) -> None:
    """Rank 0, before anything is written: one run directory holds one model or one ensemble, never both, so
    a changed default or `train.ensemble` can never bury a run's checkpoints under another's. With
    `train.resume=never` an ensemble archives the previous run (a single model's guard does the same)."""
    from xc import checkpoint as ckpt
    from xc.errors import CheckpointError
    from xc.run_guard import archive_previous_run

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


def member_dir(run_dir: str | Path, m: int) -> Path:
    return Path(run_dir) / MEMBERS_DIR / f"m{m}"


def member_config(cfg: XCConfig, m: int) -> XCConfig:
    """Member m's config: its own run directory and seed, the ensemble's validation split, its fused
    candidates saved. With fusion switched off, members still save candidates, at lambda 0 (the plain model)."""
    fusion = cfg.eval.knn_fusion
    if not fusion.enabled:
        fusion = replace(fusion, enabled=True, lam=0.0, k=fusion.k or min(fusion.ks), space="embedding")
    # train.resume=must holds for the ensemble (check_run_layout); members not started yet start afresh
    resume = "auto" if cfg.train.resume == "must" else cfg.train.resume
    return replace(cfg, name=f"{cfg.name}-m{m}", run_dir=str(member_dir(cfg.run_dir, m)), seed=cfg.seed + m,
                   data=replace(cfg.data, split_seed=cfg.data.valid_seed(cfg.seed)),
                   train=replace(cfg.train, ensemble=1, resume=resume),
                   eval=replace(cfg.eval, save_predictions=True, knn_fusion=fusion))


def average_predictions(parts: list[tuple[np.ndarray, np.ndarray]], num_labels: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean score over members of each proposed label, a member's missing label counting 0.

    parts: per member (ids (n, c_m) int, -1 pads; scores (n, c_m) float). Returns (ids (n, w), scores (n, w)),
    best first, w the largest number of distinct labels any row has; -1 / -inf pad."""
    n = parts[0][0].shape[0]
    ids = np.concatenate([np.asarray(p[0], np.int64) for p in parts], 1)
    scores = np.concatenate([np.where(np.asarray(p[0]) >= 0, p[1], 0.0) for p in parts], 1) / len(parts)
    rows = np.broadcast_to(np.arange(n, dtype=np.int64)[:, None], ids.shape)
    keep = ids >= 0
    keys, inverse = np.unique(rows[keep] * num_labels + ids[keep], return_inverse=True)
    totals = np.bincount(inverse, weights=scores[keep].astype(np.float64))
    key_rows, key_ids = keys // num_labels, keys % num_labels
    counts = np.bincount(key_rows, minlength=n)
    width = max(1, int(counts.max()) if n else 1)
    slot = np.arange(len(keys)) - (np.cumsum(counts) - counts)[key_rows]
    out_ids = np.full((n, width), -1, np.int64)
    out_scores = np.full((n, width), -np.inf, np.float32)
    out_ids[key_rows, slot] = key_ids
    out_scores[key_rows, slot] = totals
    order = np.argsort(-out_scores, axis=1, kind="stable")
    return np.take_along_axis(out_ids, order, 1), np.take_along_axis(out_scores, order, 1)


def load_member_predictions(run_dir: str | Path, members: int) -> list[dict[str, np.ndarray]]:
    out = []
    for m in range(members):
        path = member_dir(run_dir, m) / "predictions.npz"
        if not path.exists():
            raise XCError(f"{path}: missing; member {m} did not finish its final evaluation (re-run xc-train to "
                          "resume it)")
        with np.load(path) as npz:
            out.append({k: npz[k] for k in npz.files})
    return out


def _top(ids: np.ndarray, k: int) -> np.ndarray:
    if ids.shape[1] >= k:
        return ids[:, :k]
    return np.pad(ids, ((0, 0), (0, k - ids.shape[1])), constant_values=-1)


def ensemble_metrics(cfg: XCConfig, dataset, members: int) -> tuple[dict[str, float], dict]:
    """(test metrics of the averaged members, the record for ensemble.json) from the members' saved
    candidates; validation P@k (mean over eval.ks) of the ensemble beside each member's."""
    from xc.metrics import evaluate, inverse_propensities, precision_at_k

    preds = load_member_predictions(cfg.run_dir, members)
    valid_rows = preds[0]["valid_rows"]
    for m, p in enumerate(preds[1:], 1):
        if not np.array_equal(p["valid_rows"], valid_rows):
            raise XCError(f"{member_dir(cfg.run_dir, m)} was validated on other points than member 0 (its "
                          "data.split_seed differs); train it again with train.resume=never")
    ks, topk, L = tuple(cfg.eval.ks), max(cfg.eval.topk, max(cfg.eval.ks)), dataset.num_labels

    def truth(labels, rows):
        from xc.knn import labels_csr

        csr = labels_csr(labels, rows)
        return csr.indptr.astype(np.int64), csr.indices.astype(np.int64)

    v_indptr, v_indices = truth(dataset.train.labels, valid_rows)

    def valid_value(ids: np.ndarray) -> float:  # mean P@k over eval.ks, as the fusion choice measures
        return round(100 * float(np.mean(list(precision_at_k(_top(ids, topk), v_indptr, v_indices, ks).values()))), 3)

    valid_ids, _ = average_predictions([(p["valid_ids"], p["valid_scores"]) for p in preds], L)
    test_ids, _ = average_predictions([(p["test_ids"], p["test_scores"]) for p in preds], L)
    n = len(test_ids)
    t_indptr, t_indices = truth(dataset.test.labels, np.arange(n, dtype=np.int64))
    inv = inverse_propensities(dataset.train, cfg.eval.propensity_a, cfg.eval.propensity_b)
    metrics = evaluate(_top(test_ids, topk), t_indptr, t_indices, inv, ks=ks)
    for m, p in enumerate(preds):
        member = evaluate(_top(p["test_ids"], topk), t_indptr, t_indices, inv, ks=ks)
        metrics.update({f"m{m}/{k}": v for k, v in member.items() if k.split("@")[0] in ("P", "PSP")})
    record = {"members": members, "dirs": [str(member_dir(cfg.run_dir, m)) for m in range(members)],
              "seeds": [cfg.seed + m for m in range(members)], "valid_points": int(len(valid_rows)),
              "valid": valid_value(valid_ids), "valid_members": [valid_value(p["valid_ids"]) for p in preds],
              "test": {k: v for k, v in metrics.items() if "/" not in k}}
    return metrics, record


def train_ensemble(cfg: XCConfig, ctx: DistContext, dataset, members: int,
                   train_member: Callable[[XCConfig], dict]) -> dict[str, float]:
    """Train (or resume, or find finished) every member in turn, then average them (rank 0) and write
    RUN_DIR/ensemble.json and metrics.json; returns the ensemble's test metrics on every rank."""
    for m in range(members):
        mcfg = member_config(cfg, m)
        if ctx.is_main:
            log.info("ensemble member %d/%d (seed %d) in %s", m + 1, members, mcfg.seed, mcfg.run_dir)
        train_member(mcfg)
    metrics: dict[str, float] = {}
    if ctx.is_main:
        metrics, record = ensemble_metrics(cfg, dataset, members)
        write_json_atomic(os.path.join(cfg.run_dir, ENSEMBLE_FILE), record)
        log.info("ensemble of %d: validation P@k %.2f (members %s); test P@1 %.2f (members %s)", members,
                 record["valid"], ", ".join(f"{v:.2f}" for v in record["valid_members"]), metrics["P@1"],
                 ", ".join(f"{metrics[f'm{m}/P@1']:.2f}" for m in range(members)))
    return broadcast_object(metrics, ctx)


def is_ensemble(run_dir: str | Path) -> bool:
    return (Path(run_dir) / ENSEMBLE_FILE).exists()


def read_ensemble(run_dir: str | Path) -> dict:
    path = Path(run_dir) / ENSEMBLE_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise XCError(f"{path}: unreadable ensemble record ({exc})") from exc
