"""Streaming parsers that convert source datasets into memmapped CSR files (see ``sparse.py``).

Supported sources (each converted by `xc.data.sources.convert_source` into one output directory):

* ``xc_sparse``: ``train.txt``/``test.txt`` in the XC-repository format. Line 1 is ``N F L``; then N lines
  ``l1,l2,... f:v f:v ...``. A point without labels starts its line with a space or tab (a line whose
  first token already contains ``:`` is also read as "no labels"). Duplicate label ids in a row are
  kept once and labels are sorted within a row; duplicate feature ids are kept as written.
  Blank lines after the N rows are ignored.
* ``lf_raw``: ``trn.raw.txt``/``tst.raw.txt`` (one text per line), ``lbl.raw.txt`` (one label text per
  line, exactly L lines) and ``trn_X_Y.txt``/``tst_X_Y.txt`` (line 1 ``N L``, then N lines of
  ``label:value`` pairs; an empty line is a point with no labels). Label values must be numbers but
  are ignored: every listed label counts as relevant. The texts are also turned into tf-idf features
  (``text_features.py``), so bag-of-words encoders and the kNN baseline read raw text too.
* ``arff``: MULAN/MEKA multi-label ARFF (``arff.py``, ``arff_header.py``): train/test ``.arff`` files and a
  labels ``.xml`` or MEKA's ``-C n``; the label attributes' names become the label texts.
* ``libsvm``: multi-label libsvm lines ``l1,l2 f:v ...`` (``libsvm.py``), 1-based features unless a 0
  occurs, an optional ``N F L`` header.
* ``npz``: ``train_X.npz``, ``train_Y.npz``, ``test_X.npz``, ``test_Y.npz`` written by
  ``scipy.sparse.save_npz`` (X: points x features, Y: points x labels; Y's stored zeros are dropped).

Files are read in blocks of lines; each block is validated with regular expressions and converted with
one numpy call. Only when a block fails is it re-read line by line, so that every error is a
:class:`DataFormatError` naming the exact file, 1-based line and field.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp

from ..arrays import unique_ints
from ..errors import DataFormatError
from .sparse import CSRWriter, SparseMatrix, _NpyAppender, save_csr
from .text_features import featurize_lf

_NUM = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_PAIR = rf"[0-9]{{1,18}}:{_NUM}"  # ids beyond 18 digits overflow int64; the slow path reports them
_PAIRS_RE = re.compile(rf"[ \t]*(?:{_PAIR}(?:[ \t]+{_PAIR})*)?[ \t]*")
_LABELS_RE = re.compile(r"[0-9]{1,18}(?:,[0-9]{1,18})*")
_NUM_RE, _UINT_RE, _NEG_RE = re.compile(_NUM), re.compile(r"[0-9]+"), re.compile(r"-[0-9]+")
_HEAD_RE, _WS_RE = re.compile(r"[^ \t]*"), re.compile(r"[ \t]+")
_MAX_COLS = 2**31 - 1  # column ids are stored as int32
_BLOCK_BYTES = 1 << 22


def _lines(path: str, first: int = 1):
    """Yield ``(line_number_of_first, [decoded lines without EOL])`` blocks of a UTF-8 file."""
    with open(path, "rb") as f:
        lineno = first
        while True:
            raw = f.readlines(_BLOCK_BYTES)
            if not raw:
                return
            try:
                text = [b.decode("utf-8") for b in raw]
            except UnicodeDecodeError:
                for k, b in enumerate(raw):
                    try:
                        b.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise DataFormatError(path, lineno + k, "encoding",
                                              f"not valid UTF-8 (byte {e.start} of the line)") from None
            # Strip '\n' and one '\r' (CRLF files); nothing else, so texts keep their own spaces.
            text = [t[:-1] if t.endswith("\n") else t for t in text]
            if lineno == 1 and text[0].startswith("\ufeff"):
                text[0] = text[0][1:]  # a UTF-8 byte-order mark is not part of the first line
            yield lineno, [t[:-1] if t.endswith("\r") else t for t in text]
            lineno += len(raw)


def _header(path: str, names: tuple[str, ...]):
    """Parse line 1 (``N F L`` or ``N L``) into ints; returns (values, iterator over the rest)."""
    it = _lines(path)
    first = next(it, None)
    if first is None:
        raise DataFormatError(path, 1, "header", f"file is empty, expected '{' '.join(names)}'")
    _, block = first
    toks = [t for t in _WS_RE.split(block[0].strip(" \t")) if t]
    if len(toks) != len(names) or not all(_UINT_RE.fullmatch(t) and len(t) < 19 for t in toks):
        raise DataFormatError(path, 1, "header",
                              f"expected {len(names)} non-negative integers '{' '.join(names)}', "
                              f"got {block[0][:80]!r}")
    vals = [int(t) for t in toks]
    for name, v in zip(names[1:], vals[1:]):
        if v > _MAX_COLS:
            raise DataFormatError(path, 1, "header", f"{name}={v} exceeds {_MAX_COLS}")

    def rest():
        if len(block) > 1:
            yield 2, block[1:]
        yield from it

    return vals, rest()


class RowSpec(NamedTuple):
    """What a row ``[labels] id:value id:value ...`` holds, for `_parse_block`.

    label_limit, pair_limit: ids must be below them. pair_name: "feature" or "label", the fields' names ("feature id",
    "feature value"). has_labels: the row starts with a label list ``l1,l2,...`` (absent where the line starts with a
    blank or its first token holds a ":"). optional_labels: the first token is a label list only where it reads as one;
    anything else is the first pair (xc-predict's input, where a data file's labels are skipped). numbered: field
    names carry the pair's position on the line ("feature 2 id"). range_note: what an out-of-range id is measured
    against (default "header says <limit>").
    """

    label_limit: int
    pair_limit: int
    pair_name: str
    has_labels: bool
    optional_labels: bool = False
    numbered: bool = False
    range_note: str = ""


def _split_row(line: str, optional: bool = False) -> tuple[str, str]:
    """Split an XC-sparse row into its label field and its feature field (`optional`: the label field only where
    the first token reads as a label list)."""
    head = _HEAD_RE.match(line).group()
    if ":" in head or (optional and not _LABELS_RE.fullmatch(head)):  # the row starts directly with features
        return "", line
    return head, line[len(head):]


def _check_id(tok: str, limit: int, path: str, lineno: int, field: str, note: str = "") -> int:
    if not _UINT_RE.fullmatch(tok):
        what = "is negative" if _NEG_RE.fullmatch(tok) else "is not a non-negative integer"
        raise DataFormatError(path, lineno, field, f"{tok[:40]!r} {what}")
    if len(tok) > 18 or int(tok) >= limit:
        raise DataFormatError(path, lineno, field, f"{tok[:40]} is out of range ({note or f'header says {limit}'})")
    return int(tok)


def _strict_row(line: str, lineno: int, path: str, spec: RowSpec) -> None:
    """Re-check one row token by token and raise the precise error (the slow path)."""
    lab, rest = _split_row(line, spec.optional_labels) if spec.has_labels else ("", line)
    if lab:
        for tok in lab.split(","):
            _check_id(tok, spec.label_limit, path, lineno, "label id")
    toks = [tok for tok in _WS_RE.split(rest.strip(" \t")) if tok]
    for j, tok in enumerate(toks, 1):
        name = f"{spec.pair_name} {j}" if spec.numbered else spec.pair_name
        if tok.count(":") != 1:
            raise DataFormatError(path, lineno, name, f"expected 'id:value', got {tok[:40]!r}")
        i, v = tok.split(":")
        _check_id(i, spec.pair_limit, path, lineno, f"{name} id", spec.range_note)
        if not _NUM_RE.fullmatch(v):
            raise DataFormatError(path, lineno, f"{name} value", f"{v[:40]!r} is not a number")
        with np.errstate(over="ignore"):
            finite = bool(np.isfinite(np.float32(float(v))))
        if not finite:
            raise DataFormatError(path, lineno, f"{name} value", f"{v[:40]} is not a finite float32")


def _parse_block(lines: list[str], lineno: int, path: str, spec: RowSpec):
    """Parse a block of rows at once; `lineno` is the first row's line number.

    Returns ``(label_counts (n,) int64, label_ids int64, pair_counts (n,) int64, pair_ids int64,
    pair_values float32)``; raises the precise DataFormatError if any row is malformed.
    """
    label_limit, pair_limit = spec.label_limit, spec.pair_limit
    n = len(lines)
    if spec.has_labels and n:
        labs, rests = zip(*(_split_row(line, spec.optional_labels) for line in lines))
    else:
        labs, rests = [""] * n, lines
    ok = all(_LABELS_RE.fullmatch(x) for x in labs if x) and all(map(_PAIRS_RE.fullmatch, rests))
    if ok:
        lab_counts = np.fromiter((x.count(",") + 1 if x else 0 for x in labs), np.int64, n)
        joined = ",".join(x for x in labs if x)
        lab_ids = np.array(joined.split(","), np.int64) if joined else np.zeros(0, np.int64)
        pair_counts = np.fromiter((r.count(":") for r in rests), np.int64, n)
        flat = np.array(" ".join(rests).replace(":", " ").split(), np.float64)
        with np.errstate(over="ignore"):  # float32 overflow becomes inf and is rejected just below
            pair_ids, pair_vals = flat[0::2].astype(np.int64), flat[1::2].astype(np.float32)
        ok = (not lab_ids.size or lab_ids.max() < label_limit) and \
             (not pair_ids.size or pair_ids.max() < pair_limit) and bool(np.isfinite(pair_vals).all())
        if ok:
            return lab_counts, lab_ids, pair_counts, pair_ids, pair_vals
    for k, line in enumerate(lines):
        _strict_row(line, lineno + k, path, spec)
    raise DataFormatError(path, lineno, "row", "unparseable block")  # unreachable by construction


def _dedupe(counts: np.ndarray, ids: np.ndarray, num_cols: int):
    """Sort ids within each row and drop repeats; returns new (counts, ids int32)."""
    rows = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    width = max(num_cols, 1)
    key = unique_ints(rows * width + ids)  # one sort orders rows, then ids within a row, and drops repeats
    return np.bincount(key // width, minlength=len(counts)), (key % width).astype(np.int32)


def _rows(path, rest, num_rows, spec):
    """Iterate parsed blocks of exactly ``num_rows`` rows after the header, checking the row count."""
    seen = 0
    for lineno, block in rest:
        take = block[: max(num_rows - seen, 0)]
        if take:  # parse before looking at extra lines, so the first bad line is the one reported
            seen += len(take)
            yield _parse_block(take, lineno, path, spec)
        for k, extra in enumerate(block[len(take):]):
            if extra.strip(" \t"):
                raise DataFormatError(path, lineno + len(take) + k, "row count",
                                      f"more rows than the {num_rows} declared in the header")
    if seen < num_rows:
        raise DataFormatError(path, 1, "row count",
                              f"header declares {num_rows} rows but the file has only {seen}")


def convert_xc_sparse_file(path: str, out_dir: str, prefix: str):
    """Convert one XC-sparse file into ``<prefix>.labels.*`` and ``<prefix>.features.*``.

    Returns ``(labels, features, num_features, num_labels)``.
    """
    (n, nf, nl), rest = _header(path, ("N", "F", "L"))
    labels = CSRWriter(out_dir, prefix + ".labels", nl, with_values=False)
    feats = CSRWriter(out_dir, prefix + ".features", nf, with_values=True)
    try:
        for lc, li, fc, fi, fv in _rows(path, rest, n, RowSpec(nl, nf, "feature", True)):
            lc, li = _dedupe(lc, li, nl)
            labels.append(lc, li)
            feats.append(fc, fi.astype(np.int32), fv)
    except BaseException:
        labels.abort(), feats.abort()
        raise
    return labels.close(), feats.close(), nf, nl


def convert_xy_file(path: str, out_dir: str, prefix: str):
    """Convert an LF ``*_X_Y.txt`` label file into ``<prefix>.labels.*``; returns (labels, L)."""
    (n, nl), rest = _header(path, ("N", "L"))
    labels = CSRWriter(out_dir, prefix + ".labels", nl, with_values=False)
    try:
        for _, _, pc, pi, _ in _rows(path, rest, n, RowSpec(0, nl, "label", False)):
            labels.append(*_dedupe(pc, pi, nl))
    except BaseException:
        labels.abort()
        raise
    return labels.close(), nl


def copy_texts(src: str, dst: str) -> int:
    """Copy a one-text-per-line file to ``dst`` (UTF-8 checked, LF line ends) and write
    ``dst + '.offsets.npy'`` (int64 ``(n+1,)`` byte offsets of each line in ``dst``). Returns n."""
    return write_text_blocks((block for _, block in _lines(src)), dst)


def write_text_blocks(blocks, dst: str) -> int:
    """Write blocks (lists) of single-line texts to ``dst``, one a line, with ``dst + '.offsets.npy'``
    as `copy_texts` describes. Returns the number of texts."""
    offsets = _NpyAppender(dst + ".offsets.npy", np.int64)
    pos, n = 0, 0
    try:
        with open(dst, "wb") as out:
            offsets.append(np.zeros(1, np.int64))
            for block in blocks:
                data = [(t + "\n").encode("utf-8") for t in block]
                lens = np.fromiter(map(len, data), np.int64, len(data))
                offsets.append(pos + np.cumsum(lens))
                out.write(b"".join(data))
                pos += int(lens.sum())
                n += len(block)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        offsets.abort()
        raise
    offsets.close()
    return n


def _need(path: str) -> str:
    if not os.path.isfile(path):
        raise DataFormatError(path, 0, "file", "not found")
    return path


def _convert_xc_sparse(src: str, out: str) -> dict:
    info = {}
    for split, fname in (("train", "train.txt"), ("test", "test.txt")):
        path = _need(os.path.join(src, fname))
        labels, _, nf, nl = convert_xc_sparse_file(path, out, split)
        if info and (nf, nl) != (info["num_features"], info["num_labels"]):
            raise DataFormatError(path, 1, "header", f"F={nf} L={nl} differ from train.txt's "
                                  f"F={info['num_features']} L={info['num_labels']}")
        info.update(num_features=nf, num_labels=nl)
        info[split] = {"num_points": labels.num_rows, "features": True, "texts": None}
    return info


def _convert_lf_raw(src: str, out: str) -> dict:
    info = {"num_features": 0}
    for split, tag in (("train", "trn"), ("test", "tst")):
        xy = _need(os.path.join(src, f"{tag}_X_Y.txt"))
        labels, nl = convert_xy_file(xy, out, split)
        if "num_labels" in info and nl != info["num_labels"]:
            raise DataFormatError(xy, 1, "header", f"L={nl} differs from trn_X_Y.txt's {info['num_labels']}")
        info["num_labels"] = nl
        txt = _need(os.path.join(src, f"{tag}.raw.txt"))
        n = copy_texts(txt, os.path.join(out, f"{split}.texts.txt"))
        if n != labels.num_rows:
            raise DataFormatError(txt, 0, "row count",
                                  f"has {n} lines but {xy} has {labels.num_rows} rows")
        info[split] = {"num_points": n, "features": False, "texts": f"{split}.texts.txt"}
    lbl = _need(os.path.join(src, "lbl.raw.txt"))
    n = copy_texts(lbl, os.path.join(out, "label_texts.txt"))
    if n != info["num_labels"]:
        raise DataFormatError(lbl, 0, "row count", f"has {n} lines but the X_Y headers say L={info['num_labels']}")
    info["label_texts"] = "label_texts.txt"
    return featurize_lf(out, info)


def load_npz_matrix(path: str, key: str = "X"):
    """The matrix of an .npz: a dense array saved under `key` (np.savez(path, X=...)) or a scipy sparse matrix
    (save_npz), as numpy or CSR; DataFormatError naming the file otherwise. Training files and xc-predict's input
    both read through it."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            if key in npz.files:
                return np.asarray(npz[key])
            if {"data", "indices", "indptr", "shape"} <= set(npz.files) or "format" in npz.files:
                return sp.load_npz(path).tocsr()
            files = npz.files
    except DataFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - damaged archives fail in many ways (zlib.error, bad zip header, ...)
        raise DataFormatError(path, 0, "file", f"not a readable .npz ({type(exc).__name__}: {exc})") from None
    raise DataFormatError(path, 0, key, f"no dense '{key}' array or scipy sparse matrix (keys: {', '.join(files)})")


def _load_npz(path: str, key: str = "X"):
    _need(path)
    # Damaged archives fail in many ways (zlib.error, a garbled zip header, MemoryError for absurd
    # sizes, ...); none may escape as anything but a DataFormatError.
    m = load_npz_matrix(path, key)
    if not sp.issparse(m):  # np.savez(path, X=array): the natural way to save dense features
        if m.ndim != 2 or m.dtype.kind not in "biuf":
            raise DataFormatError(path, 0, key, f"expected a 2-D numeric array, got shape {m.shape} of {m.dtype}")
        with np.errstate(over="ignore"):  # float32 overflow becomes inf and is rejected
            m = sp.csr_matrix(m.astype(np.float32) if m.dtype.kind == "f" else m)
    if m.ndim != 2 or max(m.shape) > _MAX_COLS:
        raise DataFormatError(path, 0, "shape", f"unsupported shape {m.shape}")
    try:  # a damaged file can still unpack: indices out of range, indptr not monotone
        m.check_format(full_check=True)
    except Exception as e:  # noqa: BLE001
        raise DataFormatError(path, 0, "structure", f"invalid CSR arrays ({type(e).__name__}: {e})") from None
    m.sum_duplicates()  # also sorts the indices within each row
    return m


def _convert_npz(src: str, out: str) -> dict:
    info = {}
    for split in ("train", "test"):
        xp, yp = (os.path.join(src, f"{split}_{w}.npz") for w in "XY")
        x, y = _load_npz(xp, "X"), _load_npz(yp, "Y")
        if x.shape[0] != y.shape[0]:
            raise DataFormatError(yp, 0, "row count", f"{y.shape[0]} rows but {xp} has {x.shape[0]}")
        with np.errstate(over="ignore"):  # float32 overflow becomes inf and is rejected
            finite = bool(np.isfinite(x.data.astype(np.float32)).all())
        if not finite:
            raise DataFormatError(xp, 0, "feature value", "contains NaN or inf (as float32)")
        for key, val, p in (("num_features", x.shape[1], xp), ("num_labels", y.shape[1], yp)):
            if info.setdefault(key, val) != val:
                raise DataFormatError(p, 0, "shape", f"{val} columns but train has {info[key]}")
        y.eliminate_zeros()
        save_csr(SparseMatrix.from_scipy(y, binary=True), out, f"{split}.labels")
        save_csr(SparseMatrix.from_scipy(x), out, f"{split}.features")
        info[split] = {"num_points": int(x.shape[0]), "features": True, "texts": None}
    return info
