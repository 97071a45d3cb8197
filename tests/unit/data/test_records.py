"""Records with a text and label names (data.kind=jsonl|csv|tsv): what is read, the ids it gets, the errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from xc.data import load_dataset, read_texts
from xc.data.records import LABEL_NAMES, RecordFields, carve_test, read_label_names
from xc.errors import DataFormatError


def _labels(split) -> list[list[int]]:
    m = split.labels
    return [m.indices[m.indptr[i]:m.indptr[i + 1]].tolist() for i in range(m.num_rows)]


def _names(ds) -> list[str]:
    return read_label_names(ds.meta["cache_dir"], ds.meta, ds.num_labels)


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_jsonl_names_become_ids_in_order_of_first_appearance(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(src / "train.jsonl", [{"text": "fast json parser", "labels": ["json", "python"]},
                                 {"text": "plot charts", "labels": ["python", "plot", "python"]},
                                 {"text": "nothing", "labels": []}])
    (src / "train.jsonl").write_text((src / "train.jsonl").read_text() + "\n")  # a blank line is not a record
    _jsonl(src / "test.jsonl", [{"text": "yaml parser", "labels": ["yaml", "json"]}])
    ds = load_dataset("jsonl", str(src), str(tmp_path / "cache"))
    assert ds.num_labels == 4  # json 0, python 1, plot 2 from train; yaml 3 seen only in test
    assert _labels(ds.train) == [[0, 1], [1, 2], []]  # duplicates kept once, ids sorted within a row
    assert _labels(ds.test) == [[0, 3]]
    assert read_texts(ds.train.texts_path) == ["fast json parser", "plot charts", "nothing"]
    assert _names(ds) == ["json", "python", "plot", "yaml"]
    assert ds.train.features is not None and ds.train.features.num_rows == 3  # tf-idf, as LF raw text


def test_csv_quoting_bom_multiline_text_json_list_and_a_label_file(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rows = ('\ufeffid,text,tags\r\n'
            '1,"a ""quoted"", text",b;a\r\n'
            '2,"two\nlines","[""c"", ""a""]"\r\n'
            '3,plain,\r\n')
    (src / "train.csv").write_bytes(rows.encode("utf-8"))
    (src / "test.csv").write_text("id,text,tags\n9,held out,c\n", encoding="utf-8")
    (src / "labels.txt").write_text("a\tthe letter a\nb\nc\td\n", encoding="utf-8")
    fields = RecordFields(labels_field="tags", label_delimiter=";")
    ds = load_dataset("csv", str(src), str(tmp_path / "cache"), fields=fields)
    assert read_texts(ds.train.texts_path) == ['a "quoted", text', "two lines", "plain"]
    assert _labels(ds.train) == [[0, 1], [0, 2], []] and _labels(ds.test) == [[2]]
    assert read_texts(ds.label_texts_path) == ["the letter a", "b", "d"]  # a name without text is its own text
    assert _names(ds) == ["a", "b", "c"]
    tsv = tmp_path / "tsv"
    tsv.mkdir()
    (tsv / "train.tsv").write_text("labels\ttext\nx,y\tfirst\ny\tsecond\n", encoding="utf-8")
    (tsv / "test.tsv").write_text("labels\ttext\nx\tthird\n", encoding="utf-8")
    ds = load_dataset("tsv", str(tsv), str(tmp_path / "cache"))
    assert _labels(ds.train) == [[0, 1], [1]] and _labels(ds.test) == [[0]]


def test_other_fields_are_another_dataset(tmp_path):
    """The fields read are part of the cache key: naming another field converts again, it never reuses."""
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(src / "train.jsonl", [{"text": "a", "title": "t a", "labels": ["x"]}, {"text": "b", "title": "t b",
                                                                               "labels": ["y"]}])
    _jsonl(src / "test.jsonl", [{"text": "c", "title": "t c", "labels": ["x"]}])
    first = load_dataset("jsonl", str(src), str(tmp_path / "cache"))
    assert read_texts(first.train.texts_path) == ["a", "b"]
    second = load_dataset("jsonl", str(src), str(tmp_path / "cache"), fields=RecordFields(text_field="title"))
    assert read_texts(second.train.texts_path) == ["t a", "t b"]


def test_no_test_file_carves_a_fixed_fifth(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(src / "train.jsonl", [{"text": f"item {i}", "labels": [f"l{i % 7}"]} for i in range(50)])
    ds = load_dataset("jsonl", str(src), str(tmp_path / "cache"))
    held = carve_test(50)
    assert ds.test.num_points == 10 == len(held) and ds.train.num_points == 40
    assert read_texts(ds.test.texts_path) == [f"item {i}" for i in held]
    assert np.array_equal(held, carve_test(50))  # the same rows on every call: no run seed involved
    assert len(carve_test(1_000_000)) == 10_000


@pytest.mark.parametrize("kind, train, field, line", [
    ("jsonl", '{"text": "a", "labels": ["x"]}\n{"text": "b", "labels": ["x"]\n', "json", 2),
    ("jsonl", '{"text": "a", "labels": ["x"]}\n{"body": "b", "labels": ["x"]}\n', "text", 2),
    ("jsonl", '{"text": "a", "labels": ["x"]}\n{"text": "b", "labels": [1, 2]}\n', "labels", 2),
    ("jsonl", '{"text": "a", "labels": ["x"]}\n{"text": "b"}\n', "labels", 2),
    ("jsonl", '[1, 2]\n', "json", 1),
    ("csv", 'text,tags\na,x\n', "header", 1),
    ("csv", 'text,labels\n"a\nb",x\nc\n', "row", 4),
    ("csv", 'text,labels\na,"[x"\n', "labels", 2),
    # a stray quote in the labels is not a label name with a quote in it; one opening a field swallows no records
    ("csv", 'text,labels\na,tag1\nb,tag21"\nc,tag3\n', "labels", 3),
    ("csv", 'text,labels\n"a,tag1\nb",tag21"\nc,tag3\n', "labels", 2),
    ("csv", 'text,labels\na,tag1\n"b,tag2\nc,tag3\n', "text", 3),
    ("csv", 'text,labels\na,"tag1"x\n', "labels", 2),
    ("tsv", 'text\tlabels\na\tx\n"b\ty\n', "text", 3),
])
def test_bad_records_name_file_line_and_field(tmp_path, kind, train, field, line):
    src = tmp_path / "src"
    src.mkdir()
    (src / f"train.{kind}").write_text(train, encoding="utf-8")
    with pytest.raises(DataFormatError) as err:
        load_dataset(kind, str(src), str(tmp_path / "cache"))
    assert (err.value.path, err.value.line, err.value.field) == (str(src / f"train.{kind}"), line, field)


def test_a_label_missing_from_the_label_file_is_named(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(src / "train.jsonl", [{"text": "a", "labels": ["x"]}, {"text": "b", "labels": ["x", "typo"]}])
    (src / "labels.txt").write_text("x\ny\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match="'typo' is not in labels.txt") as err:
        load_dataset("jsonl", str(src), str(tmp_path / "cache"))
    assert err.value.line == 2
    (src / "labels.txt").write_text("x\ny\nx\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match="already named on line 1"):
        load_dataset("jsonl", str(src), str(tmp_path / "cache"))


def test_a_quoted_label_field_may_hold_a_quote(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.csv").write_text('text,labels\na,"say ""hi"",b"\nc "d" e,b\n', encoding="utf-8")
    (src / "test.csv").write_text("text,labels\nf,b\n", encoding="utf-8")
    ds = load_dataset("csv", str(src), str(tmp_path / "cache"))
    assert _names(ds) == ['say "hi"', "b"]  # a quote in an unquoted text is kept as text
    assert read_texts(ds.train.texts_path) == ["a", 'c "d" e']


def test_a_label_name_with_a_line_break_keeps_every_name_in_its_place(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    names = [f"tag{j}" for j in range(50)]
    names[7] = "two\nlines"
    _jsonl(src / "train.jsonl", [{"text": f"item {j}", "labels": [n]} for j, n in enumerate(names)])
    _jsonl(src / "test.jsonl", [{"text": "held", "labels": ["tag9"]}])
    ds = load_dataset("jsonl", str(src), str(tmp_path / "cache"))
    assert ds.num_labels == 50 and _names(ds) == names
    assert len(read_texts(ds.label_texts_path)) == 50  # the label texts are one a line: the break is a space
    # a cache written a name a line, as earlier versions did: refused in one line naming it, not misnamed
    legacy = {k: v for k, v in ds.meta.items() if k != "label_names_format"}
    path = f"{ds.meta['cache_dir']}/{LABEL_NAMES}"
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(n + "\n" for n in names))
    with pytest.raises(DataFormatError, match="51 lines for the data's 50 labels") as err:
        read_label_names(ds.meta["cache_dir"], legacy, 50)
    assert err.value.path == path and "\n" not in str(err.value)
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(n + "\n" for n in names if "\n" not in n) + "x\n")
    assert read_label_names(ds.meta["cache_dir"], legacy, 50)[-1] == "x"  # an earlier cache still reads


@pytest.mark.parametrize("kind, name, body, line", [
    ("jsonl", "train.jsonl", b'{"text": "a", "labels": ["x"]}\n{"text": "b\xff", "labels": ["x"]}\n', 2),
    ("csv", "train.csv", b"text,labels\na,x\nb,y\n\xe9t\xe9,x\n", 4),
    ("jsonl", "labels.txt", b"x\ny\xc3\n", 2),
])
def test_text_that_is_not_utf8_is_named_by_file_line_and_byte(tmp_path, kind, name, body, line):
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(src / "train.jsonl", [{"text": "a", "labels": ["x"]}, {"text": "b", "labels": ["y"]}])
    (src / name).write_bytes(body)
    with pytest.raises(DataFormatError, match="not UTF-8: byte 0x") as err:
        load_dataset(kind, str(src), str(tmp_path / "cache"))
    assert (err.value.path, err.value.line, err.value.field) == (str(src / name), line, "encoding")
    with pytest.raises(UnicodeDecodeError) as bad:
        body.decode("utf-8")
    assert f"byte offset {bad.value.start} of the file" in str(err.value)
