"""Every ANN backend saves its built index and loads it back to the same search results."""

from __future__ import annotations

import numpy as np
import pytest

from xc.ann.base import AnnParams
from xc.ann.centering import build_for_mips


@pytest.mark.parametrize("backend", ["diskann", "faiss_hnsw", "faiss_ivf", "exact"])
@pytest.mark.parametrize("center", [True, False])
def test_saved_index_loads_to_identical_results(tmp_path, backend, center):
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((2000, 16)).astype(np.float32) + 0.5
    queries = rng.standard_normal((40, 16)).astype(np.float32)
    built = build_for_mips(backend, AnnParams(num_threads=1), center)
    built.build_and_save(rows, str(tmp_path / "idx"))
    loaded = build_for_mips(backend, AnnParams(num_threads=1), center)
    loaded.load(str(tmp_path / "idx"))
    (s1, i1), (s2, i2) = built.search(queries, 10), loaded.search(queries, 10)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_array_equal(s1, s2)
    assert (loaded.n, loaded.dim) == (2000, 16)


def test_loading_another_backends_index_is_refused(tmp_path):
    build_for_mips("exact", AnnParams(num_threads=1), False).build_and_save(np.eye(4, dtype=np.float32), str(tmp_path))
    with pytest.raises(ValueError, match="backend 'exact', not 'faiss_hnsw'"):
        build_for_mips("faiss_hnsw", AnnParams(num_threads=1), False).load(str(tmp_path))


@pytest.mark.parametrize("center", [True, False])
def test_diskann_plain_build_saves_and_loads_too(tmp_path, center):
    """build() keeps its graph files until the next build, so save() works after it as after build_and_save()."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((500, 8)).astype(np.float32) + 0.5
    queries = rng.standard_normal((20, 8)).astype(np.float32)
    index = build_for_mips("diskann", AnnParams(num_threads=1), center)
    index.build(rows)
    index.save(str(tmp_path / "idx"))
    loaded = build_for_mips("diskann", AnnParams(num_threads=1), center)
    loaded.load(str(tmp_path / "idx"))
    (s1, i1), (s2, i2) = index.search(queries, 10), loaded.search(queries, 10)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_array_equal(s1, s2)
    index.build(rows[:100])  # a rebuild drops the previous build's files
    assert (index.n, loaded.n) == (100, 500)
