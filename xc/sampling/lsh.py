"""LSH tables over a shard's classifier rows, probed to sample negatives ("A Tale of Two Efficient and Informative Negative Sampling Distributions", LNS).

Hash families (K hash functions concatenated per table, L tables):
  simhash: sign of a Gaussian projection, 1 bit each; per-hash collision probability 1 - angle/pi;
  dwta:    winner-take-all over a random bin of `bin` coordinates, log2(bin) bits each (dense rows
           never have empty bins, so densification is not needed; rows and queries are dense here).
Each table is a CSR over bucket codes: rows sorted by code, in a random order inside each bucket.
A probe reads a random circular window of at most `window` ids from its bucket, so query cost is
O(L * (K d + window)) whatever the shard size (the released LNS code caps buckets at 128 ids for the
same reason). With window >= bucket size and the union not truncated, a label is returned with
probability 1 - (1 - alpha^K)^L (alpha = per-hash collision probability; Theorems 1-2) over the
random choice of hash functions, which the tests check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_CHUNK = 1 << 14


@dataclass
class HashFamily:
    """K * L hash functions. simhash: planes (d, K*L); dwta: coords (K*L, bin) coordinate indices."""

    kind: str
    bits: int  # K
    tables: int  # L
    planes: torch.Tensor | None = None
    coords: torch.Tensor | None = None

    @classmethod
    def draw(cls, kind: str, dim: int, bits: int, tables: int, gen: torch.Generator, bin_size: int = 8) -> "HashFamily":
        if kind == "simhash":
            if bits > 62:
                raise ValueError("simhash: at most 62 bits per table")
            return cls(kind, bits, tables, planes=torch.randn(dim, bits * tables, generator=gen))
        if bits * math.ceil(math.log2(bin_size)) > 62:
            raise ValueError(f"dwta: {bits} hashes of {bin_size} values do not fit a 62-bit code")
        # Per table, random permutations of the coordinates cut into K bins (as WTA does). Tables never
        # share a permutation, so they are independent and P(in the union) = 1 - (1 - beta)^L holds
        # with beta the per-table collision probability (the K hashes of one table are not independent).
        need = bits * bin_size
        per_table = []
        for _ in range(tables):
            perms = [torch.randperm(dim, generator=gen) for _ in range(math.ceil(need / dim))]
            per_table.append(torch.cat(perms)[:need].reshape(bits, bin_size))
        return cls(kind, bits, tables, coords=torch.cat(per_table))

    @property
    def base(self) -> int:
        return 2 if self.kind == "simhash" else self.coords.shape[1]

    def hashes(self, x: torch.Tensor) -> torch.Tensor:
        """Per-hash values (n, L, K) int64 in [0, base)."""
        x = x.detach().float().cpu()
        if self.kind == "simhash":
            values = (x @ self.planes < 0).long()
        else:
            values = x[:, self.coords].argmax(2)  # (n, K*L)
        return values.reshape(x.shape[0], self.tables, self.bits)

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """Bucket code of each row in each table (n, L) int64: the K values in base `base`."""
        out = torch.empty(x.shape[0], self.tables, dtype=torch.int64)
        weights = self.base ** torch.arange(self.bits, dtype=torch.int64)
        for start in range(0, x.shape[0], _CHUNK):
            out[start:start + _CHUNK] = (self.hashes(x[start:start + _CHUNK]) * weights).sum(2)
        return out

    def table_collision_probability(self, probe: torch.Tensor, rows: torch.Tensor | None,
                                    row_codes: torch.Tensor | None = None,
                                    probe_codes: torch.Tensor | None = None) -> torch.Tensor:
        """beta (B, c): probability that a probe (B, d) and a candidate row (B, c, d) share a bucket in
        one table, over the random choice of that table's hash functions.

        simhash: exactly (1 - angle / pi)^K (independent planes). dwta has no closed form: the share
        of the L tables whose bucket codes agree (stored codes (B, c, L) vs probe codes (B, L)), an
        unbiased estimate (the paper code's unused collision()).
        """
        if self.kind == "simhash":
            cos = torch.nn.functional.cosine_similarity(probe.unsqueeze(1).float(), rows.float(), dim=2)
            alpha = 1.0 - torch.arccos(cos.clamp(-1.0, 1.0)).double() / math.pi
            return alpha ** self.bits
        return (row_codes == probe_codes.unsqueeze(1)).double().mean(dim=2)


def inclusion_probability(beta: torch.Tensor, tables: int) -> torch.Tensor:
    """P(label in the union of the L probed buckets) = 1 - (1 - beta)^L (= 1 - (1 - alpha^K)^L)."""
    return 1.0 - (1.0 - beta.double()) ** tables


class LshTables:
    """L hash tables over n rows (offsets 0..n-1 of one shard)."""

    def __init__(self, family: HashFamily, rows: torch.Tensor, gen: torch.Generator):
        self.family = family
        self.codes = family.codes(rows)  # (n, L)
        n = rows.shape[0]
        self.num_rows = n
        shuffle = torch.randperm(n, generator=gen)  # random order inside buckets
        sorted_codes, order = torch.sort(self.codes[shuffle].t().contiguous(), dim=1, stable=True)
        self.sorted_codes = sorted_codes  # (L, n)
        self.order = shuffle[order]  # (L, n): row offsets sorted by bucket code

    def probe(self, probes: torch.Tensor, window: int, gen: torch.Generator) -> torch.Tensor:
        """Row offsets (B, L * window) found by probing every table with probes (B, d); -1 = empty."""
        codes = self.family.codes(probes)  # (B, L)
        batch, tables = codes.shape
        found = torch.full((batch, tables, window), -1, dtype=torch.int64)
        steps = torch.arange(window)
        for t in range(tables):
            query = codes[:, t].contiguous()
            lo = torch.searchsorted(self.sorted_codes[t], query, right=False)
            hi = torch.searchsorted(self.sorted_codes[t], query, right=True)
            size = hi - lo
            start = (torch.rand(batch, generator=gen, dtype=torch.float64) * size).long()
            pos = lo.unsqueeze(1) + (start.unsqueeze(1) + steps) % size.clamp_min(1).unsqueeze(1)
            ok = steps.unsqueeze(0) < size.unsqueeze(1)
            ids = self.order[t][pos.clamp_max(self.num_rows - 1)]
            found[:, t] = torch.where(ok, ids, -1)
        return found.reshape(batch, -1)


def unique_per_row(ids: torch.Tensor) -> torch.Tensor:
    """ids (B, c) with -1 holes -> same shape, each value kept once per row (repeats become -1)."""
    sorted_ids, _ = torch.sort(ids, dim=1)
    repeat = torch.zeros_like(sorted_ids, dtype=torch.bool)
    repeat[:, 1:] = sorted_ids[:, 1:] == sorted_ids[:, :-1]
    return torch.where(repeat, -1, sorted_ids)


def take_budget(ids: torch.Tensor, budget: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """At most `budget` valid ids per row, a uniform subset when there are more: (ids (B, budget)
    with -1 holes, count (B,) of valid ids kept)."""
    keys = torch.rand(ids.shape, generator=gen)
    keys = torch.where(ids >= 0, keys, 2.0)  # holes sort last
    order = torch.argsort(keys, dim=1)[:, :budget]
    kept = ids.gather(1, order)
    if kept.shape[1] < budget:
        kept = torch.cat([kept, torch.full((ids.shape[0], budget - kept.shape[1]), -1, dtype=ids.dtype)], 1)
    return kept, (kept >= 0).sum(1)
