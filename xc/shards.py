"""Label-shard layout: which contiguous label range each shard and each rank owns.

The label space [0, L) is split into `num_shards` equal blocks of `shard_size` rows (L padded up, so
rows >= L are padding that is never sampled, scored or predicted). Rank r of G owns the
`num_shards / G` consecutive blocks starting at r * num_shards / G, i.e. one contiguous row range
[lo_r, hi_r). Sampling is stratified per *shard*, not per rank, so a run on 1 process with
num_shards=2 draws exactly what 2 processes with num_shards=2 draw: that is what makes sharded
training testably equal to single-process training. Pure Python (no torch), so the miner can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from xc.errors import ConfigError


@dataclass(frozen=True)
class ShardLayout:
    num_labels: int  # L, real labels
    num_shards: int  # S, label blocks (a multiple of the world size)
    shard_size: int  # rows per block, padded (S * shard_size >= L)

    @classmethod
    def build(cls, num_labels: int, num_shards: int, multiple: int = 16) -> "ShardLayout":
        if num_labels < 1:
            raise ConfigError("data", f"dataset has no labels (num_labels={num_labels})")
        if num_shards < 1:
            raise ConfigError("parallel.num_label_shards", f"must be >= 1, got {num_shards}")
        per_shard = -(-num_labels // num_shards)
        shard_size = -(-per_shard // multiple) * multiple
        layout = cls(num_labels, num_shards, shard_size)
        if layout.real_count(num_shards - 1) <= 0:
            raise ConfigError(
                "parallel.num_label_shards",
                f"{num_shards} shards of {shard_size} rows leave the last shard without real labels "
                f"(L={num_labels}); use fewer shards or a smaller parallel.shard_multiple",
            )
        return layout

    @property
    def padded_labels(self) -> int:
        return self.num_shards * self.shard_size

    def shard_range(self, shard: int) -> tuple[int, int]:
        """[lo, hi) of shard `shard` in global label ids, padding included."""
        lo = shard * self.shard_size
        return lo, lo + self.shard_size

    def real_count(self, shard: int) -> int:
        """Rows of `shard` that are real labels (< L)."""
        lo, hi = self.shard_range(shard)
        return max(0, min(hi, self.num_labels) - lo)

    def shards_of_rank(self, rank: int, world_size: int) -> range:
        if self.num_shards % world_size:
            raise ConfigError(
                "parallel.num_label_shards",
                f"{self.num_shards} label shards cannot be split evenly over {world_size} ranks",
            )
        per_rank = self.num_shards // world_size
        return range(rank * per_rank, (rank + 1) * per_rank)

    def rank_range(self, rank: int, world_size: int) -> tuple[int, int]:
        """[lo, hi) of the rows rank `rank` holds, padding included."""
        shards = self.shards_of_rank(rank, world_size)
        return shards.start * self.shard_size, shards.stop * self.shard_size

    def split_count(self, total: int, key: str) -> int:
        """Per-shard share of a per-query count (k_hard, k_random): `total` must divide evenly."""
        if total % self.num_shards:
            raise ConfigError(
                key, f"{total} per query does not split evenly over {self.num_shards} label shards"
            )
        return total // self.num_shards
