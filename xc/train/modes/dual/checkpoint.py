"""Loading a dual-mode checkpoint (xc/train/modes/dual/mode.py): the label shards are kept, and any world size that
divides their number resumes them. The towers and Adam are the same on every rank (rank 0's file, or this rank's
on the same world size), each shard's source comes from the file of the rank that held it, free vectors are
stitched by label id, and the encoding counters are carried (summed onto rank 0 on another world size)."""

from __future__ import annotations

import torch

from xc.errors import CheckpointError
from xc.run import checkpoint as ckpt


def load_dual_weights(mode, source) -> None:
    """The towers and free vectors of the checkpoint `source` (the kept epoch's; sources and Adam left alone)."""
    _load_model(mode, source, _rank_states(source))


def restore_dual(mode, source) -> dict:
    """Load the checkpoint `source` into this rank's towers, Adam, sources, free vectors, counters and epoch
    selector (module docstring); the state dict (this rank's, or rank 0's on another world size) back."""
    ctx = mode.ctx
    if source.meta.get("mode") != "dual":
        raise CheckpointError(f"{source.path} was written by a classifier-mode run; pass another run_dir= or "
                              "train.resume=never (which archives the old run)")
    if source.layout != mode.layout:
        raise CheckpointError(f"{source.path} holds {source.num_shards} label shards of {source.layout.num_labels} "
                              f"labels; this run's layout differs (parallel.num_label_shards, or a world size of "
                              f"{ctx.world_size} that does not divide {source.num_shards}): resume on a world size "
                              "that divides it, or pass another run_dir= or train.resume=never (which archives "
                              "the old run)")
    states = _rank_states(source)
    same = source.world_size == ctx.world_size
    state = states(ctx.rank if same else 0)
    _load_optimizer(mode, state)
    _load_model(mode, source, states)
    old_ranks = range(source.world_size)
    for s, src in mode.sources.items():
        owner = next(r for r in old_ranks if s in mode.layout.shards_of_rank(r, source.world_size))
        src.load_state_dict(states(owner)["sources"][str(s)])
    if same:
        mode.fresh_encodings, mode.eval_encodings = state["fresh_encodings"], state["eval_encodings"]
    else:  # counters are summed over ranks when logged: rank 0 carries the old ranks' total
        first = ctx.rank == 0
        mode.fresh_encodings = sum(states(r)["fresh_encodings"] for r in old_ranks) if first else 0
        mode.eval_encodings = sum(states(r)["eval_encodings"] for r in old_ranks) if first else 0
    mode.selector.load_state_dict(state.get("selector"))
    return state


def _rank_states(source):
    """rank -> that rank's state in the checkpoint `source`, each file read once."""
    states: dict[int, dict] = {}

    def state_of(rank: int) -> dict:
        if rank not in states:
            states[rank] = ckpt.load_rank(source.path, rank)[0]
        return states[rank]

    return state_of


def _load_optimizer(mode, state: dict) -> None:
    try:
        mode.opt.load_state_dict(state["opt"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"the checkpoint's optimiser does not fit this run's model.* settings: "
                              f"{str(exc)[:400]}")


def _load_model(mode, source, states) -> None:
    """Towers (the same on every rank: rank 0's or this rank's file) and free vectors stitched by label id."""
    same = source.world_size == mode.ctx.world_size
    state = states(mode.ctx.rank if same else 0)
    try:
        mode.towers.load_state_dict(state["towers"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"the checkpoint's towers do not fit this run's model.* settings: {str(exc)[:400]}")
    if mode.free is None:
        return
    if state["free"] is None:
        raise CheckpointError(f"{source.path} has no free vectors but model.free_vectors=true")
    if same:
        mode.free.load_state_dict(state["free"])
    else:  # rows by label id: label l is row l in every split of the same shards
        rows = torch.cat([states(r)["free"]["weight"] for r in range(source.world_size)])
        mode.free.load_state_dict({"lo": mode.lo, "hi": mode.hi, "num_labels": mode.free.num_labels,
                                   "weight": rows[mode.lo:mode.hi].clone()})
