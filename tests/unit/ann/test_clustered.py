"""The query-clustered search (xc/ann/clustered.py) and the miner's trial of it (xc/miner/task.py shard_index)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xc.ann.base import AnnParams, recall_at_k, search_excluding
from xc.ann.exact import exact_topk
from xc.ann.registry import build_index
from xc.errors import ConfigError


def _exclusions(rng, m, n, per_query=3):
    indptr = np.arange(m + 1, dtype=np.int64) * per_query
    return indptr, rng.integers(0, n, m * per_query).astype(np.int64)


def _exact(queries, rows, k, indptr=None, indices=None):
    scores, ids = exact_topk(torch.from_numpy(queries), torch.from_numpy(rows), k, indptr, indices)
    return scores.numpy(), ids.numpy()


def _topic_data(seed, n=6000, m=4000, d=32, topics=40):
    """Rows and queries around shared topic directions: queries of a topic share most of their top rows."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((topics, d)).astype(np.float32) * 3
    rows = (centres[rng.integers(0, topics, n)] + rng.standard_normal((n, d))).astype(np.float32)
    rows *= rng.uniform(0.5, 1.5, (n, 1)).astype(np.float32)
    queries = (centres[rng.integers(0, topics, m)] + 0.5 * rng.standard_normal((m, d))).astype(np.float32)
    return rows, queries


def test_all_candidates_is_exact_search_with_exclusions():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((700, 16)).astype(np.float32)
    queries = rng.standard_normal((300, 16)).astype(np.float32)
    indptr, indices = _exclusions(rng, 300, 700)
    index = build_index("clustered", AnnParams(cluster_size=40, cluster_candidates=700))
    index.build(rows)
    want_scores, want_ids = _exact(queries, rows, 10, indptr, indices)
    np.testing.assert_array_equal(search_excluding(index, queries, 10, indptr, indices), want_ids)
    scores, ids = index.search(queries, 10)
    np.testing.assert_array_equal(ids, _exact(queries, rows, 10)[1])
    np.testing.assert_allclose(scores, _exact(queries, rows, 10)[0], rtol=1e-5, atol=1e-5)
    assert not np.isin(want_ids, -1).any()


def test_a_cluster_of_one_query_takes_its_own_exact_top_candidates():
    """One query: radius 0, so its candidates are its own exact top-K and its top-k is exact (K << n)."""
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((5000, 24)).astype(np.float32)
    index = build_index("clustered", AnnParams(cluster_candidates=64))
    index.build(rows)
    for q in rng.standard_normal((5, 24)).astype(np.float32):
        np.testing.assert_array_equal(index.search(q[None], 16)[1], _exact(q[None], rows, 16)[1])


def test_shared_candidates_find_the_top_k_where_queries_cluster_and_not_where_they_do_not():
    rows, queries = _topic_data(2)
    indptr, indices = _exclusions(np.random.default_rng(3), len(queries), len(rows))
    params = AnnParams(cluster_size=100, cluster_candidates=600)  # 10% of the rows per cluster
    index = build_index("clustered", params)
    index.build(rows)
    truth = _exact(queries, rows, 10, indptr, indices)[1]
    assert recall_at_k(search_excluding(index, queries, 10, indptr, indices), truth) >= 0.95
    scattered = np.random.default_rng(4).standard_normal(queries.shape).astype(np.float32) * 3
    truth = _exact(scattered, rows, 10, indptr, indices)[1]
    assert recall_at_k(search_excluding(index, scattered, 10, indptr, indices), truth) < 0.9


def test_the_slack_term_keeps_rows_that_members_rank_high_but_their_centroid_does_not():
    """Scattered queries (wide clusters): c.w + z r |w| / sqrt(d) finds more of the members' top-k than c.w."""
    rows, _ = _topic_data(10)
    queries = np.random.default_rng(11).standard_normal((3000, rows.shape[1])).astype(np.float32) * 3
    truth = _exact(queries, rows, 10)[1]
    found = {}
    for slack in (0.0, 1.5):
        index = build_index("clustered", AnnParams(cluster_size=100, cluster_candidates=600, cluster_slack=slack))
        index.build(rows)
        found[slack] = recall_at_k(index.search(queries, 10)[1], truth)
    assert found[1.5] > found[0.0] + 0.1, found


def test_kmeans_is_seeded_and_assigns_every_point_to_its_nearest_centre():
    from xc.ann.clustered import kmeans

    x = torch.from_numpy(np.random.default_rng(5).standard_normal((2000, 8)).astype(np.float32))
    assign, centres, radius = kmeans(x, 20)
    again = kmeans(x, 20)
    assert torch.equal(assign, again[0]) and torch.equal(centres, again[1])
    nearest = torch.cdist(x, centres).argmin(dim=1)
    assert (assign == nearest).float().mean() > 0.999  # ties and rounding aside
    for c in range(20):
        members = x[assign == c]
        if len(members):
            want = ((members - centres[c]) ** 2).sum(dim=1).mean().sqrt()
            assert torch.isclose(radius[c], want, rtol=1e-4)


def test_save_and_load_give_the_same_results(tmp_path):
    rows, queries = _topic_data(6, n=2000, m=500)
    index = build_index("clustered", AnnParams(cluster_size=50, cluster_candidates=300))
    index.build(rows)
    index.save(str(tmp_path / "idx"))
    loaded = build_index("clustered", AnnParams(cluster_size=50, cluster_candidates=300))
    loaded.load(str(tmp_path / "idx"))
    np.testing.assert_array_equal(loaded.search(queries, 8)[1], index.search(queries, 8)[1])


@pytest.mark.parametrize("field,value", [("cluster_size", 0), ("cluster_candidates", 0), ("cluster_slack", -1.0),
                                         ("clustered_recall", 1.5)])
def test_bad_clustered_settings_name_their_field(field, value):
    with pytest.raises(ConfigError, match=f"ann.{field}"):
        AnnParams(**{field: value}).validate()


@pytest.mark.parametrize("topics", [True, False])
def test_miner_keeps_the_clustered_search_only_where_its_probe_recall_reaches_the_target(topics):
    """mine_table with DiskANN configured: rows and queries with shared structure are mined by the clustered
    search (no graph), the logged recall (another sample) at the target; scattered queries get the graph."""
    from xc.miner.task import mine_table

    rows, queries = _topic_data(7, n=6000, m=3000)
    if not topics:
        queries = np.random.default_rng(8).standard_normal(queries.shape).astype(np.float32) * 3
    indptr, indices = _exclusions(np.random.default_rng(9), len(queries), len(rows))
    ann = AnnParams(backend="diskann", num_threads=1, cluster_size=100, cluster_candidates=600, clustered_recall=0.9)
    table, stats = mine_table(rows, 500, queries, indptr, indices + 500, 8, ann, 1, recall_sample=200, seed=1)
    assert table.shape == (len(queries), 8) and stats.clustered_probe is not None
    if topics:
        assert stats.search == "clustered" and stats.clustered_probe >= 0.9 and stats.recall >= 0.9, stats
        truth = _exact(queries, rows, 8, indptr, indices)[1] + 500
        assert recall_at_k(table.astype(np.int64), truth) >= 0.9
    else:
        assert stats.search in ("graph", "head_only") and stats.clustered_probe < 0.9, stats


@pytest.mark.parametrize("retry_recall", [0.95, 0.8])
def test_a_probe_short_of_the_target_is_tried_again_with_tighter_clusters_before_a_graph(retry_recall, monkeypatch):
    """The first trial (clusters of 100) misses 0.9: clusters of 50 are tried on the same probe, against the same
    exact answer, and kept where they reach it; else the graph is built, the better probe logged."""
    import xc.miner.task as task

    rows, queries = _topic_data(7, n=6000, m=3000)
    indptr, indices = _exclusions(np.random.default_rng(9), len(queries), len(rows))
    real, tried = task._clustered_trial, []

    def trial(rows, ann, threads, probe, k, recall_k, truth=None):
        index, _, found = real(rows, ann, threads, probe, k, recall_k, truth)
        tried.append((ann.cluster_size, truth is None))
        return index, (0.85 if ann.cluster_size == 100 else retry_recall), found

    monkeypatch.setattr(task, "_clustered_trial", trial)
    ann = AnnParams(backend="diskann", num_threads=1, cluster_size=100, cluster_candidates=600, clustered_recall=0.9)
    probe = task.probe_sample(queries, indptr, indices + 500, 500, len(rows), 200, 1, task.SEARCH_BLOCK)
    index, _ = task.shard_index(rows, ann, 1, probe, 8, 8)
    assert tried == [(100, True), (50, False)]  # the exact answer is searched once
    assert index.clustered_probe == max(0.85, retry_recall)
    assert index.search_kind == ("clustered" if retry_recall >= 0.9 else "graph")
    if retry_recall >= 0.9:
        assert index.params.cluster_size == 50


def test_a_graph_that_holds_less_of_the_probe_than_the_clustered_search_is_not_used(monkeypatch):
    """The clustered probe misses 0.9 (reported 0.89 on both trials), the graph is built, and judged on the same
    probe: a graph of out-degree 2 holds less, so the clustered search stays."""
    import xc.miner.task as task

    rows, queries = _topic_data(7, n=6000, m=3000)
    indptr, indices = _exclusions(np.random.default_rng(9), len(queries), len(rows))
    real = task._clustered_trial

    def trial(rows, ann, threads, probe, k, recall_k, truth=None):
        index, _, found = real(rows, ann, threads, probe, k, recall_k, truth)
        return index, 0.89, found

    monkeypatch.setattr(task, "_clustered_trial", trial)
    probe = task.probe_sample(queries, indptr, indices + 500, 500, len(rows), 200, 1, task.SEARCH_BLOCK)
    poor = AnnParams(backend="diskann", num_threads=1, cluster_size=100, cluster_candidates=600, clustered_recall=0.9,
                     exact_head=0, head_only_recall=0.0, diskann_graph_degree=2, diskann_build_complexity=4,
                     diskann_search_complexity=8)
    q, ex_ptr, ex_idx, checked, _ = probe
    graph = build_index("diskann", poor)
    graph.build(rows)
    truth = _exact(q[:checked], rows, 8, ex_ptr[:checked + 1], ex_idx[:ex_ptr[checked]])[1]
    assert recall_at_k(search_excluding(graph, q[:checked], 8, ex_ptr[:checked + 1], ex_idx[:ex_ptr[checked]]),
                       truth) < 0.89  # the premise: this graph is the worse search
    index, _ = task.shard_index(rows, poor, 1, probe, 8, 8)
    assert index.search_kind == "clustered" and index.clustered_probe == 0.89
    table, stats = task.mine_table(rows, 500, queries, indptr, indices + 500, 8, poor, 1, recall_sample=200, seed=1)
    assert stats.search == "clustered"


@pytest.mark.parametrize("free_bytes", [1 << 40, 1 << 20])
def test_a_graph_is_built_only_where_it_fits_in_the_free_memory(free_bytes, monkeypatch, caplog):
    """Scattered queries miss the clustered target, so the miner would build DiskANN: with 1 TiB free it does;
    with 1 MiB free (a graph over 6,000 rows of 32 needs 6,000 x (12 x 32 + 4 x 43) B = 3.3 MB) the clustered
    search is kept, a warning names the memory, and the table is still every query's top-8 bar its positives. The
    rows' width rule leaves the graph uncounted where this trial comes first (xc/models/row_memory.py)."""
    import logging

    import xc.miner.task as task
    from xc.free_memory import FreeMemory

    rows, _ = _topic_data(7, n=6000, m=3000)
    queries = np.random.default_rng(8).standard_normal((3000, 32)).astype(np.float32) * 3
    indptr, indices = _exclusions(np.random.default_rng(9), len(queries), len(rows))
    monkeypatch.setattr(task, "host_memory", lambda: FreeMemory(free_bytes, "MemAvailable"))
    ann = AnnParams(backend="diskann", num_threads=1, cluster_size=100, cluster_candidates=600, clustered_recall=0.9)
    with caplog.at_level(logging.WARNING, logger="xc.miner.task"):
        table, stats = task.mine_table(rows, 500, queries, indptr, indices + 500, 8, ann, 1, recall_sample=200, seed=1)
    assert stats.clustered_probe < 0.9 and table.shape == (3000, 8)
    if free_bytes > 1 << 30:
        assert stats.search in ("graph", "head_only") and "the clustered search is kept" not in caplog.text
    else:
        assert stats.search == "clustered"
        assert "a graph index over these 6000 x 32 rows needs 0.00311 GiB, over 60% of the 0.000977 GiB free" in caplog.text
        positives = {(q, int(label)) for q in range(3000) for label in indices[indptr[q]:indptr[q + 1]] + 500}
        assert not any((q, int(label)) in positives for q in range(3000) for label in table[q])
        truth = _exact(queries, rows, 8, indptr, indices)[1] + 500
        assert recall_at_k(table.astype(np.int64), truth) == pytest.approx(stats.recall, abs=0.15)


def test_the_clustered_trial_reads_bfloat16_rows_without_a_float32_copy(caplog):
    """bfloat16 rows (a bfloat16 snapshot's) mined with DiskANN configured: the trial scores them block by block and,
    kept, no float32 copy of the rows is made (xc/ann/bf16_rows.py's float32_copy logs every one)."""
    import logging

    from xc.miner.task import mine_table

    rows, queries = _topic_data(7, n=6000, m=3000)
    indptr, indices = _exclusions(np.random.default_rng(9), len(queries), len(rows))
    ann = AnnParams(backend="diskann", num_threads=1, cluster_size=100, cluster_candidates=600, clustered_recall=0.9)
    with caplog.at_level(logging.WARNING):
        table, stats = mine_table(torch.from_numpy(rows).bfloat16(), 500, queries, indptr, indices + 500, 8, ann, 1,
                                  recall_sample=200, seed=1)
    assert stats.search == "clustered" and stats.recall >= 0.9 and table.shape == (3000, 8)
    assert "needs float32 rows" not in caplog.text


@pytest.mark.parametrize("block", [65536, 1000])
def test_the_trial_search_is_the_table_only_where_its_block_held_every_query(block, monkeypatch):
    """Where the probe block is every query the clustered trial's result is kept as the table (no second
    search), else the table is searched; either way no query is given its own positive and recall holds."""
    import xc.miner.task as task

    monkeypatch.setattr(task, "SEARCH_BLOCK", block)
    rows, queries = _topic_data(7, n=6000, m=3000)
    indptr, indices = _exclusions(np.random.default_rng(9), len(queries), len(rows))
    ann = AnnParams(backend="diskann", num_threads=1, cluster_size=100, cluster_candidates=600, clustered_recall=0.9)
    searched, original = [], task.search_block
    monkeypatch.setattr(task, "search_block", lambda *a, **kw: searched.append(1) or original(*a, **kw))
    table, stats = task.mine_table(rows, 500, queries, indptr, indices + 500, 8, ann, 1, recall_sample=200, seed=1)
    assert stats.search == "clustered"
    assert bool(searched) == (block < len(queries))
    for q in range(len(queries)):
        assert not set(indices[indptr[q]:indptr[q + 1]] + 500) & set(table[q].tolist())
    truth = _exact(queries, rows, 8, indptr, indices)[1] + 500
    assert recall_at_k(table.astype(np.int64), truth) >= 0.9


def test_exclusions_of_any_query_order_are_each_querys_positives_in_the_shard():
    from xc.miner.task import exclusions_of

    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 5, 200)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    indices = rng.integers(0, 1000, int(indptr[-1])).astype(np.int64)
    picks = rng.permutation(200)[:70]
    ptr, idx = exclusions_of(indptr, indices, picks, 300, 400)
    for i, q in enumerate(picks):
        one_idx = [v - 300 for v in indices[indptr[q]:indptr[q + 1]] if 0 <= v - 300 < 400]  # by hand
        assert idx[ptr[i]:ptr[i + 1]].tolist() == one_idx
        assert all(0 <= v < 400 for v in one_idx)


def test_sampled_recall_counts_the_exact_top_k_a_table_holds():
    """sampled_hits (one blocked exact search for the whole sample) against a per-query count by hand."""
    from xc.miner.task import sampled_hits

    rng = np.random.default_rng(5)
    rows = rng.standard_normal((300, 16)).astype(np.float32)
    queries = rng.standard_normal((120, 16)).astype(np.float32)
    indptr, indices = _exclusions(rng, 120, 300)
    truth = _exact(queries, rows, 5, indptr, indices)[1]
    table = np.where(rng.random(truth.shape) < 0.6, truth + 700, -1).astype(np.int32)  # global ids, lo 700
    hits, total = sampled_hits(table, rows, 700, queries, indptr, indices + 700, 5, 50, seed=2)
    picks = np.sort(np.random.default_rng(2).choice(120, size=50, replace=False))
    assert total == 50 * 5
    assert hits == int((table[picks] >= 0).sum())


def test_ray_search_tasks_slice_the_build_tasks_trial_table_instead_of_searching_again(monkeypatch):
    """The Ray miner's tasks (plain functions, run here without Ray): where the build's clustered trial searched
    every query, the search tasks return slices of that table without loading the index, and the blocks
    together are the in-process miner's table, with its recall."""
    import xc.miner.ray_pool as ray_pool
    from xc.miner.task import mine_table, probe_sample, wants_probe

    rows, queries = _topic_data(7, n=6000, m=3000)
    indptr, indices = _exclusions(np.random.default_rng(9), len(queries), len(rows))
    indices = indices + 500
    ann = AnnParams(backend="diskann", num_threads=1, cluster_size=100, cluster_candidates=600, clustered_recall=0.9)
    expected, stats = mine_table(rows, 500, queries, indptr, indices, 8, ann, 1, recall_sample=200, seed=1)
    assert stats.search == "clustered"
    fields = {f: getattr(ann, f) for f in ann.__dataclass_fields__}
    probing, block = wants_probe(ann, 200)
    probe = probe_sample(queries, indptr, indices, 500, len(rows), 200, 1, block) if probing else None
    built = ray_pool.build_task(rows, fields, 1, probe, 8, 0, 500, len(queries))
    assert built["search"] == "clustered" and built["table"] is not None
    loaded = []
    monkeypatch.setattr(ray_pool, "_load_index", lambda *a, **kw: loaded.append(1))
    parts = [ray_pool.search_task(built, rows, 500, queries, (indptr, indices), 8, a, b, fields, 1, share, seed)
             for a, b, share, seed in ((0, 1500, 100, 11), (1500, 3000, 100, 12))]
    assert not loaded
    np.testing.assert_array_equal(np.concatenate([p["table"] for p in parts]), expected)
    hits, total = sum(p["hits"] for p in parts), sum(p["total"] for p in parts)
    assert total > 0 and hits / total >= 0.9


def test_the_first_pass_dtype_never_changes_the_clustered_answer(monkeypatch):
    """Where a shortlist pays over a cluster's candidates (here d 2,048, 4,096 candidates, k 4), they are ranked
    canonically through a first pass in bfloat16 or float32, as the speed probe says (xc/ann/shortlist.py): the
    answer is bit for bit the same either way, and its scores are the canonical ones."""
    import torch

    import xc.ann.clustered
    from xc.ann.shortlist import canonical_products, shortlist_pays

    gen = np.random.default_rng(3)
    centres = gen.standard_normal((6, 2048)).astype(np.float32)
    rows = (centres[gen.integers(0, 6, 5000)] + gen.standard_normal((5000, 2048))).astype(np.float32)
    queries = (centres[gen.integers(0, 6, 400)] + 0.3 * gen.standard_normal((400, 2048))).astype(np.float32)
    indptr, indices = _exclusions(np.random.default_rng(3), len(queries), len(rows))
    assert shortlist_pays(4, 4096, 2048)
    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        monkeypatch.setattr(xc.ann.clustered, "first_pass_dtype", lambda device, dtype=dtype: dtype)
        index = build_index("clustered", AnnParams(cluster_size=128, cluster_candidates=4096))
        index.build(rows)
        found[dtype] = index.search_excluding(queries, 4, indptr, indices), index.search(queries, 4)
    np.testing.assert_array_equal(found[torch.float32][0], found[torch.bfloat16][0])
    scores, ids = found[torch.float32][1]
    np.testing.assert_array_equal(scores, found[torch.bfloat16][1][0])
    want = canonical_products(torch.from_numpy(queries), torch.from_numpy(rows), torch.from_numpy(ids)).numpy()
    np.testing.assert_array_equal(scores, want)
