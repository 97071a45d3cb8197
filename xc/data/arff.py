"""Multi-label ARFF files as MULAN and MEKA publish them (``data.kind=arff``).

Layout of the source directory:

* the train file: ``train.arff``, else the one ``*train*.arff`` (MULAN's ``bibtex-train.arff``);
  the test file likewise (``test.arff`` or the one ``*test*.arff``);
* which attributes are labels: ``labels.xml``, else the one ``*.xml`` in the directory (MULAN's
  ``bibtex.xml``); without an XML file, MEKA's ``-C n`` in the train file's ``@relation`` name
  (n > 0: the first n attributes, n < 0: the last |n|).

The header is read by ``arff_header.py``. Rows are dense (``v1,v2,...``, one value per attribute) or
sparse (``{index value, index value}``, 0-based attribute indices in increasing order, left-out
attributes are 0); both kinds may be mixed. ``?`` (missing) counts as 0. Values may be quoted.
A label is relevant to a row when its value is non-zero; features keep their non-zero values.

Label ids follow the order of the label attributes in the file, feature ids the order of the other
attributes; the label attributes' names become the dataset's label texts (``label_texts.txt``, one a
line, as for ``lf_raw`` data). Every error names the file, the line and the field.
"""

from __future__ import annotations

import glob
import os
import re

import numpy as np

from ..errors import DataFormatError
from .arff_header import (ArffHeader, check_same_attributes, label_attributes, read_header, split_raw,
                          split_values, unquote)
from .formats import _NUM, write_text_blocks
from .sparse import CSRWriter

_SPARSE_RE = re.compile(
    rf"\{{[ \t]*(?:[0-9]{{1,9}}[ \t]+{_NUM}(?:[ \t]*,[ \t]*[0-9]{{1,9}}[ \t]+{_NUM})*)?[ \t]*\}}")
_DENSE_BYTES = np.zeros(256, dtype=bool)  # the bytes a row of plain numbers can hold
_DENSE_BYTES[np.frombuffer(b"0123456789+-.eE, \t", dtype=np.uint8)] = True
_NUM_RE = re.compile(_NUM)
_ITEM_RE = re.compile(r"([0-9]{1,18})[ \t]+(.+)")
_PUNCT = str.maketrans("{},", "   ")


def _pick(src: str, pattern: str, exact: str, what: str) -> str | None:
    """``exact`` in ``src`` if it exists, else the only file matching ``pattern``; None if none matches."""
    if os.path.isfile(os.path.join(src, exact)):
        return os.path.join(src, exact)
    found = sorted(glob.glob(os.path.join(glob.escape(src), pattern)))
    if len(found) > 1:
        raise DataFormatError(os.path.join(src, exact), 0, "file", f"{len(found)} {what} files match {pattern} "
                              f"({', '.join(map(os.path.basename, found))}); name the one to use {exact}")
    return found[0] if found else None


def layout(src: str) -> tuple[str, str, str | None]:
    """(train file, test file, labels XML or None) of an ARFF source directory."""
    files = []
    for split in ("train", "test"):
        path = _pick(src, f"*{split}*.arff", f"{split}.arff", split)
        if path is None:
            raise DataFormatError(os.path.join(src, f"{split}.arff"), 0, "file",
                                  f"not found (nor any *{split}*.arff)")
        files.append(path)
    return files[0], files[1], _pick(src, "*.xml", "labels.xml", "labels XML")


def source_files(src: str) -> list[str]:
    """Files that key the cache (the names looked for when the layout is incomplete)."""
    try:
        return [p for p in layout(src) if p]
    except DataFormatError:
        return [os.path.join(src, n) for n in ("train.arff", "test.arff", "labels.xml")]


class _Schema:
    """Per attribute: is it {0,1}, and which label or feature column it becomes."""

    def __init__(self, head: ArffHeader, label_attrs: np.ndarray):
        n = len(head.attributes)
        self.head, self.num_attrs = head, n
        self.nominal = np.array([a.nominal for a in head.attributes], dtype=bool)
        self.is_label = np.zeros(n, dtype=bool)
        self.is_label[label_attrs] = True
        self.column = np.zeros(n, dtype=np.int64)
        self.column[self.is_label] = np.arange(int(self.is_label.sum()))
        self.column[~self.is_label] = np.arange(int((~self.is_label).sum()))


def _value(tok: str, attr: int, schema: _Schema, path: str, lineno: int) -> float:
    a = schema.head.attributes[attr]
    if tok == "?":
        return 0.0  # missing: absent
    if a.nominal:  # compared as numbers ("1.0" is 1), as the block fast path does
        if not _NUM_RE.fullmatch(tok) or float(tok) not in (0.0, 1.0):
            raise DataFormatError(path, lineno, f"value of {a.name}", f"{tok[:40]!r} is not one of {{0,1}}")
        return float(tok)
    if not _NUM_RE.fullmatch(tok):
        raise DataFormatError(path, lineno, f"value of {a.name}", f"{tok[:40]!r} is not a number")
    v = float(tok)
    with np.errstate(over="ignore"):
        if not np.isfinite(np.float32(v)):
            raise DataFormatError(path, lineno, f"value of {a.name}", f"{tok[:40]} is not a finite float32")
    return v


def _strict_row(line: str, lineno: int, path: str, schema: _Schema) -> tuple[list[int], list[float]]:
    """Parse one data row item by item (quotes, '?', and the exact error): (attribute ids, values)."""
    text = line.strip(" \t")
    ids: list[int] = []
    vals: list[float] = []
    if text.startswith("{"):
        if not text.endswith("}"):
            raise DataFormatError(path, lineno, "row", "a sparse row must end with '}' "
                                  "(instance weights '{...}, {w}' are not supported)")
        inner = text[1:-1].strip(" \t")
        for item in (split_raw(inner, path, lineno, "row") if inner else []):
            m = _ITEM_RE.fullmatch(item)
            if not m:
                raise DataFormatError(path, lineno, "sparse item", f"expected 'index value', got {item[:40]!r}")
            i, tok = int(m.group(1)), unquote(m.group(2), path, lineno, "sparse item")
            if i >= schema.num_attrs:
                raise DataFormatError(path, lineno, "attribute index",
                                      f"{i} is out of range (the header declares {schema.num_attrs} attributes)")
            if ids and i <= ids[-1]:
                raise DataFormatError(path, lineno, "attribute index",
                                      f"{i} after {ids[-1]}: sparse rows list attributes in increasing order, once")
            ids.append(i)
            vals.append(_value(tok, i, schema, path, lineno))
        return ids, vals
    toks = split_values(text, path, lineno, "row")
    if len(toks) != schema.num_attrs:
        raise DataFormatError(path, lineno, "row", f"{len(toks)} values, but the header declares "
                              f"{schema.num_attrs} attributes")
    for i, tok in enumerate(toks):
        ids.append(i)
        vals.append(_value(tok, i, schema, path, lineno))
    return ids, vals


def _dense_nonzeros(text: str, n: int, num_attrs: int):
    """(row counts, attribute ids, values) of the tokens other than a bare "0" in ``n`` dense rows joined
    by ','; (None, None, None) if a token is not a plain number. Dense multi-label rows are mostly "0":
    finding those on the bytes and parsing only the rest is several times faster than parsing all."""
    buf = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    if not _DENSE_BYTES[buf].all():
        return None, None, None
    commas = np.flatnonzero(buf == ord(","))
    starts, ends = np.append(0, commas + 1), np.append(commas, len(buf))
    zero = (ends - starts == 1) & (buf[np.minimum(starts, max(len(buf) - 1, 0))] == ord("0"))
    where = np.flatnonzero(~zero)
    try:  # the byte check above leaves float() only numbers, blanks and malformed ones ("1e", "", "1-2")
        vals = np.array([float(text[a:b]) for a, b in zip(starts[where].tolist(), ends[where].tolist())], np.float64)
    except ValueError:
        return None, None, None
    rows, ids = np.divmod(where, num_attrs)
    return np.bincount(rows, minlength=n), ids, vals


def _fast_block(lines: list[str], schema: _Schema):
    """All rows of a block at once, when they are plain numbers of one kind (sparse or dense) and valid;
    (row counts, attribute ids, values) or None (then each row is parsed by :func:`_strict_row`)."""
    n = len(lines)
    if all(t.startswith("{") for t in lines):
        if not all(map(_SPARSE_RE.fullmatch, lines)):
            return None
        flat = np.array(" ".join(lines).translate(_PUNCT).split(), dtype=np.float64)
        ids, vals = flat[0::2].astype(np.int64), flat[1::2]
        counts = np.fromiter((t.count(",") + 1 if t[1:-1].strip(" \t") else 0 for t in lines), np.int64, n)
        starts = np.cumsum(counts) - counts
        increasing = np.ones(len(ids), dtype=bool)
        increasing[1:] = np.diff(ids) > 0
        increasing[starts[counts > 0]] = True
        if (ids.size and ids.max() >= schema.num_attrs) or not increasing.all():
            return None
    elif not any(t.startswith("{") for t in lines):
        if not all(t.count(",") + 1 == schema.num_attrs for t in lines):
            return None
        counts, ids, vals = _dense_nonzeros(",".join(lines), n, schema.num_attrs)
        if counts is None:
            return None
    else:
        return None
    with np.errstate(over="ignore"):
        ok = bool(np.isfinite(vals.astype(np.float32)).all())
    nominal = schema.nominal[ids]
    if not ok or not np.isin(vals[nominal], (0.0, 1.0)).all():
        return None
    return counts, ids, vals


def _parse_block(rows: list[tuple[int, str]], path: str, schema: _Schema):
    """(row counts, attribute ids, values) of a block of ``(line number, text)`` data rows."""
    lines = [t for _, t in rows]
    out = _fast_block(lines, schema)
    if out is not None:
        return out
    counts, ids, vals = [], [], []
    for lineno, text in rows:
        i, v = _strict_row(text, lineno, path, schema)
        counts.append(len(i)), ids.extend(i), vals.extend(v)
    return np.array(counts, np.int64), np.array(ids, np.int64), np.array(vals, np.float64)


def _convert_file(path: str, head: ArffHeader, blocks, schema: _Schema, out: str, prefix: str) -> int:
    """Stream the data rows of one file into ``<prefix>.labels``/``<prefix>.features``; returns the row count."""
    num_labels, num_feats = int(schema.is_label.sum()), int((~schema.is_label).sum())
    labels = CSRWriter(out, prefix + ".labels", num_labels, with_values=False)
    feats = CSRWriter(out, prefix + ".features", num_feats, with_values=True)
    try:
        for lineno, block in blocks:
            rows = [(lineno + k, t.strip(" \t")) for k, t in enumerate(block)]
            rows = [(i, t) for i, t in rows if t and not t.startswith("%")]
            if not rows:
                continue
            counts, ids, vals = _parse_block(rows, path, schema)
            row_of = np.repeat(np.arange(len(rows)), counts)
            keep = vals != 0  # dense rows list zeros; '?' was read as 0; a zero label is not relevant
            lab, feat = keep & schema.is_label[ids], keep & ~schema.is_label[ids]
            # Label attributes are taken in attribute order, so each row's label ids are already sorted.
            labels.append(np.bincount(row_of[lab], minlength=len(rows)), schema.column[ids[lab]].astype(np.int32))
            feats.append(np.bincount(row_of[feat], minlength=len(rows)), schema.column[ids[feat]].astype(np.int32),
                         vals[feat].astype(np.float32))
    except BaseException:
        labels.abort(), feats.abort()
        raise
    if not labels.num_rows:
        labels.abort(), feats.abort()
        raise DataFormatError(path, head.data_line, "@data", "no data rows follow")
    labels.close()
    return feats.close().num_rows


def write_texts(names: list[str], dst: str) -> None:
    """Write one text a line to ``dst`` plus its ``.offsets.npy`` (the layout ``copy_texts`` writes)."""
    write_text_blocks([[n.replace("\r", " ").replace("\n", " ") for n in names]], dst)


def convert_arff(src: str, out: str) -> dict:
    """Convert a MULAN/MEKA ARFF source directory into ``out``; returns the meta.json body."""
    train_path, test_path, xml_path = layout(src)
    train_head, train_blocks = read_header(train_path)
    schema = _Schema(train_head, label_attributes(train_head, xml_path))
    test_head, test_blocks = read_header(test_path)
    check_same_attributes(train_head, test_head)
    info: dict = {"num_labels": int(schema.is_label.sum()), "num_features": int((~schema.is_label).sum()),
                  "label_texts": "label_texts.txt", "arff_relation": train_head.relation}
    for split, path, head, blocks in (("train", train_path, train_head, train_blocks),
                                      ("test", test_path, test_head, test_blocks)):
        n = _convert_file(path, head, blocks, schema, out, split)
        info[split] = {"num_points": n, "features": True, "texts": None}
    names = [a.name for a, lab in zip(train_head.attributes, schema.is_label) if lab]
    write_texts(names, os.path.join(out, "label_texts.txt"))
    return info
