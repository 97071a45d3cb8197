"""Memory-mapped CSR matrices: the one container every split's labels and features live in.

A matrix is stored as ``<prefix>.indptr.npy`` (int64, ``(num_rows+1,)``), ``<prefix>.indices.npy``
(int32, ``(nnz,)``) and, unless it is binary, ``<prefix>.values.npy`` (float32, ``(nnz,)``).
:class:`CSRWriter` streams rows into those files chunk by chunk, so a matrix far larger than RAM can be
built; :func:`load_csr` maps them back read-only with ``np.load(mmap_mode="r")``.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

# Rows of nnz processed at once by whole-matrix reductions; bounds the RAM a 10^9-nnz matrix needs.
_CHUNK_NNZ = 1 << 24
# Every .npy header CSRWriter writes is exactly this long, so it can be written before the length of
# the array is known and overwritten in place at the end (numpy pads headers with spaces itself).
_NPY_HEADER_BYTES = 128


@dataclass
class SparseMatrix:
    """A CSR matrix whose arrays may be read-only ``np.memmap`` views.

    indptr: ``(num_rows+1,)`` int64; row ``i`` owns ``indices[indptr[i]:indptr[i+1]]``.
    indices: ``(nnz,)`` int32 column ids.
    values: ``(nnz,)`` float32, or ``None`` meaning every stored entry is 1 (label matrices).
    num_cols: number of columns (labels or features).
    """

    indptr: np.ndarray
    indices: np.ndarray
    values: np.ndarray | None
    num_cols: int

    @property
    def num_rows(self) -> int:
        return int(self.indptr.shape[0]) - 1

    @property
    def nnz(self) -> int:
        return int(self.indptr[-1])

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Column ids ``(k,)`` int32 and values ``(k,)`` float32 (or None) of row ``i``."""
        if not 0 <= i < self.num_rows:
            raise IndexError(f"row {i} out of range for {self.num_rows} rows")
        s, e = int(self.indptr[i]), int(self.indptr[i + 1])
        return self.indices[s:e], (None if self.values is None else self.values[s:e])

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Concatenate rows ``rows`` (``(B,)`` ints) into EmbeddingBag-style flat arrays.

        Returns ``flat_indices`` int64 ``(nnz_b,)``, ``offsets`` int64 ``(B,)`` (start of each row in the
        flat arrays) and ``flat_values`` float32 ``(nnz_b,)`` or None. Vectorised: one fancy-index read
        of the (possibly memmapped) arrays, no Python loop over rows.
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_rows):
            raise IndexError(f"row ids must lie in [0, {self.num_rows})")
        starts = np.asarray(self.indptr[rows], dtype=np.int64)
        lengths = np.asarray(self.indptr[rows + 1], dtype=np.int64) - starts
        offsets = np.zeros(rows.shape[0], dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        # Position j of the output belongs to the row r whose range covers it; its source position is
        # starts[r] + (j - offsets[r]), i.e. j plus a per-row shift repeated over the row's length.
        pos = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - offsets, lengths)
        flat_indices = np.asarray(self.indices[pos], dtype=np.int64)
        flat_values = None if self.values is None else np.asarray(self.values[pos], dtype=np.float32)
        return flat_indices, offsets, flat_values

    def row_lengths(self) -> np.ndarray:
        """Stored entries per row, ``(num_rows,)`` int64."""
        return np.diff(np.asarray(self.indptr, dtype=np.int64))

    def column_counts(self) -> np.ndarray:
        """Stored entries per column, ``(num_cols,)`` int64 (label frequencies for a label matrix).

        Counted in chunks of the memmapped indices so the whole index array is never resident at once.
        """
        counts = np.zeros(self.num_cols, dtype=np.int64)
        for s in range(0, self.nnz, _CHUNK_NNZ):
            counts += np.bincount(self.indices[s : s + _CHUNK_NNZ], minlength=self.num_cols)
        return counts

    def to_scipy(self) -> sp.csr_matrix:
        """A ``(num_rows, num_cols)`` scipy CSR copy (float32 data; ones when ``values`` is None)."""
        data = np.ones(self.nnz, np.float32) if self.values is None else np.array(self.values)
        return sp.csr_matrix(
            (data, np.array(self.indices), np.array(self.indptr)), shape=(self.num_rows, self.num_cols)
        )

    @classmethod
    def from_scipy(cls, m, binary: bool = False) -> "SparseMatrix":
        """In-memory SparseMatrix from any scipy sparse matrix (values dropped when ``binary``)."""
        m = sp.csr_matrix(m)
        return cls(
            indptr=m.indptr.astype(np.int64),
            indices=m.indices.astype(np.int32),
            values=None if binary else m.data.astype(np.float32),
            num_cols=int(m.shape[1]),
        )


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    """A version-1.0 .npy header for a 1-D C-order array, padded to exactly _NPY_HEADER_BYTES."""
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    body = "{'descr': %r, 'fortran_order': False, 'shape': (%d,), }" % (descr, length)
    body = body.ljust(_NPY_HEADER_BYTES - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("latin1")


class _NpyAppender:
    """Append-only writer of a 1-D .npy file whose final length is unknown until close()."""

    def __init__(self, path: str, dtype):
        self.path, self.dtype, self.length = path, np.dtype(dtype), 0
        self._f = open(path, "wb")
        self._f.write(_npy_header(self.dtype, 0))

    def append(self, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=self.dtype)
        self._f.write(memoryview(arr).cast("B"))
        self.length += arr.shape[0]

    def close(self) -> None:
        self._f.seek(0)
        self._f.write(_npy_header(self.dtype, self.length))
        self._f.flush()
        os.fsync(self._f.fileno())  # conversion is atomic only if the bytes hit disk before the rename
        self._f.close()

    def abort(self) -> None:
        self._f.close()


class CSRWriter:
    """Streams rows into ``<out_dir>/<prefix>.{indptr,indices[,values]}.npy``.

    Call :meth:`append` with consecutive blocks of rows, then :meth:`close` to get the memmapped
    matrix. Memory use is that of one block.
    """

    def __init__(self, out_dir: str, prefix: str, num_cols: int, with_values: bool):
        self.out_dir, self.prefix, self.num_cols = out_dir, prefix, int(num_cols)
        self.num_rows, self._nnz = 0, 0
        base = os.path.join(out_dir, prefix)
        self._indptr = _NpyAppender(base + ".indptr.npy", np.int64)
        self._indptr.append(np.zeros(1, np.int64))
        self._indices = _NpyAppender(base + ".indices.npy", np.int32)
        self._values = _NpyAppender(base + ".values.npy", np.float32) if with_values else None

    def append(self, row_lengths: np.ndarray, indices: np.ndarray, values: np.ndarray | None = None):
        """Add ``len(row_lengths)`` rows; ``indices``/``values`` hold their entries back to back."""
        row_lengths = np.asarray(row_lengths, dtype=np.int64)
        if int(row_lengths.sum()) != len(indices):
            raise AssertionError("row_lengths do not add up to the number of indices")
        self._indptr.append(self._nnz + np.cumsum(row_lengths))
        self._indices.append(indices)
        if self._values is not None:
            self._values.append(np.ones(len(indices), np.float32) if values is None else values)
        self._nnz += len(indices)
        self.num_rows += len(row_lengths)

    def close(self) -> SparseMatrix:
        for a in (self._indptr, self._indices, self._values):
            if a is not None:
                a.close()
        return load_csr(self.out_dir, self.prefix, self.num_cols)

    def abort(self) -> None:
        for a in (self._indptr, self._indices, self._values):
            if a is not None:
                a.abort()


def load_csr(directory: str, prefix: str, num_cols: int) -> SparseMatrix:
    """Map a matrix written by :class:`CSRWriter` (or :func:`save_csr`) read-only."""
    base = os.path.join(directory, prefix)
    values = base + ".values.npy"
    return SparseMatrix(
        indptr=np.load(base + ".indptr.npy", mmap_mode="r"),
        indices=np.load(base + ".indices.npy", mmap_mode="r"),
        values=np.load(values, mmap_mode="r") if os.path.exists(values) else None,
        num_cols=int(num_cols),
    )


def save_csr(m: SparseMatrix, directory: str, prefix: str, chunk_rows: int = 1 << 16) -> SparseMatrix:
    """Write any SparseMatrix to ``directory`` in row blocks and return the memmapped copy."""
    w = CSRWriter(directory, prefix, m.num_cols, m.values is not None)
    for s in range(0, m.num_rows, chunk_rows):
        e = min(s + chunk_rows, m.num_rows)
        a, b = int(m.indptr[s]), int(m.indptr[e])
        w.append(np.diff(np.asarray(m.indptr[s : e + 1])), m.indices[a:b],
                 None if m.values is None else m.values[a:b])
    return w.close()


@dataclass
class XCSplit:
    """One split of a dataset.

    labels: ``(num_points, num_labels)`` binary SparseMatrix (values None).
    features: ``(num_points, num_features)`` bag-of-words SparseMatrix, or None for text-only data.
    texts_path: a UTF-8 file with exactly num_points lines (one text each; LF layout) or None. A
    ``texts_path + ".offsets.npy"`` int64 ``(num_points+1,)`` file of line byte offsets sits next to it.
    """

    name: str
    labels: SparseMatrix
    features: SparseMatrix | None
    texts_path: str | None

    @property
    def num_points(self) -> int:
        return self.labels.num_rows


@dataclass
class XCDataset:
    """A converted dataset: both splits plus the counts they share.

    num_features is 0 for text-only data; label_texts_path has num_labels lines (LF layout) or is None;
    label_features is the (num_labels, num_features) tf-idf of the label texts (LF layout) or None;
    meta carries provenance and, for synthetic data, ``oracle_p1``/``oracle_p3``/``oracle_p5`` (percent)
    and ``generator`` (the full parameter dict).
    """

    train: XCSplit
    test: XCSplit
    num_labels: int
    num_features: int
    label_texts_path: str | None
    meta: dict
    label_features: SparseMatrix | None = None
