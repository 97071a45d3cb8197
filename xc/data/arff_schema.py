"""What each ARFF attribute becomes: a label, feature columns, or nothing; and the encoding of parsed rows.

The rules (``docs/data.md``, "ARFF"):

* a ``numeric`` feature is one column holding its value (zeros and ``?`` absent);
* a two-valued nominal is ONE column, present (value 1) at the value that is ``yes``, ``y``, ``true`` or
  ``1`` (case-insensitive, ``1`` also as a number), or, when neither or both declared values are such a
  word, at the SECOND declared value: {YES,NO}, {NO,YES}, {0,1}, {1,0}, {false,true} all mark presence
  at the affirmative value, {a,b} at ``b``;
* any other nominal is one column per declared value, in declaration order (one-hot);
* ``?`` in a nominal is absent (no column); in a sparse row, a nominal that is left out has its FIRST
  declared value, as Weka defines it (a left-out {YES,NO} is YES, a left-out {NO,YES} is NO, a left-out
  multi-valued nominal is its first value's column);
* ``string`` attributes, and identifiers, are skipped, named in one log line. An identifier is a
  nominal feature with at least 20 declared values and at least one value per two training rows
  (values >= 0.5 x rows: MULAN genbase's protein id; a small category such as birds' location stays a
  feature even in a tiny file). The train file's rows are counted in a pre-pass that stops past 2 x the
  largest such declaration: it never reads more rows than that;
* a label attribute is numeric (relevant when non-zero) or a two-valued nominal (relevant at the value
  a two-valued feature is present at); other labels are refused.

Parsers hand :meth:`ArffSchema.encode` items ``(attribute id, value)`` where a nominal's value is
already its code: the index of the declared value, -1 for ``?``.
"""

from __future__ import annotations

import logging
import re

import numpy as np

from ..errors import DataFormatError
from .arff_header import ArffHeader
from .formats import _NUM, _lines

log = logging.getLogger(__name__)

AFFIRMATIVE = frozenset({"yes", "y", "true", "1"})
IDENTIFIER_MIN_VALUES = 20  # fewer values are a category whatever the file's size (birds' location)
IDENTIFIER_VALUES_PER_ROW = 0.5
_NUM_RE = re.compile(_NUM)


def present_index(values: tuple[str, ...]) -> int:
    """Which of a two-valued nominal's values marks presence: the one affirmative value, else the second."""
    def affirmative(v: str) -> bool:
        return v.lower() in AFFIRMATIVE or (bool(_NUM_RE.fullmatch(v)) and float(v) == 1.0)
    hits = [i for i, v in enumerate(values) if affirmative(v)]
    return hits[0] if len(hits) == 1 else 1


def count_data_rows(head: ArffHeader, stop_after: int) -> int:
    """Data rows of ``head``'s file (blank and ``%`` lines excluded), counted no further than ``stop_after + 1``."""
    rows = 0
    for lineno, block in _lines(head.path):
        for k, line in enumerate(block):
            if lineno + k > head.data_line and line.strip(" \t") and not line.lstrip(" \t").startswith("%"):
                rows += 1
                if rows > stop_after:
                    return rows
    return rows


class ArffSchema:
    """Per attribute (arrays of length num_attrs): its role, and where its columns start.

    is_label, numeric, nominal (nominal and not skipped), skipped: bool masks; column: first label or
    feature column; one_hot: a nominal with one column per value; present: a two-valued nominal's
    present code (-1 otherwise); dense_zero_parsed: whose bare "0" the dense fast path must read.
    num_labels, num_features: the output widths.
    """

    def __init__(self, head: ArffHeader, label_attrs: np.ndarray):
        attrs, n = head.attributes, len(head.attributes)
        self.head, self.num_attrs = head, n
        self.is_label = np.zeros(n, dtype=bool)
        self.is_label[label_attrs] = True
        self.train_rows: int | None = None  # counted only when a nominal could be an identifier
        kinds = np.array([a.kind for a in attrs])
        widths = np.array([len(a.values) for a in attrs], dtype=np.int64)
        for i in np.flatnonzero(self.is_label):
            if kinds[i] == "string" or (kinds[i] == "nominal" and widths[i] != 2):
                a = attrs[i]
                raise DataFormatError(head.path, a.line, f"attribute {a.name}", f"a label must be numeric or a "
                                      f"two-valued nominal ({{0,1}}, {{YES,NO}}), not {a.describe()}")
        self.skipped = (kinds == "string") | self._identifiers(kinds, widths)
        self.numeric = kinds == "numeric"
        self.nominal = (kinds == "nominal") & ~self.skipped
        self.one_hot = self.nominal & (widths != 2)
        self.present = np.array([present_index(a.values) if nom and not hot else -1
                                 for a, nom, hot in zip(attrs, self.nominal, self.one_hot)], dtype=np.int64)
        width = np.where(self.one_hot, widths, 1) * ~self.skipped
        self.column = np.zeros(n, dtype=np.int64)
        for mask in (self.is_label, ~self.is_label):
            self.column[mask] = np.cumsum(width[mask]) - width[mask]
        self.num_labels, self.num_features = int(width[self.is_label].sum()), int(width[~self.is_label].sum())
        # Left out of a sparse row = code 0: these attributes then still produce a column.
        self.sparse_default = np.flatnonzero(self.nominal & (self.one_hot | (self.present == 0)))
        self._codes = [{v: c for c, v in enumerate(a.values)} for a in attrs]
        self._number_codes = [self._numbers(a.values) for a in attrs]
        self._fast_table()
        # The dense fast path skips a bare "0" unparsed (most of a dense multi-label row is "0"): right for a
        # numeric and for a two-valued nominal whose "0" is its absent value ({0,1}); any other nominal's "0"
        # is a column of its own, or undeclared (then the row-by-row path reports it), so it is parsed.
        zero_absent = [nums is not None and nums.get(0.0, -1) not in (-1, p) and not hot
                       for nums, p, hot in zip(self._number_codes, self.present, self.one_hot)]
        self.dense_zero_parsed = self.nominal & ~np.array(zero_absent, dtype=bool)
        self._log_skipped(kinds, widths)

    def _identifiers(self, kinds: np.ndarray, widths: np.ndarray) -> np.ndarray:
        candidate = (kinds == "nominal") & ~self.is_label & (widths >= IDENTIFIER_MIN_VALUES)
        if not candidate.any():
            return candidate
        limit = int(widths[candidate].max() / IDENTIFIER_VALUES_PER_ROW)
        self.train_rows = count_data_rows(self.head, limit)
        return candidate & (widths >= IDENTIFIER_VALUES_PER_ROW * self.train_rows)

    def _log_skipped(self, kinds: np.ndarray, widths: np.ndarray) -> None:
        strings = [a.name for a, k in zip(self.head.attributes, kinds) if k == "string"]
        ids = [f"{a.name} ({w} values)" for a, w, s, k in zip(self.head.attributes, widths, self.skipped, kinds)
               if s and k == "nominal"]
        parts = ([f"string: {', '.join(strings)}"] if strings else []) + (
            [f"identifiers (nominal, >= {IDENTIFIER_VALUES_PER_ROW} values per training row, "
             f"{self.train_rows} rows): {', '.join(ids)}"] if ids else [])
        if parts:
            log.info("%s: %d attributes skipped, not features: %s", self.head.path, len(strings) + len(ids),
                     "; ".join(parts))

    @staticmethod
    def _numbers(values: tuple[str, ...]) -> dict[float, int] | None:
        """Declared values that are numbers, by value ("1.0" matches a declared "1"); None if two are equal."""
        out: dict[float, int] = {}
        for c, v in enumerate(values):
            if _NUM_RE.fullmatch(v):
                if float(v) in out:
                    return None
                out[float(v)] = c
        return out

    def _fast_table(self) -> None:
        """(attribute, number) -> code as sorted int64 keys, so that a block's numeric items map in one search."""
        self.fast_nominal = np.array([nom and nums is not None for nom, nums in zip(self.nominal, self._number_codes)])
        pairs = [(a, x, c) for a in np.flatnonzero(self.fast_nominal) for x, c in self._number_codes[a].items()]
        self._uniq = np.unique(np.array([x for _, x, _ in pairs], dtype=np.float64))
        keys = np.array([a * len(self._uniq) + np.searchsorted(self._uniq, x) for a, x, _ in pairs], dtype=np.int64)
        order = np.argsort(keys)
        self._keys, self._key_codes = keys[order], np.array([c for _, _, c in pairs], dtype=np.float64)[order]

    def code(self, attr: int, tok: str) -> int | None:
        """The code of value ``tok`` of nominal ``attr`` (exact name, else equal as numbers); None if undeclared."""
        c = self._codes[attr].get(tok)
        if c is None and self._number_codes[attr] and _NUM_RE.fullmatch(tok):
            c = self._number_codes[attr].get(float(tok))
        return c

    def fast_codes(self, ids: np.ndarray, vals: np.ndarray) -> np.ndarray | None:
        """``vals`` with each nominal item's number replaced by its code; None when one is not a declared
        value (or the attribute is not matched by number): the row-by-row path then reads or reports it."""
        nominal = self.nominal[ids]
        if not nominal.any():
            return vals
        q_ids, q_vals = ids[nominal], vals[nominal]
        if not self.fast_nominal[q_ids].all() or not self._uniq.size:
            return None
        r = np.minimum(np.searchsorted(self._uniq, q_vals), self._uniq.size - 1)
        key = q_ids * self._uniq.size + r
        pos = np.minimum(np.searchsorted(self._keys, key), self._keys.size - 1)
        if not ((self._uniq[r] == q_vals).all() and (self._keys[pos] == key).all()):
            return None
        out = vals.copy()
        out[nominal] = self._key_codes[pos]
        return out

    def _fill_left_out(self, rows, ids, vals, sparse_rows: np.ndarray):
        """Add code 0 for each :attr:`sparse_default` attribute a sparse row leaves out; keep (row, attribute) order."""
        sparse_at = np.flatnonzero(sparse_rows)
        cand_rows = np.repeat(sparse_at, self.sparse_default.size)
        cand_ids = np.tile(self.sparse_default, sparse_at.size)
        left_out = ~np.isin(cand_rows * self.num_attrs + cand_ids, rows * self.num_attrs + ids)
        rows = np.concatenate([rows, cand_rows[left_out]])
        ids = np.concatenate([ids, cand_ids[left_out]])
        vals = np.concatenate([vals, np.zeros(int(left_out.sum()))])
        order = np.argsort(rows * self.num_attrs + ids, kind="stable")
        return rows[order], ids[order], vals[order]

    def encode(self, counts: np.ndarray, ids: np.ndarray, vals: np.ndarray, sparse_rows: np.ndarray):
        """Items of ``n = len(counts)`` rows (``counts[r]`` items each, attribute ids increasing within a row)
        -> ((label counts [n], label columns), (feature counts [n], feature columns, float32 values)).
        Columns come out sorted within each row: they grow with (attribute, code)."""
        n = len(counts)
        rows = np.repeat(np.arange(n), counts)
        if self.sparse_default.size and sparse_rows.any():
            rows, ids, vals = self._fill_left_out(rows, ids, vals, sparse_rows)
        nominal, one_hot = self.nominal[ids], self.one_hot[ids]
        keep = np.where(nominal, (vals >= 0) & (one_hot | (vals == self.present[ids])), self.numeric[ids] & (vals != 0))
        rows, ids, vals, nominal, one_hot = rows[keep], ids[keep], vals[keep], nominal[keep], one_hot[keep]
        cols = self.column[ids] + np.where(one_hot, vals, 0).astype(np.int64)
        vals = np.where(nominal, 1.0, vals).astype(np.float32)
        lab = self.is_label[ids]
        labels = (np.bincount(rows[lab], minlength=n), cols[lab].astype(np.int32))
        feats = (np.bincount(rows[~lab], minlength=n), cols[~lab].astype(np.int32), vals[~lab])
        return labels, feats
