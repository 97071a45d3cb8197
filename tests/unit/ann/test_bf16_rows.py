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


def test_where_a_shortlist_pays_bf16_rows_take_the_canonical_top_k_whichever_the_first_pass(monkeypatch):
    """A 10^7-label model's bfloat16 rows: where a shortlist pays, exact_topk multiplies them as stored in a bfloat16
    first pass (no upcast) or upcasts a block at a time in a float32 one, and either way returns the canonical top-k
    of their values (xc/ann/shortlist.py), bit for bit; the block-upcast float32 ranking is not used."""
    from xc.ann import exact
    from xc.ann.shortlist import shortlist_pays
    from tests.unit.ann.test_exact import _canonical_reference

    gen = torch.Generator().manual_seed(3)
    rows, queries = torch.randn(3500, 2048, generator=gen).bfloat16(), torch.randn(40, 2048, generator=gen)
    bias = torch.randn(3500, generator=gen)
    assert shortlist_pays(5, len(rows), 2048)
    want = _canonical_reference(queries, rows.float(), 5, bias)
    monkeypatch.setattr(exact, "topk_over_row_blocks", lambda *a, **k: pytest.fail("upcast ranking used"))
    for pinned in ("on", "off"):
        monkeypatch.setenv("XC_BF16_PRODUCTS", pinned)
        exact.bf16_products_pay.cache_clear()
        top, ids = exact_topk(queries, rows, 5, row_bias=bias)
        assert torch.equal(top, want[0]) and torch.equal(ids, want[1])
    exact.bf16_products_pay.cache_clear()
