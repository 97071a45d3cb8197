"""Mixed precision on CPU: fp32 master rows for low-precision classifier shards, bf16 autocast of the
encoder, the fp16 refusal off CUDA, and the dynamic loss scaler (alone and inside the trainer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xc.run import checkpoint as ckpt
from xc.config import build_config, to_dict
from xc.errors import ConfigError
from xc.models import ClassifierShard
from xc.models.encoders import BowEncoder, QueryEncoder
from xc.train.optim import SparseRowSGD
from xc.train.precision import LossScaler, autocast_dtype

LOW = [torch.bfloat16, torch.float16]


def _shard(dtype, master, rows=4, dim=8):
    return ClassifierShard(0, rows, rows, dim, 0.01, seed=0, device=torch.device("cpu"), dtype=dtype,
                           master_fp32=master)


@pytest.mark.parametrize("dtype", LOW)
def test_master_rows_keep_many_small_updates(dtype):
    """1000 SGD steps of +1e-4 on rows at 1.0: each is below half an ulp of bf16/fp16 at 1.0 (2^-8 / 2^-11),
    so storage-dtype updates round every one away; with fp32 masters the rows reach 1.1."""
    ids = torch.tensor([0, 2])
    kept, lost = _shard(dtype, True), _shard(dtype, False)
    assert kept.master is not None and kept.master.dtype == torch.float32 and lost.master is None
    for shard in (kept, lost):
        shard.write_rows(ids, torch.ones(2, shard.dim))
        opt = SparseRowSGD(shard, lr=1.0, weight_decay=0.0)
        for _ in range(1000):
            unique, rows, _ = shard.gather(ids)
            opt.accumulate(unique, torch.full_like(rows, -1e-4), rows)
            opt.step(1.0)
    assert torch.all(lost.weight[ids].float() == 1.0)  # every update rounded away
    torch.testing.assert_close(kept.master[ids], torch.full((2, kept.dim), 1.1), rtol=0, atol=1e-4)
    assert torch.equal(kept.weight, kept.master.to(dtype))  # stored rows are the masters' rounding
    assert abs(float(kept.weight[0, 0]) - 1.1) < 0.01
    # untouched rows keep their initial values, in both copies
    assert torch.equal(kept.weight[1], kept.master[1].to(dtype))


def test_master_rows_are_off_for_float32_and_start_from_unrounded_init():
    assert _shard(torch.float32, True).master is None
    full, half = _shard(torch.float32, False), _shard(torch.bfloat16, True)
    assert torch.equal(half.master, full.weight)  # the same fp32 initial values, not their rounding
    assert torch.equal(half.weight, full.weight.to(torch.bfloat16))


def test_checkpoint_saves_and_restores_masters(tmp_path):
    shard = _shard(torch.bfloat16, True)
    shard.write_rows(torch.tensor([1]), torch.full((1, shard.dim), 0.123456789))
    path = tmp_path / "s.pt"
    torch.save({"classifier": shard.state_dict()}, path)
    state = torch.load(path, weights_only=True)["classifier"]
    assert state["master"].dtype == torch.float32 and state["weight"].dtype == torch.bfloat16

    again = _shard(torch.bfloat16, True)
    again.load_state_dict(state)
    assert torch.equal(again.master, shard.master) and torch.equal(again.weight, shard.weight)
    # An fp32 run resuming it takes the masters (more precise than the bf16 rows) ...
    full = _shard(torch.float32, False)
    full.load_state_dict(state)
    assert torch.equal(full.weight, shard.master)
    # ... and a bf16+master run resuming an fp32 checkpoint starts its masters from the fp32 rows.
    back = _shard(torch.bfloat16, True)
    back.load_state_dict(full.state_dict())
    assert torch.equal(back.master, shard.master)


def test_masters_are_stitched_by_label_id_on_a_resplit(tmp_path):
    """A resume on another world size reads master rows from whichever rank files hold them."""
    parts = [ClassifierShard(lo, lo + 8, 12, 4, 0.5, 0, torch.device("cpu"), torch.bfloat16, True) for lo in (0, 8)]
    for rank, part in enumerate(parts):
        ckpt.write_rank_files(tmp_path, 5, rank, {"classifier": part.state_dict()}, None)
    path = ckpt.publish(tmp_path, 5, 2, {"config": {}}, keep=2)
    meta = ckpt.validate(path)
    master = ckpt.load_classifier_rows(path, meta, 4, 12, num_labels=12, key="master")
    weight = ckpt.load_classifier_rows(path, meta, 4, 12, num_labels=12)
    assert master.dtype == torch.float32 and weight.dtype == torch.bfloat16
    expected = torch.cat([parts[0].master[4:8], parts[1].master[0:4]])
    assert torch.equal(master, expected)
    assert torch.equal(weight, expected.to(torch.bfloat16))


def _encoder(amp):
    torch.manual_seed(0)
    enc = QueryEncoder(BowEncoder(50, 32, [16], 0.0), bottleneck_dim=8, dropout=0.0, normalize=False)
    enc.autocast = amp
    return enc


def test_bf16_autocast_runs_the_encoder_in_bf16_on_cpu_and_returns_float32():
    batch = {"feat_ids": torch.tensor([1, 5, 7, 2, 9]), "feat_offsets": torch.tensor([0, 3]),
             "feat_values": torch.tensor([0.5, 0.5, 0.7, 1.0, 0.2])}
    full, mixed = _encoder(None), _encoder(torch.bfloat16)
    out_full, out_mixed = full(batch), mixed(batch)
    assert out_mixed.dtype == torch.float32 and out_mixed.shape == (2, 8)
    assert not torch.equal(out_mixed, out_full)  # the linear layers really ran in bf16 ...
    torch.testing.assert_close(out_mixed, out_full, rtol=0.05, atol=0.02)  # ... close to fp32
    out_mixed.sum().backward()
    grads = [p.grad for p in mixed.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_amp_choices_and_the_fp16_refusal_on_cpu():
    cpu = torch.device("cpu")
    assert autocast_dtype("none", cpu) is None
    assert autocast_dtype("bf16", cpu) == torch.bfloat16
    assert autocast_dtype("fp16", torch.device("cuda", 0)) == torch.float16
    with pytest.raises(ConfigError, match=r"train\.amp.*fp16 autocast needs a CUDA device"):
        autocast_dtype("fp16", cpu)
    with pytest.raises(ConfigError, match="train.amp"):
        build_config({"train": {"amp": "fp8"}})


def test_loss_scaler_backs_off_grows_and_round_trips():
    off = LossScaler(False)
    loss = torch.tensor(3.0)
    assert off.scaled(loss) is loss and off.scale == 1.0
    scaler = LossScaler(True, init_scale=8.0, growth_interval=2)
    assert float(scaler.scaled(loss)) == 24.0
    grad = torch.tensor([24.0, 8.0])
    scaler.unscale_([grad])
    assert grad.tolist() == [3.0, 1.0]
    scaler.overflow()
    assert scaler.scale == 4.0 and scaler.overflows == 1
    scaler.step_done()
    scaler.step_done()
    assert scaler.scale == 8.0 and scaler.good_steps == 0
    other = LossScaler(True)
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict()


# ---------------------------------------------------------------- the scaler inside the trainer


def _trainer(tmp_path, name):
    from xc.data import load_dataset
    from xc.distributed import init_distributed
    from xc.train.plan import resolve_run
    from xc.train.trainer import Trainer

    cfg = build_config({
        "run_dir": str(tmp_path / name), "seed": 0,
        "data": {"cache_dir": str(tmp_path / "cache"), "synthetic": {
            "num_train": 600, "num_test": 50, "num_labels": 300, "num_features": 500}},
        "model": {"embed_dim": 16, "hidden_dims": [16], "dropout": 0.0},  # no RNG use: both trainers see the same
        "sampler": {"k_hard": 0, "k_random": 16},
        "train": {"batch_size": 64, "resume": "never", "warmup_steps": 0, "grad_accum": 2},
        "logger": {"wandb": "disabled", "progress": False, "jsonl": False},
    })
    dataset = load_dataset("synthetic", None, str(tmp_path / "cache" / "synthetic"), to_dict(cfg.data.synthetic))
    ctx = init_distributed(device="cpu")
    return Trainer(resolve_run(cfg, ctx, dataset), ctx, dataset)


def _steps(trainer, n):
    from xc.sampling import StepKey

    order = np.random.default_rng(0).permutation(trainer.mode.c.train.num_rows)
    mb = trainer.mode.c.micro_batch
    for i in range(n):
        batch = trainer.mode.preparer(i, order[i * mb:(i + 1) * mb], StepKey(0, 0, i))
        trainer.step_batch(batch, i % 2 == 1)


def test_power_of_two_loss_scale_gives_identical_updates(tmp_path):
    """Scaling the loss by 2^10 and unscaling every gradient is exact in float32: the same weights."""
    plain, scaled = _trainer(tmp_path, "plain"), _trainer(tmp_path, "scaled")
    scaled.mode.scaler = LossScaler(True, init_scale=2.0 ** 10)
    _steps(plain, 6)
    _steps(scaled, 6)
    assert scaled.mode.scaler.overflows == 0 and scaled.mode.scaler.good_steps == 3
    assert torch.equal(plain.mode.c.shard.weight, scaled.mode.c.shard.weight)
    for a, b in zip(plain.mode.c.encoder.parameters(), scaled.mode.c.encoder.parameters()):
        assert torch.equal(a, b)


def test_overflowing_scale_skips_the_step_and_backs_off(tmp_path):
    """A scale so large that the scaled gradients overflow to inf: the step is dropped (nothing applied,
    no error even with train.nonfinite=stop) and the scale halves until the gradients fit."""
    trainer = _trainer(tmp_path, "overflow")
    trainer.mode.scaler = LossScaler(True, init_scale=2.0 ** 140)  # loss * scale is inf in float32
    before = trainer.mode.c.shard.weight.clone()
    _steps(trainer, 2)
    assert trainer.mode.scaler.overflows == 2 and trainer.mode.scaler.scale == 2.0 ** 138
    assert torch.equal(trainer.mode.c.shard.weight, before) and trainer.global_step == 0
    for _ in range(30):
        if trainer.mode.scaler.scale <= 2.0 ** 100:
            break
        _steps(trainer, 2)
    overflows = trainer.mode.scaler.overflows
    _steps(trainer, 4)
    assert trainer.mode.scaler.overflows == overflows and trainer.global_step >= 2
    assert torch.isfinite(trainer.mode.c.shard.weight).all()
    assert not torch.equal(trainer.mode.c.shard.weight, before)
