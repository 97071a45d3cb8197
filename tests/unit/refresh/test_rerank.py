"""Re-ranking an asynchronous generation's candidates with the current rows (xc/refresh/rerank.py)."""

import numpy as np
import pytest
import torch

from xc.defaults import RERANK_FACTOR, auto_rerank_candidates
from xc.refresh.rerank import CPU_BLOCK_BYTES, block_queries, rerank_candidates


def _brute(candidates, rows, lo, queries, k):
    out = np.full((len(candidates), k), -1, dtype=np.int64)
    for q, cand in enumerate(candidates):
        ids = [int(c) for c in cand if c >= 0]
        ids.sort(key=lambda c: -float(rows[c - lo] @ queries[q]))
        out[q, :min(k, len(ids))] = ids[:k]
    return out


@pytest.mark.parametrize("block", [3, 4096, 0])  # 0: the device rule
def test_keeps_the_k_candidates_scoring_highest_under_the_current_rows(block):
    gen = torch.Generator().manual_seed(0)
    lo, n, d, num_queries, width, k = 100, 50, 8, 11, 12, 4
    rows, queries = torch.randn(n, d, generator=gen), torch.randn(num_queries, d, generator=gen)
    rng = np.random.default_rng(0)
    candidates = np.stack([rng.choice(n, width, replace=False) + lo for _ in range(num_queries)]).astype(np.int32)
    candidates[2, 3:] = -1   # 3 candidates only: the last kept slot stays empty
    candidates[5, :] = -1    # none at all
    candidates[7, ::2] = -1  # holes anywhere in the row
    kept, _ = rerank_candidates(candidates, rows, lo, queries, k, block=block)
    assert kept.dtype == np.int32 and kept.shape == (num_queries, k)
    np.testing.assert_array_equal(kept, _brute(candidates, rows.numpy(), lo, queries.numpy(), k))
    assert (kept[2] == [*kept[2, :3], -1]).all() and (kept[5] == -1).all()


def test_cpu_blocks_hold_a_cache_sized_gather_buffer():
    """(block, K, d) float32 gathered at once: 16 MiB on a CPU (256 queries at K = d = 128, the 10^6 run),
    larger on a GPU, and at least one query however wide the candidates."""
    assert block_queries(128, 128, on_gpu=False) == 256
    assert block_queries(128, 128, on_gpu=False) * 128 * 128 * 4 == CPU_BLOCK_BYTES
    assert block_queries(128, 128, on_gpu=True) == 4096
    assert block_queries(1 << 20, 1024, on_gpu=False) == 1


def test_unchanged_share_counts_kept_ids_from_the_miners_own_top_k():
    """Candidates mined from these very rows (sorted by score) keep their first k: share 1; reversed, the
    kept are the last k columns: share 0."""
    gen = torch.Generator().manual_seed(1)
    rows, queries = torch.randn(40, 6, generator=gen), torch.randn(5, 6, generator=gen)
    order = torch.argsort(queries @ rows.T, dim=1, descending=True)[:, :16].numpy().astype(np.int32)
    kept, share = rerank_candidates(order, rows, 0, queries, 4)
    np.testing.assert_array_equal(kept, order[:, :4])
    assert share == 1.0
    kept, share = rerank_candidates(order[:, ::-1], rows, 0, queries, 4)
    np.testing.assert_array_equal(kept, order[:, :4])
    assert share == 0.0


def test_no_wider_than_k_is_kept_as_mined():
    table = np.array([[3, -1], [1, 2]], dtype=np.int32)
    kept, share = rerank_candidates(table, torch.zeros(4, 2), 0, torch.zeros(2, 2), 2)
    np.testing.assert_array_equal(kept, table)
    assert share == 1.0


def test_rule_reranks_only_for_an_asynchronous_miner_on_classifier_rows():
    assert auto_rerank_candidates("pool", "classifier", 16) == RERANK_FACTOR * 16
    assert auto_rerank_candidates("external", "classifier", 16) == RERANK_FACTOR * 16
    assert auto_rerank_candidates("sync", "classifier", 16) == 16
    assert auto_rerank_candidates("pool", "label_text", 16) == 16
