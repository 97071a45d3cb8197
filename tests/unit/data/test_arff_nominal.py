"""ARFF as MULAN ships it: nominal features one-hot, two-valued ones as one column, string and identifier
attributes skipped, {YES,NO} labels, date attributes refused; dense and sparse rows, fast and strict paths."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import xc.data.arff as arff_mod
from tests.unit.data.test_formats_multilabel import _convert_both_ways
from xc.data import load_dataset, read_texts
from xc.data.arff_header import read_header
from xc.errors import DataFormatError

# Labels tag_a {YES,NO} (present at YES) and tag_b {0,1}; features: x (column 0), flag {NO,YES} (1),
# loc {2,10,1} (2, 3, 4: one per value), colour {red,green} (5: the second value, no affirmative word),
# note (a string: skipped), on {yes,no} (6: present at yes, its FIRST value).
WORDS_HEADER = """@relation 'toy: -C 2'
@attribute tag_a {YES,NO}
@attribute tag_b {0,1}
@attribute x numeric
@attribute flag {NO,YES}
@attribute loc {2,10,1}
@attribute colour {red,green}
@attribute note string
@attribute on {yes,no}
@data
"""
DENSE_ROWS = ["YES,0,1.5,YES,10,red,'hello world',yes", "NO,1,0,NO,2,green,?,no", "?,?,?,?,?,?,?,?",
              'NO,0,0,NO,1,red,"a, b",no', "YES,1,3,YES,2,green,x,yes", "NO,0,0,NO,10,red,y,no",
              "NO,0,0,NO,1,red,z,no", "NO,0,0,NO,2,red,z,no", "YES,0,0,NO,2,red,?,yes"]
# The same rows as Weka writes them sparse: a left-out nominal is its first declared value (tag_a YES,
# flag NO, loc 2, colour red, on yes), a left-out numeric 0; the last row leaves out everything.
SPARSE_ROWS = ["{2 1.5,3 YES,4 10,6 'hello world'}", "{0 NO,1 1,3 NO,5 green,6 ?,7 no}",
               "{0 ?,1 ?,2 ?,3 ?,4 ?,5 ?,6 ?,7 ?}", "{0 NO,4 1,6 'a, b',7 no}", "{1 1,2 3,3 YES,5 green,6 x}",
               "{0 NO,4 10,6 y,7 no}", "{0 NO,4 1,6 z,7 no}", "{0 NO,6 z,7 no}", "{}"]
EXPECTED_LABELS = [[0], [1], [], [], [0, 1], [], [], [], [0]]
EXPECTED_FEATURES = [([0, 1, 3, 6], [1.5, 1, 1, 1]), ([2, 5], [1, 1]), ([], []), ([4], [1]),
                     ([0, 1, 2, 5, 6], [3, 1, 1, 1, 1]), ([3], [1]), ([4], [1]), ([2], [1]), ([2, 6], [1, 1])]


def _csr(rows_cols, rows_vals=None):
    """(indptr, indices, values) of hand-written rows."""
    indptr = np.cumsum([0] + [len(c) for c in rows_cols])
    indices = np.array([c for cols in rows_cols for c in cols], dtype=np.int32)
    values = None if rows_vals is None else np.array([v for vals in rows_vals for v in vals], dtype=np.float32)
    return indptr, indices, values


def _assert_csr(matrix, rows_cols, rows_vals=None):
    indptr, indices, values = _csr(rows_cols, rows_vals)
    np.testing.assert_array_equal(matrix.indptr, indptr)
    np.testing.assert_array_equal(matrix.indices, indices)
    if values is not None:
        np.testing.assert_array_equal(matrix.values, values)


def _source(tmp_path, header, train_rows, test_rows=None, name="src"):
    d = tmp_path / name
    d.mkdir()
    (d / "train.arff").write_text(header + "\n".join(train_rows) + "\n")
    (d / "test.arff").write_text(header + "\n".join(test_rows or train_rows[:1]) + "\n")
    return d


@pytest.mark.parametrize("rows", ["dense", "sparse", "mixed"])
def test_one_hot_encoding_matches_hand_written_csr(tmp_path, rows, caplog):
    train = {"dense": DENSE_ROWS, "sparse": SPARSE_ROWS,
             "mixed": [(d if k % 2 else s) for k, (d, s) in enumerate(zip(DENSE_ROWS, SPARSE_ROWS))]}[rows]
    d = _source(tmp_path, WORDS_HEADER, train, test_rows=[SPARSE_ROWS[-1]])
    with caplog.at_level(logging.INFO, logger="xc.data.arff_schema"):
        ds = load_dataset("arff", str(d), str(tmp_path / "cache"))
    assert (ds.num_labels, ds.num_features) == (2, 7)
    _assert_csr(ds.train.labels, EXPECTED_LABELS)
    _assert_csr(ds.train.features, *zip(*EXPECTED_FEATURES))
    _assert_csr(ds.test.labels, [[0]])
    _assert_csr(ds.test.features, [[2, 6]], [[1, 1]])
    assert read_texts(ds.label_texts_path) == ["tag_a", "tag_b"]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "string: note" in skipped[0], skipped


NUMBERS_HEADER = """@relation 'numbers: -C -2'
@attribute loc {2,10,1}
@attribute x numeric
@attribute bit {1,0}
@attribute l0 {0,1}
@attribute l1 numeric
@data
"""
# loc one-hot (columns 0-2), x (3), bit {1,0} present at 1, its FIRST value (4): all numbers, so the
# block fast path reads them; the left-out loc and bit of a sparse row are 2 and 1.
NUMBER_ROWS = ["10,0.5,0,1,0", "{0 1,2 0,4 2}", "2,0,1,0,0", "{1 -1,3 1}", "1.0,0,0,1,3"]


def test_numeric_nominals_take_the_fast_path_and_agree_with_the_strict_one(tmp_path, monkeypatch):
    d = _source(tmp_path, NUMBERS_HEADER, NUMBER_ROWS)
    info, (train_labels, train_features, _, _) = _convert_both_ways("arff", str(d), str(tmp_path), monkeypatch)
    assert (info["num_labels"], info["num_features"]) == (2, 5)
    _assert_csr(train_labels, [[0], [1], [], [0], [0, 1]])
    _assert_csr(train_features, [[1, 3], [2], [0, 4], [0, 3, 4], [2]], [[1, 0.5], [1], [1, 1], [1, -1, 1], [1]])
    head, _ = read_header(str(d / "train.arff"))
    schema = arff_mod.ArffSchema(head, np.array([3, 4]))
    for block in (NUMBER_ROWS[0::2], NUMBER_ROWS[1::2][:1]):  # dense rows, sparse rows
        assert arff_mod._fast_block(block, schema) is not None, block


def _ids_header(num_ids):
    values = ",".join(f"P{k:03d}" for k in range(num_ids))
    return (f"@relation 'ids: -C 1'\n@attribute lab {{0,1}}\n@attribute protein {{{values}}}\n"
            "@attribute x numeric\n@data\n")


@pytest.mark.parametrize("num_rows, skipped", [(48, True), (49, False)])
def test_a_nominal_with_a_value_per_two_rows_is_an_identifier_and_skipped(tmp_path, num_rows, skipped, caplog):
    """24 declared values (at least 20): an identifier in 48 rows (24 >= 0.5 x 48), one-hot in 49."""
    rows = [f"{k % 2},P{k % 24:03d},{k + 1}" for k in range(num_rows)]
    d = _source(tmp_path, _ids_header(24), rows)
    with caplog.at_level(logging.INFO, logger="xc.data.arff_schema"):
        ds = load_dataset("arff", str(d), str(tmp_path / "cache"))
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    if skipped:
        assert ds.num_features == 1 and ds.train.features.to_scipy().toarray()[:, 0].tolist() == list(range(1, 49))
        assert len(lines) == 1 and "protein (24 values)" in lines[0] and "48 rows" in lines[0], lines
    else:
        assert ds.num_features == 25 and not lines
        assert ds.train.features.to_scipy().toarray()[3, :24].tolist() == [0, 0, 0, 1] + [0] * 20


def test_rows_are_counted_only_as_far_as_the_identifier_rule_needs(tmp_path):
    from xc.data.arff_schema import count_data_rows  # the module is new: the other tests fail on their own

    d = _source(tmp_path, _ids_header(3), ["0,P000,1", "% a comment", "", "1,P001,2"] + ["0,P002,3"] * 50)
    head, _ = read_header(str(d / "train.arff"))
    assert count_data_rows(head, stop_after=1000) == 52
    assert count_data_rows(head, stop_after=5) == 6  # stops at the first row past the limit


def test_an_identifier_may_declare_other_values_in_the_test_file_a_feature_may_not(tmp_path):
    rows = [f"{k % 2},P{k % 24:03d},{k + 1}" for k in range(48)]
    d = _source(tmp_path, _ids_header(24), rows)
    (d / "test.arff").write_text(_ids_header(30) + "1,P029,5\n")
    assert load_dataset("arff", str(d), str(tmp_path / "cache")).num_features == 1
    d2 = _source(tmp_path, _ids_header(3), [f"{k % 2},P{k % 3:03d},{k}" for k in range(30)], name="src2")
    (d2 / "test.arff").write_text(_ids_header(4) + "1,P003,5\n")
    with pytest.raises(DataFormatError, match=r"test\.arff:3: attribute protein: differs from .*train\.arff:3 "
                                              r"\('protein', \{P000,P001,P002\}\)"):
        load_dataset("arff", str(d2), str(tmp_path / "cache"))


@pytest.mark.parametrize("row, field, needle", [
    ("maybe,0,1.5,YES,10,red,x,yes", "value of tag_a", "'maybe' is not one of {YES,NO}"),
    ("YES,0,1.5,YES,11,red,x,yes", "value of loc", "'11' is not one of {2,10,1}"),
    ("{0 YES,5 blue}", "value of colour", "'blue' is not one of {red,green}"),
    ("YES,0,1.5,yes,10,red,x,yes", "value of flag", "'yes' is not one of {NO,YES}"),  # case counts, as in Weka
])
def test_undeclared_nominal_values_name_file_line_field(tmp_path, row, field, needle):
    d = _source(tmp_path, WORDS_HEADER, [DENSE_ROWS[0], row])
    with pytest.raises(DataFormatError) as e:
        load_dataset("arff", str(d), str(tmp_path / "cache"))
    assert (e.value.path, e.value.line, e.value.field) == (str(d / "train.arff"), 12, field), str(e.value)
    assert needle in e.value.problem, str(e.value)


def test_a_date_attribute_is_refused_naming_file_line_and_attribute(tmp_path):
    header = WORDS_HEADER.replace("@attribute note string", "@attribute seen date 'yyyy-MM-dd HH:mm:ss'")
    d = _source(tmp_path, header, ["YES,0,1,YES,2,red,'2024-01-02 03:04:05',yes"])
    with pytest.raises(DataFormatError) as e:
        load_dataset("arff", str(d), str(tmp_path / "cache"))
    assert (e.value.path, e.value.line, e.value.field) == (str(d / "train.arff"), 8, "attribute seen")
    assert "date attributes are not supported" in e.value.problem and "\n" not in str(e.value)
