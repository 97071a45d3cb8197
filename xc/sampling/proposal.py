"""The popularity proposal q(l) ∝ (train frequency of l + 1) ** alpha over each label shard.

It serves the popularity sampler (i.i.d. negatives from q) and the random part of ASTRA's mixture under
`sampler.random_proposal=popularity`. ASTRA's eq. 2 weights the random draws by (n - |H|) / k, the inverse of
k uniform draws' expected count; drawn from any q that gives every label outside H a positive probability, the
weight 1 / (k q(l)) keeps the negative sum unbiased in the same way, and the +1 keeps every q(l) > 0.

Why a second proposal: with few training points a label, most of a query's negative mass sits on the popular
labels; at 10^6 labels a step's uniform draws almost never hold one, and the first hard negatives arrive one
epoch late (docs/negatives_that_pay.md).
"""

from __future__ import annotations

import numpy as np
import torch

from xc.shards import ShardLayout


class PopularityProposal:
    """q over each shard's real labels, with an inverse-CDF draw in O(log n) per draw.

    label_counts (L,) training frequency per label. Tables are built once per shard (and copied once per
    device) on first use.
    """

    def __init__(self, layout: ShardLayout, label_counts: np.ndarray, alpha: float):
        self.layout = layout
        self.label_counts = label_counts
        self.alpha = alpha
        self._tables: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def table(self, shard: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(prob, cdf), each (n_real,) float64 on `device`: q of each of the shard's labels, and its running sum."""
        key = (shard, str(device))
        if key not in self._tables:
            host = self._tables.get((shard, "cpu"))
            if host is None:
                lo, _ = self.layout.shard_range(shard)
                counts = np.asarray(self.label_counts[lo:lo + self.layout.real_count(shard)], dtype=np.float64)
                mass = torch.from_numpy(counts + 1.0) ** self.alpha
                prob = mass / mass.sum()
                host = (prob, torch.cumsum(prob, 0))
                self._tables[(shard, "cpu")] = host
            self._tables[key] = (host[0].to(device), host[1].to(device))
        return self._tables[key]

    def prepare(self, shards, device: torch.device | str = "cpu") -> None:
        """Build the tables of `shards` (on the host and on `device`) now: an O(n) pass each, kept out of the steps."""
        for shard in shards:
            self.table(shard, device)

    def prob(self, shard: int) -> torch.Tensor:
        """(n_real,) float64 q of the shard's labels, on the host."""
        return self.table(shard)[0]

    def draw(self, shard: int, shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Offsets (shape) int64 in [0, n_real) drawn i.i.d. from q, and q of each (shape) float64, on gen's device."""
        prob, cdf = self.table(shard, gen.device)
        u = torch.rand(shape, generator=gen, dtype=torch.float64, device=gen.device) * cdf[-1]
        offsets = torch.searchsorted(cdf, u, right=True).clamp_max(prob.numel() - 1)
        return offsets, prob.index_select(0, offsets.reshape(-1)).reshape(offsets.shape)


def inclusion_from_proposal(hard: torch.Tensor, prob: torch.Tensor, lo: int, k: int) -> torch.Tensor:
    """(B, n) probability that each label is among `hard` (B, h) global ids (-1 = empty) plus k i.i.d. draws
    from `prob` (n,) over the whole shard: 1 for the hard ids, 1 - (1 - q(l))^k for the others."""
    batch = hard.shape[0]
    out = (1.0 - (1.0 - prob.double()) ** k).unsqueeze(0).expand(batch, -1).clone()
    valid = hard >= 0
    rows = torch.arange(batch).unsqueeze(1).expand_as(hard)
    out[rows[valid], hard[valid] - lo] = 1.0
    return out
