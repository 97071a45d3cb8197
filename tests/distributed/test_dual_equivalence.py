"""Dual-encoder mode: 2 gloo ranks train to the same towers, caches and corrector as 1 process.

Both runs split the labels into 2 shards; the 1-process run holds both. Per-shard mining reads the
all-gathered queries, draws per (step, shard) generators, the towers' gradients are summed over ranks,
and each shard's corrector sees the same sampled set S either way, so only float summation order differs.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

TINY = [
    "experiment=synthetic_lf", "data.name=lf-tiny", "data.synthetic_lf.num_train=512", "data.synthetic_lf.num_test=128",
    "data.synthetic_lf.num_labels=300", "data.synthetic_lf.vocab=400", "model.embed_dim=16", "train.batch_size=64",
    "train.epochs=2", "train.warmup_steps=2", "train.log_every=4", "sampler.k_hard=8", "sampler.k_random=16",
    "sampler.corrector_hidden=16", "sampler.corrector_lr=0.001", "sampler.cache_refresh_every=3", "parallel.num_label_shards=2",
    "logger.wandb=disabled", "logger.progress=false", "train.resume=never",
]


def load_dual_state(run_dir, world_size: int) -> dict[str, torch.Tensor]:
    """Tower tensors (rank 0) and every shard's source tensors, keyed by shard, from the newest checkpoint."""
    ckpts = sorted((run_dir / "checkpoints").glob("step-*[0-9]"))
    assert ckpts, f"no checkpoint in {run_dir}"
    states = [torch.load(ckpts[-1] / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
    out = {f"towers.{k}": v for k, v in states[0]["towers"].items()}
    if states[0]["free"] is not None:
        out["free"] = torch.cat([s["free"]["weight"] for s in states])
    for state in states:
        for shard, src in state["sources"].items():
            if "nystrom" in src:  # dynamic_tree: the regressed (n, d') cache
                out[f"shard{shard}.nystrom"] = src["nystrom"]["features"]
            else:
                out[f"shard{shard}.cache"] = src["cache"]["rows"]
            out[f"shard{shard}.encodings"] = torch.tensor(src["encodings"])
            for k, v in src.get("h", {}).items():
                out[f"shard{shard}.h.{k}"] = v
    return out


# dynamic_tree: per-shard forests small enough for 150 labels, refit from s' = 64 fresh encodings every 3 steps
TREE = ["sampler.tree.num_landmarks=8", "sampler.tree.regression_samples=64", "sampler.tree.targets_per_tree=75"]


@pytest.mark.parametrize("sampler", ["corrector", "lf_exhaustive", "lf_exhaustive+shared", "corrector+inbatch",
                                     "dynamic_tree"])
def test_dual_two_ranks_equal_one_process(tmp_path, sampler):
    cache = tmp_path / "cache"
    one, two = tmp_path / "one", tmp_path / "two"
    # +shared: one uniform draw per shard for the whole batch; +inbatch: that, and the batch's positives as negatives
    sampler, _, variant = sampler.partition("+")
    args = [*TINY, f"sampler={sampler}", f"data.cache_dir={cache}", *(TREE if sampler == "dynamic_tree" else []),
            *(["sampler.shared_uniform=true"] if variant else []),
            *(["sampler.inbatch_negatives=true"] if variant == "inbatch" else [])]
    run_cli([*args, f"run_dir={one}"], cwd=REPO)
    run_cli([*args, f"run_dir={two}"], cwd=REPO, nproc=2)
    a, b = load_dual_state(one, 1), load_dual_state(two, 2)
    assert a.keys() == b.keys() and any(k.startswith("shard1.") for k in a)
    for name in a:
        if name.endswith(".h.outer.bias"):
            # Under the softmax corrector loss this bias shifts every score of a query equally: its gradient
            # is exactly zero, and Adam turns the float noise left in it into full-size random steps.
            continue
        # The corrector's Adam turns float-noise gradients (elements whose gradient is ~0) into full-size
        # steps, so h gets a looser bound: still 10x below lr * steps, the drift a different S would cause.
        atol = 1e-3 if ".h." in name else 1e-5
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")
    m1 = json.loads((one / "metrics.json").read_text())
    m2 = json.loads((two / "metrics.json").read_text())
    assert abs(m1["P@1"] - m2["P@1"]) < 0.5, (m1["P@1"], m2["P@1"])
    # the same label encodings were counted (summed over ranks)
    counts = [[json.loads(x) for x in (r / "log.jsonl").read_text().splitlines() if '"encodings"' in x][-1]
              for r in (one, two)]
    for key in ("cache_encodings", "fresh_encodings", "eval_encodings"):
        assert counts[0][key] == counts[1][key], key
