"""The device batch path (xc/train/modes/classifier/device_batches.py), run on CPU tensors: exact where nothing is
random (inputs, hard lookups, positives under the same generator), equal in distribution where the draws are made
another way (uniform negatives), and refused where the sampler draws on the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xc.train.modes.classifier.batches import BatchPreparer
from xc.config import build_config, to_dict
from xc.train.modes.classifier.device_batches import DeviceBatchPreparer, ResidentCSR, device_batches_rule
from xc.errors import ConfigError
from xc.sampling import HardNegativeSet, SampleBatch, StepKey, UniformSampler
from xc.sampling.samplers import uniform_excluding

K_HARD = 8


def _trainer(tmp_path, encoder: str = "bow", sampler: str = "astra", shared_pool: int = 0, device: str = "cpu"):
    from xc.data import load_dataset
    from xc.distributed import init_distributed
    from xc.train.plan import resolve_run
    from xc.train.trainer import Trainer

    cfg = build_config({
        "run_dir": str(tmp_path / f"{encoder}-{sampler}"), "seed": 0,
        "data": {"cache_dir": str(tmp_path / "cache"), "synthetic": {
            "num_train": 600, "num_test": 16, "num_labels": 300, "num_features": 200}},
        "model": {"embed_dim": 8, "hidden_dims": [], "encoder": encoder},
        "sampler": {"name": sampler, "k_hard": K_HARD, "k_random": 16, "k_pos": 2, "shared_pool": shared_pool},
        "train": {"batch_size": 32, "resume": "never", "warmup_steps": 0, "device": device, "device_batches": True,
                  "static_shapes": "off"},  # the dynamic path; the fixed-shape one: test_static_shapes.py
        "logger": {"wandb": "disabled", "progress": False, "jsonl": False},
    })
    dataset = load_dataset("synthetic", None, str(tmp_path / "cache" / "synthetic"), to_dict(cfg.data.synthetic))
    ctx = init_distributed(device=device)
    trainer = Trainer(resolve_run(cfg, ctx, dataset), ctx, dataset)
    c = trainer.mode.c
    if c.sampler is not None and c.sampler.wants_hard_negatives:
        rng = np.random.default_rng(0)
        tables = {s: (c.layout.shard_range(s)[0] + rng.permuted(
            np.tile(np.arange(c.layout.real_count(s)), (c.train.num_rows, 1)), axis=1)[:, :K_HARD]).astype(np.int32)
            for s in c.my_shards}
        c.sampler.update(1, HardNegativeSet(tables, 1, 0, 0))
    return trainer


def _both(trainer, step: int):
    rows = np.random.default_rng(step).permutation(trainer.mode.c.train.num_rows)[:trainer.mode.c.micro_batch]
    key = StepKey(0, 1, step)
    host = BatchPreparer(trainer.cfg, trainer.mode.c, trainer.ctx)(step, rows, key)
    device = trainer.mode.preparer(step, rows, key)
    return host, device


@pytest.mark.parametrize("encoder", ["bow", "dense"])
def test_resident_inputs_and_positives_equal_the_host_path(tmp_path, encoder):
    trainer = _trainer(tmp_path, encoder)
    assert isinstance(trainer.mode.preparer, DeviceBatchPreparer) and trainer.mode.preparer.inputs is not None
    for step in range(3):
        host, device = _both(trainer, step)
        assert host.inputs.keys() == device.inputs.keys()
        for name in host.inputs:
            assert torch.equal(host.inputs[name], device.inputs[name]), name
        # the same generator on the same device: the same subsample of positives, the same weights and keys
        for field in ("ids", "weight", "keys", "table"):
            assert torch.equal(getattr(host.positives, field), getattr(device.positives, field)), field


def test_hard_lookups_are_exact_and_uniform_draws_avoid_them(tmp_path):
    trainer = _trainer(tmp_path)
    c = trainer.mode.c
    host, device = _both(trainer, 0)
    k_pos = device.positives.ids.shape[1]
    hard = slice(k_pos, k_pos + K_HARD)
    assert torch.equal(host.cand.local_ids[:, hard], device.cand.local_ids[:, hard])
    assert torch.equal(host.cand.weight[:, hard], device.cand.weight[:, hard])
    uniform = device.cand.local_ids[:, k_pos + K_HARD:]
    own_hard = device.cand.local_ids[:, hard]
    active = device.cand.weight[:, k_pos + K_HARD:] > 0
    assert not ((uniform.unsqueeze(2) == own_hard.unsqueeze(1)).any(2) & active).any()
    assert int(uniform.max()) < c.layout.real_count(0)


def test_device_uniform_draws_have_the_host_distribution():
    """Per row, the torch-only exact mapping and the host's rejection draw from the same distribution: uniform
    over the labels the row does not exclude (chi-square against uniform, and the two samples against each
    other)."""
    from scipy import stats  # imported here: the GPU tests import this module's helper on hosts without scipy

    lo, n, k = 100, 40, 20000
    excluded = torch.tensor([[103, 100, 139, -1], [-1, -1, -1, -1], [101, 102, 104, 105]])
    host = uniform_excluding(excluded, n, lo, k, torch.Generator().manual_seed(0))
    torch_only = uniform_excluding(excluded, n, lo, k, torch.Generator().manual_seed(1), torch_only=True)
    assert torch.equal(host.weight, torch_only.weight) and torch.equal(host.log_q, torch_only.log_q)
    for row in range(excluded.shape[0]):
        banned = {i for i in excluded[row].tolist() if i >= 0}
        allowed = [i for i in range(lo, lo + n) if i not in banned]
        a = np.array([(torch_only.ids[row] == i).sum().item() for i in allowed])
        b = np.array([(host.ids[row] == i).sum().item() for i in allowed])
        assert a.sum() == k and b.sum() == k  # no draw outside the allowed labels
        assert stats.chisquare(a).pvalue > 1e-3
        assert stats.chi2_contingency(np.stack([a, b])).pvalue > 1e-3


def test_device_astra_inclusion_matches_the_stated_distribution(tmp_path):
    """Over many steps, how often each label enters a query's candidates on the device path matches the sampler's
    stated inclusion probability (1 for hard ids, 1 - (1 - 1/m)^k for the others)."""
    trainer = _trainer(tmp_path)
    c, sampler = trainer.mode.c, trainer.mode.c.sampler
    batch = SampleBatch(torch.arange(4), torch_only=True)
    steps = 3000
    counts = torch.zeros(4, c.layout.real_count(0), dtype=torch.float64)
    for step in range(steps):
        draw = sampler.sample(StepKey(5, 1, step), 0, batch)
        hit = torch.zeros_like(counts, dtype=torch.bool)
        hit[torch.arange(4).unsqueeze(1).expand_as(draw.ids), draw.ids] = True
        counts += hit
    expected = sampler.distribution(0, batch) * steps
    soft = expected < steps  # the uniform part; hard ids are in every draw
    assert torch.equal(counts[~soft], expected[~soft])
    z = (counts[soft] - expected[soft]) / expected[soft].sqrt()
    assert float((z ** 2).mean()) < 1.3, float((z ** 2).mean())  # chi-square per cell, ~1 when right


def test_resident_csr_gathers_rows_in_order():
    csr = ResidentCSR(np.array([0, 2, 2, 5]), np.array([7, 8, 1, 2, 3]), np.array([.1, .2, .3, .4, .5], np.float32),
                      torch.device("cpu"))
    indptr, ids, values = csr.gather(torch.tensor([2, 1, 0, 2]))
    assert indptr.tolist() == [0, 3, 3, 5, 8]
    assert ids.tolist() == [1, 2, 3, 7, 8, 1, 2, 3]
    assert torch.allclose(values, torch.tensor([.3, .4, .5, .1, .2, .3, .4, .5]))


def test_rule_picks_the_device_path_on_cuda_only_for_device_samplers():
    layout_sampler = object()  # any sampler that is not one of the device samplers
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    uniform = UniformSampler.__new__(UniformSampler)
    assert device_batches_rule(None, cuda, uniform)[0] and device_batches_rule(None, cuda, None)[0]
    assert not device_batches_rule(None, cpu, uniform)[0]
    on, why = device_batches_rule(None, cuda, layout_sampler)
    assert not on and "host" in why
    with pytest.raises(ConfigError, match="train.device_batches"):
        device_batches_rule(True, cpu, layout_sampler)
    assert not device_batches_rule(False, cuda, uniform)[0]
