"""Parsers, sparse container and cache of xc.data: round trips, every malformed case, fuzzing, real data."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xc.data.cache as cache_mod
import xc.data.formats as formats
from xc.data import SparseMatrix, load_dataset, open_dataset, read_texts, save_csr
from xc.data.sparse import CSRWriter, _npy_header
from xc.errors import ConfigError, DataFormatError

# Same default as tests/conftest.py: XC_DATA, else the shared/data directory beside the repository.
SHARED = os.environ.get("XC_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "shared", "data"))
TRAIN = "4 6 5\n0,3 0:1 2:0.5\n 1:2\n2,2,1 5:1.5e0 0:1\n4\n"
TEST = "\ufeff2 6 5\n1 3:1\r\n\n\n"  # BOM, CRLF row, one blank point, a trailing blank line (ignored)


def write_xc(d, train=TRAIN, test=TEST):
    os.makedirs(d, exist_ok=True)
    for name, text in (("train.txt", train), ("test.txt", test)):
        with open(os.path.join(d, name), "wb") as f:
            f.write(text.encode() if isinstance(text, str) else text)
    return str(d)


def dense(m: SparseMatrix) -> np.ndarray:
    return m.to_scipy().toarray()


# ---------------------------------------------------------------- SparseMatrix

def test_gather_matches_rows_and_embeddingbag_layout(tmp_path):
    rng = np.random.default_rng(0)
    ref = sp.random(50, 30, density=0.2, format="csr", random_state=1, dtype=np.float32)
    ref = sp.csr_matrix(sp.diags((np.arange(50) != 7).astype(np.float32)) @ ref)  # row 7 empty
    ref.eliminate_zeros()
    assert ref[7].nnz == 0
    m = save_csr(SparseMatrix.from_scipy(ref), str(tmp_path), "x")
    assert isinstance(m.indices, np.memmap) and m.indices.dtype == np.int32 and m.indptr.dtype == np.int64
    rows = rng.integers(0, 50, 40)
    rows[3] = 7
    flat, offs, vals = m.gather(rows)
    assert flat.dtype == np.int64 and offs.dtype == np.int64 and vals.dtype == np.float32
    assert offs.shape == (40,) and offs[0] == 0
    ends = np.append(offs[1:], len(flat))
    for b, r in enumerate(rows):
        idx, v = m.row(int(r))
        np.testing.assert_array_equal(flat[offs[b]:ends[b]], idx)
        np.testing.assert_array_equal(vals[offs[b]:ends[b]], v)
    np.testing.assert_array_equal(m.row_lengths(), np.diff(ref.indptr))
    np.testing.assert_array_equal(m.column_counts(), np.bincount(ref.indices, minlength=30))
    np.testing.assert_allclose(dense(m), ref.toarray())
    assert m.gather(np.zeros(0, np.int64))[0].shape == (0,)
    with pytest.raises(IndexError):
        m.gather(np.array([50]))


def test_column_counts_is_chunked(monkeypatch):
    import xc.data.sparse as sparse_mod

    monkeypatch.setattr(sparse_mod, "_CHUNK_NNZ", 3)
    m = SparseMatrix(np.array([0, 2, 7]), np.array([0, 1, 1, 1, 4, 4, 0], np.int32), None, 5)
    np.testing.assert_array_equal(m.column_counts(), [2, 3, 0, 0, 2])


def test_npy_header_fixed_size_and_writer_roundtrip(tmp_path):
    assert len(_npy_header(np.int64, 0)) == len(_npy_header(np.float32, 10**18)) == 128
    w = CSRWriter(str(tmp_path), "m", 4, with_values=True)
    w.append(np.array([2, 0]), np.array([1, 3], np.int32), np.array([0.5, 2.0], np.float32))
    w.append(np.array([1]), np.array([0], np.int32), np.array([7.0], np.float32))
    m = w.close()
    np.testing.assert_array_equal(np.load(str(tmp_path / "m.indptr.npy")), [0, 2, 2, 3])
    np.testing.assert_array_equal(dense(m), [[0, 0.5, 0, 2], [0, 0, 0, 0], [7, 0, 0, 0]])


# ---------------------------------------------------------------- XC sparse

def test_xc_sparse_roundtrip_and_cache_reuse(tmp_path, monkeypatch):
    src = write_xc(tmp_path / "src")
    ds = load_dataset("xc_sparse", src, str(tmp_path / "cache"))
    assert (ds.num_labels, ds.num_features, ds.train.num_points, ds.test.num_points) == (5, 6, 4, 2)
    np.testing.assert_array_equal(dense(ds.train.labels),
                                  [[1, 0, 0, 1, 0], [0] * 5, [0, 1, 1, 0, 0], [0, 0, 0, 0, 1]])
    assert ds.train.labels.values is None  # labels are binary; duplicate "2,2" kept once
    np.testing.assert_array_equal(ds.train.labels.indices, [0, 3, 1, 2, 4])  # sorted within rows
    np.testing.assert_allclose(dense(ds.train.features), [[1, 0, .5, 0, 0, 0], [0, 2, 0, 0, 0, 0],
                                                          [1, 0, 0, 0, 0, 1.5], [0] * 6])
    np.testing.assert_allclose(dense(ds.test.features), [[0, 0, 0, 1, 0, 0], [0] * 6])
    assert ds.test.texts_path is None and ds.label_texts_path is None
    monkeypatch.setattr(cache_mod, "convert_source", lambda *a: pytest.fail("converted twice"))
    again = load_dataset("xc_sparse", src, str(tmp_path / "cache"))
    assert again.meta["cache_dir"] == ds.meta["cache_dir"]
    assert open_dataset(ds.meta["cache_dir"]).train.labels.nnz == 5


def test_changed_source_is_reconverted_and_old_entry_removed(tmp_path):
    src = write_xc(tmp_path / "src")
    cache = str(tmp_path / "cache")
    old = load_dataset("xc_sparse", src, cache).meta["cache_dir"]
    time.sleep(0.01)
    write_xc(tmp_path / "src", train=TRAIN.replace("4\n", "0\n"))  # last point now has label 0
    ds = load_dataset("xc_sparse", src, cache)
    assert ds.meta["cache_dir"] != old and not os.path.exists(old)
    assert ds.train.labels.row(3)[0].tolist() == [0]
    assert not [n for n in os.listdir(cache) if n.startswith((".tmp-", ".trash-"))]


BAD = [  # (train.txt content, line, field)
    ("", 1, "header"),
    ("\n", 1, "header"),
    ("3 5\n", 1, "header"),
    ("1 6 -5\n0 1:1\n", 1, "header"),
    ("1 6 x\n0 1:1\n", 1, "header"),
    ("1 6 5\n5 1:1\n", 2, "label id"),
    ("2 6 5\n0 1:1\n-1 1:1\n", 3, "label id"),
    ("1 6 5\n1,a 1:1\n", 2, "label id"),
    ("1 6 5\n1, 1:1\n", 2, "label id"),
    ("1 6 5\n0 6:1\n", 2, "feature id"),
    ("1 6 5\n0 1:1 -2:1\n", 2, "feature id"),
    ("1 6 5\n0 1:abc\n", 2, "feature value"),
    ("1 6 5\n0 1:nan\n", 2, "feature value"),
    ("1 6 5\n0 1:inf\n", 2, "feature value"),
    ("1 6 5\n0 1:1e39\n", 2, "feature value"),  # finite in float64, inf as float32
    ("1 6 5\n0 1:1 2\n", 2, "feature"),
    ("1 6 5\n0 1:1:1\n", 2, "feature"),
    ("3 6 5\n0 1:1\n", 1, "row count"),
    ("1 6 5\n0 1:1\n1 2:1\n", 3, "row count"),
    ("1 6 5\n0 1:1\n\n1 2:1\n", 4, "row count"),
    ("1 6 5\n0 1:x\n1 2:1\n", 2, "feature value"),  # the earlier error wins
    (b"1 6 5\n0 1:1\n1 2:\xff1\n", 3, "encoding"),
]


@pytest.mark.parametrize("text,line,field", BAD)
def test_malformed_xc_sparse(tmp_path, text, line, field):
    src = write_xc(tmp_path / "src", train=text)
    cache = tmp_path / "cache"
    with pytest.raises(DataFormatError) as e:
        load_dataset("xc_sparse", src, str(cache))
    err = e.value
    assert (err.path, err.line, err.field) == (os.path.join(src, "train.txt"), line, field), str(err)
    assert os.listdir(cache) == [n for n in os.listdir(cache) if n.endswith(".lock")]  # nothing left


def test_test_header_must_agree_with_train(tmp_path):
    src = write_xc(tmp_path / "src", test="1 7 5\n0 1:1\n")
    with pytest.raises(DataFormatError) as e:
        load_dataset("xc_sparse", src, str(tmp_path / "c"))
    assert (os.path.basename(e.value.path), e.value.line, e.value.field) == ("test.txt", 1, "header")


def test_line_numbers_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "_BLOCK_BYTES", 50)  # many small blocks
    rows = [f"{i % 5} {i % 6}:1 {(i + 1) % 6}:2" for i in range(300)]
    rows[217] = "1 2:1 3:x"
    path = tmp_path / "t.txt"
    path.write_text("300 6 5\n" + "\n".join(rows) + "\n")
    with pytest.raises(DataFormatError) as e:
        formats.convert_xc_sparse_file(str(path), str(tmp_path), "t")
    assert (e.value.line, e.value.field) == (219, "feature value")
    rows[217] = " 2:1"
    path.write_text("300 6 5\n" + "\n".join(rows) + "\n")
    labels, feats, _, _ = formats.convert_xc_sparse_file(str(path), str(tmp_path), "t")
    assert labels.num_rows == 300 and labels.row(217)[0].size == 0 and feats.nnz == 599


def test_missing_source_and_bad_kind(tmp_path):
    with pytest.raises(DataFormatError, match="not found"):
        load_dataset("xc_sparse", str(tmp_path), str(tmp_path / "c"))
    with pytest.raises(ConfigError):
        load_dataset("parquet", str(tmp_path), str(tmp_path / "c"))  # libsvm is a kind now


TOKENS = [b":", b",", b" ", b"\t", b"\n", b"\r\n", b"-", b"nan", b"1e39", b".", b"9" * 20, b"\xff", b"\xc3",
          "\ufeff".encode(), b"0:1", b"\x85"]
EDITS = st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(["set", "ins", "del"]),
                           st.one_of(st.binary(min_size=1, max_size=3), st.sampled_from(TOKENS))),
                 min_size=1, max_size=4)


def _apply_edits(data: bytearray, edits) -> None:
    """Apply hypothesis byte edits (set / insert / delete at a position) in place."""
    for pos, op, payload in edits:
        pos %= len(data) + 1
        if op == "set" and pos < len(data):
            data[pos:pos + 1] = payload[:1]
        elif op == "ins":
            data[pos:pos] = payload
        else:
            del data[pos:pos + len(payload)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(EDITS, st.sampled_from(["xc", "xy"]))
def test_fuzz_corruptions_parse_or_raise_dataformaterror(edits, which):
    data = bytearray((TRAIN if which == "xc" else "3 4\n0:1 2:1\n\n3:1.0 3:1\n").encode())
    _apply_edits(data, edits)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "in.txt")
        with open(path, "wb") as f:
            f.write(bytes(data))
        try:
            if which == "xc":
                labels, feats, nf, nl = formats.convert_xc_sparse_file(path, d, "f")
            else:
                (labels, nl), feats = formats.convert_xy_file(path, d, "f"), None
        except DataFormatError as e:
            assert e.field != "row", "fast and strict parsers disagree"
            return
        for m, n in ((labels, nl), (feats, nf if feats is not None else 0)):
            if m is None:
                continue
            assert np.all(np.diff(m.indptr) >= 0) and m.indptr[-1] == m.indices.size
            assert m.indices.size == 0 or (0 <= m.indices.min() and m.indices.max() < n)
            assert m.values is None or np.isfinite(m.values).all()
        assert feats is None or labels.num_rows == feats.num_rows


# ---------------------------------------------------------------- LF raw

def write_lf(d, trn_xy="3 4\n0:1 2:1\n\n3:1.0 3:1\n", tst_xy="1 4\n1:1\n", trn="a b\nc\r\nd é\n",
             tst="q\n", lbl="l0\nl1\nl2\nl3\n"):
    os.makedirs(d, exist_ok=True)
    for name, text in (("trn_X_Y.txt", trn_xy), ("tst_X_Y.txt", tst_xy), ("trn.raw.txt", trn),
                       ("tst.raw.txt", tst), ("lbl.raw.txt", lbl)):
        with open(os.path.join(d, name), "wb") as f:
            f.write(text.encode() if isinstance(text, str) else text)
    return str(d)


def test_lf_raw_roundtrip(tmp_path):
    ds = load_dataset("lf_raw", write_lf(tmp_path / "s"), str(tmp_path / "c"))
    assert (ds.num_labels, ds.num_features, ds.train.num_points, ds.test.num_points) == (4, 0, 3, 1)
    assert ds.train.features is None
    np.testing.assert_array_equal(dense(ds.train.labels), [[1, 0, 1, 0], [0] * 4, [0, 0, 0, 1]])
    assert read_texts(ds.train.texts_path) == ["a b", "c", "d é"]
    assert read_texts(ds.train.texts_path, np.array([2, 0])) == ["d é", "a b"]
    assert read_texts(ds.label_texts_path, [3]) == ["l3"]
    np.testing.assert_array_equal(np.load(ds.train.texts_path + ".offsets.npy"), [0, 4, 6, 11])


@pytest.mark.parametrize("kw,fname,line,field", [
    ({"trn": "a\nb\n"}, "trn.raw.txt", 0, "row count"),
    ({"lbl": "l0\nl1\n"}, "lbl.raw.txt", 0, "row count"),
    ({"trn_xy": "3 4\n0:1\n\n4:1\n"}, "trn_X_Y.txt", 4, "label id"),
    ({"trn_xy": "3 4\n0:1\n1\n3:1\n"}, "trn_X_Y.txt", 3, "label"),
    ({"trn_xy": "3 4\n0:1\n1:x\n3:1\n"}, "trn_X_Y.txt", 3, "label value"),
    ({"trn_xy": "3 4 1\n"}, "trn_X_Y.txt", 1, "header"),
    ({"tst_xy": "1 5\n1:1\n"}, "tst_X_Y.txt", 1, "header"),
    ({"tst_xy": "2 4\n1:1\n"}, "tst_X_Y.txt", 1, "row count"),
    ({"trn": b"a\n\xc3\n c\n"}, "trn.raw.txt", 2, "encoding"),
    ({"lbl": b"l0\n\xffl1\nl2\nl3\n"}, "lbl.raw.txt", 2, "encoding"),
    ({"tst": "q\nr\n"}, "tst.raw.txt", 0, "row count"),  # texts and labels disagree
    ({"trn_xy": ""}, "trn_X_Y.txt", 1, "header"),  # empty file
    ({"trn_xy": "3 4\n0:1\n"}, "trn_X_Y.txt", 1, "row count"),  # truncated
])
def test_malformed_lf_raw(tmp_path, kw, fname, line, field):
    src = write_lf(tmp_path / "s", **kw)
    with pytest.raises(DataFormatError) as e:
        load_dataset("lf_raw", src, str(tmp_path / "c"))
    assert (os.path.basename(e.value.path), e.value.line, e.value.field) == (fname, line, field), str(e.value)
    if fname == "trn.raw.txt" and field == "row count":
        assert "trn_X_Y.txt" in str(e.value)  # both files are named


# ---------------------------------------------------------------- npz

def test_npz_roundtrip_and_shape_errors(tmp_path):
    src = tmp_path / "s"
    src.mkdir()
    x = sp.random(20, 9, density=0.3, format="csr", random_state=0, dtype=np.float32)
    y = sp.random(20, 4, density=0.4, format="csr", random_state=1) > 0
    for split in ("train", "test"):
        sp.save_npz(str(src / f"{split}_X.npz"), x)
        sp.save_npz(str(src / f"{split}_Y.npz"), y.astype(np.float32).tocsr())
    ds = load_dataset("npz", str(src), str(tmp_path / "c"))
    assert (ds.num_features, ds.num_labels, ds.train.num_points) == (9, 4, 20)
    np.testing.assert_allclose(dense(ds.train.features), x.toarray())
    np.testing.assert_array_equal(dense(ds.test.labels), y.toarray())
    sp.save_npz(str(src / "test_Y.npz"), y[:5].astype(np.float32).tocsr())
    with pytest.raises(DataFormatError) as e:
        load_dataset("npz", str(src), str(tmp_path / "c"))
    assert (os.path.basename(e.value.path), e.value.field) == ("test_Y.npz", "row count")
    (src / "test_Y.npz").write_bytes(b"garbage")
    with pytest.raises(DataFormatError, match="not a readable .npz"):
        load_dataset("npz", str(src), str(tmp_path / "c"))


def test_npz_dense_arrays_saved_with_np_savez_are_read(tmp_path):
    """Dense features are naturally saved as `np.savez(path, X=array)` (as xc-predict reads them); they were refused."""
    src = tmp_path / "d"
    src.mkdir()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 5)).astype(np.float32)
    y = (rng.random((12, 3)) < 0.5).astype(np.int8)
    for split in ("train", "test"):
        np.savez(src / f"{split}_X.npz", X=x)
        np.savez(src / f"{split}_Y.npz", Y=y)
    ds = load_dataset("npz", str(src), str(tmp_path / "c"))
    assert (ds.num_features, ds.num_labels, ds.train.num_points) == (5, 3, 12)
    np.testing.assert_allclose(dense(ds.train.features), x)
    np.testing.assert_array_equal(dense(ds.test.labels), y)
    np.savez(src / "train_X.npz", X=x, Z=x)  # X is taken where several arrays are saved
    assert load_dataset("npz", str(src), str(tmp_path / "c2")).num_features == 5
    np.savez(src / "train_X.npz", A=x)  # no X: refused, naming the file and the key
    with pytest.raises(DataFormatError, match="train_X.npz: X: no dense 'X' array"):
        load_dataset("npz", str(src), str(tmp_path / "c3"))


def _npz_source(tmp_path, x=None):
    src = tmp_path / "s"
    src.mkdir(exist_ok=True)
    x = sp.random(20, 9, density=0.3, format="csr", random_state=0, dtype=np.float32) if x is None else x
    y = (sp.random(20, 4, density=0.4, format="csr", random_state=1) > 0).astype(np.float32).tocsr()
    for split in ("train", "test"):
        sp.save_npz(str(src / f"{split}_X.npz"), x)
        sp.save_npz(str(src / f"{split}_Y.npz"), y)
    return src


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e39])
def test_npz_non_finite_feature_values_are_rejected(tmp_path, bad):
    x = sp.random(20, 9, density=0.3, format="csr", random_state=0, dtype=np.float64)
    x.data[5] = bad
    src = _npz_source(tmp_path, x)
    with pytest.raises(DataFormatError) as e:
        load_dataset("npz", str(src), str(tmp_path / "c"))
    assert (os.path.basename(e.value.path), e.value.field) == ("train_X.npz", "feature value")


@pytest.mark.parametrize("damage,field", [
    (lambda b: b"", "file"),  # empty file
    (lambda b: b[: len(b) // 2], "file"),  # truncated
    (lambda b: b[:40] + bytes([b[40] ^ 0xFF]) + b[41:], "file"),  # a flipped byte
])
def test_npz_damaged_files_are_rejected(tmp_path, damage, field):
    src = _npz_source(tmp_path)
    path = src / "test_Y.npz"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataFormatError) as e:
        load_dataset("npz", str(src), str(tmp_path / "c"))
    assert (os.path.basename(e.value.path), e.value.field) == ("test_Y.npz", field)


def test_npz_out_of_range_ids_are_rejected(tmp_path):
    src = _npz_source(tmp_path)
    # a well-formed archive whose CSR arrays are not: column id 9 in a 9-column matrix
    np.savez(src / "train_X.npz", format=np.array("csr"), shape=np.array([2, 9]), data=np.ones(2, np.float32),
             indices=np.array([0, 9], np.int32), indptr=np.array([0, 1, 2]))
    with pytest.raises(DataFormatError) as e:
        load_dataset("npz", str(src), str(tmp_path / "c"))
    assert (os.path.basename(e.value.path), e.value.field) == ("train_X.npz", "structure")


def _valid_npz_bytes(compressed: bool) -> bytes:
    import io

    buf = io.BytesIO()
    sp.save_npz(buf, sp.random(20, 9, density=0.3, format="csr", random_state=0, dtype=np.float32), compressed=compressed)
    return buf.getvalue()


NPZ = {True: _valid_npz_bytes(True), False: _valid_npz_bytes(False)}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans(), st.integers(0, 10**6), EDITS)
def test_fuzz_npz_corruptions_load_or_raise_dataformaterror(compressed, cut, edits):
    """Byte edits and truncation of a valid .npz: it loads as a valid CSR matrix or gives DataFormatError.
    (This found zlib.error and NotImplementedError escaping from damaged archives.)"""
    data = bytearray(NPZ[compressed])
    _apply_edits(data, edits)
    if cut % 3 == 0:
        del data[cut % (len(data) + 1):]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "train_X.npz")
        with open(path, "wb") as f:
            f.write(bytes(data))
        try:
            m = formats._load_npz(path)
        except DataFormatError:
            return
    assert np.all(np.diff(m.indptr) >= 0) and m.indptr[-1] == m.indices.size
    assert m.indices.size == 0 or (0 <= m.indices.min() and m.indices.max() < m.shape[1])


def test_duplicates_and_rows_without_labels_policy(tmp_path):
    """Documented policy (xc/data/formats.py, docs/reliability.md): duplicate label ids are kept once,
    duplicate feature ids are kept as written (the bag sums them), rows without labels are kept."""
    src = write_xc(tmp_path / "src", train="3 4 3\n1,1,0 2:1 2:0.5\n 1:1\n2\n", test="1 4 3\n0 0:1\n")
    ds = load_dataset("xc_sparse", src, str(tmp_path / "c"))
    assert ds.train.labels.row(0)[0].tolist() == [0, 1]
    assert ds.train.features.row(0)[0].tolist() == [2, 2] and ds.train.features.row(0)[1].tolist() == [1.0, 0.5]
    assert ds.train.labels.row(1)[0].size == 0 and ds.train.num_points == 3


# ---------------------------------------------------------------- concurrency

def _worker(args):
    src, cache, log = args
    real = cache_mod.convert_source

    def logged(*a):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)  # widen the race window
        return real(*a)

    cache_mod.convert_source = logged
    ds = load_dataset("xc_sparse", src, cache)
    return ds.meta["cache_dir"], int(ds.train.labels.nnz)


def test_concurrent_loads_convert_once(tmp_path):
    src, log = write_xc(tmp_path / "s"), str(tmp_path / "log")
    with mp.get_context("fork").Pool(2) as pool:
        results = pool.map(_worker, [(src, str(tmp_path / "c"), log)] * 2)
    assert results[0] == results[1] and results[0][1] == 5
    with open(log) as f:
        assert len(f.read().split()) == 1


# ---------------------------------------------------------------- real data

@pytest.mark.parametrize("name,kind,shape", [
    ("bibtex", "xc_sparse", (4880, 2515, 159, 1836)),
    ("delicious", "xc_sparse", (12920, 3185, 983, 500)),
    ("debian-deps", "lf_raw", (45644, 11056, 37960, 41375)),
])
def test_real_data(tmp_path, name, kind, shape):
    src = os.path.join(SHARED, name)
    if not os.path.isdir(src):
        pytest.skip(f"{src} missing")
    ds = load_dataset(kind, src, str(tmp_path))
    assert (ds.train.num_points, ds.test.num_points, ds.num_labels, ds.num_features) == shape
    if name == "bibtex":
        assert abs(ds.train.labels.nnz / ds.train.num_points - 2.39) < 0.01
        assert ds.train.labels.column_counts().min() > 0
    if kind == "lf_raw":
        assert len(read_texts(ds.label_texts_path)) == ds.num_labels
    shutil.rmtree(tmp_path, ignore_errors=True)
