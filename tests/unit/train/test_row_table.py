"""A feature table trained by gathered rows (model.sparse_features) moves as torch's dense Adam moves a dense
EmbeddingBag, step for step, though each step reads and writes only the rows it touched; the table is caught up
before it is read and before it is saved, so a resumed run goes on as an uninterrupted one."""

from __future__ import annotations

import torch
from torch import nn

from xc.config import TrainConfig
from xc.models.encoders import BowEncoder, touched_row_grads
from xc.train.optim import EncoderOptimizer, RowTableAdam, build_encoder_optimizer, set_lr


def _batch(gen: torch.Generator, num_features: int, rows: int = 6, per_row: int = 5) -> dict:
    ids = torch.randint(0, num_features, (rows * per_row,), generator=gen)  # repeats within and across rows
    return {"feat_ids": ids, "feat_offsets": torch.arange(0, rows * per_row, per_row),
            "feat_values": torch.rand(rows * per_row, generator=gen)}


def _train(ours, opt, gen, head, steps: int, ref=None, ref_opt=None, check=None) -> None:
    for step in range(steps):
        lr = 0.01 * (1.0 + 0.5 * torch.cos(torch.tensor(step / 3.0)).item())  # a schedule: lr changes every step
        set_lr(opt, lr)
        if ref_opt is not None:
            set_lr(ref_opt, lr)
        for _ in range(2):  # two micro-steps accumulate before each step
            b = _batch(gen, 200)
            (ours(b) @ head).square().sum().backward()
            if ref is not None:
                (ref(b["feat_ids"], b["feat_offsets"], per_sample_weights=b["feat_values"]) @ head).square().sum().backward()
        assert len(touched_row_grads(ours)) == 2
        opt.step()
        assert not ours.touched
        if ref_opt is not None:
            ref_opt.step()
            ref_opt.zero_grad()
        if check is not None:
            check(step)


def test_gathered_rows_with_row_table_adam_equal_dense_adam():
    """Rows a step did not touch keep moving by their decaying moments, as in dense Adam; here after each step
    (the table read outside a step is caught up) and at the end."""
    torch.manual_seed(0)
    ours = BowEncoder(200, 8, [], 0.0, sparse_grad=True)
    ref = nn.EmbeddingBag(200, 8, mode="sum")
    ref.weight.data.copy_(ours.bag.weight)
    head = torch.randn(8, 3)
    opt = build_encoder_optimizer(ours.parameters(), TrainConfig(lr_encoder=0.01), [ours])
    assert isinstance(opt, EncoderOptimizer) and opt.dense is None  # the table is the whole encoder
    ref_opt = torch.optim.Adam([ref.weight], lr=0.01)
    gen = torch.Generator().manual_seed(1)
    table = opt.tables[0]
    probe = _batch(torch.Generator().manual_seed(9), 200)

    def check(step: int) -> None:
        if step % 4 == 3:  # now and then, not every step: rows fall behind by several steps in between
            behind = int((table.last < table.steps).sum())
            assert behind > 0  # the step wrote only the touched rows
            with torch.no_grad():  # inference reads a caught-up table and records nothing
                out = ours(probe)
            assert not ours.touched and int((table.last < table.steps).sum()) == 0
            torch.testing.assert_close(out, ref(probe["feat_ids"], probe["feat_offsets"],
                                                per_sample_weights=probe["feat_values"]), rtol=1e-4, atol=1e-5)

    _train(ours, opt, gen, head, 12, ref, ref_opt, check)
    table.catch_up()
    torch.testing.assert_close(ours.bag.weight, ref.weight, rtol=1e-4, atol=1e-5)  # Adam amplifies float noise
    torch.testing.assert_close(table.exp_avg, ref_opt.state[ref.weight]["exp_avg"], rtol=1e-4, atol=1e-7)
    moved = (ours.bag.weight != ref.weight.detach()).any(1)
    assert moved.sum() < 200  # float noise aside, most rows are bit-for-bit dense Adam's


def test_a_checkpointed_table_resumes_as_the_uninterrupted_one():
    torch.manual_seed(0)
    head = torch.randn(8, 3)

    def fresh():
        torch.manual_seed(0)
        enc = BowEncoder(200, 8, [], 0.0, sparse_grad=True)
        return enc, build_encoder_optimizer(enc.parameters(), TrainConfig(lr_encoder=0.01), [enc])

    whole, whole_opt = fresh()
    first, first_opt = fresh()
    gen_whole, gen_first = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    _train(whole, whole_opt, gen_whole, head, 3)
    whole.state_dict(), whole_opt.state_dict()  # the uninterrupted run writes its checkpoint too
    _train(whole, whole_opt, gen_whole, head, 5)
    _train(first, first_opt, gen_first, head, 3)
    saved = ({k: v.clone() for k, v in first.state_dict().items()},
             {"dense": None, "tables": [{k: (v.clone() if torch.is_tensor(v) else v)
                                         for k, v in first_opt.state_dict()["tables"][0].items()}]})
    resumed, resumed_opt = fresh()
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    _train(resumed, resumed_opt, gen_first, head, 5)
    assert torch.equal(resumed.state_dict()["bag.weight"], whole.state_dict()["bag.weight"])
    assert torch.equal(resumed_opt.tables[0].exp_avg_sq, whole_opt.tables[0].exp_avg_sq)


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
