"""Which training queries a generation mines: a slice sized so the miner's search fits in about an epoch.

Mining every training query against every label shard takes the pool longer than an epoch trains once the
labels and points are many: on an H100 host at 10^7 labels and 1M points an epoch trained in 44 s and the CPU
pool mined a generation in 216 s (docs/gpu_path.md, "Figures on an H100"). So a generation may mine a slice: a window
of `count` consecutive training rows (modulo N) starting where the previous generation's window ended, so that
the windows rotate over every row. Queries outside the window keep their previous negatives until their turn
(the trainer merges, `xc/refresh/negatives.py`).

The count (`slice_count`): `miner.refresh_share` x N where it is set; else the rule: every row, until the miner
has been measured; then as many rows as the miner's measured per-query search time fits, beside its index
builds, into `EPOCH_SHARE` of the last epoch's wall time; never fewer than N / `miner.max_rotation`, so every query
is refreshed within max_rotation generations. The rule reads the clock, so under `miner.late_policy=wait`, whose
promise is figures that do not depend on the miner's speed or the machine's load, it is not applied: every row,
unless refresh_share fixes the share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EPOCH_SHARE = 0.8  # of an epoch's wall time the miner's generation may take: the rest is slack for the hand-off


@dataclass(frozen=True)
class MinerRate:
    """One published generation's measured work, per worker: the seconds its shards' index builds and searches
    took (summed over shards, divided by the workers that ran them side by side), and the queries it searched.
    The miner's fixed costs (process start, file reads) are left to the epoch's slack: at a small L they are most
    of a generation and scale with nothing."""

    search_seconds: float
    build_seconds: float
    queries: int

    @staticmethod
    def of(stats: list[dict], queries: int, workers: int) -> "MinerRate":
        parallel = max(1, min(workers, len(stats)))
        total = lambda key: sum(float(st.get(key) or 0.0) for st in stats) / parallel  # noqa: E731
        return MinerRate(total("search_seconds"), total("build_seconds"), queries)


def slice_count(num_rows: int, share: float | None, max_rotation: int, epoch_seconds: float | None,
                rate: MinerRate | None, timed: bool = True) -> int:
    """Training rows the next generation mines (1 <= count <= num_rows); see the module docstring. `timed`: the
    rule may size the slice from measured seconds (False under late_policy=wait: every row without a share)."""
    floor = max(1, math.ceil(num_rows / max(1, max_rotation)))
    if share is not None:
        return min(num_rows, max(1, math.ceil(share * num_rows)))
    if not timed or epoch_seconds is None or rate is None or rate.queries <= 0:
        return num_rows
    per_query = max(rate.search_seconds, 1e-9) / rate.queries
    fits = (EPOCH_SHARE * epoch_seconds - rate.build_seconds) / per_query
    return int(min(num_rows, max(floor, math.floor(fits))))


def next_window(previous: dict | None, count: int, num_rows: int) -> dict | None:
    """The window {"start", "count", "num_rows"} after `previous` (None: from row 0); None where the count is
    every row (the generation mines all of them, in order, as without slicing)."""
    start = 0
    if previous is not None and int(previous["num_rows"]) == num_rows:
        start = (int(previous["start"]) + int(previous["count"])) % num_rows
    if count >= num_rows:
        return None
    return {"start": start, "count": count, "num_rows": num_rows}
