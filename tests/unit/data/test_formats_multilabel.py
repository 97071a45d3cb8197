"""The formats users already have: MULAN/MEKA multi-label ARFF (data.kind=arff) and multi-label libsvm
(data.kind=libsvm): parsing, layouts, label names, and every malformed case naming file:line: field."""

from __future__ import annotations

import json
import os
import re
import tempfile

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.data.test_data_formats import _apply_edits
from tests.format_writers import write_all, write_arff, write_libsvm, write_mulan_xml, write_xc
from xc.data import load_dataset, read_texts
from xc.data.cli import main as data_cli
from xc.errors import DataFormatError

SHARED = os.environ.get("XC_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "shared", "data"))


def _dense(m) -> np.ndarray:
    return m.to_scipy().toarray()


def _load(kind, d, tmp_path):
    return load_dataset(kind, str(d), str(tmp_path / "cache"))


def _random(seed=0, n=30, nf=12, nl=7):
    rng = np.random.default_rng(seed)
    y = (rng.random((n, nl)) < 0.25).astype(np.float32)
    x = np.where(rng.random((n, nf)) < 0.3, np.round(rng.random((n, nf)) * 4 + 0.25, 2), 0).astype(np.float32)
    y[min(3, n - 1)] = 0  # a point without labels
    x[min(4, n - 1)] = 0  # a point without features
    return sp.csr_matrix(y), sp.csr_matrix(x)


def _same(ds, splits):
    for split, (y, x) in splits.items():
        part = getattr(ds, split)
        np.testing.assert_array_equal(_dense(part.labels), y.toarray())
        np.testing.assert_array_equal(_dense(part.features), x.toarray())


# ------------------------------------------------------------------------------------------ ARFF


@pytest.mark.parametrize("labels_first", [False, True])
@pytest.mark.parametrize("sparse_rows", [True, False])
def test_arff_mulan_xml_rows_and_label_positions(tmp_path, labels_first, sparse_rows):
    splits = {"train": _random(0), "test": _random(1, n=9)}
    names = ["Beach", "Sun set", "it's", "a,b", "x", "y", "z"]
    d = tmp_path / "src"
    d.mkdir()
    for split, (y, x) in splits.items():
        write_arff(d / f"{split}.arff", y, x, names, labels_first, sparse=sparse_rows)
    write_mulan_xml(d / "labels.xml", names)
    ds = _load("arff", d, tmp_path)
    assert (ds.num_labels, ds.num_features) == (7, 12)
    _same(ds, splits)
    assert read_texts(ds.label_texts_path) == names


@pytest.mark.parametrize("labels_first", [False, True])
def test_arff_meka_c_in_relation(tmp_path, labels_first):
    splits = {"train": _random(2), "test": _random(3, n=5)}
    names = [f"L{j}" for j in range(7)]
    d = tmp_path / "meka"
    d.mkdir()
    for split, (y, x) in splits.items():
        write_arff(d / f"{split}.arff", y, x, names, labels_first, relation=f"Toy: -C {7 if labels_first else -7}")
    ds = _load("arff", d, tmp_path)
    _same(ds, splits)
    assert read_texts(ds.label_texts_path) == names


HEADER = """% a comment before the relation
@RELATION 'toy data'

@Attribute "label one" {0,1}
@attribute 'f \\'quoted\\', with blanks' NUMERIC
% comments may sit anywhere
@attribute\tf2\treal
@attribute 'label two' { 0 , 1 }
@attribute f3 integer
@DATA
"""
XML = '<labels xmlns="http://mulan.sourceforge.net/labels"><label name="label one"/><label name="label two">' \
      '<label name="f3"/></label></labels>'


def test_arff_quoted_names_comments_missing_values_mixed_rows_and_hierarchy(tmp_path):
    d = tmp_path / "q"
    d.mkdir()
    rows = "{0 1,1 2.5,3 '1'}\n%comment\n\n1,?,0,0,0\n  {1 -1e1 , 4 7}  \n{}\n0,'3',0.5,1,0\n"
    (d / "toy-train.arff").write_text(HEADER + rows)
    (d / "toy-test.arff").write_text(HEADER + "0,0,0,0,2\n")
    (d / "toy.xml").write_text(XML)  # f3 is a label too: nested labels of a hierarchy count
    ds = _load("arff", d, tmp_path)
    assert (ds.num_labels, ds.num_features) == (3, 2)
    np.testing.assert_array_equal(_dense(ds.train.labels), [[1, 1, 0], [1, 0, 0], [0, 0, 1], [0, 0, 0], [0, 1, 0]])
    np.testing.assert_array_equal(_dense(ds.train.features), [[2.5, 0], [0, 0], [-10, 0], [0, 0], [3, 0.5]])
    np.testing.assert_array_equal(_dense(ds.test.labels), [[0, 0, 1]])  # numeric label: non-zero is relevant
    assert read_texts(ds.label_texts_path) == ["label one", "label two", "f3"]
    assert ds.meta["kind"] == "arff"


def _arff_dir(tmp_path, train_rows, header=HEADER, xml=XML, test=None):
    d = tmp_path / "bad"
    d.mkdir(exist_ok=True)
    (d / "train.arff").write_text(header + train_rows)
    (d / "test.arff").write_text(test if test is not None else HEADER + "0,0,0,0,0\n")
    if xml is not None:
        (d / "labels.xml").write_text(xml)
    return d


@pytest.mark.parametrize("rows,line,field,needle", [
    ("{0 1,7 1}\n", 11, "attribute index", "7 is out of range"),
    ("{3 1,1 1}\n", 11, "attribute index", "increasing order"),
    ("{0 2}\n", 11, "value of label one", "not one of {0,1}"),
    ("0,abc,0,0,0\n", 11, "value of f 'quoted', with blanks", "'abc' is not a number"),
    ("0,1,0\n", 11, "row", "3 values, but the header declares 5"),
    ("0,0,0,0,0\n{1 1e999}\n", 12, "value of f 'quoted', with blanks", "not a finite float32"),
    ("{1 1} trailing\n", 11, "row", "must end with '}'"),
    ("{1}\n", 11, "sparse item", "expected 'index value'"),
    ("0,'1,0,0,0\n", 11, "row", "unterminated quote"),
    ("% only a comment\n\n", 10, "@data", "no data rows follow"),
])
def test_arff_malformed_rows_name_file_line_field(tmp_path, rows, line, field, needle):
    d = _arff_dir(tmp_path, rows)
    with pytest.raises(DataFormatError) as e:
        _load("arff", d, tmp_path)
    assert (e.value.path, e.value.line, e.value.field) == (str(d / "train.arff"), line, field), str(e.value)
    assert needle in e.value.problem and str(e.value).startswith(f"{d / 'train.arff'}:{line}: {field}: ")


@pytest.mark.parametrize("header,xml,file,line,field,needle", [
    ("@attribute a numeric\n@data\n", XML, "train.arff", 1, "header", "expected '@relation NAME' first"),
    ("@relation r\n@attribute a relational\n@data\n", XML, "train.arff", 2, "attribute a", "type 'relational'"),
    ("@relation r\n@attribute a {x,y,x}\n@data\n", XML, "train.arff", 2, "attribute a", "'x' declared twice"),
    ("@relation r\n@attribute a {x,,y}\n@data\n", XML, "train.arff", 2, "attribute a", "has an empty value"),
    (HEADER.replace('"label one" {0,1}', '"label one" {a,b,c}'), XML, "train.arff", 4, "attribute label one",
     "a label must be numeric or a two-valued nominal"),
    (HEADER.replace("f3 integer", "f3 string"), XML, "train.arff", 9, "attribute f3", "not string"),
    ("@relation r\n@attribute a numeric\n@attribute a numeric\n@data\n", XML, "train.arff", 3, "attribute a",
     "declared twice (first on line 2)"),
    ("@relation r\n@attribute a numeric\n", XML, "train.arff", 0, "header", "no @data line"),
    ("@relation r\n@attribute a numeric\n@attribute b numeric\n@data\n", None, "train.arff", 1, "relation",
     "MEKA's '-C n'"),
    ("@relation 'r: -C 5'\n@attribute a numeric\n@attribute b numeric\n@data\n", None, "train.arff", 1,
     "relation", "-C 5: needs 0 < |C| < 2"),
    (HEADER, '<labels><label name="nope"/></labels>', "labels.xml", 0, "label", "'nope' is not an attribute"),
    (HEADER, "<labels><label name='x'>", "labels.xml", 1, "xml", "no element found"),
])
def test_arff_malformed_headers_and_label_files(tmp_path, header, xml, file, line, field, needle):
    d = _arff_dir(tmp_path, "", header=header, xml=xml)
    with pytest.raises(DataFormatError) as e:
        _load("arff", d, tmp_path)
    assert (e.value.path, e.value.line, e.value.field) == (str(d / file), line, field), str(e.value)
    assert needle in e.value.problem, str(e.value)


def test_arff_test_file_must_declare_the_same_attributes_and_layout_errors(tmp_path):
    d = _arff_dir(tmp_path, "", test=HEADER.replace("f3 integer", "f4 integer") + "0,0,0,0,0\n")
    with pytest.raises(DataFormatError, match=r"test\.arff:9: attribute f4: differs from .*train\.arff:9"):
        _load("arff", d, tmp_path)
    os.remove(d / "test.arff")
    with pytest.raises(DataFormatError, match=r"test\.arff: file: not found"):
        _load("arff", d, tmp_path)
    (d / "a-test.arff").write_text(HEADER)
    (d / "b-test.arff").write_text(HEADER)
    with pytest.raises(DataFormatError, match="2 test files match"):
        _load("arff", d, tmp_path)


# ---------------------------------------------------------------------------------------- libsvm


def _svm(tmp_path, train, test="0 1:1\n", names=("train.txt", "test.txt")):
    d = tmp_path / "svm"
    d.mkdir(exist_ok=True)
    (d / names[0]).write_text(train)
    (d / names[1]).write_text(test)
    return d


def test_libsvm_empty_label_lists_one_based_and_inferred_counts(tmp_path):
    # no labels: a leading blank, a leading feature, or a blank line in the middle; blank lines at the end are not rows
    d = _svm(tmp_path, "2,0,2 1:0.5 4:2\n 3:1\n2:-1.5e0\n\n1 1:1\n\n\n", "5\n")
    ds = _load("libsvm", d, tmp_path)
    assert (ds.num_labels, ds.num_features, ds.train.num_points, ds.test.num_points) == (6, 4, 5, 1)
    np.testing.assert_array_equal(_dense(ds.train.labels)[:, :3], [[1, 0, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0],
                                                                   [0, 1, 0]])
    np.testing.assert_array_equal(_dense(ds.train.features), [[0.5, 0, 0, 2], [0, 0, 1, 0], [0, -1.5, 0, 0],
                                                              [0, 0, 0, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(_dense(ds.test.labels)[0], [0, 0, 0, 0, 0, 1])
    assert ds.label_texts_path is None


def test_libsvm_zero_feature_id_means_zero_based_and_header_fixes_counts(tmp_path):
    d = _svm(tmp_path, "1 0:1 2:1\n", "0 3:1\n", names=("yeast_train.svm", "yeast_test.svm"))
    ds = _load("libsvm", d, tmp_path)
    assert ds.num_features == 4
    np.testing.assert_array_equal(_dense(ds.train.features), [[1, 0, 1, 0]])
    d2 = tmp_path / "h"
    d2.mkdir()
    (d2 / "train.svm").write_text("2 10 9\n1 1:1\n\n")
    (d2 / "test.svm").write_text("1 10 9\n 10:2\n")
    ds = _load("libsvm", d2, tmp_path)
    assert (ds.num_features, ds.num_labels, ds.train.num_points) == (10, 9, 2)
    np.testing.assert_array_equal(_dense(ds.test.features)[0, -1], 2)


@pytest.mark.parametrize("train,line,field,needle", [
    ("1,x 1:1\n", 1, "label id", "'x' is not a non-negative integer"),
    ("1 1:1\n-1 2:1\n", 2, "label id", "'-1' is negative"),
    ("1 1:1\n2 3\n", 2, "feature", "expected 'id:value'"),
    ("1 1:1\n2 3:abc\n", 2, "feature value", "'abc' is not a number"),
    ("1 2:1e999\n", 1, "feature value", "not a finite float32"),
    ("3 4 2\n1 1:1\n0 5:1\n1 1:1\n", 3, "feature id", "5 is out of range (the header says features: 4, ids 1-based)"),
    ("3 4 2\n1 1:1\n2 1:1\n", 3, "label id", "2 is out of range"),
    ("1 4 2\n1 1:1\n0 1:1\n", 3, "row count", "more rows than the 1"),
    ("3 4 2\n1 1:1\n", 1, "row count", "header declares 3 rows but the file has only 1"),
    ("\n \n", 1, "row", "the file holds no data rows"),
    ("1 4 9999999999\n1 1:1\n", 1, "header", "L=9999999999 exceeds"),
])
def test_libsvm_malformed_lines_name_file_line_field(tmp_path, train, line, field, needle):
    has_header = re.fullmatch(r"[0-9]+ [0-9]+ [0-9]+", train.split("\n")[0])
    test = "1 4 2\n0 1:1\n" if has_header else "0 1:1\n"
    d = _svm(tmp_path, train, test)
    with pytest.raises(DataFormatError) as e:
        _load("libsvm", d, tmp_path)
    assert (e.value.path, e.value.line, e.value.field) == (str(d / "train.txt"), line, field), str(e.value)
    assert needle in e.value.problem, str(e.value)


def test_libsvm_headers_must_agree_and_files_must_be_found(tmp_path):
    d = _svm(tmp_path, "1 4 2\n1 1:1\n", "0 1:1\n")
    with pytest.raises(DataFormatError, match=r"test\.txt:1: header: the other file has"):
        _load("libsvm", d, tmp_path)
    (d / "test.txt").write_text("1 5 2\n0 1:1\n")
    with pytest.raises(DataFormatError, match=r"test\.txt:1: header: F L = \(5, 2\) differ"):
        _load("libsvm", d, tmp_path)
    os.remove(d / "test.txt")
    with pytest.raises(DataFormatError, match=r"test\.txt: file: not found"):
        _load("libsvm", d, tmp_path)


# ------------------------------------------------------------------- the same data in every format


def _xc_matrices(ds):
    return {s: (sp.csr_matrix(getattr(ds, s).labels.to_scipy()), sp.csr_matrix(getattr(ds, s).features.to_scipy()))
            for s in ("train", "test")}


def test_bibtex_slice_reads_the_same_in_every_format(tmp_path, capsys):
    src = os.path.join(SHARED, "bibtex")
    if not os.path.isdir(src):
        pytest.skip(f"{src} not present")
    full = load_dataset("xc_sparse", src, str(tmp_path / "c0"))
    splits = {s: (y[:400], x[:400]) for s, (y, x) in _xc_matrices(full).items()}
    dirs = write_all(tmp_path, splits)
    datasets = {kind: _load(kind, d, tmp_path) for kind, d in dirs.items()}
    for kind, ds in datasets.items():
        ref = datasets["xc_sparse"]
        assert (ds.num_labels, ds.num_features) == (ref.num_labels, ref.num_features), kind
        for split in ("train", "test"):
            for what in ("labels", "features"):
                a, b = getattr(getattr(ds, split), what), getattr(getattr(ref, split), what)
                np.testing.assert_array_equal(a.indptr, b.indptr)
                np.testing.assert_array_equal(a.indices, b.indices)
                if what == "features":
                    np.testing.assert_array_equal(a.values, b.values)
    # xc-data convert takes the new kinds too
    assert data_cli(["convert", "--kind", "arff", "--path", str(dirs["arff"]), "--cache", str(tmp_path / "c1"),
                     "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_labels"] == full.num_labels and stats["train"]["points"] == 400
    assert stats["label_texts"].endswith("label_texts.txt")


def test_writers_agree_with_xc_sparse_on_random_data(tmp_path):
    splits = {"train": _random(4), "test": _random(5, n=11)}
    x = splits["train"][1].toarray()
    x[0, 0] = 1.5  # feature 0 occurs: the libsvm copy below is read 0-based
    splits["train"] = (splits["train"][0], sp.csr_matrix(x))
    for kind in ("xc_sparse", "libsvm"):
        (tmp_path / kind).mkdir()
    for s, (y, x) in splits.items():
        write_xc(tmp_path / "xc_sparse" / f"{s}.txt", y, x)
        write_libsvm(tmp_path / "libsvm" / f"{s}.svm", y, x, base=0, header=True)
    _same(_load("xc_sparse", tmp_path / "xc_sparse", tmp_path), splits)
    ds = _load("libsvm", tmp_path / "libsvm", tmp_path)  # 0-based with a header: what an XC file is
    _same(ds, splits)
    assert (ds.num_labels, ds.num_features) == (7, 12)


# ------------------------------------------------------------------------------------------ fuzz

TOKENS = [b":", b",", b" ", b"\t", b"\n", b"\r\n", b"-", b"nan", b"1e39", b".", b"9" * 20, b"\xff", b"{", b"}",
          b"'", b'"', b"?", b"%", b"@data\n", b"0", b"1", b"0:1", b"-C 2"]
EDITS = st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(["set", "ins", "del"]),
                           st.one_of(st.binary(min_size=1, max_size=3), st.sampled_from(TOKENS))),
                 min_size=1, max_size=4)
ARFF_TRAIN = HEADER + "{0 1,1 2.5,3 '1'}\n1,?,0,0,0\n{1 -1e1 , 4 7}\n{}\n0,'3',0.5,1,0\n0,0,0,0,0\n"
SVM_TRAIN = "2,0,2 1:0.5 4:2\n 3:1\n2:-1.5e0\n\n1 1:1\n"


def _convert_both_ways(kind, d, out, monkeypatch):
    """Convert with the block fast path and again with every row parsed alone; both must agree."""
    import xc.data.arff as arff_mod
    import xc.data.formats as formats_mod
    import xc.data.libsvm as libsvm_mod
    import xc.data.sources as sources_mod

    os.makedirs(os.path.join(out, "fast")), os.makedirs(os.path.join(out, "slow"))
    info = sources_mod.convert_source(kind, d, os.path.join(out, "fast"))
    fast = load_dataset_dir(os.path.join(out, "fast"), info)
    with monkeypatch.context() as m:
        if kind == "arff":
            m.setattr(arff_mod, "_fast_block", lambda lines, schema: None)
        else:
            real = formats_mod._parse_block
            m.setattr(libsvm_mod, "_parse_block",
                      lambda lines, lineno, path, spec: _concat([real([t], lineno + k, path, spec)
                                                                 for k, t in enumerate(lines)]))
        info2 = sources_mod.convert_source(kind, d, os.path.join(out, "slow"))
    assert info2 == info
    slow = load_dataset_dir(os.path.join(out, "slow"), info)
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a.indptr, b.indptr)
        np.testing.assert_array_equal(a.indices, b.indices)
        if a.values is not None:
            np.testing.assert_array_equal(a.values, b.values)
    return info, fast


def _concat(parts):
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(5))


def load_dataset_dir(directory, info):
    from xc.data import load_csr

    return [load_csr(directory, f"{s}.{w}", info["num_labels" if w == "labels" else "num_features"])
            for s in ("train", "test") for w in ("labels", "features")]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(edits=EDITS, kind=st.sampled_from(["arff", "libsvm"]))
def test_fuzz_corruptions_parse_or_raise_dataformaterror(edits, kind, monkeypatch):
    data = bytearray((ARFF_TRAIN if kind == "arff" else SVM_TRAIN).encode())
    _apply_edits(data, edits)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "src")
        os.mkdir(src)
        name = "train.arff" if kind == "arff" else "train.txt"
        with open(os.path.join(src, name), "wb") as f:
            f.write(bytes(data))
        with open(os.path.join(src, "test.arff" if kind == "arff" else "test.txt"), "w") as f:
            f.write(HEADER + "0,0,0,0,0\n" if kind == "arff" else "0 1:1\n")
        if kind == "arff":
            with open(os.path.join(src, "labels.xml"), "w") as f:
                f.write(XML)
        try:
            info, mats = _convert_both_ways(kind, src, d, monkeypatch)
        except DataFormatError:
            return
        for m, n in zip(mats, [info["num_labels"], info["num_features"]] * 2):
            assert np.all(np.diff(m.indptr) >= 0) and m.indptr[-1] == m.indices.size
            assert m.indices.size == 0 or (0 <= m.indices.min() and m.indices.max() < n)
            assert m.values is None or np.isfinite(m.values).all()


@pytest.mark.parametrize("kind", ["arff", "libsvm"])
def test_fast_and_strict_paths_agree_on_valid_files(tmp_path, kind, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    if kind == "arff":
        (src / "train.arff").write_text(ARFF_TRAIN)
        (src / "test.arff").write_text(HEADER + "0,0,0,0,2\n")
        (src / "labels.xml").write_text(XML)
    else:
        (src / "train.txt").write_text(SVM_TRAIN)
        (src / "test.txt").write_text("0 1:1\n")
    info, mats = _convert_both_ways(kind, str(src), str(tmp_path), monkeypatch)
    assert info["train"]["num_points"] == (6 if kind == "arff" else 5) and mats[1].nnz > 3
