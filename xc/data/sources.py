"""Which reader converts which kind of source: the registry `xc.data.cache` converts through.

Kept apart from the readers so the import order is one-way: `formats` (XC sparse, LF raw text, npz and the shared
line readers) <- `arff`, `libsvm` (which build on those readers) <- this module <- `cache`.
"""

from __future__ import annotations

import os

from ..errors import DataFormatError
from . import arff, libsvm, records
from .formats import _convert_lf_raw, _convert_npz, _convert_xc_sparse
from .records import RecordFields

CONVERTERS = {"xc_sparse": _convert_xc_sparse, "lf_raw": _convert_lf_raw, "npz": _convert_npz,
              "arff": arff.convert_arff, "libsvm": libsvm.convert_libsvm}


KINDS = tuple(CONVERTERS) + records.KINDS


def convert_source(kind: str, src: str, out_dir: str, fields: RecordFields | None = None) -> dict:
    """Convert dataset directory ``src`` of ``kind`` into ``out_dir``; returns the meta.json body
    (``num_labels``, ``num_features``, per-split ``num_points``/``features``/``texts``, ``label_texts``).
    ``fields`` names the text and labels fields of records kinds (jsonl, csv, tsv)."""
    if not os.path.isdir(src):
        raise DataFormatError(src, 0, "path", f"not a directory (dataset kind {kind!r})")
    if kind in records.KINDS:
        info = records.convert_records(kind, src, out_dir, fields or RecordFields())
    else:
        info = CONVERTERS[kind](src, out_dir)
    info.setdefault("label_texts", None)
    return info


def source_files(kind: str, src: str) -> list[str]:
    """The files whose size and mtime key the cache for a ``kind`` source directory."""
    if kind in records.KINDS:
        return records.source_files(kind, src)
    if kind in ("arff", "libsvm"):  # their file names depend on what the directory holds
        return {"arff": arff, "libsvm": libsvm}[kind].source_files(src)
    names = {"xc_sparse": ["train.txt", "test.txt"],
             "lf_raw": ["trn_X_Y.txt", "tst_X_Y.txt", "trn.raw.txt", "tst.raw.txt", "lbl.raw.txt"],
             "npz": ["train_X.npz", "train_Y.npz", "test_X.npz", "test_Y.npz"]}[kind]
    return [os.path.join(src, n) for n in names]
