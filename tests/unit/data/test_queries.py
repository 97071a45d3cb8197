"""Prediction inputs (xc/data/queries.py): format detection, XC feature lines, npz, and errors that name
file, line and field."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from xc.data.queries import parse_sparse_lines, read_queries
from xc.errors import DataFormatError


def _rows(blocks):
    return [b for b in blocks]


def test_sparse_lines_with_header_and_labels_parse_to_csr(tmp_path):
    path = tmp_path / "q.txt"
    path.write_text("3 10 4\n1,2 0:1 3:0.5\n 7:2\n\n")
    fmt, blocks = read_queries(str(path), "auto", 2, 10)
    blocks = _rows(blocks)
    assert fmt == "sparse" and [b.first_line for b in blocks] == [2, 4]
    m = blocks[0].features
    assert m.indptr.tolist() == [0, 2, 3] and m.indices.tolist() == [0, 3, 7]
    assert m.values.tolist() == [1.0, 0.5, 2.0]
    assert blocks[1].features.num_rows == 1 and blocks[1].features.nnz == 0  # an empty line: a row without features


def test_text_is_detected_and_streamed_in_blocks(tmp_path):
    path = tmp_path / "q.txt"
    path.write_text("python json parser\nfast 3d engine\nthird\n")
    fmt, blocks = read_queries(str(path), "auto", 2, 0)
    assert fmt == "text" and [b.texts for b in blocks] == [["python json parser", "fast 3d engine"], ["third"]]


@pytest.mark.parametrize("line,field", [
    ("3:1 7:x", "feature 2 value"),
    ("3:1 seven", "feature 2"),
    ("3:1 12:1", "feature 2 id"),
    ("abc 3:1", "feature 1"),
    ("3:1 4:inf", "feature 2 value"),
])
def test_malformed_sparse_line_names_file_line_and_field(line, field):
    with pytest.raises(DataFormatError) as err:
        parse_sparse_lines(["1:1", line], 41, "q.txt", 10)
    assert (err.value.path, err.value.line, err.value.field) == ("q.txt", 42, field)
    assert str(err.value).startswith(f"q.txt:42: {field}: ")


def test_npz_dense_and_sparse(tmp_path):
    x = np.array([[0, 1.5, 0], [2, 0, 0]], np.float32)
    np.savez(tmp_path / "d.npz", X=x)
    sp.save_npz(tmp_path / "s.npz", sp.csr_matrix(x))
    for name in ("d.npz", "s.npz"):
        fmt, blocks = read_queries(str(tmp_path / name), "auto", 10, 3)
        (block,) = list(blocks)
        assert fmt == "npz" and block.features.indices.tolist() == [1, 0] and block.features.values.tolist() == [1.5, 2]
    with pytest.raises(DataFormatError, match="3 feature columns, but the model reads 4"):
        list(read_queries(str(tmp_path / "d.npz"), "auto", 10, 4)[1])


def test_missing_input_file_is_a_data_error(tmp_path):
    with pytest.raises(DataFormatError, match="missing.txt: file: cannot be read"):
        read_queries(str(tmp_path / "missing.txt"), "auto", 10, 5)


@pytest.mark.parametrize("line,field", [
    ("1:0.5 -3:1.0", "feature 2 id"),
    ("1:nan", "feature 1 value"),
    ("5,7 2:1 4:1e999", "feature 2 value"),
])
def test_malformed_pairs_are_detected_as_sparse_and_get_the_precise_error(tmp_path, line, field):
    """Auto-detection must not call a line of bad `id:value` pairs raw text: the sparse parser names the field."""
    path = tmp_path / "q.txt"
    path.write_text(line + "\n")
    fmt, blocks = read_queries(str(path), "auto", 10, 10)
    assert fmt == "sparse"
    with pytest.raises(DataFormatError) as err:
        list(blocks)
    assert (err.value.line, err.value.field) == (1, field), str(err.value)


@pytest.mark.parametrize("text", ["meet at 10:30 tomorrow", "ratio 3:1 is fine", "python json"])
def test_text_with_a_colon_stays_text(tmp_path, text):
    path = tmp_path / "q.txt"
    path.write_text(text + "\n")
    assert read_queries(str(path), "auto", 10, 0)[0] == "text"


def test_a_line_longer_than_the_limit_is_refused_with_its_number(tmp_path, monkeypatch):
    import xc.data.queries as queries

    monkeypatch.setattr(queries, "MAX_LINE_CHARS", 50)
    path = tmp_path / "q.txt"
    path.write_text("short query\n" + "word " * 20 + "\nanother\n")
    fmt, blocks = read_queries(str(path), "auto", 1, 0)
    with pytest.raises(DataFormatError) as err:
        list(blocks)
    assert (err.value.line, err.value.field) == (2, "length") and "longer than 50 characters" in str(err.value)
    path.write_text("x" * 50 + "\n" + "y" * 50)  # exactly at the limit, with and without an end of line
    assert [b.texts for b in read_queries(str(path), "text", 1, 0)[1]] == [["x" * 50], ["y" * 50]]


@pytest.mark.parametrize("num_features", [0, 10])  # a text model, a feature-row model
def test_blank_lines_alone_are_no_queries_said_in_one_line(tmp_path, num_features):
    """Blank lines only were read as raw text, and a feature-row model then blamed the input for being raw text."""
    path = tmp_path / "q.txt"
    path.write_text("\n  \n\t\n")
    with pytest.raises(DataFormatError) as err:
        read_queries(str(path), "auto", 10, num_features)
    message = str(err.value)
    assert message.startswith(f"{path}: input: holds no queries: 3 blank line(s)") and "raw text, but" not in message


def test_leading_blank_lines_stay_rows_and_the_first_real_line_tells_the_format(tmp_path):
    path = tmp_path / "q.txt"
    path.write_text("\n\n1:1 3:0.5\n")
    fmt, blocks = read_queries(str(path), "auto", 10, 10)
    (block,) = list(blocks)
    assert fmt == "sparse" and block.first_line == 1 and block.features.num_rows == 3
    assert block.features.indptr.tolist() == [0, 0, 0, 2]


def test_query_lines_are_read_by_the_training_files_parser(monkeypatch):
    """One XC-line parser: xc-predict's lines go through xc/data/formats.py's, which now also names an id too long
    for int64 as the id (it was blamed on the value), with the position of the pair on the line."""
    import xc.data.queries as queries

    seen = []
    real = queries._parse_block
    monkeypatch.setattr(queries, "_parse_block", lambda *a: seen.append(a[3]) or real(*a))
    m = parse_sparse_lines([" 5,7\x0b1:0.5\xa03:2", "2:1"], 1, "q.txt", 10)  # any white space separates, as before
    assert m.indptr.tolist() == [0, 2, 3] and m.indices.tolist() == [1, 3, 2] and m.values.tolist() == [0.5, 2, 1]
    assert seen and seen[0].numbered and seen[0].optional_labels
    with pytest.raises(DataFormatError) as err:
        parse_sparse_lines(["1:1 99999999999999999999:1"], 7, "q.txt", 10)
    assert (err.value.line, err.value.field) == (7, "feature 2 id") and "the model reads 10 features" in str(err.value)
