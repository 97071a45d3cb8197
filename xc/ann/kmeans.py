"""Lloyd's K-means, one implementation for its two users:

* the query-clustered search (xc/ann/clustered.py) groups a search call's queries: a fixed number of steps from
  seeded starting centres, on the queries' device; a cluster that empties keeps its centre;
* the MIDX proposal (xc/sampling/midx.py) quantises a shard's classifier rows into two codebooks: warm-started from
  the last epoch's codebook, a cluster that empties is re-seeded with a random row (drawn from the sampler's
  generator), and the steps stop early once the mean distortion stops improving.

Each caller picks its starting centres and passes its own block of rows per product, so each gets the centroids it
got from its own copy before: the products, and so every rounding, are the same.
"""

from __future__ import annotations

import math


def nearest_centroids(x, centroids, block_rows: int):
    """(assign (n,) int64, squared distance (n,)) of each row of x (n, d) to its nearest centroid of (C, d), in
    blocks of `block_rows` rows. The nearest minimises |c|^2 - 2 x.c (ties: the lowest centroid index); the distance
    adds |x|^2 back, clamped at 0 against rounding."""
    import torch

    c_sq = (centroids * centroids).sum(1)
    assign = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    dist = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[0], block_rows):
        part = x[start:start + block_rows]
        best, idx = (c_sq.unsqueeze(0) - 2.0 * part @ centroids.t()).min(1)
        assign[start:start + block_rows] = idx
        dist[start:start + block_rows] = (best + (part * part).sum(1)).clamp_min(0)
    return assign, dist


def lloyd(x, centroids, iters: int, block_rows: int, reseed=None, tol: float | None = None):
    """Lloyd steps on x (n, d) from `centroids` (C, d), which is not modified: (centroids (C, d), assign (n,),
    squared distance (n,)) after up to `iters` steps, the assignment being the last centroids'.

    reseed: None keeps an emptied cluster's centre; a torch.Generator moves it to a random row of x drawn from it.
    tol: stop once a step improves the mean squared distance by less than this share (and no cluster emptied);
    None runs every step (and never reads a value back from the device)."""
    import torch

    k = centroids.shape[0]
    assign, dist = nearest_centroids(x, centroids, block_rows)
    previous = math.inf
    for _ in range(iters):
        loss = float(dist.mean()) if tol is not None else 0.0
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k).to(x.dtype)
        empty = counts == 0
        centroids = torch.where(empty.unsqueeze(1), centroids, sums / counts.clamp_min(1).unsqueeze(1))
        emptied = reseed is not None and bool(empty.any())
        if emptied:
            centroids[empty] = x[torch.randint(x.shape[0], (int(empty.sum()),), generator=reseed)]
        assign, dist = nearest_centroids(x, centroids, block_rows)
        if tol is not None and previous - loss <= tol * max(previous, 1e-12) and not emptied:
            break
        previous = loss
    return centroids, assign, dist
