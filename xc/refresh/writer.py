"""A refresh snapshot's files, written on a background thread while training goes on.

At the epoch boundary the caller hands over a HOST COPY of this rank's classifier rows, (n_s, d)
float32 per label shard (or a bfloat16 tensor where the rows are trained in bfloat16: half the copy), so
that training may keep updating the live rows; the thread writes the copies (bfloat16 ones as their bit
patterns, streamed `WRITE_BLOCK_ROWS` rows at a time: the file's bytes are never a second copy in memory),
and on rank 0 the query embeddings Q (N, d) float32, into the generation's private Stage
(`Stage.write_array`: hashed as written, flushed, fsynced). The bytes are those the synchronous path writes.

The thread touches files only: every torch.distributed collective (gathering the manifest entries,
the barrier) stays with the caller on the main thread, so every rank issues collectives in the same
order. A failure on the thread (a full disk, say) is kept and re-raised by `join`; the caller then
abandons the stage, so nothing half-written is ever published.
"""

from __future__ import annotations

import errno
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xc.ann.bf16_rows import bits_of, is_bf16
from xc.faults import NO_FAULTS, Faults
from xc.handoff import BF16, Stage, storage_failed

WRITE_BLOCK_ROWS = 1 << 20  # bfloat16 rows written at a time: 128 MiB of bit patterns at d 64


@dataclass
class ShardRows:
    """One label shard's rows to write: global id of its first row, real row count, rows (n, d) float32 (numpy)
    or bfloat16 (a CPU torch tensor)."""

    shard: int
    lo: int
    num_real: int
    rows: np.ndarray | torch.Tensor

    def copy(self) -> "ShardRows":
        rows = self.rows.clone() if isinstance(self.rows, torch.Tensor) else np.array(self.rows, copy=True)
        return ShardRows(self.shard, self.lo, self.num_real, rows)


class SnapshotWrite:
    """Writes `shards` (and `queries` (N, d) float32 when given) into `stage`; `background` on a thread.
    `faults` (xc/faults.py, for tests): snapshot_enospc fails every write like a full disk."""

    def __init__(self, stage: Stage, shards: list[ShardRows], queries: np.ndarray | None, background: bool,
                 faults: Faults = NO_FAULTS):
        self.stage, self.shards, self.queries, self.faults = stage, shards, queries, faults
        self.entries: list[dict[str, Any]] = []
        self.q_entry: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.write_seconds = 0.0
        self.bytes = 0
        self._thread = None
        if background:
            # The rows as of now: on CPU `rows` is a view of the live classifier weights, which training
            # goes on updating while the thread writes (costs 4*d*n_s bytes of host RAM until written, 2*d*n_s for
            # bfloat16 rows).
            self.shards = [p.copy() for p in shards]
            # A daemon: a trainer that crashes meanwhile does not wait for it; the unpublished stage
            # directory is all it leaves (the startup sweep removes it).
            self._thread = threading.Thread(target=self._run, name="xc-snapshot-writer", daemon=True)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            for part in self.shards:
                name = f"W.shard{part.shard}.npy"
                if self.faults.snapshot_enospc:
                    self._fail_like_full_disk(name, part.rows)
                entry = write_rows(self.stage, name, part.rows)
                self.entries.append(dict(entry, shard=part.shard, lo=part.lo, num_real=part.num_real))
                self.bytes += entry["bytes"]
            if self.queries is not None:
                self.q_entry = self.stage.write_array("Q.npy", self.queries)
                self.bytes += self.q_entry["bytes"]
        except BaseException as exc:  # noqa: BLE001 - kept for the main thread, which re-raises it
            # a storage failure (disk full, read-only, permission, quota) becomes one line naming the file and the fix
            self.error = storage_failed(exc, getattr(exc, "filename", None) or self.stage.path)
        finally:
            self.write_seconds = time.perf_counter() - start
            self.shards = []  # drop the host copies as soon as they are on disk
            self.queries = None

    def _fail_like_full_disk(self, name: str, rows: np.ndarray) -> None:
        """The snapshot_enospc fault: half a file on disk, then ENOSPC, as a disk filling up mid-write does."""
        path = self.stage.path / name
        with open(path, "wb") as handle:
            data = (bits_of(rows) if is_bf16(rows) else np.ascontiguousarray(rows)).tobytes()
            handle.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))

    @property
    def background(self) -> bool:
        return self._thread is not None

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def join(self) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """Wait for the writer; its manifest entries (shards, then Q or None), or its exception re-raised."""
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        return self.entries, self.q_entry


def write_rows(stage: Stage, name: str, rows) -> dict[str, Any]:
    """The manifest entry of `rows` written as `name`: float32 through `Stage.write_array` (the format every run
    has), bfloat16 (a torch tensor (n, d)) as uint16 bit patterns streamed `WRITE_BLOCK_ROWS` rows at a time."""
    if not is_bf16(rows):
        return stage.write_array(name, rows)
    blocks = (bits_of(rows[a:a + WRITE_BLOCK_ROWS]) for a in range(0, rows.shape[0], WRITE_BLOCK_ROWS))
    return stage.write_blocks(name, tuple(rows.shape), BF16, blocks)
