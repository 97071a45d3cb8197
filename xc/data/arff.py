"""Multi-label ARFF files as MULAN and MEKA publish them (``data.kind=arff``).

Layout of the source directory:

* the train file: ``train.arff``, else the one ``*train*.arff`` (MULAN's ``bibtex-train.arff``);
  the test file likewise (``test.arff`` or the one ``*test*.arff``);
* which attributes are labels: ``labels.xml``, else the one ``*.xml`` in the directory (MULAN's
  ``bibtex.xml``); without an XML file, MEKA's ``-C n`` in the train file's ``@relation`` name
  (n > 0: the first n attributes, n < 0: the last |n|).

The header is read by ``arff_header.py``; what each attribute becomes (numeric values, one-hot
nominals, skipped strings and identifiers, labels) is ``arff_schema.py``'s rule. Rows are dense
(``v1,v2,...``, one value per attribute) or sparse (``{index value, index value}``, 0-based attribute
indices in increasing order; a left-out numeric is 0, a left-out nominal its first declared value);
both kinds may be mixed. ``?`` (missing) is 0 in a numeric, absent in a nominal. Values may be quoted.

Label ids follow the order of the label attributes in the file, feature ids the order of the other
attributes (a one-hot nominal taking one id per declared value); the label attributes' names become
the dataset's label texts (``label_texts.txt``, one a line, as for ``lf_raw`` data). Every error names
the file, the line and the field.
"""

from __future__ import annotations

import glob
import os
import re

import numpy as np

from ..errors import DataFormatError
from .arff_header import (ArffHeader, check_same_attributes, label_attributes, read_header, split_raw,
                          split_values, unquote)
from .arff_schema import ArffSchema
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


def _value(tok: str, attr: int, schema: ArffSchema, path: str, lineno: int) -> float:
    """A numeric attribute's number, a nominal's code (-1 for '?'); 0 for a skipped attribute, whatever it holds."""
    if schema.skipped[attr]:
        return 0.0
    a = schema.head.attributes[attr]
    if tok == "?":
        return -1.0 if schema.nominal[attr] else 0.0  # missing: absent
    if schema.nominal[attr]:
        code = schema.code(attr, tok)
        if code is None:
            raise DataFormatError(path, lineno, f"value of {a.name}", f"{tok[:40]!r} is not one of {a.describe()}")
        return float(code)
    if not _NUM_RE.fullmatch(tok):
        raise DataFormatError(path, lineno, f"value of {a.name}", f"{tok[:40]!r} is not a number")
    v = float(tok)
    with np.errstate(over="ignore"):
        if not np.isfinite(np.float32(v)):
            raise DataFormatError(path, lineno, f"value of {a.name}", f"{tok[:40]} is not a finite float32")
    return v


def _strict_row(line: str, lineno: int, path: str, schema: ArffSchema) -> tuple[list[int], list[float], bool]:
    """Parse one data row item by item (quotes, '?', words, and the exact error):
    (attribute ids, values as :func:`_value` gives them, whether the row is sparse)."""
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
        return ids, vals, True
    toks = split_values(text, path, lineno, "row")
    if len(toks) != schema.num_attrs:
        raise DataFormatError(path, lineno, "row", f"{len(toks)} values, but the header declares "
                              f"{schema.num_attrs} attributes")
    for i, tok in enumerate(toks):
        ids.append(i)
        vals.append(_value(tok, i, schema, path, lineno))
    return ids, vals, False


def _dense_items(text: str, n: int, keep_zeros: np.ndarray):
    """(row counts, attribute ids, values) of ``n`` dense rows joined by ',': every token but a bare "0" of
    an attribute outside ``keep_zeros`` [num_attrs] (where "0" means no column); (None, None, None) if a
    token is not a plain number. Dense multi-label rows are mostly "0": finding those on the bytes and
    parsing only the rest is several times faster than parsing all."""
    buf = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    if not _DENSE_BYTES[buf].all():
        return None, None, None
    commas = np.flatnonzero(buf == ord(","))
    starts, ends = np.append(0, commas + 1), np.append(commas, len(buf))
    zero = (ends - starts == 1) & (buf[np.minimum(starts, max(len(buf) - 1, 0))] == ord("0"))
    if keep_zeros.any():  # rows hold len(keep_zeros) tokens each (checked by the caller)
        zero &= ~np.tile(keep_zeros, n)
    where = np.flatnonzero(~zero)
    try:  # the byte check above leaves float() only numbers, blanks and malformed ones ("1e", "", "1-2")
        vals = np.array([float(text[a:b]) for a, b in zip(starts[where].tolist(), ends[where].tolist())], np.float64)
    except ValueError:
        return None, None, None
    rows, ids = np.divmod(where, len(keep_zeros))
    return np.bincount(rows, minlength=n), ids, vals


def _fast_block(lines: list[str], schema: ArffSchema):
    """All rows of a block at once, when they are plain numbers of one kind (sparse or dense) and valid
    (nominal ones declared, matched by number); (row counts, attribute ids, values with nominal codes,
    per-row sparse flags) or None (then each row is parsed by :func:`_strict_row`)."""
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
        counts, ids, vals = _dense_items(",".join(lines), n, schema.dense_zero_parsed)
        if counts is None:
            return None
    else:
        return None
    with np.errstate(over="ignore"):
        if not np.isfinite(vals.astype(np.float32)).all():
            return None
    vals = schema.fast_codes(ids, vals)
    return None if vals is None else (counts, ids, vals, np.full(n, lines[0].startswith("{")))


def _parse_block(rows: list[tuple[int, str]], path: str, schema: ArffSchema):
    """(row counts, attribute ids, values, sparse flags) of a block of ``(line number, text)`` data rows."""
    out = _fast_block([t for _, t in rows], schema)
    if out is not None:
        return out
    counts, ids, vals, sparse = [], [], [], []
    for lineno, text in rows:
        i, v, is_sparse = _strict_row(text, lineno, path, schema)
        counts.append(len(i)), ids.extend(i), vals.extend(v), sparse.append(is_sparse)
    return np.array(counts, np.int64), np.array(ids, np.int64), np.array(vals, np.float64), np.array(sparse, bool)


def _convert_file(path: str, head: ArffHeader, blocks, schema: ArffSchema, out: str, prefix: str) -> int:
    """Stream the data rows of one file into ``<prefix>.labels``/``<prefix>.features``; returns the row count."""
    labels = CSRWriter(out, prefix + ".labels", schema.num_labels, with_values=False)
    feats = CSRWriter(out, prefix + ".features", schema.num_features, with_values=True)
    try:
        for lineno, block in blocks:
            rows = [(lineno + k, t.strip(" \t")) for k, t in enumerate(block)]
            rows = [(i, t) for i, t in rows if t and not t.startswith("%")]
            if not rows:
                continue
            label_part, feature_part = schema.encode(*_parse_block(rows, path, schema))
            labels.append(*label_part)
            feats.append(*feature_part)
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
    schema = ArffSchema(train_head, label_attributes(train_head, xml_path))
    test_head, test_blocks = read_header(test_path)
    check_same_attributes(train_head, test_head, frozenset(np.flatnonzero(schema.skipped).tolist()))
    info: dict = {"num_labels": schema.num_labels, "num_features": schema.num_features,
                  "label_texts": "label_texts.txt", "arff_relation": train_head.relation}
    for split, path, head, blocks in (("train", train_path, train_head, train_blocks),
                                      ("test", test_path, test_head, test_blocks)):
        n = _convert_file(path, head, blocks, schema, out, split)
        info[split] = {"num_points": n, "features": True, "texts": None}
    names = [a.name for a, lab in zip(train_head.attributes, schema.is_label) if lab]
    write_texts(names, os.path.join(out, "label_texts.txt"))
    return info
