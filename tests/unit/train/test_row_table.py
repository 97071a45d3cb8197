"""A feature table trained by gathered rows (model.sparse_features) equals torch's SparseAdam on a sparse
EmbeddingBag, step for step, and leaves untouched rows alone."""

from __future__ import annotations

import torch
from torch import nn

from xc.config import TrainConfig
from xc.models.encoders import BowEncoder, touched_row_grads
from xc.train.optim import EncoderOptimizer, RowTableAdam, build_encoder_optimizer


def _batch(gen: torch.Generator, num_features: int, rows: int = 6, per_row: int = 5) -> dict:
    ids = torch.randint(0, num_features, (rows * per_row,), generator=gen)  # repeats within and across rows
    return {"feat_ids": ids, "feat_offsets": torch.arange(0, rows * per_row, per_row),
            "feat_values": torch.rand(rows * per_row, generator=gen)}


def test_gathered_rows_with_row_table_adam_equal_sparse_adam():
    torch.manual_seed(0)
    ours = BowEncoder(200, 8, [], 0.0, sparse_grad=True)
    ref = nn.EmbeddingBag(200, 8, mode="sum", sparse=True)
    ref.weight.data.copy_(ours.bag.weight)
    head = torch.randn(8, 3)
    opt = build_encoder_optimizer(ours.parameters(), TrainConfig(lr_encoder=0.01), [ours])
    assert isinstance(opt, EncoderOptimizer) and opt.dense is None  # the table is the whole encoder
    ref_opt = torch.optim.SparseAdam([ref.weight], lr=0.01)
    gen = torch.Generator().manual_seed(1)
    never = set(range(200))
    for step in range(5):
        for _ in range(2):  # two micro-steps accumulate before each step
            b = _batch(gen, 200)
            never -= set(b["feat_ids"].tolist())
            (ours(b) @ head).square().sum().backward()
            (ref(b["feat_ids"], b["feat_offsets"], per_sample_weights=b["feat_values"]) @ head).square().sum().backward()
        assert len(touched_row_grads(ours)) == 2
        opt.step()
        ref_opt.step()
        ref_opt.zero_grad()
        assert not ours.touched
        torch.testing.assert_close(ours.bag.weight, ref.weight, rtol=1e-4, atol=1e-5)  # Adam amplifies float noise
    untouched = torch.tensor(sorted(never))
    assert len(untouched) and torch.equal(opt.tables[0].exp_avg[untouched], torch.zeros(len(untouched), 8))
    with torch.no_grad():  # inference reads the table directly and records nothing
        ours(_batch(gen, 200))
    assert not ours.touched


def test_row_table_state_round_trips():
    torch.manual_seed(0)
    enc = BowEncoder(20, 4, [3], 0.0, sparse_grad=True)
    opt = build_encoder_optimizer(enc.parameters(), TrainConfig(lr_encoder=0.05), [enc])
    assert opt.dense is not None and all(p is not enc.bag.weight for g in opt.dense.param_groups for p in g["params"])
    gen = torch.Generator().manual_seed(2)
    enc(_batch(gen, 20)).sum().backward()
    opt.step()
    state = opt.state_dict()
    other = RowTableAdam(enc, 0.5)
    other.load_state_dict(state["tables"][0])
    assert other.steps == 1 and other.param_groups[0]["lr"] == 0.05
    torch.testing.assert_close(other.exp_avg_sq, opt.tables[0].exp_avg_sq)
