"""ANN backends (xc.ann): recall against exact MIPS, row-id correctness, exclusions, the faiss_gpu CPU
fallback, parameter validation. Small random data so the file runs in well under half a minute."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

from xc.ann.base import AnnParams, _search_excluding_generic, recall_at_k, search_excluding
from xc.ann.exact import exact_topk
from xc.ann.registry import build_index
from xc.errors import ConfigError

pytest.importorskip("faiss")
pytest.importorskip("diskannpy")

N_ROWS, DIM, N_QUERIES, K = 5000, 32, 300, 10
APPROX = ["diskann", "faiss_hnsw", "faiss_ivf", "faiss_gpu"]
EXACT = ["exact", "torch"]  # torch: exact products on the rank's GPU, here the CPU
ALL = APPROX + EXACT
# Small-data params: the defaults are tuned for 10^6 rows; IVF here has 128 lists.
PARAMS = AnnParams(num_threads=2, ivf_nprobe=64)


def _data(seed: int, n: int, d: int, m: int, unit: bool = False):
    """Clustered Gaussian rows with log-normal norms (classifier-like) and queries near rows."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((max(1, n // 100), d)).astype(np.float32)
    rows = centers[rng.integers(0, len(centers), n)] + 0.8 * rng.standard_normal((n, d)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    if not unit:
        rows *= rng.lognormal(0.0, 0.35, (n, 1)).astype(np.float32)
    src = rng.integers(0, n, m)
    queries = rows[src] + 0.3 * rng.standard_normal((m, d)).astype(np.float32) / np.sqrt(d)
    return rows.astype(np.float32), queries.astype(np.float32)


@pytest.fixture(scope="module")
def data():
    rows, queries = _data(0, N_ROWS, DIM, N_QUERIES)
    _, exact_ids = exact_topk(torch.from_numpy(queries), torch.from_numpy(rows), K)
    return rows, queries, exact_ids.numpy()


@pytest.fixture(scope="module")
def built(data):
    rows = data[0]
    out = {}
    for backend in ALL:
        index = build_index(backend, PARAMS)
        index.build(rows)
        out[backend] = index
    return out


@pytest.mark.parametrize("backend", ALL)
def test_recall_and_scores(built, data, backend):
    rows, queries, exact_ids = data
    index = built[backend]
    assert index.name == backend and index.n == N_ROWS and index.dim == DIM
    assert index.build_seconds > 0 and index.memory_bytes >= rows.nbytes
    scores, ids = index.search(queries, K)
    assert scores.shape == ids.shape == (N_QUERIES, K)
    assert scores.dtype == np.float32 and ids.dtype == np.int64
    assert ((ids >= 0) & (ids < N_ROWS)).all()
    recall = recall_at_k(ids, exact_ids)
    floor = 1.0 if backend in ("exact", "torch", "faiss_gpu") else 0.9  # faiss_gpu falls back to exact flat IP here
    assert recall >= floor, f"{backend} recall@{K} = {recall:.3f}"
    # Scores are inner products (not distances), best first.
    true = np.einsum("md,mkd->mk", queries, rows[ids])
    np.testing.assert_allclose(scores, true, rtol=1e-4, atol=1e-4)
    assert (np.diff(scores, axis=1) <= 1e-5).all()


@pytest.mark.parametrize("backend", ALL)
def test_ids_are_row_ids(backend):
    """Unit-norm rows: each row is its own unique top-1 under inner product."""
    rows, _ = _data(1, 2000, 16, 1, unit=True)
    index = build_index(backend, PARAMS)
    index.build(rows)
    probe = np.random.default_rng(2).choice(len(rows), 300, replace=False)
    scores, ids = index.search(rows[probe], 1)
    hit = (ids[:, 0] == probe).mean()
    assert hit >= (1.0 if backend in ("exact", "faiss_gpu") else 0.97), f"{backend}: self-hit {hit:.3f}"
    np.testing.assert_allclose(scores[ids[:, 0] == probe, 0], 1.0, atol=1e-5)


@pytest.mark.parametrize("backend", ALL)
def test_fewer_rows_than_k_pads(backend):
    rows, queries = _data(3, 7, 8, 5)
    index = build_index(backend, PARAMS)
    index.build(rows)
    scores, ids = index.search(queries, 10)
    assert ids.shape == (5, 10)
    assert (ids[:, 7:] == -1).all() and np.isneginf(scores[:, 7:]).all()
    for row in ids:  # every row found exactly once (diskann pads with id 0: must not leak through)
        assert sorted(row[:7].tolist()) == list(range(7))
    _, exact = exact_topk(torch.from_numpy(queries), torch.from_numpy(rows), 7)
    np.testing.assert_array_equal(ids[:, :7], exact.numpy())


@pytest.mark.parametrize("backend", ["diskann", "faiss_hnsw", "exact", "torch"])
def test_empty_index(backend):
    index = build_index(backend, PARAMS)
    index.build(np.zeros((0, 4), np.float32))
    scores, ids = index.search(np.ones((3, 4), np.float32), 2)
    assert (ids == -1).all() and np.isneginf(scores).all()


def _exclusions(queries, rows, rng):
    """Each query excludes its exact top-(0..8) rows (like positives) plus an out-of-range id;
    query 0 excludes its top 150, far beyond the 99th percentile (forces a second search round)."""
    _, top = exact_topk(torch.from_numpy(queries), torch.from_numpy(rows), 150)
    top = top.numpy()
    lists = [list(top[i, : rng.integers(0, 9)]) + [len(rows) + 5] for i in range(len(queries))]
    lists[0] = list(top[0])
    indptr = np.zeros(len(lists) + 1, np.int64)
    indptr[1:] = np.cumsum([len(x) for x in lists])
    return indptr, np.concatenate([np.asarray(x, np.int64) for x in lists])


@pytest.mark.parametrize("backend", ALL)
def test_search_excluding(built, data, backend):
    rows, queries, _ = data
    indptr, indices = _exclusions(queries, rows, np.random.default_rng(4))
    ids = search_excluding(built[backend], queries, K, indptr, indices)
    assert ids.shape == (N_QUERIES, K) and ids.dtype == np.int64
    for i in range(N_QUERIES):
        assert not set(ids[i].tolist()) & set(indices[indptr[i]:indptr[i + 1]].tolist())
        assert len(set(ids[i].tolist())) == K and (ids[i] >= 0).all()
    _, ref = exact_topk(torch.from_numpy(queries), torch.from_numpy(rows), K, indptr, indices)
    recall = recall_at_k(ids, ref.numpy())
    assert recall >= (1.0 if backend in ("exact", "torch", "faiss_gpu") else 0.85), f"{backend}: {recall:.3f}"


def test_generic_exclusion_path_matches_exact(built, data):
    """The over-fetch / re-search path, run on the exact index, equals exact exclusion."""
    rows, queries, _ = data
    indptr, indices = _exclusions(queries, rows, np.random.default_rng(5))
    calls = []
    index = built["exact"]
    original = index.search

    def counting(q, k):
        calls.append((len(q), k))
        return original(q, k)

    index.search = counting
    try:
        ids = _search_excluding_generic(index, queries, K, indptr, indices)
    finally:
        del index.search
    _, ref = exact_topk(torch.from_numpy(queries), torch.from_numpy(rows), K, indptr, indices)
    np.testing.assert_array_equal(ids, ref.numpy())
    assert calls[0][0] == N_QUERIES and len(calls) == 2 and calls[1][0] == 1  # only query 0 re-searched


def test_exclusions_leaving_fewer_than_k():
    rows, queries = _data(6, 12, 8, 2)
    indptr = np.array([0, 5, 12])
    indices = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6])
    for backend in ("exact", "faiss_hnsw", "diskann"):
        index = build_index(backend, PARAMS)
        index.build(rows)
        ids = search_excluding(index, queries, 10, indptr, indices)
        assert sorted(ids[0][ids[0] >= 0].tolist()) == list(range(5, 12)), backend
        assert sorted(ids[1][ids[1] >= 0].tolist()) == list(range(7, 12)), backend


def test_recall_at_k():
    exact = np.array([[1, 2, 3, 4], [5, 6, -1, -1], [-1, -1, -1, -1]])
    approx = np.array([[4, 3, 9, 9], [6, -1, -1, -1], [1, 2, 3, 4]])
    assert recall_at_k(approx, exact) == pytest.approx((0.5 + 0.5) / 2)
    assert recall_at_k(exact[:2], exact[:2]) == 1.0
    assert recall_at_k(np.array([[7, 8, 9]]), np.array([[1, 2, 3]])) == 0.0


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_faiss_gpu_falls_back_without_gpu(monkeypatch, caplog, data, kind):
    from xc.ann import faiss_backend

    monkeypatch.setattr(faiss_backend, "num_gpus", lambda: 0)
    rows, queries, exact_ids = data
    with caplog.at_level(logging.WARNING, logger="xc.ann.faiss_backend"):
        index = build_index("faiss_gpu", AnnParams(num_threads=2, gpu_index=kind, ivf_nprobe=64))
    assert not index.on_gpu
    assert any("falling back to faiss CPU" in r.getMessage() for r in caplog.records)
    index.build(rows)
    _, ids = index.search(queries, K)
    assert recall_at_k(ids, exact_ids) >= (1.0 if kind == "flat" else 0.9)


def test_faiss_gpu_fallback_message_says_why_and_what_to_do(caplog):
    """On this machine (faiss-cpu, no CUDA) the warning names the cause and the fix, without monkeypatching."""
    from xc.ann import faiss_backend

    count, why = faiss_backend.gpu_status()
    if count:
        pytest.skip("faiss sees a GPU here")
    assert why  # e.g. "the installed faiss 1.15.1 is a CPU-only build (faiss-cpu)"
    with caplog.at_level(logging.WARNING, logger="xc.ann.faiss_backend"):
        build_index("faiss_gpu", AnnParams(num_threads=1))
    (message,) = [r.getMessage() for r in caplog.records]
    assert why in message and "falling back to faiss CPU (IndexFlatIP, exact" in message
    assert "install faiss-gpu" in message


def test_faiss_gpu_is_selectable_for_the_miner_and_for_serving(monkeypatch, data):
    """miner.ann.backend=faiss_gpu and `xc-eval --ann faiss_gpu` both reach FaissGpuIndex; without a GPU its
    flat fallback is exact, so the mined table and the served top-k equal exact search."""
    from xc.ann import faiss_backend
    from xc.config import AnnConfig, build_config
    from xc.distributed import DistContext
    from xc.eval.inference import sharded_topk
    from xc.miner.params import ann_params
    from xc.miner.task import mine_table
    from xc.models import ClassifierShard
    from xc.serve.ann import AnnSearcher
    from xc.shards import ShardLayout

    monkeypatch.setattr(faiss_backend, "num_gpus", lambda: 0)
    assert build_config({"miner": {"ann": {"backend": "faiss_gpu"}}}).miner.ann.backend == "faiss_gpu"
    rows, queries, _ = data
    rows, queries = rows[:1000], queries[:64]
    empty = np.zeros(len(queries) + 1, dtype=np.int64)
    ann, exact = AnnConfig(backend="faiss_gpu", center=False), AnnConfig(backend="exact")
    table, stats = mine_table(rows, 500, queries, empty, np.zeros(0, dtype=np.int64), 8, ann, 1, recall_sample=32)
    want, _ = mine_table(rows, 500, queries, empty, np.zeros(0, dtype=np.int64), 8, exact, 1)
    assert np.array_equal(table, want) and stats.recall == 1.0

    layout = ShardLayout.build(1000, 2, 16)
    shard = ClassifierShard(0, layout.padded_labels, 1000, DIM, 0.0, 0, torch.device("cpu"))
    shard.weight[:1000] = torch.from_numpy(rows)
    searcher = AnnSearcher(shard, layout, range(2), ann, threads=1)
    assert all(isinstance(index, faiss_backend.FaissGpuIndex) and not index.on_gpu for _, index in searcher.indexes)
    _, ids = sharded_topk(torch.from_numpy(queries), searcher, 5, DistContext())
    _, truth = exact_topk(torch.from_numpy(queries), torch.from_numpy(rows), 5)
    assert torch.equal(torch.sort(ids, 1).values, torch.sort(truth, 1).values)

    # gpu_device -1 (the default) is this process's LOCAL_RANK: each torchrun rank searches on its own GPU.
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert ann_params(AnnConfig(backend="faiss_gpu"), 1).device_ordinal() == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert ann_params(AnnConfig(backend="faiss_gpu"), 1).device_ordinal() == 0
    assert ann_params(AnnConfig(backend="faiss_gpu", gpu_device=1), 1).device_ordinal() == 1


def test_one_ann_schema_for_the_run_config_and_the_backends():
    """miner.ann is AnnParams itself: the same fields, defaults and checks; num_threads 0 takes the miner's."""
    from xc.config import AnnConfig, build_config
    from xc.miner.params import ann_params

    assert AnnConfig is AnnParams
    cfg = build_config({"miner": {"ann": {"backend": "diskann", "hnsw_m": 8}}}).miner.ann
    assert isinstance(cfg, AnnParams) and cfg.hnsw_m == 8
    assert cfg.diskann_graph_degree == AnnParams().diskann_graph_degree
    assert ann_params(cfg, 3).num_threads == 3
    assert ann_params(dataclasses.replace(cfg, num_threads=5), 3).num_threads == 5
    with pytest.raises(ConfigError, match="ann.hnsw_m"):
        ann_params(dataclasses.replace(cfg, hnsw_m=1), 3)


@pytest.mark.parametrize("field,value", [
    ("diskann_graph_degree", 0), ("diskann_build_complexity", -3), ("diskann_alpha", 0.5),
    ("diskann_search_complexity", 0), ("hnsw_m", 1), ("hnsw_ef_construction", 0), ("hnsw_ef_search", "a"),
    ("ivf_nlist", -1), ("ivf_nprobe", 0), ("gpu_index", "hnsw"), ("num_threads", -1),
    ("exact_block_queries", 0), ("diskann_alpha", float("nan")), ("hnsw_m", True), ("backend", "annoy"),
    ("torch_device", "tpu"), ("torch_dtype", "float16"),
])
def test_bad_params_raise_config_error(field, value):
    with pytest.raises(ConfigError) as err:
        build_index("faiss_hnsw" if field != "backend" else None, AnnParams(**{field: value}))
    assert err.value.key == f"ann.{field}"
    assert f"ann.{field}" in str(err.value)


def test_unknown_backend_and_key():
    with pytest.raises(ConfigError, match="ann.backend"):
        build_index("annoy", AnnParams())
    with pytest.raises(ConfigError, match="ann.hnsw_mm"):
        AnnParams.from_dict({"hnsw_mm": 8})
    assert AnnParams.from_dict({"hnsw_m": 8}).hnsw_m == 8


def test_misuse_raises(data):
    rows = data[0]
    index = build_index("faiss_hnsw", PARAMS)
    with pytest.raises(RuntimeError):
        index.search(rows[:2], 3)
    index.build(rows[:100])
    with pytest.raises(ValueError):
        index.search(rows[:2, :5], 3)
    with pytest.raises(ValueError):
        index.search(rows[:2], 0)
    with pytest.raises(ValueError):
        index.build(np.full((3, 4), np.nan, np.float32))


def test_torch_backend_equals_exact_search_on_cpu(built, data, tmp_path):
    """backend=torch on a machine without CUDA is the exact backend, id for id, with and without exclusions,
    and after a save / load round trip; bfloat16 rows keep recall high against float32."""
    rows, queries, _ = data
    exact, torch_index = built["exact"], built["torch"]
    assert torch_index.device == "cpu"
    s_exact, i_exact = exact.search(queries, K)
    s_torch, i_torch = torch_index.search(queries, K)
    np.testing.assert_array_equal(i_torch, i_exact)
    np.testing.assert_array_equal(s_torch, s_exact)
    indptr, indices = _exclusions(queries, rows, np.random.default_rng(4))
    np.testing.assert_array_equal(torch_index.search_excluding(queries, K, indptr, indices),
                                  exact.search_excluding(queries, K, indptr, indices))
    torch_index.save(str(tmp_path))
    again = build_index("torch", PARAMS)
    again.load(str(tmp_path))
    np.testing.assert_array_equal(again.search(queries, K)[1], i_exact)
    half = build_index("torch", dataclasses.replace(PARAMS, torch_dtype="bfloat16"))
    half.build(rows)
    assert half.memory_bytes == rows.nbytes // 2
    assert recall_at_k(half.search(queries, K)[1], i_exact) >= 0.9


def test_torch_backend_asked_for_cuda_without_one_says_so(data):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    index = build_index("torch", dataclasses.replace(PARAMS, torch_device="cuda"))
    with pytest.raises(ConfigError, match="ann.torch_device"):
        index.build(data[0])
