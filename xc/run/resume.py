"""Resuming a run from its newest valid checkpoint, on the same or on a different number of ranks.

The decision is taken before any component is built (`find_checkpoint`, then `plan_layout`), because
the label layout it picks decides what every rank builds:

* same world size, same layout: a plain resume, bit-identical to an uninterrupted run;
* another world size with `parallel.num_label_shards=0` (the default, "one shard per rank"): the
  checkpoint's shard count is adopted when it splits evenly over the new ranks. Sampling is stratified
  per shard with generators keyed by (seed, epoch, step, shard), so the continuation is the very
  training the old world size would have done (up to float summation order across ranks);
* otherwise (2 shards onto 4 ranks, say) the labels are re-split into one shard per rank. Global
  label id l is row l in every layout (padding only follows the last real label), so classifier rows
  are read by label id from whichever rank files hold them, and each hard-negative table is re-cut by
  label id: a new shard keeps, per query, the first k of the old tables' ids that fall in its range
  (-1 where it got fewer). The encoder, its optimiser, the step counters and the RNG are replicated
  and load as they are; the classifier's SGD keeps no per-row state. Such a continuation is sound but
  not bit-identical to the uninterrupted run (the per-shard draws differ), and the log says so;
* impossible, with a CheckpointError naming both values: another number of labels, an explicit
  `parallel.num_label_shards` that differs from the checkpoint's, another classifier dimension or
  encoder shape (checked when the state is loaded).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xc.run import checkpoint as ckpt
from xc.config import XCConfig
from xc.distributed import DistContext, broadcast_object
from xc.errors import CheckpointError
from xc.shards import ShardLayout

log = logging.getLogger("xc.run.resume")

SAME, ADOPT, RESPLIT = "same", "adopt", "resplit"


@dataclass
class ResumeSource:
    """A validated checkpoint and the label layout it was written with."""

    path: Path
    meta: dict[str, Any]
    layout: ShardLayout

    @property
    def world_size(self) -> int:
        return int(self.meta["world_size"])

    @property
    def num_shards(self) -> int:
        return self.layout.num_shards


def _layout_of(path: Path, meta: dict[str, Any]) -> ShardLayout:
    """The checkpoint's layout: recorded in meta.json, or (older checkpoints) rebuilt from its config."""
    if isinstance(meta.get("layout"), dict):
        return ShardLayout(**meta["layout"])
    num_labels = int(ckpt.load_state_file(path / "rank0.pt", mmap=True)["classifier"]["num_labels"])
    return ShardLayout.build(num_labels, int(meta["num_label_shards"]), int(meta["config"]["parallel"]["shard_multiple"]))


def source_at(path: Path) -> ResumeSource:
    """The checkpoint at `path`, validated, as a source to restore from (e.g. the epoch a run keeps)."""
    meta = ckpt.validate(path)
    return ResumeSource(path, meta, _layout_of(path, meta))


def load_model_weights(path: Path, encoder, shard, layout: ShardLayout, rank: int, world_size: int,
                       k_hard_per_shard: int) -> dict[int, np.ndarray] | None:
    """Load the encoder's and this rank's classifier rows' weights of the checkpoint at `path`, written under
    any layout (the epoch a run keeps, xc/eval/epoch_select.py); optimiser state and counters are left alone.
    Returns this rank's hard-negative tables stored with them ({shard: (N, k)}, None without)."""
    # mapped: the rows are copied into the live shard, the optimiser state is never read (10^7 rows of 256 in
    # bfloat16 with their state took the trainer from 9.2 to 15.2 GB here when the file was read whole), and the
    # rows' pages are let go block by block as they are copied (copy_mapped)
    state, tables = restore_rank(source_at(path), layout, rank, world_size, k_hard_per_shard, mmap=True)
    encoder.load_state_dict(state["encoder"])
    shard.load_state_dict(state["classifier"], copy=ckpt.copy_mapped)
    lexical = getattr(shard, "lexical", None)
    if lexical is not None and state.get("lexical") is not None:
        lexical.load_state_dict(state["lexical"], copy=ckpt.copy_mapped)
    return tables


def load_serving_weights(files: Path, meta: dict[str, Any], encoder, shard) -> None:
    """A finished classifier run's weights into a model built for serving in one process (`xc.load`, `xc-eval`):
    the encoder from rank 0's file, the shard's rows by label id from whichever rank files hold them, the lexical
    weights where the model has them; every file mapped, its pages let go as they are copied (copy_mapped)."""
    state = ckpt.load_state_file(files / "rank0.pt", mmap=True)
    encoder.load_state_dict(state["encoder"])
    ckpt.load_classifier_rows(files, meta, shard.lo, shard.hi, out=shard.weight)
    lexical = getattr(shard, "lexical", None)
    if lexical is not None:  # model.lexical_features: the labels' weights on their own features
        lexical.load_state_dict(state["lexical"], copy=ckpt.copy_mapped)


def find_checkpoint(cfg: XCConfig, ctx: DistContext) -> ResumeSource | None:
    """Rank 0 sweeps half-written checkpoint directories of a crashed attempt and picks the newest valid
    checkpoint (falling back past damaged ones); every rank gets the same answer."""
    found = None
    if ctx.is_main:
        ckpt.sweep_partial(cfg.run_dir)
        hit = ckpt.latest_loadable(cfg.run_dir) if cfg.train.resume != "never" else None
        if hit is not None:
            path, meta = hit
            found = (str(path), meta, dataclasses.asdict(_layout_of(path, meta)))
    found = broadcast_object(found, ctx)
    if found is None:
        if cfg.train.resume == "must":
            raise CheckpointError(f"train.resume=must but {cfg.run_dir}/checkpoints has no valid checkpoint")
        return None
    path, meta, layout = found
    return ResumeSource(Path(path), meta, ShardLayout(**layout))


def plan_layout(source: ResumeSource, requested_shards: int, world_size: int, num_labels: int,
                shard_multiple: int) -> tuple[int, str]:
    """(num_label_shards to build, SAME | ADOPT | RESPLIT) for resuming `source` on `world_size` ranks."""
    old = source.layout
    where = f"checkpoint {source.path}"
    if old.num_labels != num_labels:
        raise CheckpointError(
            f"{where} was trained on {old.num_labels} labels, but this run's data has {num_labels}; its classifier "
            "cannot be carried over (did data.* change?). Use another run_dir or train.resume=never")
    if requested_shards and requested_shards != old.num_shards:
        raise CheckpointError(
            f"{where} was written with {old.num_shards} label shards, but this run sets "
            f"parallel.num_label_shards={requested_shards}. Set parallel.num_label_shards={old.num_shards}, or 0 to "
            "let the resume adopt the checkpoint's shards (or re-split them when they do not divide the world size)")
    shards = old.num_shards if requested_shards or old.num_shards % world_size == 0 else world_size
    new = ShardLayout.build(num_labels, shards, shard_multiple)
    if new != old:
        return shards, RESPLIT
    return shards, SAME if world_size == source.world_size else ADOPT


def adapt_config(cfg: XCConfig, source: ResumeSource | None, world_size: int, num_labels: int) -> tuple[XCConfig, str]:
    """The config to build components with (num_label_shards fixed by the plan) and the plan's mode."""
    if source is None:
        return cfg, SAME
    shards, mode = plan_layout(source, cfg.parallel.num_label_shards, world_size, num_labels,
                               cfg.parallel.shard_multiple)
    if cfg.parallel.num_label_shards == 0 and mode != SAME:
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, num_label_shards=shards))
    return cfg, mode


def restore_rank(source: ResumeSource, layout: ShardLayout, rank: int, world_size: int,
                 k_hard_per_shard: int, mmap: bool = False) -> tuple[dict[str, Any], dict[int, np.ndarray] | None]:
    """This rank's state dict and hard-negative tables under `layout`, from any rank files of `source`; `mmap`:
    the files' tensors mapped, read only where they are copied out (`load_model_weights`)."""
    path, old = source.path, source.layout
    if layout == old and world_size == source.world_size:
        return ckpt.load_rank(path, rank, mmap)
    # Encoder, its optimiser, counters and RNG are the same on every rank: read them from one file.
    state = ckpt.load_state_file(path / f"rank{rank if rank < source.world_size else 0}.pt", mmap=mmap)
    if state.get("lexical") is not None:
        raise CheckpointError(f"{path} holds lexical weights (model.lexical_features) written by "
                              f"{source.world_size} rank(s) with {old.num_shards} label shards; they resume and "
                              "serve on the same layout only")
    lo, hi = layout.rank_range(rank, world_size)
    kept_master = "master" in state["classifier"]
    kept_row_sq = "row_sq" in state["classifier"]
    weight = ckpt.load_classifier_rows(path, source.meta, lo, hi, layout.num_labels)
    state["classifier"] = {"lo": lo, "hi": hi, "num_labels": layout.num_labels, "weight": weight}
    if kept_master:  # fp32 master rows of a low-precision shard move by label id like the rows
        state["classifier"]["master"] = ckpt.load_classifier_rows(path, source.meta, lo, hi, layout.num_labels,
                                                                  key="master")
    if kept_row_sq:  # row-wise Adagrad accumulators, (rows, 1), move by label id too
        state["classifier"]["row_sq"] = ckpt.load_classifier_rows(path, source.meta, lo, hi, layout.num_labels,
                                                                  key="row_sq")
    if state.get("hard") is None:
        return state, None
    old_per_rank = old.num_shards // source.world_size
    cache: dict[int, dict[int, np.ndarray]] = {}

    def old_table(shard: int) -> np.ndarray:
        owner = shard // old_per_rank
        if owner not in cache:
            tables = ckpt.load_hard_tables(path, owner)
            if tables is None or shard not in tables:
                raise CheckpointError(f"{path}: hard negatives are in use but rank{owner}.hard.npz lacks shard {shard}")
            cache[owner] = tables
        return cache[owner][shard]

    tables = {}
    for shard in layout.shards_of_rank(rank, world_size):
        if layout == old:
            tables[shard] = old_table(shard)
            continue
        s_lo, s_hi = layout.shard_range(shard)
        last = min(s_hi, layout.num_labels) - 1
        parts = [old_table(t) for t in range(s_lo // old.shard_size, last // old.shard_size + 1)]
        tables[shard] = recut_table(np.concatenate(parts, axis=1), s_lo, s_hi, k_hard_per_shard)
    return state, tables


def recut_table(table: np.ndarray, lo: int, hi: int, k: int) -> np.ndarray:
    """(N, k) int32: per row, the first k ids of `table` (N, m) inside [lo, hi), in their order; -1 after."""
    inside = (table >= lo) & (table < hi)
    order = np.argsort(~inside, axis=1, kind="stable")  # ids in range first, each group in its old order
    picked = np.take_along_axis(table, order, axis=1)[:, :k]
    keep = np.take_along_axis(inside, order, axis=1)[:, :k]
    out = np.full((table.shape[0], k), -1, dtype=np.int32)
    out[:, :picked.shape[1]] = np.where(keep, picked, -1)
    return out


def describe(source: ResumeSource, mode: str, layout: ShardLayout, world_size: int) -> str:
    """One log line saying how the checkpoint's layout maps onto this run."""
    was = f"written by {source.world_size} rank(s) with {source.num_shards} label shards"
    if mode == SAME:
        return was
    if mode == ADOPT:
        return (f"{was}, resumed on {world_size} rank(s): adopted its {source.num_shards} label shards "
                f"({layout.num_shards // world_size} per rank), so training continues exactly as it would have")
    return (f"{was}, resumed on {world_size} rank(s): RE-SPLIT into {layout.num_shards} label shards of "
            f"{layout.shard_size} rows (classifier rows and hard negatives moved by label id); the continuation "
            "is not bit-identical to an uninterrupted run")
