"""bfloat16 rows searched in float32 block by block: the rankings of a float32 search over their upcast."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xc.ann import bf16_rows
from xc.ann.base import AnnParams
from xc.ann.clustered import ClusteredIndex
from xc.ann.exact import exact_topk
from xc.ann.exact_backend import ExactIndex


def _data(n=3000, m=400, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = (torch.randn(n, d, generator=gen) * torch.rand(n, 1, generator=gen)).bfloat16()
    queries = torch.randn(m, d, generator=gen)
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, size=m)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    indices = rng.integers(0, n + 5, size=int(indptr[-1])).astype(np.int64)  # a few outside the shard
    return rows, queries, indptr, indices


def test_exact_topk_of_bf16_rows_is_the_float32_search_of_their_values(monkeypatch):
    monkeypatch.setattr(bf16_rows, "QUERY_CHUNK", 64)  # several query chunks and row blocks
    rows, queries, indptr, indices = _data()
    bias = torch.randn(rows.shape[0])
    got = exact_topk(queries, rows, 10, indptr, indices, block_floats=64 * 500, row_bias=bias)
    want = exact_topk(queries, rows.float(), 10, indptr, indices, row_bias=bias)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])


def test_every_row_excluded_reads_minus_one():
    rows = torch.ones(3, 2).bfloat16()
    scores, ids = exact_topk(torch.ones(1, 2), rows, 3, np.array([0, 2]), np.array([0, 2]))
    assert ids.tolist() == [[1, -1, -1]] and torch.isneginf(scores[0, 1:]).all()


@pytest.mark.parametrize("index_class, params", [(ExactIndex, AnnParams()),
                                                 (ClusteredIndex, AnnParams(cluster_size=64, cluster_candidates=512))])
def test_bf16_index_returns_the_top_k_of_its_float32_upcast(index_class, params, monkeypatch):
    monkeypatch.setattr(bf16_rows, "ROW_BLOCK", 700)
    rows, queries, indptr, indices = _data()
    low, full = index_class(params), index_class(params)
    low.build(rows)
    full.build(rows.float().numpy())
    assert low.memory_bytes == rows.numel() * 2 and low._rows.dtype == torch.bfloat16  # no float32 copy is kept
    q = queries.numpy()
    assert np.array_equal(low.search_excluding(q, 10, indptr, indices), full.search_excluding(q, 10, indptr, indices))


def test_bf16_rows_with_nan_are_refused():
    rows = torch.zeros(5, 3).bfloat16()
    rows[4, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        ExactIndex().build(rows)
