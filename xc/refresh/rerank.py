"""Re-ranking an asynchronous generation's candidates with the rows and encoder of the step that uses them.

An asynchronous miner searches the rows of a snapshot taken an epoch before its negatives are used (ASTRA
Sec. 3.2), and the rows move in that epoch: at 10^6 labels only 42% of a generation's top-16 was still in the
rows' top-16 when training switched to it. The snapshot's wider top-K still holds most of the current top-16
(69% for K = 64, 79% for K = 128: docs/miner_quality.md). So the miner returns K =
`miner.rerank_candidates` per query, and at the switch the trainer scores them with its current query
embeddings and rows and keeps the k_hard highest: fresh hard negatives for N x K dot products (seconds), where
mining the current rows again costs an index search of every query (minutes on CPUs, `miner=sync`).

The kept set is a function of the model at the switch only, so eq. 2 stays unbiased (H is any set fixed
before the uniform draw), and it is saved in checkpoints as any hard-negative table is: a resumed run does not
re-rank (its rows have moved) but restores the table it had.
"""

from __future__ import annotations

import numpy as np
import torch

# Bytes of the (block, K, d) candidate vectors gathered at once. On a CPU the buffer must stay in cache: at
# 10^6 labels (K = 128, d = 128, 2M queries, 2 cores) 16 MiB (256 queries) re-ranked in 25 s where 256 MiB
# (4096 queries) took 66 s, the gathered rows being written out to memory and read back for the product.
# A GPU wants large blocks (few launches) and has the memory for them.
CPU_BLOCK_BYTES = 16 << 20
GPU_BLOCK_BYTES = 256 << 20


def block_queries(width: int, dim: int, on_gpu: bool) -> int:
    """Queries per block: the (block, width, dim) float32 gather buffer within the device's block budget."""
    budget = GPU_BLOCK_BYTES if on_gpu else CPU_BLOCK_BYTES
    return max(1, budget // max(1, 4 * width * dim))


@torch.no_grad()
def rerank_candidates(candidates: np.ndarray, rows: torch.Tensor, lo: int, queries: torch.Tensor, k: int,
                      block: int = 0) -> tuple[np.ndarray, float]:
    """The k candidates per query that score highest under the current rows.

    candidates (N, K) int label ids of one shard (-1 = empty), as mined from a stale snapshot; rows (n, d)
    the shard's current classifier rows, label id lo + j at row j (any float dtype, on the device that
    computes); queries (N, d) the current query embeddings. Returns (kept (N, k) int32, ordered by score
    with -1 where a query has fewer than k candidates; the share of kept ids that were already in the miner's
    own first k columns, i.e. how much the re-ranking changed). block: queries per block (0: `block_queries`)."""
    num_queries, width = candidates.shape
    kept = np.full((num_queries, k), -1, dtype=np.int32)
    if width <= k:
        kept[:, :width] = candidates
        return kept, 1.0
    same = total = 0
    device = rows.device
    block = block or block_queries(width, rows.shape[1], device.type == "cuda")
    for start in range(0, num_queries, block):
        stop = min(num_queries, start + block)
        cand = torch.from_numpy(np.ascontiguousarray(candidates[start:stop], dtype=np.int64)).to(device)
        valid = cand >= 0
        local = torch.where(valid, cand - lo, torch.zeros_like(cand))
        vectors = rows[local].float()  # (b, K, d)
        scores = torch.bmm(vectors, queries[start:stop].to(device, torch.float32).unsqueeze(2)).squeeze(2)
        scores = scores.masked_fill(~valid, float("-inf"))
        top_scores, top = scores.topk(k, dim=1)
        ids = torch.where(torch.isfinite(top_scores), cand.gather(1, top), torch.full_like(top, -1))
        kept[start:stop] = ids.cpu().numpy()
        filled = ids >= 0
        same += _in_first(ids, cand, k, filled)
        total += int(filled.sum())
    return kept, (same / total if total else 1.0)


def _in_first(ids: torch.Tensor, cand: torch.Tensor, k: int, filled: torch.Tensor) -> int:
    """How many filled entries of ids (b, k) appear among the same row's first k candidates."""
    return int(((ids.unsqueeze(2) == cand[:, :k].unsqueeze(1)).any(2) & filled).sum())
