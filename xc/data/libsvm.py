"""Multi-label libsvm files (``data.kind=libsvm``), as the LIBSVM multi-label collection publishes them.

Layout of the source directory (the first that exists wins, for train and for test alike):

* ``train.txt`` / ``test.txt``, else ``train.svm`` / ``test.svm``,
* else exactly one ``*train*.svm`` and one ``*test*.svm`` (``yeast_train.svm``, ``yeast_test.svm``).

Each line is one point: ``l1,l2,... f:v f:v ...``. The label list may be empty (the line starts with a
space or tab, or directly with a feature); label ids are taken as written (0-based ids, as in the
LIBSVM collection). Duplicate labels in a row are kept once and sorted; features are kept as written.

Feature ids are 1-based (the libsvm convention) unless a feature id 0 occurs in either file, in which
case both files are read 0-based; the choice is logged in meta.json (``libsvm_feature_base``).

An optional header line ``N F L`` (three integers, as in the XC-repository format) fixes the number of
rows and the numbers of features and labels; without one, the counts are the largest id + 1 over both
files, and every line is a point except blank lines at the end of the file. Give the header when the
last features or labels may be absent from the data and the column counts matter (a model trained on
one file set and evaluated on another).
"""

from __future__ import annotations

import glob
import os
import re

import numpy as np

from ..errors import DataFormatError
from .formats import _MAX_COLS, RowSpec, _dedupe, _lines, _parse_block
from .sparse import CSRWriter

_HEADER_RE = re.compile(r"[ \t]*([0-9]{1,18})[ \t]+([0-9]{1,18})[ \t]+([0-9]{1,18})[ \t]*")
# A feature id that is all zeros, where a feature can start: at the line start or after a blank.
_ZERO_FEATURE_RE = re.compile(r"(?:^|[ \t])0+:", re.MULTILINE)


def _pick(src: str, split: str) -> str:
    """The ``split`` file of a libsvm source directory (see the module docstring for the order)."""
    for name in (f"{split}.txt", f"{split}.svm"):
        if os.path.isfile(os.path.join(src, name)):
            return os.path.join(src, name)
    found = sorted(glob.glob(os.path.join(glob.escape(src), f"*{split}*.svm")))
    if len(found) == 1:
        return found[0]
    problem = ("not found" if not found else
               f"ambiguous: {len(found)} files match *{split}*.svm ({', '.join(map(os.path.basename, found))})")
    raise DataFormatError(os.path.join(src, f"{split}.txt"), 0, "file",
                          f"{problem}; expected {split}.txt, {split}.svm or one *{split}*.svm")


def source_files(src: str) -> list[str]:
    """Files that key the cache: the chosen train and test files (or the names that were looked for)."""
    out = []
    for split in ("train", "test"):
        try:
            out.append(_pick(src, split))
        except DataFormatError:
            out.append(os.path.join(src, f"{split}.txt"))  # conversion reports what is wrong
    return out


def _scan(path: str) -> tuple[tuple[int, int, int] | None, int, bool]:
    """One quick pass: ``(header (N, F, L) or None, number of data lines, whether a feature id 0 occurs)``.

    Without a header the number of data lines excludes blank lines at the end of the file."""
    header, last, zero = None, 0, False
    for lineno, block in _lines(path):
        if lineno == 1 and block:
            m = _HEADER_RE.fullmatch(block[0])
            if m:
                header = tuple(int(g) for g in m.groups())
        zero = zero or bool(_ZERO_FEATURE_RE.search("\n".join(block[1:] if header and lineno == 1 else block)))
        for k in range(len(block) - 1, -1, -1):
            if block[k].strip(" \t"):
                last = lineno + k
                break
    if header is None:
        if not last:
            raise DataFormatError(path, 1, "row", "the file holds no data rows")
        return None, last, zero
    for name, v in zip("FL", header[1:]):
        if v > _MAX_COLS:
            raise DataFormatError(path, 1, "header", f"{name}={v} exceeds {_MAX_COLS}")
    return header, header[0], zero


def _convert_file(path: str, out: str, prefix: str, scan, base: int):
    """Write ``<prefix>.labels``/``<prefix>.features`` of one file; returns (num_rows, max label, max feature)."""
    header, num_rows, _ = scan
    first = 2 if header else 1
    label_limit = header[2] if header else _MAX_COLS
    feat_limit = header[1] if header else _MAX_COLS
    spec = RowSpec(_MAX_COLS, _MAX_COLS, "feature", True)  # ranges are checked below, against the base-shifted ids
    labels = CSRWriter(out, prefix + ".labels", label_limit, with_values=False)
    feats = CSRWriter(out, prefix + ".features", feat_limit, with_values=True)
    seen, max_label, max_feat = 0, -1, -1
    try:
        for lineno, block in _lines(path):
            if lineno < first:
                lineno, block = first, block[first - lineno:]
            take = block[: max(num_rows - seen, 0)]
            for k, extra in enumerate(block[len(take):]):
                if extra.strip(" \t"):
                    raise DataFormatError(path, lineno + len(take) + k, "row count",
                                          f"more rows than the {num_rows} declared in the header")
            if not take:
                continue
            lc, li, fc, fi, fv = _parse_block(take, lineno, path, spec)
            fi = fi - base
            _check_range(path, lineno, take, lc, li, label_limit, "label id", 0)
            _check_range(path, lineno, take, fc, fi, feat_limit, "feature id", base)
            lc, li = _dedupe(lc, li, label_limit if header else int(li.max(initial=0)) + 1)
            labels.append(lc, li)
            feats.append(fc, fi.astype(np.int32), fv)
            max_label, max_feat = max(max_label, int(li.max(initial=-1))), max(max_feat, int(fi.max(initial=-1)))
            seen += len(take)
        if seen < num_rows:
            raise DataFormatError(path, 1, "row count", f"header declares {num_rows} rows but the file has only {seen}")
    except BaseException:
        labels.abort(), feats.abort()
        raise
    labels.close(), feats.close()
    return seen, max_label, max_feat


def _check_range(path, lineno, lines, counts, ids, limit, field, base) -> None:
    """Raise for the first row of a block holding an id >= limit (ids already shifted by ``base``)."""
    bad = np.nonzero(ids >= limit)[0]
    if not bad.size:
        return
    row = int(np.searchsorted(np.cumsum(counts), bad[0], side="right"))
    what = f"{int(ids[bad[0]]) + base} is out of range (the header says {field.split()[0]}s: {limit}"
    raise DataFormatError(path, lineno + row, field, what + (", ids 1-based)" if base else ")"))


def convert_libsvm(src: str, out: str) -> dict:
    """Convert a libsvm source directory into ``out``; returns the meta.json body."""
    paths = {split: _pick(src, split) for split in ("train", "test")}
    scans = {split: _scan(p) for split, p in paths.items()}
    headers = {split: s[0] for split, s in scans.items() if s[0]}
    if headers and len(headers) != 2:
        split = "test" if "train" in headers else "train"
        raise DataFormatError(paths[split], 1, "header", "the other file has an 'N F L' header, this one has none")
    if headers and headers["train"][1:] != headers["test"][1:]:
        raise DataFormatError(paths["test"], 1, "header", f"F L = {headers['test'][1:]} differ from the train "
                              f"file's {headers['train'][1:]}")
    base = 0 if any(s[2] for s in scans.values()) else 1
    info: dict = {"libsvm_feature_base": base}
    max_label = max_feat = -1
    for split, path in paths.items():
        n, ml, mf = _convert_file(path, out, split, scans[split], base)
        max_label, max_feat = max(max_label, ml), max(max_feat, mf)
        info[split] = {"num_points": n, "features": True, "texts": None}
    if headers:
        info.update(num_features=headers["train"][1], num_labels=headers["train"][2])
    else:
        info.update(num_features=max_feat + 1, num_labels=max_label + 1)
    return info
