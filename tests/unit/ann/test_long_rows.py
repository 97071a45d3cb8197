"""xc/ann/long_rows.py: a ranking over long rows first gives the answer of a ranking over every row (ids, scores,
ties, exclusions, biases, masked rows), and reads the short rows only for the queries they could enter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xc.ann.long_rows as long_rows
import xc.ann.row_blocks as row_blocks
from xc.ann.long_rows import long_row_split
from xc.ann.row_blocks import topk_in_row_blocks

D, LONG, SHORT = 32, 300, 2700


def _rows(dtype=torch.float32, seed=0) -> torch.Tensor:
    """LONG rows of norm about 20 (the trained ones), then SHORT of norm about 0.5 (left at their start), shuffled."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(LONG + SHORT, D, generator=gen)
    rows = rows / rows.norm(dim=1, keepdim=True)
    rows[:LONG] *= 20 + torch.rand(LONG, 1, generator=gen)
    rows[LONG:] *= 0.2 + 0.3 * torch.rand(SHORT, 1, generator=gen)
    return rows[torch.randperm(LONG + SHORT, generator=gen)].to(dtype)


@pytest.fixture(autouse=True)
def small_rankings_split(monkeypatch):
    monkeypatch.setattr(long_rows, "MIN_ROWS", 1000)


def _exclusions(m: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return np.arange(0, 3 * m + 1, 3, dtype=np.int64), rng.integers(0, n, 3 * m).astype(np.int64)


def test_the_split_is_the_norm_gap_within_the_longest_quarter():
    rows = _rows()
    split = long_row_split(rows)
    norms = rows.norm(dim=1)
    assert torch.equal(split.ids, torch.nonzero(norms > 5).flatten())
    assert split.short_norm == pytest.approx(float(norms[norms < 5].max()))
    assert long_row_split(rows, min_rows=10 ** 6) is None  # too few rows to pay
    assert long_row_split(torch.randn(3000, D)) is None  # norms without a gap
    half = rows.clone()
    half[: len(rows) // 2] = half[: len(rows) // 2] / half[: len(rows) // 2].norm(dim=1, keepdim=True) * 20
    assert long_row_split(half) is None  # the long rows over a quarter: nothing to save


@pytest.mark.parametrize("dtype,first_pass", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("k", [5, 290])
def test_long_rows_first_give_the_canonical_answer_over_every_row(dtype, first_pass, k):
    rows = _rows(dtype)
    n = len(rows)
    queries = torch.randn(200, D, generator=torch.Generator().manual_seed(2))
    queries[:3] = 0.0  # empty queries: every score 0, ties to the lower id
    exclude = _exclusions(len(queries), n)
    gen = torch.Generator().manual_seed(3)
    biases = [None, torch.randn(n, generator=gen), torch.where(rows.float().norm(dim=1) > 5, float("-inf"), 0.0),
              torch.where(rows.float().norm(dim=1) > 5, 0.0, float("-inf"))]
    split = topk_in_row_blocks(queries, rows, k, biases, 1 << 14, first_pass, exclude)
    every = topk_in_row_blocks(queries, rows, k, biases, 1 << 14, first_pass, exclude, split_long=False)
    for (s, i), (s_all, i_all) in zip(split, every):
        assert torch.equal(i, i_all) and torch.equal(s, s_all)
    indptr, indices = exclude
    for q in range(len(queries)):
        assert not set(indices[indptr[q]:indptr[q + 1]].tolist()) & set(split[1][1][q].tolist())


def test_the_plain_float32_ranking_is_the_same_within_rounding():
    rows = _rows()
    queries = torch.randn(100, D, generator=torch.Generator().manual_seed(4))
    biases = [None, 0.1 * torch.randn(len(rows), generator=torch.Generator().manual_seed(5))]
    split = topk_in_row_blocks(queries, rows, 10, biases, 1 << 14, None)
    every = topk_in_row_blocks(queries, rows, 10, biases, 1 << 14, None, split_long=False)
    for (s, i), (s_all, i_all) in zip(split, every):
        assert torch.equal(i, i_all)
        torch.testing.assert_close(s, s_all, rtol=1e-5, atol=1e-5)


def test_the_short_rows_are_read_only_by_the_queries_they_could_enter(monkeypatch):
    calls = []
    real = row_blocks.topk_in_row_blocks

    def spy(queries, rows, *args, **kwargs):
        calls.append((len(queries), len(rows)))
        return real(queries, rows, *args, **kwargs)

    monkeypatch.setattr(row_blocks, "topk_in_row_blocks", spy)
    rows = _rows()
    queries = torch.randn(200, D, generator=torch.Generator().manual_seed(6))
    queries[0] = 0.0  # an empty query scores every row 0: a short row may be in its answer
    spy(queries, rows, 5, [None], 1 << 14, torch.float32)
    assert calls[1] == (200, LONG)  # every query over the long rows
    assert calls[2:] == [(1, LONG + SHORT)]  # then that one query over every row
