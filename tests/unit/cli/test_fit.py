"""`xc.fit`'s inputs are checked before anything is staged: one line naming the argument, never a model trained on
a different problem (a -1/+1 matrix, label names shifted or padded) or an error naming a staged file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp

from xc.cli.fit import stage_sources
from xc.errors import XCError

X = np.random.default_rng(0).random((10, 4)).astype(np.float32)
Y = (np.arange(10)[:, None] % 5 == np.arange(5)[None, :]).astype(np.int64)  # (10, 5) 0/1, one label a row
TEXTS = [f"text {i}" for i in range(10)]


def _stage(tmp_path, x, y, **kw):
    return stage_sources(str(tmp_path / "cache"), x, y, **kw)


@pytest.mark.parametrize("y, match", [
    (2 * Y - 1, r"Y\[0, 1\] is -1: label entries are 0 or 1 \(or bool\) \(for a -1/\+1 matrix, pass Y > 0\)"),
    (Y * 0.5, r"Y\[0, 0\] is 0.5"),
    (np.where(Y == 1, np.nan, 0.0), r"Y\[0, 0\] is nan"),
    (sp.csr_matrix(Y * 2), r"Y\[0, 0\] is 2"),
    (Y.astype(str), "Y has dtype <U21: a label matrix holds 0/1 numbers or bools"),
    (Y[:, 0], "Y must be an \\(n, L\\) sparse or dense 0/1 matrix or n lists of label names, got a 1-D array"),
    (Y[:7], "Y has 7 rows, its inputs 10"),
])
def test_label_matrices_hold_zeros_and_ones(tmp_path, y, match):
    with pytest.raises(XCError, match=match):
        _stage(tmp_path, X, y)
    assert not list((tmp_path / "cache" / "fit-sources").iterdir())  # nothing staged, no temporary folder left


def test_bool_and_sparse_label_matrices_are_taken(tmp_path):
    kind, folder = _stage(tmp_path, X, Y.astype(bool))
    assert kind == "npz"
    staged = sp.load_npz(f"{folder}/train_Y.npz").toarray()
    assert staged.shape[1] == 5 and set(np.unique(staged)) == {0, 1}
    assert _stage(tmp_path, sp.csr_matrix(X), sp.coo_matrix(Y))[0] == "npz"


@pytest.mark.parametrize("x, match", [
    ([1, 2, 3] * 3 + [4], r"X\[0\] is int, not a text: X is a list of texts \(str\) or an \(n, F\) feature matrix"),
    (TEXTS[:3] + [None] + TEXTS[4:], r"X\[3\] is NoneType, not a text"),
    (np.arange(10.0), "X must be a scipy sparse matrix, a 2-D numeric numpy array or a list of texts, got a 1-D "
                      "float64 array"),
    (np.where(X > 0.9, np.inf, X), "X holds NaN or infinite values"),
    ([], "X has no rows"),
])
def test_inputs_are_texts_or_finite_feature_matrices(tmp_path, x, match):
    with pytest.raises(XCError, match=match):
        _stage(tmp_path, x, Y)


@pytest.mark.parametrize("names, match", [
    ([f"n{j}" for j in range(7)], "label_names has 7 names for the 5 label columns of Y"),
    ([f"n{j}" for j in range(3)], "label_names has 3 names for the 5 label columns of Y"),
    (["a", "b", "a", "c", "d"], r"label_names\[2\] 'a' repeats label_names\[0\]: each label needs its own name"),
    (["a", "b", "c\td", "e", "f"], r"label_names\[2\] 'c\\td' holds a tab, a line break or another control"),
    (["a", "b", "c", "two\nlines", "f"], r"label_names\[3\] 'two\\nlines' holds a tab, a line break"),
    (["a", " ", "c", "d", "e"], r"label_names\[1\] is a blank label name"),
    ("abcde", "label_names must be a list of names, got str"),
])
@pytest.mark.parametrize("x", [X, TEXTS], ids=["features", "texts"])
def test_label_names_are_one_distinct_line_each_and_one_per_label(tmp_path, x, names, match):
    with pytest.raises(XCError, match=match):
        _stage(tmp_path, x, Y, label_names=names)


def test_label_names_name_the_columns_in_order(tmp_path):
    names = ["e", "d", "c", "b", "a"]
    _, folder = _stage(tmp_path, TEXTS, Y, x_test=TEXTS[:2], y_test=Y[:2], label_names=names)
    assert open(f"{folder}/labels.txt", encoding="utf-8").read().split() == names
    first = json.loads(open(f"{folder}/train.jsonl", encoding="utf-8").readline())
    assert first["labels"] == ["e"]  # row 0 holds column 0


def test_label_name_lists_are_checked_against_label_names(tmp_path):
    tags = [["x"], ["y", "x"]] * 5
    with pytest.raises(XCError, match=r"Y\[1\] names the label 'y', which is not in label_names"):
        _stage(tmp_path, TEXTS, tags, label_names=["x", "z"])
    with pytest.raises(XCError, match=r"Y\[3\] label 'y\\nz' holds a tab, a line break"):
        _stage(tmp_path, TEXTS, tags[:3] + [["y\nz"]] + tags[4:])
    _, folder = _stage(tmp_path, TEXTS, tags, label_names=["z", "y", "x"])
    assert open(f"{folder}/labels.txt", encoding="utf-8").read().split() == ["z", "y", "x"]
    with pytest.raises(XCError, match="Y and Y_test must both be 0/1 matrices or both be lists of label names"):
        _stage(tmp_path, TEXTS, tags, x_test=TEXTS[:2], y_test=Y[:2])
