"""Norm-range partitioning (xc/ann/norm_head.py): the longest rows searched exactly, merged with an index."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xc.ann.base import AnnParams, recall_at_k, search_excluding
from xc.ann.centering import CenteredIndex, build_for_mips
from xc.ann.exact import exact_topk
from xc.ann.norm_head import NormHeadIndex, head_rows
from xc.ann.registry import build_index


def _hub_rows(seed: int, n: int = 4000, d: int = 16, hubs: int = 60):
    """Rows of unit-ish norm plus a few long ones (frequent labels' rows), and queries that lean towards the
    hubs' shared direction, as trained queries do; positives as random exclusions."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d)
    lead = rng.standard_normal(d).astype(np.float32)
    rows[:hubs] = (rows[:hubs] + lead) * rng.uniform(3, 6, (hubs, 1)).astype(np.float32)
    queries = (rng.standard_normal((300, d)) / np.sqrt(d) + 0.5 * lead).astype(np.float32)
    counts = rng.integers(0, 6, len(queries))
    indptr = np.concatenate([[0], np.cumsum(counts)])
    indices = np.concatenate([rng.choice(n, c, replace=False) if c else np.zeros(0, np.int64) for c in counts])
    indices[:: 3] = rng.integers(0, hubs, len(indices[:: 3]))  # some queries' positives are hubs
    return rows, queries, indptr, indices


def _exact(rows, queries, k, indptr=None, indices=None):
    scores, ids = exact_topk(torch.from_numpy(queries), torch.from_numpy(rows), k, indptr, indices)
    return scores.numpy(), ids.numpy()


@pytest.mark.parametrize("head", [1, 37, 500])
def test_exact_inner_index_gives_exact_search_at_any_head_size(head):
    """With an exact index for the rest, the partition must equal exact search: the merge, the id maps and the
    per-part exclusions are what is tested."""
    rows, queries, indptr, indices = _hub_rows(0)
    index = NormHeadIndex(build_index("exact", AnnParams(exact_head=head)))
    index.build(rows)
    assert len(index.head_ids) == head and len(index.rest_ids) == len(rows) - head
    exact_scores, exact_ids = _exact(rows, queries, 10)
    scores, ids = index.search(queries, 10)
    np.testing.assert_array_equal(ids, exact_ids)
    np.testing.assert_allclose(scores, exact_scores, rtol=1e-5, atol=1e-5)
    _, exact_ex = _exact(rows, queries, 10, indptr, indices)
    np.testing.assert_array_equal(search_excluding(index, queries, 10, indptr, indices), exact_ex)


def test_head_holds_the_longest_rows_and_at_most_an_eighth():
    rows, *_ = _hub_rows(1)
    assert head_rows(AnnParams(exact_head=4096), len(rows)) == len(rows) // 8
    assert head_rows(AnnParams(exact_head=0), len(rows)) == 0
    index = NormHeadIndex(build_index("exact", AnnParams(exact_head=60)))
    index.build(rows)
    assert set(index.head_ids.tolist()) == set(range(60))  # the 60 hubs are the longest rows


def test_diskann_with_an_exact_head_finds_the_hubs_the_graph_misses():
    """The miner's failure mode at scale: a graph over the rows reaches the long rows poorly from the queries;
    the partition's recall must be high, and not below the graph alone."""
    rows, queries, indptr, indices = _hub_rows(2, n=6000, hubs=200)
    _, exact_ids = _exact(rows, queries, 16, indptr, indices)
    params = AnnParams(num_threads=1, diskann_graph_degree=8, diskann_build_complexity=16,
                       diskann_search_complexity=16)
    recalls = {}
    for head in (0, 256):
        index = build_for_mips("diskann", AnnParams(**{**params.__dict__, "exact_head": head}), True)
        assert isinstance(index, NormHeadIndex if head else CenteredIndex)
        index.build(rows)
        recalls[head] = recall_at_k(search_excluding(index, queries, 16, indptr, indices), exact_ids)
    assert recalls[256] >= 0.9, recalls
    assert recalls[256] >= recalls[0], recalls


def test_exact_backends_are_not_partitioned():
    assert not isinstance(build_for_mips("exact", AnnParams(), True), NormHeadIndex)
    assert not isinstance(build_for_mips("torch", AnnParams(torch_device="cpu"), True), NormHeadIndex)


def test_saved_partition_loads_to_identical_results_without_the_rows(tmp_path):
    rows, queries, indptr, indices = _hub_rows(3)
    built = build_for_mips("diskann", AnnParams(num_threads=1, exact_head=100), True)
    built.build_and_save(rows, str(tmp_path / "idx"))
    assert not (tmp_path / "idx" / "vectors.npy").exists()
    loaded = build_for_mips("diskann", AnnParams(num_threads=1, exact_head=100), True)
    loaded.load(str(tmp_path / "idx"))
    (s1, i1), (s2, i2) = built.search(queries, 10), loaded.search(queries, 10)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_array_equal(s1, s2)
    np.testing.assert_array_equal(search_excluding(built, queries, 10, indptr, indices),
                                  search_excluding(loaded, queries, 10, indptr, indices))


def test_head_only_rows_picks_the_smallest_head_that_holds_the_probes_top_k():
    """The share is counted against brute force: the probe's exact top-k (positives excluded) against the
    longest rows; the smallest of exact_head x 1, 2, 4, 8 that reaches the target wins, else 0."""
    from xc.ann.norm_head import head_only_rows, norm_order

    rows, queries, indptr, indices = _hub_rows(4, n=4000, hubs=60)
    _, truth = _exact(rows, queries, 8, indptr, indices)
    longest = norm_order(rows)
    shares = {h: float(np.isin(truth[truth >= 0], longest[:h]).mean()) for h in (16, 32, 64, 128)}
    assert shares[16] < shares[128]  # the test is only meaningful when head size matters
    for target in sorted(set(shares.values())):
        want = min(h for h, s in shares.items() if s >= target)
        h, share = head_only_rows(rows, queries, indptr, indices, 8, AnnParams(exact_head=16, head_only_recall=target))
        assert (h, share) == (want, pytest.approx(shares[want])), target
    h, share = head_only_rows(rows, queries, indptr, indices, 8, AnnParams(exact_head=16, head_only_recall=1.0))
    assert h == 0 if shares[128] < 1.0 else h > 0
    off = AnnParams(exact_head=16, head_only_recall=0.0)
    assert head_only_rows(rows, queries, indptr, indices, 8, off) == (0, None)
    assert head_only_rows(rows, queries, indptr, indices, 8, AnnParams(exact_head=0))[0] == 0
    # isotropic rows (no hubs): the head holds a sliver of the top-k, so the index is built
    iso = np.random.default_rng(5).standard_normal((4000, 16)).astype(np.float32)
    h, share = head_only_rows(iso, queries, indptr, indices, 8, AnnParams(exact_head=64))
    assert h == 0 and share < 0.9


def test_head_only_index_is_exact_over_its_head_and_survives_save_and_load(tmp_path):
    rows, queries, indptr, indices = _hub_rows(6)
    index = build_for_mips("diskann", AnnParams(num_threads=1, exact_head=100), True).head_only(60)
    index.build(rows)
    head = np.arange(60)  # the 60 hubs are the longest rows
    scores, ids = index.search(queries, 10)
    exact_scores, exact_local = _exact(rows[head], queries, 10)
    np.testing.assert_array_equal(ids, head[exact_local])
    np.testing.assert_allclose(scores, exact_scores, rtol=1e-5, atol=1e-5)
    in_head = np.isin(indices, head)
    sub_ptr = np.concatenate([[0], np.cumsum([in_head[a:b].sum() for a, b in zip(indptr[:-1], indptr[1:])])])
    _, exact_ex = _exact(rows[head], queries, 10, sub_ptr, indices[in_head])
    got = search_excluding(index, queries, 10, indptr, indices)
    np.testing.assert_array_equal(got, np.where(exact_ex >= 0, head[np.maximum(exact_ex, 0)], -1))
    index.save(str(tmp_path / "idx"))
    assert not (tmp_path / "idx" / "inner").exists()
    loaded = build_for_mips("diskann", AnnParams(num_threads=1, exact_head=100), True)
    loaded.load(str(tmp_path / "idx"))
    assert loaded.inner is None
    np.testing.assert_array_equal(loaded.search(queries, 10)[1], ids)
    np.testing.assert_array_equal(search_excluding(loaded, queries, 10, indptr, indices), got)


@pytest.mark.parametrize("hubs", [True, False])
def test_miner_searches_the_head_alone_only_where_the_probe_says_it_suffices(hubs):
    """mine_table on DiskANN: hub-heavy rows are mined from the head alone, with the logged recall (measured on
    another sample) at the target; rows without hubs get the graph as before."""
    from xc.miner.task import mine_table

    rows, queries, indptr, indices = _hub_rows(7, n=4000, hubs=60)
    if not hubs:
        rows = np.random.default_rng(8).standard_normal(rows.shape).astype(np.float32)
    # the clustered trial off: this is the head-only test (tests/unit/ann/test_clustered.py covers the trial)
    ann = AnnParams(backend="diskann", num_threads=1, exact_head=64, head_only_recall=0.9, clustered_recall=0.0)
    table, stats = mine_table(rows, 1000, queries, indptr, indices + 1000, 8, ann, 1, recall_sample=150, seed=3)
    assert table.shape == (len(queries), 8)
    if hubs:
        assert stats.head_only in (64, 128, 256, 500) and stats.recall >= 0.85 and stats.head_share >= 0.9, stats
        assert np.isin(table[table >= 0] - 1000, norm_order_of(rows)[:stats.head_only]).all()
    else:
        assert stats.head_only == 0 and stats.recall is not None and stats.head_share < 0.9


def norm_order_of(rows):
    from xc.ann.norm_head import norm_order

    return norm_order(rows)
