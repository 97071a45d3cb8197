"""Prediction inputs: new queries read from a file (or stdin) in blocks, for `xc-predict` and `xc.load`.

Three formats (``detect_format`` picks one when not told):

* ``text``: one raw text per line (UTF-8). Featurised as the run's data was: tf-idf with the vocabulary
  kept in the data cache (``text_features.TfidfFeaturizer``) or the tokenizer of a text encoder.
* ``sparse``: XC-repository feature lines ``id:value id:value ...`` (0-based feature ids). A leading
  comma-separated label list (as in ``train.txt``/``test.txt``) is skipped, and so is a first line of
  two or three bare integers (the ``N F L`` header), so an XC data file can be fed as it is.
* ``npz``: ``X`` as a dense array (``np.savez(path, X=...)``) or a scipy-sparse matrix (``save_npz``).

Blocks are ``QueryBlock``s: ``texts`` (list of str) or ``features`` (a CSR ``SparseMatrix``, float32 values)
with the 1-based line number of their first row, so errors name file, line and field.
"""

from __future__ import annotations

import io
import re
import sys
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import scipy.sparse as sp

from ..errors import DataFormatError
from .formats import RowSpec, _parse_block, load_npz_matrix
from .sparse import SparseMatrix

FORMATS = ("auto", "text", "sparse", "npz")
_LABELS_RE = re.compile(r"[0-9]{1,18}(?:,[0-9]{1,18})*")
_HEADER_RE = re.compile(r"[0-9]+(?:[ \t]+[0-9]+){1,2}")
_ID_RE = re.compile(r"[+-]?[0-9]+")
# One query per line, read whole: a longer line is refused with its number rather than risking memory
# (a sparse line this long holds about 1.5M id:value pairs).
MAX_LINE_CHARS = 16 * 2**20


@dataclass
class QueryBlock:
    """Rows first_line .. first_line + len - 1 of the input: texts (list[str]) or features (SparseMatrix)."""

    first_line: int
    texts: list[str] | None = None
    features: SparseMatrix | None = None

    def __len__(self) -> int:
        return len(self.texts) if self.texts is not None else self.features.num_rows


def features_from_array(x, num_features: int | None = None, source: str = "<array>") -> SparseMatrix:
    """A dense (n, F) array or scipy sparse matrix as a float32 CSR SparseMatrix (explicit zeros dropped)."""
    m = sp.csr_matrix(x, dtype=np.float32) if not sp.issparse(x) else sp.csr_matrix(x).astype(np.float32)
    if m.ndim != 2:
        raise DataFormatError(source, 0, "shape", f"expected a 2-D (rows, features) matrix, got shape {m.shape}")
    if num_features is not None and m.shape[1] != num_features:
        raise DataFormatError(source, 0, "shape", f"{m.shape[1]} feature columns, but the model reads {num_features}")
    if m.nnz and not np.isfinite(m.data).all():
        raise DataFormatError(source, 0, "feature value", "contains NaN or inf")
    m.eliminate_zeros()
    m.sort_indices()
    return SparseMatrix(m.indptr.astype(np.int64), m.indices.astype(np.int32), m.data.astype(np.float32), m.shape[1])


def parse_sparse_lines(lines: list[str], first_line: int, source: str, num_features: int) -> SparseMatrix:
    """XC feature lines -> SparseMatrix (len(lines), num_features); DataFormatError names file, line, field.

    The training files' parser reads them (xc/data/formats.py), with a data line's labels skipped unchecked and the
    fields numbered by position ("feature 2 value"): a query line has no header to count by."""
    spec = RowSpec(label_limit=10**18, pair_limit=num_features, pair_name="feature", has_labels=True,
                   optional_labels=True, numbered=True, range_note=f"the model reads {num_features} features")
    # any white space separates tokens, as str.split sees it (the training files' parser splits at blanks and tabs)
    _, _, counts, ids, values = _parse_block([" ".join(line.split()) for line in lines], first_line, source, spec)
    indptr = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
    return features_from_array(sp.csr_matrix((values, ids, indptr), shape=(len(lines), num_features)))


def _open_lines(path: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its end of line) of a UTF-8 file, or of stdin for "-"."""
    try:
        stream = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="strict") if path == "-" else \
            open(path, encoding="utf-8")
    except OSError as exc:
        raise DataFormatError(path, 0, "file", f"cannot be read ({exc.strerror or exc})") from None
    lineno = 0
    try:
        while True:
            try:
                line = stream.readline(MAX_LINE_CHARS + 1)
            except UnicodeDecodeError as exc:
                raise DataFormatError(_name(path), lineno + 1, "encoding", f"not valid UTF-8 ({exc.reason})") from None
            if not line:
                return
            if len(line.rstrip("\n").rstrip("\r")) > MAX_LINE_CHARS:
                raise DataFormatError(_name(path), lineno + 1, "length",
                                      f"longer than {MAX_LINE_CHARS} characters; one query per line is read whole, "
                                      "so split or shorten it")
            lineno += 1
            yield lineno, line.rstrip("\n").rstrip("\r")
    finally:
        if path != "-":
            stream.close()
        else:
            stream.detach()


def _name(path: str) -> str:
    return "<stdin>" if path == "-" else path


def looks_sparse(line: str) -> bool:
    """Whether a line is meant as XC feature pairs: after an optional label list, every token is `id:value`
    with an integer-looking id. Values and signs are not checked here, so a malformed pair (``-3:1.0``,
    ``1:nan``) reaches the sparse parser and its precise error instead of being read as raw text."""
    toks = line.split()
    if toks and ":" not in toks[0] and _LABELS_RE.fullmatch(toks[0]):
        toks = toks[1:]
    return bool(toks) and all(t.count(":") == 1 and _ID_RE.fullmatch(t.split(":")[0]) for t in toks)


def detect_format(path: str, first_line: str | None) -> str:
    """npz by extension; otherwise sparse when the first line is a header or reads as XC feature pairs."""
    if path.endswith(".npz"):
        return "npz"
    if first_line is not None and (_HEADER_RE.fullmatch(first_line.strip()) or looks_sparse(first_line)):
        return "sparse"
    return "text"


def read_queries(path: str, fmt: str, block_rows: int, num_features: int) -> tuple[str, Iterator[QueryBlock]]:
    """(the format used, blocks of at most `block_rows` rows) of the input at `path` ("-": stdin)."""
    if fmt not in FORMATS:
        raise DataFormatError(_name(path), 0, "format", f"{fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "npz" or (fmt == "auto" and path.endswith(".npz")):
        return "npz", _npz_blocks(path, block_rows, num_features)
    lines = _open_lines(path)
    blank, first = _leading_blank_lines(lines)
    if first is None and blank:  # else every row would be read as an empty raw text, and blamed on being text
        raise DataFormatError(_name(path), 0, "input", f"holds no queries: {len(blank)} blank line(s) and "
                              "nothing else (one query a line: raw text, or XC feature pairs id:value)")
    fmt = detect_format(path, first[1] if first else None) if fmt == "auto" else fmt
    if first is None:
        return fmt, iter(())
    rest = lines
    if fmt == "sparse" and not blank and _HEADER_RE.fullmatch(first[1].strip()):
        first = next(lines, None)  # the N F L header of an XC data file
        if first is None:
            return fmt, iter(())
    return fmt, _line_blocks(_chain(blank, first, rest), fmt, block_rows, _name(path), num_features)


def _leading_blank_lines(lines: Iterator[tuple[int, str]]) -> tuple[list[tuple[int, str]], tuple[int, str] | None]:
    """(the blank lines before the first that holds anything, that line or None at the end of the input). The
    format is told by that first line; the blank ones stay queries (an empty row each), so line numbers hold."""
    blank = []
    for numbered in lines:
        if numbered[1].strip():
            return blank, numbered
        blank.append(numbered)
    return blank, None


def _chain(blank: list[tuple[int, str]], first: tuple[int, str],
           rest: Iterable[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    yield from blank
    yield first
    yield from rest


def _line_blocks(lines, fmt: str, block_rows: int, source: str, num_features: int) -> Iterator[QueryBlock]:
    block: list[str] = []
    start = 0
    for lineno, line in lines:
        if not block:
            start = lineno
        block.append(line)
        if len(block) == block_rows:
            yield _block(block, start, fmt, source, num_features)
            block = []
    if block:
        yield _block(block, start, fmt, source, num_features)


def _block(lines: list[str], start: int, fmt: str, source: str, num_features: int) -> QueryBlock:
    if fmt == "text":
        return QueryBlock(start, texts=lines)
    if not num_features:
        raise DataFormatError(source, start, "format", "sparse feature rows, but the model reads raw text "
                              "(pass --format text)")
    return QueryBlock(start, features=parse_sparse_lines(lines, start, source, num_features))


def _npz_blocks(path: str, block_rows: int, num_features: int) -> Iterator[QueryBlock]:
    if path == "-":
        raise DataFormatError("<stdin>", 0, "format", "an .npz cannot be read from stdin; pass its path")
    x = load_npz_matrix(path)
    if x.ndim != 2:
        raise DataFormatError(path, 0, "shape", f"expected a 2-D (rows, features) matrix, got shape {x.shape}")
    if x.shape[1] != num_features:
        raise DataFormatError(path, 0, "shape", f"{x.shape[1]} feature columns, but the model reads {num_features}")
    for start in range(0, x.shape[0], block_rows):
        yield QueryBlock(start + 1, features=features_from_array(x[start:start + block_rows], num_features, path))
