"""The one K-means (xc/ann/kmeans.py) gives each of its two callers exactly what the caller's own copy gave: the
query-clustered search's `kmeans` (seeded start, fixed steps, an emptied cluster keeps its centre) and MIDX's
(warm start, re-seeded empty clusters, early stop). The two copies they had are kept below, only here, as oracles."""

from __future__ import annotations

import pytest
import torch

from xc.ann import clustered
from xc.ann.kmeans import lloyd, nearest_centroids
from xc.sampling import midx


def _old_clustered_kmeans(x, num_clusters, iters=8):
    def nearest(x, centroids):
        out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        half_sq = 0.5 * (centroids * centroids).sum(dim=1)
        step = max(1, (1 << 26) // max(1, centroids.shape[0]))
        for a in range(0, x.shape[0], step):
            out[a:a + step] = torch.argmax(x[a:a + step] @ centroids.T - half_sq, dim=1)
        return out

    m = x.shape[0]
    num_clusters = min(num_clusters, m)
    gen = torch.Generator().manual_seed(0x5EED)
    centroids = x[torch.randperm(m, generator=gen)[:num_clusters].to(x.device)].clone()
    assign = nearest(x, centroids)
    for _ in range(iters):
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=num_clusters).to(x.dtype)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None]
        assign = nearest(x, centroids)
    dist2 = ((x - centroids[assign]) ** 2).sum(dim=1)
    counts = torch.bincount(assign, minlength=num_clusters).clamp_min(1).to(x.dtype)
    radius = (torch.zeros(num_clusters, dtype=x.dtype, device=x.device).index_add_(0, assign, dist2) / counts).sqrt()
    return assign, centroids, radius


def _old_midx_assign(x, centroids, chunk=1 << 15):
    c_sq = (centroids * centroids).sum(1)
    assign = torch.empty(x.shape[0], dtype=torch.int64)
    dist = torch.empty(x.shape[0])
    for start in range(0, x.shape[0], chunk):
        part = x[start:start + chunk]
        d = c_sq.unsqueeze(0) - 2.0 * part @ centroids.t()
        best, idx = d.min(1)
        assign[start:start + chunk] = idx
        dist[start:start + chunk] = (best + (part * part).sum(1)).clamp_min(0)
    return assign, dist


def _old_midx_kmeans(x, k, iters, gen, init=None, tol=1e-6):
    n = x.shape[0]
    if init is None or init.shape != (k, x.shape[1]):
        centroids = x[torch.randint(n, (k,), generator=gen)].clone()
    else:
        centroids = init.clone()
    previous = float("inf")
    for _ in range(max(1, iters)):
        assign, dist = _old_midx_assign(x, centroids)
        loss = float(dist.mean())
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k).to(x.dtype)
        empty = counts == 0
        centroids = sums / counts.clamp_min(1).unsqueeze(1)
        if bool(empty.any()):
            centroids[empty] = x[torch.randint(n, (int(empty.sum()),), generator=gen)]
        if previous - loss <= tol * max(previous, 1e-12) and not bool(empty.any()):
            break
        previous = loss
    assign, _ = _old_midx_assign(x, centroids)
    return centroids, assign


def _points(n, d, seed=3, centres=12):
    """(n, d) float32 points around `centres` random centres, a few of them repeated (ties, emptied clusters)."""
    g = torch.Generator().manual_seed(seed)
    mid = torch.randn(centres, d, generator=g) * 3
    x = mid[torch.randint(centres, (n,), generator=g)] + torch.randn(n, d, generator=g)
    x[: n // 10] = x[0]  # a block of identical rows: equal distances, clusters that empty
    return x.float()


@pytest.mark.parametrize("n,d,clusters", [(1, 4, 1), (500, 8, 1), (3000, 16, 7), (3000, 16, 300), (40, 3, 40)])
def test_the_clustered_search_gets_the_centroids_its_own_copy_gave(n, d, clusters):
    x = _points(n, d)
    for got, want in zip(clustered.kmeans(x, clusters), _old_clustered_kmeans(x, clusters)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("n,d,k,iters,tol", [(3000, 8, 16, 25, 1e-6), (3000, 8, 64, 3, 1e-6), (200, 4, 150, 10, 1e-6),
                                             (40000, 6, 32, 4, 0.0), (3000, 8, 16, 25, 0.05), (10, 2, 3, 0, 1e-6)])
def test_midx_gets_the_codebook_its_own_copy_gave(n, d, k, iters, tol):
    """Cold and warm starts, early stops, re-seeded empty clusters (150 centres on 200 rows, 20 of them equal) and
    more rows than one block of products (40,000 > 2^15)."""
    x = _points(n, d)
    for init in (None, x[:k] + 0.5):
        got = midx.kmeans(x, k, iters, torch.Generator().manual_seed(11), init, tol)
        want = _old_midx_kmeans(x, k, iters, torch.Generator().manual_seed(11), init, tol)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_midx_index_and_learned_codewords_are_unchanged():
    """build_index (both quantisers) and learn_codewords' final assignment go through the shared helpers."""
    rows = _points(2000, 8)
    for quantizer in ("pq", "rq"):
        index = midx.build_index(rows, 16, quantizer, 10, torch.Generator().manual_seed(5))
        gen = torch.Generator().manual_seed(5)
        if quantizer == "pq":
            c1, a1 = _old_midx_kmeans(rows[:, :4].contiguous(), 16, 10, gen)
            c2, a2 = _old_midx_kmeans(rows[:, 4:].contiguous(), 16, 10, gen)
        else:
            c1, a1 = _old_midx_kmeans(rows, 16, 10, gen)
            c2, a2 = _old_midx_kmeans(rows - c1[a1], 16, 10, gen)
        for got, want in ((index.c1, c1), (index.c2, c2), (index.a1, a1), (index.a2, a2)):
            assert torch.equal(got, want)
        learned = midx.learn_codewords(index, rows, rows[:32], 2, 0.01, torch.Generator().manual_seed(1))
        full = learned.c1 if quantizer == "rq" else None
        want_a1 = _old_midx_assign(rows if full is not None else rows[:, :4].contiguous(), learned.c1)[0]
        assert torch.equal(learned.a1, want_a1)


def test_lloyd_keeps_or_reseeds_an_emptied_cluster_and_leaves_its_start_alone():
    x = torch.tensor([[0.0, 0.0], [0.0, 0.1], [10.0, 10.0]])
    start = torch.tensor([[0.0, 0.05], [10.0, 10.0], [50.0, 50.0]])  # the third centre wins no row
    kept, assign, dist = lloyd(x, start, 3, block_rows=2)
    assert torch.equal(kept[2], start[2]) and assign.tolist() == [0, 0, 1]
    assert torch.allclose(dist, torch.tensor([0.0025, 0.0025, 0.0]), atol=1e-6)
    moved, _, _ = lloyd(x, start, 1, block_rows=2, reseed=torch.Generator().manual_seed(0))
    assert any(torch.equal(moved[2], row) for row in x)  # re-seeded onto a row
    assert torch.equal(start[2], torch.tensor([50.0, 50.0]))  # the caller's start is not modified


def test_nearest_centroids_ties_go_to_the_lowest_centre_in_any_block_size():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    c = torch.tensor([[0.0, 0.0], [1.0, 1.0]])  # the third point is equally far from both
    for block in (1, 2, 8):
        assign, _ = nearest_centroids(x, c, block)
        assert assign.tolist() == [0, 0, 0]
