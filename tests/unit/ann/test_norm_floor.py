"""The clustered search's norm floor (xc/ann/norm_floor.py): short rows left out, never a row of a query's top-k."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xc.ann.base import AnnParams, search_excluding
from xc.ann.exact import exact_topk
from xc.ann.norm_floor import NormFloor, head_size
from xc.ann.registry import build_index
from xc.errors import ConfigError


def _rows_few_long(seed, n=6000, d=24, long_share=0.1, m=800):
    """Rows of which `long_share` are long (norm ~14, around topic directions), the rest short (norm ~0.1):
    labels with training points against labels whose rows never learned."""
    rng = np.random.default_rng(seed)
    # topics share a common direction, as the embeddings of one encoder do (xc/ann/centering.py)
    centres = (rng.standard_normal((30, d)) + rng.standard_normal(d)).astype(np.float32)
    rows = 0.02 * rng.standard_normal((n, d)).astype(np.float32)
    long = rng.choice(n, int(long_share * n), replace=False)
    rows[long] = 2 * (centres[rng.integers(0, 30, len(long))] + 0.3 * rng.standard_normal((len(long), d)))
    queries = (centres[rng.integers(0, 30, m)] + 0.5 * rng.standard_normal((m, d))).astype(np.float32)
    return rows, queries, np.sort(long)


def _exclusions(rng, m, rows_pool, per_query=3):
    indptr = np.arange(m + 1, dtype=np.int64) * per_query
    return indptr, rng.choice(rows_pool, m * per_query).astype(np.int64)


def _exact(queries, rows, k, indptr=None, indices=None):
    scores, ids = exact_topk(torch.from_numpy(queries), torch.as_tensor(rows), k, indptr, indices)
    return scores.numpy(), ids.numpy()


def _index(rows, **params):
    index = build_index("clustered", AnnParams(**params))
    index.build(rows)
    return index


def test_all_candidates_with_the_floor_is_exact_search_and_scans_only_the_long_rows():
    rows, queries, long = _rows_few_long(0)
    indptr, indices = _exclusions(np.random.default_rng(1), len(queries), long)  # positives among the long rows
    index = _index(rows, cluster_size=10, cluster_candidates=len(rows))
    np.testing.assert_array_equal(search_excluding(index, queries, 10, indptr, indices),
                                  _exact(queries, rows, 10, indptr, indices)[1])
    assert index.last_search["rows_scanned"] == len(long)  # every short row left out, every long one kept
    assert index.last_search["floor"] > 0


def test_the_floor_bounds_each_querys_kth_best_score_from_below():
    rows, queries, long = _rows_few_long(2)
    indptr, indices = _exclusions(np.random.default_rng(3), len(queries), long)
    floor = NormFloor(torch.from_numpy(rows), torch.from_numpy(np.linalg.norm(rows, axis=1)), head=64)
    floors = floor.query_floors(torch.from_numpy(queries), 10, indptr, indices).numpy()
    kth = _exact(queries, rows, 10, indptr, indices)[0][:, -1]
    size = np.linalg.norm(queries, axis=1)
    assert (floors > 0).mean() > 0.8
    assert np.all(floors * size <= kth)
    # the head's own 10th best, excluded rows left out, is the bound (a hair lower)
    head = floor.head_ids.numpy()
    for i in (0, 7, 500):
        allowed = np.setdiff1d(head, indices[indptr[i]:indptr[i + 1]])
        want = np.sort(rows[allowed] @ queries[i])[-10] / size[i]
        assert floors[i] == pytest.approx(want, rel=2e-3)


def test_queries_under_the_floor_scan_every_row_and_still_get_their_exact_top_k():
    """An empty query and one that every head row scores negatively: their floor is 0, so they scan every row."""
    rows, queries, long = _rows_few_long(4, m=3000)  # 2 queries of 3,000: under the floor's 0.1% quantile
    queries = queries.copy()
    queries[5] = 0
    rows = rows.copy()
    rows[long, 0] = np.abs(rows[long, 0]) + 3  # the long rows all lean along +e0 ...
    queries[9] = 0
    queries[9, 0] = -1  # ... and this query scores every one of them negatively: its best rows are short ones
    index = _index(rows, cluster_size=10, cluster_candidates=len(rows))
    got = index.search(queries, 10)[1]
    want = _exact(queries, rows, 10)[1]
    np.testing.assert_array_equal(got[9], want[9])
    assert not np.isin(got[9], long).all()  # short rows are its answer: the floor did not drop them
    np.testing.assert_array_equal(got, want)
    assert index.last_search["rows_scanned"] == len(long)


def test_with_few_candidates_the_floor_finds_at_least_what_the_full_scan_does():
    rows, queries, long = _rows_few_long(6, n=20000, long_share=0.05)
    truth = _exact(queries, rows, 10)[1]
    found = {}
    for on in (False, True):
        index = _index(rows, cluster_size=20, cluster_candidates=300, cluster_norm_floor=on)
        ids = index.search(queries, 10)[1]
        found[on] = np.mean([len(np.intersect1d(a, b)) for a, b in zip(ids, truth)]) / 10
        assert index.last_search["rows_scanned"] == (len(long) if on else len(rows))
    assert found[True] >= found[False] - 0.01


def test_rows_whose_norms_spread_smoothly_are_all_scanned():
    rng = np.random.default_rng(8)
    rows = (rng.standard_normal((3000, 16)) * rng.uniform(0.5, 1.5, (3000, 1))).astype(np.float32)
    queries = rng.standard_normal((300, 16)).astype(np.float32)
    index = _index(rows, cluster_size=5, cluster_candidates=3000)  # a head of 37 rows
    np.testing.assert_array_equal(index.search(queries, 5)[1], _exact(queries, rows, 5)[1])
    assert index.last_search["rows_scanned"] == 3000 and index.last_search["floor"] == 0.0


def test_a_later_block_with_a_lower_floor_gathers_the_rows_anew():
    rows, queries, long = _rows_few_long(10)
    index = _index(rows, cluster_size=10, cluster_candidates=len(rows))
    index.search(queries[:400], 10)
    first = index.last_search["floor"]
    noisy = queries[400:] + 1.0 * np.random.default_rng(11).standard_normal(queries[400:].shape).astype(np.float32)
    np.testing.assert_array_equal(index.search(noisy, 10)[1], _exact(noisy, rows, 10)[1])
    assert 0 < index.last_search["floor"] < first  # wider queries, lower floor: the kept rows gathered again
    np.testing.assert_array_equal(index.search(queries[:400], 10)[1], _exact(queries[:400], rows, 10)[1])
    assert index.last_search["floor"] < first  # a higher floor reuses the larger set


def test_bfloat16_rows_are_floored_on_their_values():
    rows, queries, long = _rows_few_long(12)
    rows_bf16 = torch.from_numpy(rows).to(torch.bfloat16)
    index = build_index("clustered", AnnParams(cluster_size=10, cluster_candidates=len(rows)))
    index.build(rows_bf16)
    want = _exact(queries, rows_bf16.float().numpy(), 10)[1]
    np.testing.assert_array_equal(index.search(queries, 10)[1], want)
    assert index.last_search["rows_scanned"] == len(long)


def test_the_switch_must_be_a_boolean():
    with pytest.raises(ConfigError, match="ann.cluster_norm_floor"):
        AnnParams(cluster_norm_floor="yes").validate()


def test_the_miner_reports_the_rows_its_clustered_search_scanned():
    """mine_table over a shard at [500, 500 + n): the table is every query's exact top-k (all candidates), and the
    shard stats say the search scanned only the long rows."""
    from xc.miner.task import mine_table

    rows, queries, long = _rows_few_long(14)
    indptr, indices = _exclusions(np.random.default_rng(15), len(queries), long)
    ann = AnnParams(backend="clustered", cluster_size=10, cluster_candidates=len(rows), torch_device="cpu")
    table, stats = mine_table(rows, 500, queries, indptr, indices + 500, 8, ann, 1, recall_sample=100, seed=1)
    np.testing.assert_array_equal(table, _exact(queries, rows, 8, indptr, indices)[1] + 500)
    assert stats.rows_scanned == len(long) and stats.recall == 1.0


def test_where_the_scan_is_small_the_head_would_cost_more_and_the_floor_stays_off():
    rows, queries, long = _rows_few_long(16)
    assert head_size(len(rows), 1024) == 0 and head_size(10**7, 1024) == 610 and head_size(10**9, 1024) == 4096
    index = _index(rows, cluster_size=1024, cluster_candidates=len(rows))
    np.testing.assert_array_equal(index.search(queries, 10)[1], _exact(queries, rows, 10)[1])
    assert index.last_search["rows_scanned"] == len(rows)
