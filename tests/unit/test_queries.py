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
