"""Tagging data as people keep it: one record per item with a text and a list of label *names*
(``data.kind=jsonl``, ``csv`` or ``tsv``).

Layout of the source directory ``data.path``:

* ``train.jsonl`` (``train.csv``, ``train.tsv``): one record per line (CSV/TSV: per row, after a header row).
  The text field (``data.records.text_field``, ``text`` by default) holds the item's text; the labels field
  (``data.records.labels_field``, ``labels``) its label names: in JSON lines a list of strings (a single string
  is one label); in CSV/TSV a string split on ``data.records.label_delimiter`` (``,`` by default; a field that
  reads as a JSON list, ``["a", "b"]``, is taken as that list). Names are stripped of surrounding blanks and
  kept once per record; an empty list is a record with no labels (it still counts in evaluation).
* ``test.jsonl`` (``test.csv``, ``test.tsv``), optional. Without one, the test split is carved from the training
  records by a fixed rule: a fifth of them, at most 10,000, chosen by a permutation seeded with 0, so that every
  run on the same file holds out the same records whatever the run's seed.
* ``labels.txt``, optional: one label name per line, in the order that gives their ids; a line
  ``name<TAB>text`` also gives the label a text (its description, read like LF label texts: tf-idf label
  features, `data.label_text_augmentation`). A name missing from it that a record uses is an error naming the
  record. Without the file, ids follow the first appearance of each name in the training records and then in the
  test records; the label text is the name.

CSV/TSV are read by Python's csv module (quoting, embedded newlines, a UTF-8 byte-order mark), JSON lines by the
json module; every error names the file, the line and the field. Line breaks inside a text become spaces
(the converted texts are one a line). The texts are turned into tf-idf features as LF raw text is
(``text_features.py``), so every encoder and the kNN read them, and the label names travel with the cache
(``label_names.txt``, one JSON string a line, so that a name may hold any character): `xc-predict` prints them.
CSV/TSV are read strictly: a quote left open, text after a closing quote, or a stray quote in an unquoted labels
field is an error naming the line and the column, never a record swallowed or a label name with a quote in it.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass

import numpy as np

from ..errors import DataFormatError
from .formats import write_text_blocks
from .sparse import CSRWriter
from .text_features import featurize_lf

KINDS = ("jsonl", "csv", "tsv")
TEST_SHARE, TEST_MAX, TEST_SEED = 0.2, 10_000, 0  # the carve-out rule when no test file is given
LABEL_NAMES = "label_names.txt"  # in the cache directory: one JSON string per label id, a line
NAMES_FORMAT_KEY = "label_names_format"  # meta.json "meta": "json" where LABEL_NAMES holds JSON strings


@dataclass(frozen=True)
class RecordFields:
    """Which fields hold what: plain values, so the cache key can hash them."""

    text_field: str = "text"
    labels_field: str = "labels"
    label_delimiter: str = ","


def source_files(kind: str, src: str) -> list[str]:
    """Files whose size and mtime key the cache (the optional ones included, absent or not)."""
    return [os.path.join(src, n) for n in (f"train.{kind}", f"test.{kind}", "labels.txt")]


def _flat(text: str) -> str:
    # The converted texts are one a line: a record's own line breaks must not split it.
    return " ".join(text.splitlines()) if ("\n" in text or "\r" in text) else text


def _names(value, path: str, line: int, field: str, delimiter: str | None) -> list[str]:
    """A record's label names from its labels field: a list of strings, one string, or (CSV) a delimited string."""
    if value is None:
        return []
    if isinstance(value, str):
        raw = value.strip()
        if delimiter is not None and raw.startswith("["):
            try:
                value = json.loads(raw)
            except ValueError:
                raise DataFormatError(path, line, field, f"starts with '[' but is not a JSON list: {raw[:60]!r}") from None
        elif delimiter is None:
            value = [raw] if raw else []
        else:
            value = raw.split(delimiter) if raw else []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DataFormatError(path, line, field, f"expected a list of label names (strings), got {value!r:.80}")
    seen: dict[str, None] = {}
    for name in value:
        name = name.strip()
        if name:
            seen.setdefault(name, None)
    return list(seen)


def _not_utf8(path: str) -> DataFormatError:
    """The error naming the first line (and byte) of ``path`` that is not UTF-8; read again, in binary, only once
    decoding has failed somewhere (the text reader decodes in blocks, so it cannot say where)."""
    offset = 0
    with open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return DataFormatError(path, line, "encoding", f"not UTF-8: byte 0x{raw[exc.start]:02x} at byte "
                                       f"offset {offset + exc.start} of the file (save the file as UTF-8)")
            offset += len(raw)
    return DataFormatError(path, 0, "encoding", "not UTF-8 (save the file as UTF-8)")


def _jsonl_records(path: str, fields: RecordFields):
    """Yield ``(line, text, label names)`` of a JSON-lines file; blank lines are skipped."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        for line, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except ValueError as exc:
                raise DataFormatError(path, line, "json", f"not a JSON object ({exc.msg}, column {exc.colno})") from None
            if not isinstance(rec, dict):
                raise DataFormatError(path, line, "json", f"expected an object per line, got {type(rec).__name__}")
            text = rec.get(fields.text_field)
            if not isinstance(text, str):
                problem = "missing" if text is None else f"expected a string, got {type(text).__name__}"
                raise DataFormatError(path, line, fields.text_field,
                                      f"{problem} (data.records.text_field; the record's keys: {', '.join(rec)})")
            if fields.labels_field not in rec:
                raise DataFormatError(path, line, fields.labels_field,
                                      f"missing (data.records.labels_field; the record's keys: {', '.join(rec)})")
            yield line, _flat(text), _names(rec[fields.labels_field], path, line, fields.labels_field, None)


class _RowText:
    """The lines a csv reader takes from ``lines``, kept until `row` is asked: the raw text of the row just read."""

    def __init__(self, lines):
        self.lines, self.taken = iter(lines), []

    def __iter__(self):
        return self

    def __next__(self) -> str:
        text = next(self.lines)
        self.taken.append(text)
        return text

    def row(self) -> str:
        text, self.taken = "".join(self.taken), []
        return text


def _quote_fault(raw: str, delimiter: str, stray_column: int) -> tuple[int, str] | None:
    """``(column, problem)`` of the first badly quoted field of one CSV row's raw text, None when all are well
    formed. A quoted field opens with a quote, doubles the quotes inside and closes just before a delimiter or the
    end of the line. A quote inside an unquoted field is kept as text by the csv module: harmless in a text, but in
    ``stray_column`` (the labels) it is a quote left over from a field that was meant to be quoted."""
    pos, column, end = 0, 0, len(raw)
    while True:
        if raw.startswith('"', pos):
            close = pos + 1
            while (close := raw.find('"', close)) >= 0 and raw.startswith('""', close):
                close += 2
            if close < 0:
                return column, "a quote opened here is never closed"
            pos = close + 1
            if pos < end and raw[pos] not in delimiter + "\r\n":
                return column, f"text after a closing quote: {raw[max(0, close - 20):pos + 20]!r}"
        else:
            stop = min((i for i in (raw.find(delimiter, pos), raw.find("\n", pos)) if i >= 0), default=end)
            field = raw[pos:stop].rstrip("\r")
            if column == stray_column and '"' in field:
                return column, (f"stray quote in the unquoted field {field[:60]!r} (a field holding a quote is "
                                "written whole in quotes, with the quote doubled)")
            pos = stop
        if pos >= end or raw[pos] != delimiter:
            return None
        pos, column = pos + 1, column + 1


def _table_records(path: str, fields: RecordFields, delimiter: str):
    """Yield ``(line, text, label names)`` of a CSV/TSV file with a header row."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = _RowText(f)
        reader = csv.reader(rows, delimiter=delimiter, strict=True)
        try:
            header = next(reader, None)
        except csv.Error as exc:
            raise DataFormatError(path, 1, "header", str(exc)) from None
        if header is None:
            raise DataFormatError(path, 1, "header", f"file is empty: expected a header row naming "
                                  f"{fields.text_field!r} and {fields.labels_field!r}")
        header = [h.strip() for h in header]
        for key, name in (("text_field", fields.text_field), ("labels_field", fields.labels_field)):
            if name not in header:
                raise DataFormatError(path, 1, "header", f"no column {name!r} (data.records.{key}; columns: "
                                      f"{', '.join(header)})")
        text_col, labels_col = header.index(fields.text_field), header.index(fields.labels_field)
        column_name = lambda j: header[j] if j < len(header) and header[j] else f"column {j + 1}"  # noqa: E731
        line = reader.line_num + 1
        rows.row()
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                fault = _quote_fault(rows.row(), delimiter, labels_col)
                if fault is None:
                    raise DataFormatError(path, line, "row", str(exc)) from None
                raise DataFormatError(path, line, column_name(fault[0]), fault[1]) from None
            raw = rows.row()
            if not row or (len(row) == 1 and not row[0].strip()):
                line = reader.line_num + 1
                continue
            if len(row) <= max(text_col, labels_col):
                raise DataFormatError(path, line, "row", f"{len(row)} columns, the header has {len(header)}")
            if '"' in row[labels_col]:  # a quote in a label name: only where its field was quoted
                fault = _quote_fault(raw, delimiter, labels_col)
                if fault is not None and fault[0] == labels_col:
                    raise DataFormatError(path, line, fields.labels_field, fault[1])
            yield (line, _flat(row[text_col]),
                   _names(row[labels_col], path, line, fields.labels_field, fields.label_delimiter))
            line = reader.line_num + 1


def read_records(kind: str, path: str, fields: RecordFields):
    """Yield ``(line, text, label names)`` of one records file of ``kind``."""
    records = _jsonl_records(path, fields) if kind == "jsonl" else \
        _table_records(path, fields, "," if kind == "csv" else "\t")
    try:
        yield from records
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _label_file(path: str) -> tuple[dict[str, int], list[str]]:
    """``labels.txt``: name -> id in line order, and each label's text (the name where no text is given)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = list(f)
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    ids: dict[str, int] = {}
    texts: list[str] = []
    for line, raw in enumerate(lines, 1):
        raw = raw.rstrip("\r\n")
        name, _, text = raw.partition("\t")
        name = name.strip()
        if not name:
            raise DataFormatError(path, line, "name", "empty label name (one name per line, optionally "
                                  "name<TAB>text)")
        if name in ids:
            raise DataFormatError(path, line, "name", f"{name!r} already named on line {ids[name] + 1}")
        ids[name] = len(texts)
        texts.append(_flat(text.strip()) or name)
    if not ids:
        raise DataFormatError(path, 0, "file", "no label names")
    return ids, texts


class _Split:
    """One split's records held as texts and per-record label-id arrays, until the label count is known."""

    def __init__(self):
        self.texts: list[str] = []
        self.label_ids: list[np.ndarray] = []

    def take(self, rows: np.ndarray) -> "_Split":
        part = _Split()
        part.texts = [self.texts[r] for r in rows]
        part.label_ids = [self.label_ids[r] for r in rows]
        return part


def _read_split(kind: str, path: str, fields: RecordFields, ids: dict[str, int], fixed: bool) -> _Split:
    split = _Split()
    for line, text, names in read_records(kind, path, fields):
        row = []
        for name in names:
            label_id = ids.get(name)
            if label_id is None:
                if fixed:
                    raise DataFormatError(path, line, fields.labels_field,
                                          f"label {name!r} is not in labels.txt")
                label_id = ids[name] = len(ids)
            row.append(label_id)
        split.texts.append(text)
        split.label_ids.append(np.unique(np.asarray(row, dtype=np.int32)))
    if not split.texts:
        raise DataFormatError(path, 0, "file", "no records")
    return split


def carve_test(num_records: int) -> np.ndarray:
    """Rows of the training file held out as the test split when there is no test file: ``(n_test,)`` int64,
    sorted; a fifth, at most 10,000, by a permutation seeded with 0 (the same whatever the run's seed)."""
    n_test = min(TEST_MAX, int(round(TEST_SHARE * num_records)))
    if num_records < 2 or n_test < 1:
        raise DataFormatError("", 0, "test", f"{num_records} record(s) cannot be split into train and test: "
                              "give a test file")
    return np.sort(np.random.default_rng(TEST_SEED).permutation(num_records)[:n_test])


def _write(split: _Split, out: str, name: str, num_labels: int) -> dict:
    writer = CSRWriter(out, f"{name}.labels", num_labels, with_values=False)
    try:
        lengths = np.fromiter(map(len, split.label_ids), np.int64, len(split.label_ids))
        writer.append(lengths, np.concatenate(split.label_ids) if split.label_ids else np.zeros(0, np.int32))
    except BaseException:
        writer.abort()
        raise
    writer.close()
    n = write_text_blocks([split.texts], os.path.join(out, f"{name}.texts.txt"))
    return {"num_points": n, "features": False, "texts": f"{name}.texts.txt"}


def convert_records(kind: str, src: str, out: str, fields: RecordFields) -> dict:
    """Convert a records directory (module docstring) into ``out``; returns the meta body, tf-idf included."""
    train_path = os.path.join(src, f"train.{kind}")
    if not os.path.isfile(train_path):
        raise DataFormatError(train_path, 0, "file", f"not found (data.kind={kind} reads train.{kind} and, if "
                              f"present, test.{kind} and labels.txt)")
    label_path = os.path.join(src, "labels.txt")
    fixed = os.path.isfile(label_path)
    ids, label_texts = _label_file(label_path) if fixed else ({}, [])
    train = _read_split(kind, train_path, fields, ids, fixed)
    test_path = os.path.join(src, f"test.{kind}")
    if os.path.isfile(test_path):
        test = _read_split(kind, test_path, fields, ids, fixed)
        carved = None
    else:
        try:
            held = carve_test(len(train.texts))
        except DataFormatError as exc:
            raise DataFormatError(train_path, 0, "test", exc.problem) from None
        keep = np.setdiff1d(np.arange(len(train.texts)), held)
        train, test, carved = train.take(keep), train.take(held), {"rule": "share", "share": TEST_SHARE,
                                                                   "max": TEST_MAX, "seed": TEST_SEED}
    names = list(ids)  # in id order (dicts keep insertion order)
    if not fixed:
        label_texts = [_flat(name) for name in names]  # a JSON name may hold a line break; a text may not
    num_labels = len(label_texts)
    info = {"num_features": 0, "num_labels": num_labels,
            "train": _write(train, out, "train", num_labels), "test": _write(test, out, "test", num_labels),
            "label_texts": "label_texts.txt", "meta": {NAMES_FORMAT_KEY: "json"},
            "records": {"kind": kind, "fields": fields.__dict__, "label_file": fixed, "carved_test": carved}}
    write_text_blocks([label_texts], os.path.join(out, "label_texts.txt"))
    # what xc-predict prints: one JSON string a line, so that a name holding a line break stays one line
    write_text_blocks([[json.dumps(n, ensure_ascii=False) for n in names]], os.path.join(out, LABEL_NAMES))
    return featurize_lf(out, info)


def read_label_names(cache_dir: str, meta: dict, num_labels: int) -> list[str] | None:
    """The label names records data gave, in id order, from LABEL_NAMES in its cache directory ``cache_dir``
    (``meta``: the dataset's meta, which says how they are stored); None where that file does not exist (other
    kinds of data). A file whose names do not number ``num_labels`` is refused: serving would print every later
    label under its neighbour's name."""
    path = os.path.join(cache_dir, LABEL_NAMES)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line
    if meta.get(NAMES_FORMAT_KEY) == "json":
        names = []
        for line, raw in enumerate(lines, 1):
            try:
                name = json.loads(raw)
            except ValueError:
                name = None
            if not isinstance(name, str):
                raise DataFormatError(path, line, "name", f"not a JSON string: {raw[:60]!r} (the data cache is "
                                      f"damaged: remove {cache_dir} and the data is converted again)")
            names.append(name)
        how = "names"
    else:  # written by an earlier xc, a name a line: a name holding a line break took two
        names, how = lines, "lines"
    if len(names) != num_labels:
        raise DataFormatError(path, 0, "file", f"{len(names)} {how} for the data's {num_labels} labels (a label "
                              f"name holding a line break?): remove {cache_dir} and the data is converted again")
    return names
