"""A sampled training step does no O(L) work: checked op by op, not by timing.

Every aten op that a micro-step dispatches (batch preparation, forward, backward, the sparse row update)
is recorded by a TorchDispatchMode. With L = 2^18 labels and tiny batches, anything of L elements or
more is O(L): an op must neither produce such a tensor nor read one, except the row gather/scatter
(`index_select` / `index_copy_`, which touch only the indexed rows) and views (slicing the shard into
per-shard views allocates nothing), and the binary search of the popularity proposal's CDF (`searchsorted`, O(log L);
the CDF itself is built at the epoch boundary, outside the step). A dense weight decay (`weight.mul_`), a dense optimizer, a full
score matrix or a copy of the rows would each be caught; `test_detector_flags_full_bce` shows the
detector does catch the O(L) full-BCE step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from xc.config import build_config, to_dict

L = 1 << 18
DIM = 8
# Ops that may take the whole shard as input: they read or write only the rows they are given, or
# make views.
ROW_OPS = {"index_select", "index_copy", "index_copy_", "slice", "select", "view", "alias", "detach",
           "as_strided",
           "searchsorted"}  # a binary search: reads O(log n) of its sorted input (the popularity proposal's CDF)


class _Recorder(TorchDispatchMode):
    """Records (op name, 'in'/'out', numel) of every tensor of L elements or more that an op reads or
    newly allocates (in-place results and views share an input's storage and are not allocations)."""

    def __init__(self):
        super().__init__()
        self.big: list[tuple[str, str, int]] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        name = func.overloadpacket.__name__
        inputs = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        seen = {t.untyped_storage().data_ptr() for t in inputs}
        for t in inputs:
            if t.numel() >= L and name not in ROW_OPS:
                self.big.append((name, "in", t.numel()))
        for t in tree_flatten(out)[0]:  # a new allocation, not an in-place result or a view of an input
            if isinstance(t, torch.Tensor) and t.numel() >= L and t.untyped_storage().data_ptr() not in seen:
                self.big.append((name, "out", t.numel()))
        return out


def _trainer(tmp_path, sampler: str, weight_decay: float = 0.0):
    from xc.data import load_dataset
    from xc.distributed import init_distributed
    from xc.sampling import HardNegativeSet
    from xc.train.plan import resolve_run
    from xc.train.trainer import Trainer

    cfg = build_config({
        "run_dir": str(tmp_path / sampler), "seed": 0,
        "data": {"cache_dir": str(tmp_path / "cache"), "synthetic": {
            "num_train": 512, "num_test": 16, "num_labels": L, "num_features": 300}},
        "model": {"embed_dim": DIM, "hidden_dims": []},
        "sampler": {"name": sampler, "k_hard": 8, "k_random": 16, "k_pos": 4},
        "train": {"batch_size": 32, "resume": "never", "warmup_steps": 0, "device": "cpu",
                  "weight_decay_classifier": weight_decay},
        "logger": {"wandb": "disabled", "progress": False, "jsonl": False},
    })
    dataset = load_dataset("synthetic", None, str(tmp_path / "cache" / "synthetic"), to_dict(cfg.data.synthetic))
    ctx = init_distributed(device="cpu")
    trainer = Trainer(resolve_run(cfg, ctx, dataset), ctx, dataset)
    c = trainer.mode.c
    if c.sampler is not None and c.sampler.wants_hard_negatives:
        rng = np.random.default_rng(0)
        tables = {s: rng.integers(0, c.layout.real_count(s), (c.train.num_rows, 8)).astype(np.int32)
                  for s in c.my_shards}
        c.sampler.update(1, HardNegativeSet(tables, 1, 0, 0))
    return trainer


def _recorded_steps(trainer, n: int = 2) -> _Recorder:
    from xc.sampling import StepKey

    c = trainer.mode.c
    order = np.random.default_rng(1).permutation(c.train.num_rows)
    rec = _Recorder()
    for i in range(n):
        rows = order[i * c.micro_batch:(i + 1) * c.micro_batch]
        with rec:
            batch = trainer.mode.preparer(i, rows, StepKey(0, 1, i))
            trainer.step_batch(batch, True)
    return rec


@pytest.mark.parametrize("sampler,weight_decay", [("astra", 0.0), ("astra", 0.01), ("uniform", 0.0)])
def test_sampled_step_touches_nothing_of_size_L(tmp_path, sampler, weight_decay):
    trainer = _trainer(tmp_path, sampler, weight_decay)
    before = trainer.mode.c.shard.weight.clone()
    rec = _recorded_steps(trainer)
    assert rec.ops > 100  # the mode really saw the step
    assert trainer.global_step == 2 and not torch.equal(before, trainer.mode.c.shard.weight)  # rows were updated
    assert rec.big == [], f"O(L) tensors in a {sampler} step: {rec.big[:10]}"


def test_detector_flags_full_bce(tmp_path):
    """The full-BCE step scores every label: the recorder must see its O(L) matmul and scores."""
    rec = _recorded_steps(_trainer(tmp_path, "full"), n=1)
    names = {name for name, _, _ in rec.big}
    assert "mm" in names or "addmm" in names, rec.big[:10]
