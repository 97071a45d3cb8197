"""Rankings that walk the rows in blocks (xc/ann/row_blocks.py): the one-block answer, bit for bit, for every
first pass, bias and exclusion, and for the queries no first pass can settle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xc.ann import row_blocks
from xc.ann.exact import exact_topk
from xc.ann.row_blocks import MIN_QUERY_CHUNK, row_blocks_pay, topk_in_row_blocks
from xc.ann.shortlist import best_k, canonical_all


def _data(seed: int, n: int = 4000, m: int = 300, d: int = 32):
    """Rows around a few directions with a few large-norm hubs, duplicates (exact ties), queries near the rows."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(10, d, generator=gen)
    rows = centres[torch.randint(0, 10, (n,), generator=gen)] + torch.randn(n, d, generator=gen)
    rows *= torch.rand(n, 1, generator=gen) ** 3
    rows[:20] *= 4
    rows[9::97] = rows[5]
    queries = centres[torch.randint(0, 10, (m,), generator=gen)] + 0.3 * torch.randn(m, d, generator=gen)
    return rows, queries


def _exclusions(m: int, n: int, seed: int):
    """CSR of 5 row ids a query, one of them outside [0, n) (ignored, as exact_topk ignores it)."""
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, n, (m, 5))
    indices[:, 4] = n + 3
    return np.arange(m + 1, dtype=np.int64) * 5, indices.reshape(-1)


def _canonical(queries, rows, k, bias, exclude):
    scores = canonical_all(queries, rows)
    if bias is not None:
        scores += bias
    indptr, indices = exclude
    for q in range(len(queries)):
        cols = indices[indptr[q]:indptr[q + 1]]
        scores[q, cols[cols < len(rows)]] = float("-inf")
    top, ids = best_k(scores, torch.arange(len(rows)).expand(len(queries), -1), k)
    return top, torch.where(torch.isneginf(top), -1, ids)


@pytest.mark.parametrize("first_pass", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [1, 5, 16])
def test_walking_the_rows_in_blocks_gives_the_canonical_top_k(first_pass, k):
    rows, queries = _data(k)
    exclude = _exclusions(len(queries), len(rows), k)
    bias = torch.randn(len(rows)) * 2
    ranked = topk_in_row_blocks(queries, rows, k, [None, bias], block_floats=64 * len(rows) // 4,
                                first_pass=first_pass, exclude=exclude)  # 16 row blocks a chunk
    for (top, ids), b in zip(ranked, [None, bias]):
        want = _canonical(queries, rows, k, b, exclude)
        assert torch.equal(top, want[0]) and torch.equal(ids, want[1])


def test_without_a_first_pass_the_plain_float32_top_k_is_kept():
    rows, queries = _data(7)
    bias = torch.randn(len(rows))
    (top, ids), = topk_in_row_blocks(queries, rows, 5, [bias], block_floats=20 * len(rows))
    plain = queries @ rows.t() + bias
    want = torch.topk(plain, 5, dim=1).values
    torch.testing.assert_close(top, want, rtol=0, atol=1e-5)
    assert torch.equal(torch.gather(plain, 1, ids), top)  # each score is its own row's


def test_exact_topk_walks_the_rows_where_a_block_would_hold_too_few_queries(monkeypatch):
    """exact_topk takes the row-block path exactly where `row_blocks_pay`, with the one-block answer."""
    rows, queries = _data(3, n=6000, m=400)
    calls = []
    real = row_blocks.topk_in_row_blocks
    monkeypatch.setattr("xc.ann.exact.topk_in_row_blocks", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    one_block = exact_topk(queries, rows, 5, bf16_first=True)
    assert not calls
    walked = exact_topk(queries, rows, 5, bf16_first=True, block_floats=8 * len(rows))
    assert calls and torch.equal(walked[0], one_block[0]) and torch.equal(walked[1], one_block[1])
    assert row_blocks_pay(400, 6000, 8 * 6000) and not row_blocks_pay(400, 6000, MIN_QUERY_CHUNK * 6000)
    assert not row_blocks_pay(2, 6000, 2 * 6000)  # no more queries than a block holds: one block


def test_queries_no_first_pass_can_settle_still_get_the_canonical_answer(monkeypatch):
    """Rows equal up to float32 rounding: neither pass settles a query; bfloat16 hands them to a float32 row-block
    pass, whose leftovers go to the one-block search (rows within reach, every row); the answer stays canonical."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(1, 32, generator=gen)
    rows = base + 1e-7 * torch.randn(3000, 32, generator=gen)
    queries = base + 0.01 * torch.randn(300, 32, generator=gen)
    finished = []
    real = row_blocks._finish
    monkeypatch.setattr(row_blocks, "_finish", lambda *a: finished.append((len(a[6]), a[8])) or real(*a))
    exclude = _exclusions(300, 3000, 1)
    (top, ids), = topk_in_row_blocks(queries, rows, 5, [None], block_floats=16 * 3000, first_pass=torch.bfloat16,
                                     exclude=exclude)
    want = _canonical(queries, rows, 5, None, exclude)
    assert torch.equal(top, want[0]) and torch.equal(ids, want[1])
    dtypes = [dtype for _, dtype in finished]
    assert torch.bfloat16 in dtypes and torch.float32 in dtypes  # both hand-overs happened
    assert sum(count for count, dtype in finished if dtype == torch.bfloat16) < 300  # later chunks start in float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_top_list_found_through_group_maxima_holds_the_top_values(dtype):
    """Values with many ties (bfloat16, rounded scores) and -inf: the same values as torch.topk, each at its position."""
    gen = torch.Generator().manual_seed(0)
    scores = (torch.randn(40, row_blocks.GROUP * 400, generator=gen) * 4).round().to(dtype)
    scores[:, ::7] = float("-inf")
    scores[3] = float("-inf")  # a query with no allowed row
    for width in (1, 5, 26):
        top, pos = row_blocks.block_topk(scores, width)
        assert torch.equal(top, torch.topk(scores, width, dim=1).values)
        assert torch.equal(torch.gather(scores, 1, pos), top)


@pytest.mark.parametrize("first_pass", [torch.bfloat16, None])
def test_blocks_long_enough_for_group_maxima_give_the_one_block_answer(first_pass):
    rows, queries = _data(11, n=70_000, m=300, d=8)
    block_floats = 256 * 32 * row_blocks.GROUP * 8  # blocks of 32,768 rows: 256 groups, past 8 x 128 x 26
    if first_pass is None:  # the plain float32 product: its top values, each its own row's score
        (top, ids), = topk_in_row_blocks(queries, rows, 5, [None], block_floats)
        plain = queries @ rows.t()
        assert torch.equal(torch.gather(plain, 1, ids), top)
        torch.testing.assert_close(top, torch.topk(plain, 5, dim=1).values, rtol=0, atol=1e-5)
        return
    exclude = _exclusions(len(queries), len(rows), 11)
    (top, ids), = topk_in_row_blocks(queries, rows, 5, [None], block_floats, first_pass, exclude)
    want = _canonical(queries, rows, 5, None, exclude)
    assert torch.equal(top, want[0]) and torch.equal(ids, want[1])


def _bf16_upcasts(monkeypatch) -> list[int]:
    """The element counts of every bfloat16 tensor converted to float32 (by .float() or .to) while patched."""
    seen = []
    real_to, real_float = torch.Tensor.to, torch.Tensor.float

    def to(t, *args, **kwargs):
        out = real_to(t, *args, **kwargs)
        if t.dtype == torch.bfloat16 and out.dtype == torch.float32:
            seen.append(t.numel())
        return out

    def float_(t, *args, **kwargs):
        if t.dtype == torch.bfloat16:
            seen.append(t.numel())
        return real_float(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "float", float_)
    return seen


@pytest.mark.parametrize("first_pass", [None, torch.bfloat16, torch.float32])
def test_bfloat16_rows_rank_as_their_float32_values_without_a_float32_copy(first_pass, monkeypatch):
    """bfloat16 rows (a 10^7-label model's) walked in blocks give the ranking their float32 values give, in every
    pass, the queries no pass settles included, and never as a float32 copy of every row: a float32 pass upcasts a
    block at a time (the whole copy, 10 GB for 10^7 rows of 256, stopped such a run at its first validation)."""
    rows, queries = _data(11, n=3000)
    rows[3000 // 2:] = rows[0] + 1e-3 * rows[3000 // 2:]  # near-ties that a bfloat16 pass cannot settle
    rows = rows.bfloat16()
    exclude, bias = _exclusions(len(queries), len(rows), 2), torch.randn(len(rows))
    want = topk_in_row_blocks(queries, rows.float(), 5, [None, bias], block_floats=16 * len(rows),
                              first_pass=first_pass, exclude=exclude)
    monkeypatch.setattr("xc.ann.bf16_rows.ROW_BLOCK", 500)  # the norms' blocks too (65,536 rows at scale)
    seen = _bf16_upcasts(monkeypatch)
    got = topk_in_row_blocks(queries, rows, 5, [None, bias], block_floats=16 * len(rows), first_pass=first_pass,
                             exclude=exclude)
    for (top, ids), (want_top, want_ids) in zip(got, want):
        assert torch.equal(top, want_top) and torch.equal(ids, want_ids)
    assert seen and max(seen) < rows.numel()  # blocks upcast, never every row at once


@pytest.mark.parametrize("first_pass", [torch.bfloat16, torch.float32])
def test_rows_masked_by_a_minus_infinite_bias_leave_the_first_pass_settling(first_pass, monkeypatch):
    """A bias of -inf masks rows out (the label prior ranks the rows without a training positive so): the masked rows
    never rank, and the rest settle in the first pass as they would unmasked, rather than every query going on to a
    deeper pass (an infinite bias in the rounding bound settled none)."""
    rows, queries = _data(3)
    bias = torch.where(torch.arange(len(rows)) % 3 == 0, float("-inf"), 0.0)
    finished = []
    real = row_blocks._finish
    monkeypatch.setattr(row_blocks, "_finish", lambda *a: finished.append(len(a[6])) or real(*a))
    (top, ids), = topk_in_row_blocks(queries, rows, 5, [bias], block_floats=64 * len(rows) // 4, first_pass=first_pass)
    want = _canonical(queries, rows, 5, bias, (np.zeros(len(queries) + 1, np.int64), np.zeros(0, np.int64)))
    assert torch.equal(top, want[0]) and torch.equal(ids, want[1])
    assert (ids % 3 != 0).all()
    assert sum(finished) < len(queries) // 10  # settled in the first pass
