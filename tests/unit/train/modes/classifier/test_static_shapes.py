"""`train.static_shapes` (xc/sampling/fixed_shapes.py, StaticBatchPreparer): the fixed-shape batch assembly draws what
the dynamic device path draws (on the CPU bit for bit: ids, weights, log-q, masks), its padded slots contribute
nothing to the loss or the gradients, its shapes do not depend on the batch, and it dispatches no op that makes the
host wait (item, nonzero, unique, boolean-mask indexing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from xc.config import build_config, to_dict
from xc.defaults import static_shapes_rule
from xc.errors import ConfigError
from xc.sampling import POSITIVE_STREAM, HardNegativeSet, SampleBatch, StepKey, draw_positives
from xc.sampling.fixed_shapes import KEY_PAD, draw_positives_static, sample_static, union_static
from xc.train.modes.classifier.device_batches import (DeviceBatchPreparer, StaticBatchPreparer,
                                                      device_batches_rule)
from xc.train.modes.classifier.step import batch_loss

K_HARD = 8
# ops whose output size depends on the data, or that read a device value on the host
SYNC_OPS = {"_local_scalar_dense", "nonzero", "nonzero_static", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "masked_select", "item", "equal", "is_nonzero"}


def _trainer(tmp_path, shared_pool: int = 0, loss: str = "bce", hard: bool = True, sampler: str = "astra",
             device: str = "cpu", proposal: str = "uniform"):
    from xc.data import load_dataset
    from xc.distributed import init_distributed
    from xc.train.plan import resolve_run
    from xc.train.trainer import Trainer

    cfg = build_config({
        "run_dir": str(tmp_path / f"run-{shared_pool}-{loss}-{hard}-{sampler}-{proposal}"), "seed": 0,
        "data": {"cache_dir": str(tmp_path / "cache"), "synthetic": {
            "num_train": 600, "num_test": 16, "num_labels": 300, "num_features": 200}},
        "model": {"embed_dim": 8, "hidden_dims": []},
        "sampler": {"name": sampler, "k_hard": K_HARD, "k_random": 16, "k_pos": 2, "shared_pool": shared_pool,
                    "loss": loss, "random_proposal": proposal},
        "parallel": {"num_label_shards": 2},
        "train": {"batch_size": 32, "resume": "never", "warmup_steps": 0, "device": device, "static_shapes": "on"},
        "logger": {"wandb": "disabled", "progress": False, "jsonl": False},
    })
    dataset = load_dataset("synthetic", None, str(tmp_path / "cache" / "synthetic"), to_dict(cfg.data.synthetic))
    ctx = init_distributed(device=device)
    trainer = Trainer(resolve_run(cfg, ctx, dataset), ctx, dataset)
    c = trainer.mode.c
    if hard and c.sampler.wants_hard_negatives:
        # tables as the miner writes them: distinct ids within a row, shared across rows, some rows short (-1)
        rng = np.random.default_rng(0)
        tables = {}
        for s in c.my_shards:
            n = c.layout.real_count(s)
            table = c.layout.shard_range(s)[0] + rng.permuted(np.tile(np.arange(n // 4), (c.train.num_rows, 1)),
                                                              axis=1)[:, :K_HARD]
            table[rng.random(table.shape) < 0.1] = -1
            tables[s] = table.astype(np.int32)
        c.sampler.update(1, HardNegativeSet(tables, 1, 0, 0))
    return trainer


def _both(trainer, step: int):
    """(dynamic, static) PreparedBatch of the same rows and key: the device path against its fixed-shape form."""
    c = trainer.mode.c
    assert isinstance(trainer.mode.preparer, StaticBatchPreparer)
    rows = np.random.default_rng(step).permutation(c.train.num_rows)[:c.micro_batch]
    key = StepKey(0, 1, step)
    return DeviceBatchPreparer(trainer.cfg, c, trainer.ctx)(step, rows, key), trainer.mode.preparer(step, rows, key)


def _pool_padding(trainer, key: StepKey, rows) -> torch.Tensor:
    """(c,) bool over the static pool's columns (every shard's, in order): True on the padded union slots."""
    c = trainer.mode.c
    batch = SampleBatch(torch.as_tensor(rows, dtype=torch.int64), torch_only=True)
    draws = [sample_static(c.sampler, key, s, batch) for s in c.my_shards]
    return torch.cat([d.ids[0] < 0 for d in draws])


def test_positives_equal_the_dynamic_draw_for_rows_of_any_count():
    """Rows of 0, 1, k_pos, many positives: the same subsample, weights and keys (pads after), and the table."""
    counts = torch.tensor([0, 1, 2, 7, 3, 12])
    width = int(counts.max()) + 3  # wider than any row, as the training set's widest row may be
    rng = np.random.default_rng(0)
    rows = [rng.choice(500, int(n), replace=False) for n in counts]
    indptr = np.concatenate([[0], np.cumsum(counts.numpy())])
    padded = torch.full((len(rows), width), -1, dtype=torch.int64)
    for r, ids in enumerate(rows):
        padded[r, :len(ids)] = torch.from_numpy(ids)
    for seed in range(20):
        dyn = draw_positives(indptr, np.concatenate(rows), 2, 512, torch.Generator().manual_seed(seed))
        sta = draw_positives_static(padded, counts, 2, 512, torch.Generator().manual_seed(seed))
        assert torch.equal(dyn.ids, sta.ids) and torch.equal(dyn.weight, sta.weight)
        nnz = dyn.keys.numel()
        assert torch.equal(sta.keys[:nnz], dyn.keys) and bool((sta.keys[nnz:] == KEY_PAD).all())
        most = dyn.table.shape[1]
        assert torch.equal(sta.table[:, :most], dyn.table) and bool((sta.table[:, most:] < 0).all())


def test_union_is_the_distinct_hard_ids_then_padding():
    hard = torch.tensor([[5, 3, -1], [3, 9, 5], [-1, -1, -1], [2, 9, 11]])
    union = union_static(hard)
    expected = torch.unique(hard[hard >= 0])
    assert union.shape == (12,) and torch.equal(union[:expected.numel()], expected)
    assert bool((union[expected.numel():] == -1).all())


@pytest.mark.parametrize("proposal", ["uniform", "popularity"])
@pytest.mark.parametrize("pool", [0, 64], ids=["per-query", "shared-pool"])
@pytest.mark.parametrize("hard", [True, False], ids=["hard", "uniform-epoch"])
def test_static_assembly_equals_the_dynamic_one(tmp_path, pool, hard, proposal):
    """The same positives, negative ids, weights and log-q corrections; the pool's padded union columns carry weight
    0, and without them the dense pool equals the dynamic one column for column; with the random part drawn
    uniformly or from the popularity proposal (`sampler.random_proposal`)."""
    trainer = _trainer(tmp_path, pool, hard=hard, proposal=proposal)
    c = trainer.mode.c
    for step in range(3):
        dyn, sta = _both(trainer, step)
        for field in ("ids", "weight"):
            assert torch.equal(getattr(dyn.positives, field), getattr(sta.positives, field)), field
        for field in ("local_ids", "weight", "target"):
            assert torch.equal(getattr(dyn.cand, field), getattr(sta.cand, field)), field
        assert sta.cand.num_pos == dyn.cand.num_pos
        if not pool:
            assert sta.cand.pool_ids is None and dyn.cand.pool_ids is None
            batch = SampleBatch(torch.as_tensor(dyn.rows), torch_only=True)
            for s in c.my_shards:  # the log-q corrections too (the candidates carry only the weights)
                a, b = c.sampler.sample(dyn.key, s, batch), sample_static(c.sampler, dyn.key, s, batch)
                assert torch.equal(a.ids, b.ids) and torch.equal(a.weight, b.weight) and torch.equal(a.log_q, b.log_q)
            continue
        padding = _pool_padding(trainer, dyn.key, dyn.rows)
        assert padding.any() == hard  # a uniform epoch has no union to pad
        assert torch.equal(sta.cand.pool_ids[~padding], dyn.cand.pool_ids)
        assert torch.equal(sta.cand.pool_weight[~padding], dyn.cand.pool_weight)
        assert not sta.cand.pool_weight[padding].any()
        a, b = dyn.cand.dense(), sta.cand.dense()
        keep = torch.cat([torch.ones(dyn.cand.local_ids.shape[1], dtype=torch.bool), ~padding])
        assert torch.equal(b.weight[:, keep], a.weight) and torch.equal(b.target[:, keep], a.target)
        assert not b.weight[:, ~keep].any()
        assert a.weight[:, dyn.cand.local_ids.shape[1]:].eq(0).sum() > 0  # some accidental hits were masked


@pytest.mark.parametrize("pool, loss", [(0, "bce"), (0, "softmax"), (64, "bce"), (64, "softmax")])
def test_one_step_has_the_same_loss_and_gradients(tmp_path, pool, loss):
    trainer = _trainer(tmp_path, pool, loss)
    c, cfg, ctx = trainer.mode.c, trainer.cfg, trainer.ctx
    dyn, sta = _both(trainer, 0)
    base = torch.randn(c.micro_batch, c.shard.dim, generator=torch.Generator().manual_seed(1))
    out = []
    for batch in (dyn, sta):
        emb = base.clone().requires_grad_(True)
        value, unique, rows_leaf, _ = batch_loss(cfg.sampler, c, ctx, emb, batch.rows, batch.key, batch.positives,
                                              float(c.micro_batch), batch.cand)
        value.backward()
        rows_grad = torch.zeros(c.shard.num_rows, c.shard.dim).index_add_(0, unique, rows_leaf.grad)
        out.append((value.detach(), emb.grad, rows_grad))
    for a, b in zip(*out):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pool", [0, 64])
def test_shapes_do_not_depend_on_the_batch_and_no_op_waits_for_the_device(tmp_path, pool):
    trainer = _trainer(tmp_path, pool)
    c, cfg, ctx, prep = trainer.mode.c, trainer.cfg, trainer.ctx, trainer.mode.preparer
    shapes = set()
    for step in range(4):
        rows = torch.as_tensor(np.random.default_rng(step).permutation(c.train.num_rows)[:c.micro_batch])
        key = StepKey(0, 1, step)
        with _Recorder() as seen:
            ids, counts = prep.labels.gather_padded(rows, prep.width)
            positives = draw_positives_static(ids, counts, cfg.sampler.k_pos, c.layout.padded_labels,
                                              key.generator(POSITIVE_STREAM))
            from xc.train.modes.classifier.step import draw_candidates

            cand = draw_candidates(cfg.sampler, c, ctx, rows, key, positives, torch_only=True, static=True)
            cand.dense()
        assert not seen.bad, seen.bad
        shapes.add(tuple(tuple(t.shape) for t in (*vars(positives).values(), *vars(cand).values())
                         if isinstance(t, torch.Tensor)))
    assert len(shapes) == 1, shapes


class _Recorder(TorchDispatchMode):
    """Names the dispatched ops that sync the host or size their output by the data (boolean-mask indexing too)."""

    def __init__(self):
        super().__init__()
        self.bad: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        masks = [a for a in (args[1] if name in ("index", "index_put", "index_put_") else [])
                 if isinstance(a, torch.Tensor) and a.dtype == torch.bool]
        if name in SYNC_OPS or masks or (name == "repeat_interleave" and "output_size" not in (kwargs or {})):
            self.bad.append(name)
        return func(*args, **(kwargs or {}))


def test_rule_is_on_for_cuda_samplers_on_the_device_only():
    assert static_shapes_rule("auto", "cuda", "astra", "classifier", None)[0] == "on"
    assert static_shapes_rule("auto", "cpu", "astra", "classifier", None)[0] == "off"
    assert static_shapes_rule("auto", "cuda", "astra", "classifier", False)[0] == "off"
    assert static_shapes_rule("auto", "cuda", "midx_pq", "classifier", None)[0] == "off"
    assert static_shapes_rule("on", "cuda", "full", "classifier", None)[0] == "off"
    assert static_shapes_rule("on", "cpu", "uniform", "classifier", None)[0] == "on"
    assert static_shapes_rule("off", "cuda", "astra", "classifier", None)[0] == "off"
    assert static_shapes_rule("auto", "cuda", "astra", "dual", None)[0] == "off"
    cpu = torch.device("cpu")
    assert device_batches_rule(None, cpu, None, static=True)[0]
    with pytest.raises(ConfigError, match="train.static_shapes"):
        device_batches_rule(False, cpu, None, static=True)


def test_cpu_default_stays_dynamic(tmp_path):
    """auto on the CPU: the host path, as before."""
    from xc.defaults import resolve

    cfg = build_config({"run_dir": str(tmp_path), "train": {"device": "cpu"}})
    assert cfg.train.static_shapes == "auto"
    assert resolve(cfg, 1000, 5000, 100, "cpu").train.static_shapes == "off"
    assert resolve(cfg, 1000, 5000, 100, "cuda").train.static_shapes == "on"
    with pytest.raises(ConfigError, match="train.static_shapes"):
        build_config({"run_dir": str(tmp_path), "train": {"static_shapes": "always"}})
