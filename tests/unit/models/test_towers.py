"""Dual-mode towers (xc/models/towers.py) and the synthetic LF generator (xc/data/synthetic_lf.py)."""

from __future__ import annotations

import dataclasses

import torch

from xc.config import ModelConfig, SyntheticLFConfig
from xc.models.towers import DualTowers, TokenBagTower


def test_token_bag_is_the_mean_over_real_tokens_only():
    tower = TokenBagTower(50, 4, [], 0.0)
    ids = torch.tensor([[5, 7, 0, 0], [9, 9, 9, 3]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    out = tower({"input_ids": ids, "attention_mask": mask})
    table = tower.bag.weight.detach()
    # padding (id 0) must not enter the mean: a bag that averaged all T columns would fail row 0
    torch.testing.assert_close(out[0], (table[5] + table[7]) / 2)
    torch.testing.assert_close(out[1], (3 * table[9] + table[3]) / 4)


def test_token_bag_gradient_equals_embedding_bag_backward():
    """The CPU sparse-product backward gives torch's embedding_bag gradient, empty texts included."""
    gen = torch.Generator().manual_seed(0)
    tower = TokenBagTower(vocab_size=50, embed_dim=6, hidden_dims=[], dropout=0.0)
    ids = torch.randint(0, 50, (9, 7), generator=gen)
    mask = (torch.rand(9, 7, generator=gen) < 0.6).long()
    mask[2] = 0  # a text of padding only
    grad_out = torch.randn(9, 6, generator=gen)
    tower({"input_ids": ids, "attention_mask": mask}).backward(grad_out)
    ours = tower.bag.weight.grad.clone()
    flat = ids[mask.bool()]
    lengths = mask.sum(1)
    weight = tower.bag.weight.detach().clone().requires_grad_(True)
    torch.nn.functional.embedding_bag(flat, weight, torch.cumsum(lengths, 0) - lengths, mode="mean").backward(grad_out)
    torch.testing.assert_close(ours, weight.grad)
    assert ours.abs().sum() > 0


def test_shared_and_separate_towers():
    shared = DualTowers(ModelConfig(mode="dual", tower="tokenbag", embed_dim=8, share_towers=True))
    separate = DualTowers(ModelConfig(mode="dual", tower="tokenbag", embed_dim=8, share_towers=False))
    assert shared.label is shared.query
    assert separate.label is not separate.query
    assert sum(p.numel() for p in separate.parameters()) == 2 * sum(p.numel() for p in shared.parameters())


def test_minilm_towers_smoke():
    """model.tower=transformer builds MiniLM towers that embed a token batch (GPU-sized; one tiny forward)."""
    towers = DualTowers(ModelConfig(mode="dual", tower="transformer", encoder="transformer", embed_dim=384,
                                    bottleneck_dim=32, share_towers=False))
    batch = {"input_ids": torch.tensor([[101, 7592, 2088, 102]]), "attention_mask": torch.ones(1, 4, dtype=torch.int64)}
    with torch.no_grad():
        q, l = towers.query(batch), towers.label(batch)
    assert q.shape == l.shape == (1, 32) and torch.isfinite(q).all()


def test_synthetic_lf_labels_are_the_teachers_top_labels(tmp_path):
    from xc.data.synthetic_lf import generate
    from xc.models.text_encoder import default_minilm_path

    params = dataclasses.asdict(SyntheticLFConfig(num_train=200, num_test=50, num_labels=120, vocab=300))
    summary = generate(params, default_minilm_path() + "/vocab.txt", str(tmp_path))
    labels = (tmp_path / "lbl.raw.txt").read_text().splitlines()
    queries = (tmp_path / "trn.raw.txt").read_text().splitlines()
    rows = (tmp_path / "trn_X_Y.txt").read_text().splitlines()
    assert rows[0] == "200 120" and len(labels) == 120 and len(queries) == 200
    assert all(len(r.split()) == params["labels_per_query"] for r in rows[1:])
    # queries borrow words of their seed labels, which the teacher mostly ranks among the top labels
    assert summary["trn_seed_label_recall"] > 0.5
    again = generate(params, default_minilm_path() + "/vocab.txt", str(tmp_path / "again"))
    assert again == summary and (tmp_path / "again" / "trn_X_Y.txt").read_text() == "\n".join(rows) + "\n"
