"""MIDX: an inverted multi-index over a shard's classifier rows as an adaptive softmax proposal.

Two codebooks of K codewords quantise every row q_i to a cell (k1, k2) ("Adaptive Sampled Softmax with Inverted Multi-Index", Sec. 4):
  product quantisation (pq): q = [q^1 ; q^2], K-means on each half, reconstruction [c1_k1 ; c2_k2];
  residual quantisation (rq): K-means on q, then on q - c1_k1, reconstruction c1_k1 + c2_k2.
The fast sampler (Theorem 2) draws a cell with probability proportional to
|cell| * exp(z1.c1_k1 + z2.c2_k2) and then a label uniformly inside it, so
    Q(i | z) = exp(z . qhat_i) / sum_j exp(z . qhat_j),   qhat_i = the reconstruction of row i,
i.e. exactly the softmax over the reconstructed rows. Per query this costs O(K d + K^2 + M), never
O(n). We draw the cell from the joint K x K table in one multinomial; the paper's two stages
(k1, then k2 | k1) factor the same distribution. `exact_decomposition` is Theorem 1's three-stage
product, which equals the full softmax; it costs O(n d) and exists as a test oracle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from xc.ann.kmeans import lloyd, nearest_centroids

log = logging.getLogger(__name__)

_CHUNK = 1 << 15


def kmeans(x: torch.Tensor, k: int, iters: int, gen: torch.Generator,
           init: torch.Tensor | None = None, tol: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's K-means on x (n, d) float32: (centroids (k, d), assignment (n,)).

    Warm-started from `init` when given (the previous epoch's codebook); empty clusters are re-seeded
    with random points; stops early when the mean distortion improves by less than `tol` (relative)
    (xc/ann/kmeans.py `lloyd`).
    """
    if init is None or init.shape != (k, x.shape[1]):
        centroids = x[torch.randint(x.shape[0], (k,), generator=gen)]
    else:
        centroids = init
    centroids, assign, _ = lloyd(x, centroids, max(1, iters), _CHUNK, reseed=gen, tol=tol)
    return centroids, assign


@dataclass
class MidxIndex:
    """The multi-index of one shard's n rows.

    c1 (K, d1), c2 (K, d2) codebooks; a1, a2 (n,) codeword of each row; counts (K, K) cell sizes
    |Omega_{k1,k2}|; order (n,) row offsets sorted by cell; indptr (K*K + 1,) CSR offsets into order.
    """

    quantizer: str  # pq | rq
    c1: torch.Tensor
    c2: torch.Tensor
    a1: torch.Tensor
    a2: torch.Tensor
    counts: torch.Tensor
    order: torch.Tensor
    indptr: torch.Tensor

    @property
    def num_codewords(self) -> int:
        return self.c1.shape[0]

    def split(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sub-queries (z1, z2) for the two codebooks: halves (pq) or z twice (rq)."""
        if self.quantizer == "pq":
            half = self.c1.shape[1]
            return z[:, :half], z[:, half:]
        return z, z

    def reconstruct(self) -> torch.Tensor:
        """qhat (n, d): each row's cell reconstruction."""
        if self.quantizer == "pq":
            return torch.cat([self.c1[self.a1], self.c2[self.a2]], dim=1)
        return self.c1[self.a1] + self.c2[self.a2]

    def cell_logits(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For queries z (B, d): (r1 (B, K), r2 (B, K), joint (B, K*K)) with
        joint[k1*K + k2] = r1[k1] + r2[k2] + log|cell| (-inf for empty cells)."""
        z1, z2 = self.split(z.float())
        r1, r2 = z1 @ self.c1.t(), z2 @ self.c2.t()
        log_counts = torch.log(self.counts.float())  # -inf where a cell is empty
        joint = r1.unsqueeze(2) + r2.unsqueeze(1) + log_counts.unsqueeze(0)
        return r1, r2, joint.reshape(z.shape[0], -1)

    def log_prob(self, z: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """log Q(i | z) for row offsets (B, c) of this shard: z . qhat_i - log Z(z)."""
        r1, r2, joint = self.cell_logits(z)
        log_z = torch.logsumexp(joint, dim=1, keepdim=True)
        return r1.gather(1, self.a1[offsets]) + r2.gather(1, self.a2[offsets]) - log_z

    def sample(self, z: torch.Tensor, m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """m i.i.d. draws per query from Q(. | z): (row offsets (B, m), log Q (B, m))."""
        r1, r2, joint = self.cell_logits(z)
        log_z = torch.logsumexp(joint, dim=1, keepdim=True)
        probs = torch.exp(joint - log_z)
        cells = torch.multinomial(probs, m, replacement=True, generator=gen)  # (B, m)
        k = self.num_codewords
        k1, k2 = cells // k, cells % k
        start = self.indptr[cells]
        size = self.indptr[cells + 1] - start
        pick = (torch.rand(cells.shape, generator=gen, dtype=torch.float64) * size).long()
        offsets = self.order[start + torch.minimum(pick, size - 1)]
        log_q = r1.gather(1, k1) + r2.gather(1, k2) - log_z
        return offsets, log_q


def _with_cells(quantizer: str, c1: torch.Tensor, c2: torch.Tensor, a1: torch.Tensor, a2: torch.Tensor) -> MidxIndex:
    """The index for given codebooks and assignments: cell sizes and the CSR of rows by cell."""
    k = c1.shape[0]
    cell = a1 * k + a2
    counts = torch.bincount(cell, minlength=k * k)
    indptr = torch.zeros(k * k + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(counts, 0)
    return MidxIndex(quantizer, c1, c2, a1, a2, counts.reshape(k, k), torch.argsort(cell, stable=True), indptr)


def build_index(rows: torch.Tensor, num_codewords: int, quantizer: str, iters: int, gen: torch.Generator,
                previous: MidxIndex | None = None) -> MidxIndex:
    """Quantise rows (n, d) into a MidxIndex; `previous` warm-starts the K-means."""
    x = rows.detach().float().cpu()
    n, d = x.shape
    k = max(1, min(num_codewords, n))
    warm = previous if previous is not None and previous.num_codewords == k else None
    if quantizer == "pq":
        if d % 2:
            raise ValueError(f"MIDX-pq splits the embedding in two halves; d={d} is odd (use midx_rq)")
        first, second = x[:, :d // 2].contiguous(), x[:, d // 2:].contiguous()
        c1, a1 = kmeans(first, k, iters, gen, None if warm is None else warm.c1)
        c2, a2 = kmeans(second, k, iters, gen, None if warm is None else warm.c2)
    else:
        c1, a1 = kmeans(x, k, iters, gen, None if warm is None else warm.c1)
        c2, a2 = kmeans(x - c1[a1], k, iters, gen, None if warm is None else warm.c2)
    return _with_cells(quantizer, c1, c2, a1, a2)


def exact_decomposition(index: MidxIndex, rows: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Theorem 1: P(i|z) = P1(k1) * P2(k2|k1) * P3(i|k1,k2) for every row, (B, n); equals softmax(z rows^T).

    P3(i | cell) = exp(z . res_i) / omega_cell with res_i = q_i - qhat_i;
    P2(k2 | k1) = omega_{k1,k2} exp(z2 . c2_k2) / psi_k1;  P1(k1) = psi_k1 exp(z1 . c1_k1) / sum.
    """
    z = z.double()
    rows = rows.double()
    k = index.num_codewords
    residual_scores = z @ (rows - index.reconstruct().double()).t()  # (B, n)
    cell = index.a1 * k + index.a2
    omega = torch.zeros(z.shape[0], k * k, dtype=torch.float64).index_add_(1, cell, torch.exp(residual_scores))
    z1, z2 = index.split(z)
    r1, r2 = z1 @ index.c1.double().t(), z2 @ index.c2.double().t()
    omega = omega.reshape(-1, k, k)
    psi = (omega * torch.exp(r2).unsqueeze(1)).sum(2)  # (B, K)
    p1 = psi * torch.exp(r1)
    p1 = p1 / p1.sum(1, keepdim=True)
    p2 = omega * torch.exp(r2).unsqueeze(1) / psi.clamp_min(1e-300).unsqueeze(2)  # (B, K, K)
    p3 = torch.exp(residual_scores) / omega.reshape(-1, k * k)[:, cell]
    return p1[:, index.a1] * p2.reshape(-1, k * k)[:, cell] * p3


def learn_codewords(index: MidxIndex, rows: torch.Tensor, queries: torch.Tensor, steps: int, lr: float,
                    gen: torch.Generator, max_rows: int = 8192) -> MidxIndex:
    """Refine the codewords by gradient ("Adaptive Sampled Softmax with Inverted Multi-Index", Sec. 2.5), rows and queries detached.

    Loss = soft-assignment reconstruction error + Renyi-2 divergence D2(P || Q) between the softmax
    over rows P and the softmax over reconstructions Q, estimated on a row sample (the paper's O(n)
    sums do not scale) with the given queries (B, d). Hard assignments are recomputed afterwards.
    The paper leaves the weighting unstated; we weight both terms 1 (per-row and per-query means).
    """
    x = rows.detach().float().cpu()
    if x.shape[0] > max_rows:
        x = x[torch.randperm(x.shape[0], generator=gen)[:max_rows]]
    z = queries.detach().float().cpu()
    c1 = index.c1.clone().requires_grad_(True)
    c2 = index.c2.clone().requires_grad_(True)
    opt = torch.optim.Adam([c1, c2], lr=lr)
    half = c1.shape[1]

    def soft(part: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
        # softmax(-squared distance): it concentrates on the nearest codeword, the hard assignment
        # that sampling uses (the paper's softmax(q . c) can favour a different codeword).
        dist = (part * part).sum(1, keepdim=True) - 2 * part @ codebook.t() + (codebook * codebook).sum(1)
        return torch.softmax(-dist, 1) @ codebook

    for _ in range(steps):
        if index.quantizer == "pq":
            hat = torch.cat([soft(x[:, :half], c1), soft(x[:, half:], c2)], 1)
        else:
            first = soft(x, c1)
            hat = first + soft(x - first, c2)
        recon = ((hat - x) ** 2).sum(1).mean()
        log_p = torch.log_softmax(z @ x.t(), 1)
        log_q = torch.log_softmax(z @ hat.t(), 1)
        renyi2 = torch.logsumexp(2 * log_p - log_q, 1).mean()
        opt.zero_grad()
        (recon + renyi2).backward()
        opt.step()
    c1, c2 = c1.detach(), c2.detach()
    full = rows.detach().float().cpu()
    if index.quantizer == "pq":
        a1, _ = nearest_centroids(full[:, :half].contiguous(), c1, _CHUNK)
        a2, _ = nearest_centroids(full[:, half:].contiguous(), c2, _CHUNK)
    else:
        a1, _ = nearest_centroids(full, c1, _CHUNK)
        a2, _ = nearest_centroids(full - c1[a1], c2, _CHUNK)
    return _with_cells(index.quantizer, c1, c2, a1, a2)
