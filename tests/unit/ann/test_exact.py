"""Exact top-k through a shortlist (xc/ann/exact.py, xc/ann/shortlist.py): the canonical answer whichever first
pass ran, the passes' error bounds, the fallbacks, and a speed probe that decides nothing of the answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xc.ann import exact, shortlist
from xc.ann.exact import exact_topk
from xc.ann.shortlist import best_k, bf16_error, canonical_all, f32_error, refine_topk


def _rows_and_queries(seed: int, n: int = 3000, m: int = 400, d: int = 64):
    """Rows of unequal norms around a few directions, queries near some of them: top-k lists with close scores."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(12, d, generator=gen)
    rows = centres[torch.randint(0, 12, (n,), generator=gen)] + torch.randn(n, d, generator=gen)
    rows *= torch.rand(n, 1, generator=gen) * 3 + 0.2
    queries = centres[torch.randint(0, 12, (m,), generator=gen)] + 0.3 * torch.randn(m, d, generator=gen)
    return rows, queries


def test_the_bound_holds_for_bfloat16_products_of_any_rows():
    """|bf16 product - float32 product| <= bf16_error(d) |q| |w|, for rows of every scale and sign."""
    gen = torch.Generator().manual_seed(0)
    for d in (7, 64, 1024):
        q = torch.randn(300, d, generator=gen) * torch.logspace(-3, 3, 300)[:, None]
        w = torch.randn(500, d, generator=gen) * torch.logspace(3, -3, 500)[:, None]
        approx = (q.bfloat16() @ w.bfloat16().t()).float()
        exact_scores = (q.double() @ w.double().t()).float()
        worst = ((approx - exact_scores).abs() / (q.norm(dim=1)[:, None] * w.norm(dim=1)[None])).max().item()
        assert 0 < worst <= bf16_error(d)


def test_the_float32_bound_holds_against_the_canonical_score():
    """|float32 product - canonical score| <= f32_error(d) |q| |w| (the float32 first pass's slack)."""
    gen = torch.Generator().manual_seed(1)
    for d in (7, 64, 1024):
        q = torch.randn(300, d, generator=gen) * torch.logspace(-3, 3, 300)[:, None]
        w = torch.randn(500, d, generator=gen) * torch.logspace(3, -3, 500)[:, None]
        worst = ((q @ w.t() - canonical_all(q, w)).abs() / (q.norm(dim=1)[:, None] * w.norm(dim=1)[None])).max()
        assert 0 < worst.item() <= f32_error(d)


def _canonical_reference(queries, rows, k, row_bias=None, excluded=()):
    """The definition of xc/ann/shortlist.py, computed over every row: canonical scores (+ bias), excluded pairs
    at -inf, the k best with ties to the lower id."""
    scores = canonical_all(queries, rows)
    if row_bias is not None:
        scores += row_bias
    for q, j in excluded:
        scores[q, j] = float("-inf")
    top, ids = best_k(scores, torch.arange(len(rows)).expand(len(queries), -1), k)
    return top, torch.where(torch.isneginf(top), -1, ids)


@pytest.mark.parametrize("k", [1, 5, 20])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("exclusions", [False, True])
def test_both_first_passes_return_the_canonical_top_k_bit_for_bit(k, bias, exclusions):
    rows, queries = _rows_and_queries(k)
    rows[7::50] = rows[3]  # duplicated rows: exact ties, settled by the lower id
    rng = np.random.default_rng(k)
    row_bias = torch.randn(len(rows)) * 5 if bias else None
    indptr = indices = None
    pairs = ()
    if exclusions:  # each query's 3 best rows and some others excluded: its answer must go past them
        best = torch.topk(queries @ rows.t(), 3, dim=1).indices.numpy()
        others = rng.integers(0, len(rows), (len(queries), 4))
        indices = np.concatenate([best, others], axis=1).reshape(-1)
        indptr = np.arange(len(queries) + 1, dtype=np.int64) * 7
        pairs = [(q, int(j)) for q in range(len(queries)) for j in indices[7 * q:7 * q + 7]]
    by_float32 = exact_topk(queries, rows, k, indptr, indices, row_bias=row_bias, bf16_first=False)
    by_bf16 = exact_topk(queries, rows, k, indptr, indices, row_bias=row_bias, bf16_first=True,
                         block_floats=50 * len(rows))  # several blocks
    want = _canonical_reference(queries, rows, k, row_bias, pairs)
    for got in (by_float32, by_bf16):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_speed_probe_never_changes_a_ranking(monkeypatch):
    """Where a shortlist pays (3,500 rows of 2,048), the rule's ranking is the same whichever answer the speed probe
    gives, and XC_BF16_PRODUCTS pins that answer."""
    gen = torch.Generator().manual_seed(4)
    rows, queries = torch.randn(3500, 2048, generator=gen), torch.randn(40, 2048, generator=gen)
    row_bias = torch.randn(3500, generator=gen)
    assert shortlist.shortlist_pays(5, len(rows), 2048)
    answers = []
    for pinned in ("on", "off"):
        monkeypatch.setenv("XC_BF16_PRODUCTS", pinned)
        exact.bf16_products_pay.cache_clear()
        assert exact.bf16_products_pay("cpu") is (pinned == "on")
        answers.append(exact_topk(queries, rows, 5, row_bias=row_bias))
    exact.bf16_products_pay.cache_clear()
    assert torch.equal(answers[0][0], answers[1][0]) and torch.equal(answers[0][1], answers[1][1])
    monkeypatch.setenv("XC_BF16_PRODUCTS", "sometimes")
    with pytest.raises(ValueError, match="XC_BF16_PRODUCTS='sometimes': expected on, off or auto"):
        exact.bf16_products_pay("cpu")
    exact.bf16_products_pay.cache_clear()


def test_a_query_with_fewer_allowed_rows_than_k_gets_minus_one_pads():
    rows, queries = _rows_and_queries(3, n=200, m=4)
    indptr = np.array([0, 197, 197, 197, 197])
    indices = np.arange(197)  # query 0 may return 3 rows
    scores, ids = exact_topk(queries, rows, 5, indptr, indices, bf16_first=True)
    want_scores, want_ids = exact_topk(queries, rows, 5, indptr, indices, bf16_first=False)
    np.testing.assert_array_equal(ids.numpy(), want_ids.numpy())
    assert (ids[0, 3:] == -1).all() and torch.isneginf(scores[0, 3:]).all()


def test_queries_the_shortlist_cannot_settle_are_widened_then_scored_in_full(monkeypatch):
    """Rows of equal scores up to float32's rounding: no shortlist can prove its k-th, and every row is within reach
    of it, so every query goes to the full canonical scores, and the answer is still the canonical one."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(1, 32, generator=gen)
    rows = base + 1e-7 * torch.randn(2000, 32, generator=gen)  # every score within rounding of the others
    queries = base + 0.01 * torch.randn(10, 32, generator=gen)
    widths = _count_tiers(monkeypatch)
    ids = exact_topk(queries, rows, 5, bf16_first=False)[1]
    assert widths == [26, 208, ("full", 10)]  # 2 k + 16, then 8x, then every row (all 2,000 within reach)
    monkeypatch.undo()
    every = torch.arange(len(rows)).expand(len(queries), -1)
    np.testing.assert_array_equal(ids.numpy(), best_k(canonical_all(queries, rows), every, 5)[1].numpy())


def _count_tiers(monkeypatch) -> list:
    """The widths refine_topk re-scores, in order, ("full", queries) where it scores every row and ("float32",
    queries) where a bfloat16 pass hands queries on."""
    widths = []
    real = shortlist.refine_topk

    def counting(approx, k, slack, rescore, full, finish=None):
        def rescored(which, ids):
            widths.append(ids.shape[1])
            return rescore(which, ids)

        def fully(which):
            widths.append(("full", len(which)))
            return full(which)

        def handed_on(which):
            widths.append(("float32", len(which)))
            return finish(which)

        return real(approx, k, slack, rescored, fully, handed_on if finish is not None else None)

    monkeypatch.setattr(shortlist, "refine_topk", counting)
    return widths


@pytest.mark.parametrize("biased", [False, True])
def test_unsettled_queries_are_scored_on_the_rows_within_reach_not_every_row(monkeypatch, biased):
    """600 rows tied up to float32's rounding beside 19,400 that score far below: no shortlist of 208 settles a
    query, but only the tied rows can reach the k-th, so they alone are re-scored. The answer is the canonical
    one, with the label prior's bias too."""
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(1, 32, generator=gen)
    tied = base + 1e-7 * torch.randn(600, 32, generator=gen)
    rest = 0.05 * torch.randn(19_400, 32, generator=gen)
    rows = torch.cat([rest[:9000], tied, rest[9000:]])
    queries = base + 0.01 * torch.randn(10, 32, generator=gen)
    bias = 1e-7 * torch.randn(len(rows), generator=gen) if biased else None
    widths = _count_tiers(monkeypatch)
    scores, ids = exact_topk(queries, rows, 5, bf16_first=False, row_bias=bias)
    assert widths[:2] == [26, 208] and 600 <= widths[2] < 700 and len(widths) == 3, widths
    monkeypatch.undo()
    canonical = canonical_all(queries, rows) + (0 if bias is None else bias)
    full_scores, full_ids = best_k(canonical, torch.arange(len(rows)).expand(len(queries), -1), 5)
    np.testing.assert_array_equal(ids.numpy(), full_ids.numpy())
    np.testing.assert_array_equal(scores.numpy(), full_scores.numpy())


def test_a_bfloat16_pass_hands_unsettled_queries_to_float32_and_then_runs_in_float32(monkeypatch):
    """Scores 0.1% apart: within bfloat16's bound (about 1%), far outside float32's. The first shortlist of the
    bfloat16 pass settles no query; a float32 pass over them settles each at its first shortlist; once more than
    half of 64 queries seen needed it, the next blocks' products are float32 from the start. Same answer."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(1, 32, generator=gen)
    rows = base + 1e-3 * torch.randn(2000, 32, generator=gen)
    queries = base + 0.01 * torch.randn(150, 32, generator=gen)
    dtypes = []
    real_products = shortlist.ShortlistScores.products

    def products(self, q):
        out = real_products(self, q)
        dtypes.append(out.dtype)
        return out

    widths = _count_tiers(monkeypatch)
    monkeypatch.setattr(shortlist.ShortlistScores, "products", products)
    monkeypatch.setattr(exact, "row_blocks_pay", lambda *a: False)  # the one-block path (xc/ann/row_blocks.py)
    ids = exact_topk(queries, rows, 5, block_floats=50 * 2000, bf16_first=True)[1]  # 3 blocks of 50 queries
    assert dtypes == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert widths == [26, ("float32", 50), 26] * 2 + [26], widths
    monkeypatch.undo()
    want = best_k(canonical_all(queries, rows), torch.arange(len(rows)).expand(len(queries), -1), 5)[1]
    np.testing.assert_array_equal(ids.numpy(), want.numpy())


def test_refine_keeps_a_settled_query_and_rescores_only_the_unsettled():
    approx = torch.tensor([[9.0, 1.0, 0.5, 0.4, 0.3, 0.2, 0.1] + [0.0] * 40,
                           [5.0, 4.75, 4.5, 4.25, 4.0, 3.75, 3.5] + [3.0] * 40]).bfloat16()
    exact_rows = approx.float()
    asked = []

    def rescore(which, ids):
        asked.append(which.tolist())
        return torch.gather(exact_rows[which], 1, ids)

    def full(which):
        asked.append(("full", which.tolist()))
        return exact_rows[which]

    top, ids = refine_topk(approx, 1, torch.tensor([0.5, 2.5]), rescore, full)
    assert ids[:, 0].tolist() == [0, 0] and top[:, 0].tolist() == [9.0, 5.0]
    # the first shortlist is 2 k + 16 = 18 of 47 rows: query 0's 9.0 clears its last (0.0) + 0.5; query 1's 5.0 does
    # not clear 3.0 + 2.5, and the next width (144) is every row
    assert asked == [[0, 1], ("full", [1])]


def test_the_shortlist_pays_only_where_the_product_outweighs_its_re_scores():
    assert shortlist.shortlist_pays(5, 37_960, 1024) and shortlist.shortlist_pays(50, 41_080, 1024)  # debian-deps' rankings
    assert not shortlist.shortlist_pays(16, 983, 1024) and not shortlist.shortlist_pays(5, 159, 1024)  # Delicious, Bibtex
    assert not shortlist.shortlist_pays(5, 37_960, 64)  # narrow rows: the float32 product is cheap already
    rows, queries = _rows_and_queries(0, n=200, m=20, d=16)
    calls = []
    real = shortlist.refine_topk
    shortlist.refine_topk = lambda *args: calls.append(1) or real(*args)
    try:
        exact_topk(queries, rows, 5)  # the rule decides: these 200 rows of 16 do not pay
        assert not calls
        exact_topk(queries, rows, 5, bf16_first=True)  # forced: any shortlist shorter than the rows
        assert calls
    finally:
        shortlist.refine_topk = real


def test_the_speed_rule_is_measured_once_per_device_and_cuda_keeps_float32():
    exact.bf16_products_pay.cache_clear()
    assert exact.bf16_products_pay("cuda:0") is False
    first = exact.bf16_products_pay("cpu")
    assert exact.bf16_products_pay("cpu") is first and exact.bf16_products_pay.cache_info().hits >= 1


def test_the_speed_rule_stops_at_the_small_product_where_bfloat16_loses(monkeypatch):
    """An emulating CPU can take seconds on the large bfloat16 product (5.8 s on a 2-core AVX2 EPYC): the small
    one settles it; only where bfloat16 keeps up there is the large one timed, and both must show 1.5x."""
    # bfloat16's speed-up on the (small, large) product -> the rule's answer, products timed
    for speedups, want, timed in (((0.1, 3.0), False, 2), ((3.0, 3.0), True, 4), ((3.0, 1.2), False, 4)):
        calls = []

        def seconds(queries, rows, dim, dtype, repeats, speedups=speedups):
            calls.append(queries)
            return 1.0 if dtype == torch.float32 else 1.0 / speedups[queries != 64]

        monkeypatch.setattr(exact, "_product_seconds", seconds)
        exact.bf16_products_pay.cache_clear()
        assert exact.bf16_products_pay("cpu") is want
        assert calls == [64, 64, 512, 512][:timed]
    exact.bf16_products_pay.cache_clear()


def test_the_speed_rule_leaves_the_global_random_stream_alone():
    """The probe runs at a process's first ranking (after epoch 1, or after the epoch a resumed run starts in): a
    draw from torch's global generator there would make a resumed run's later epochs differ from an uninterrupted
    one's."""
    exact.bf16_products_pay.cache_clear()
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    exact.bf16_products_pay("cpu")
    assert torch.equal(torch.rand(4), expected)
    exact.bf16_products_pay.cache_clear()
