"""Row-wise Adagrad on classifier rows (xc/train/optim.py SparseRowSGD) against the update written out by hand."""

import numpy as np
import torch

from xc.models.classifier import ClassifierShard
from xc.train.optim import SparseRowSGD


def _shard() -> ClassifierShard:
    return ClassifierShard(0, 6, 6, 4, 0.1, seed=3, device=torch.device("cpu"))


def test_rowadagrad_matches_the_update_by_hand():
    """Two steps, the second with two micro-batches that share a row: G_r += mean_j g_rj^2 over the summed
    gradient, w_r -= lr * factor * g_r / (sqrt(G_r) + eps); untouched rows keep their values and accumulators."""
    shard = _shard()
    start = shard.weight.double().numpy().copy()
    opt = SparseRowSGD(shard, lr=0.5, weight_decay=0.0, rule="rowadagrad", eps=1e-8)
    gen = torch.Generator().manual_seed(0)
    g1 = torch.randn(2, 4, generator=gen)
    opt.accumulate(torch.tensor([1, 4]), g1, shard.weight.index_select(0, torch.tensor([1, 4])))
    opt.step(0.8)
    g2a, g2b = torch.randn(2, 4, generator=gen), torch.randn(2, 4, generator=gen)
    opt.accumulate(torch.tensor([1, 2]), g2a)
    opt.accumulate(torch.tensor([2, 5]), g2b)
    opt.step(0.3)

    w, G = start.copy(), np.zeros(6)
    for factor, grads in ((0.8, {1: g1[0], 4: g1[1]}), (0.3, {1: g2a[0], 2: g2a[1] + g2b[0], 5: g2b[1]})):
        for r, g in grads.items():
            g = g.double().numpy()
            G[r] += np.mean(g ** 2)
            w[r] -= 0.5 * factor * g / (np.sqrt(G[r]) + 1e-8)
    np.testing.assert_allclose(shard.weight.double().numpy(), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(shard.row_sq.double().numpy().ravel(), G, rtol=1e-5, atol=1e-7)
    assert np.array_equal(shard.weight.numpy()[[0, 3]], start[[0, 3]].astype(np.float32))


def test_sgd_with_weight_decay_matches_the_update_by_hand():
    shard = _shard()
    start = shard.weight.double().numpy().copy()
    opt = SparseRowSGD(shard, lr=2.0, weight_decay=0.1, rule="sgd")
    g = torch.randn(1, 4, generator=torch.Generator().manual_seed(1))
    opt.accumulate(torch.tensor([3]), g)
    opt.step(0.5)
    expect = start.copy()
    expect[3] -= 2.0 * 0.5 * (g[0].double().numpy() + 0.1 * start[3])
    np.testing.assert_allclose(shard.weight.double().numpy(), expect, rtol=1e-5, atol=1e-6)
