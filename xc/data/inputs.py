"""Turn dataset rows into encoder inputs and label lists (the bridge from memmaps to tensors).

Label-text augmentation (ASTRA Sec. 5; LF data) appends the L label texts as extra training rows:
row N + l has text lbl.raw.txt[l] and the single label l. `TrainingView` hides that from the trainer.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

InputFn = Callable[[np.ndarray], dict[str, torch.Tensor]]


def idf_weights(train_features) -> np.ndarray:
    """(F,) float32 inverse document frequencies log((1 + N) / (1 + df)) + 1 from the training split."""
    df = train_features.column_counts().astype(np.float64)
    return (np.log((1.0 + train_features.num_rows) / (1.0 + df)) + 1.0).astype(np.float32)


def sparse_inputs(matrix, feature_weights: np.ndarray | None = None) -> InputFn:
    """Bag-of-words inputs from a SparseMatrix of features, optionally re-weighted per feature (idf),
    each row's values L2-normalised (so long documents do not dominate the bag's sum)."""

    def gather(rows: np.ndarray) -> dict[str, torch.Tensor]:
        flat, offsets, values = matrix.gather(rows)
        values = np.ones(len(flat), dtype=np.float32) if values is None else np.array(values, dtype=np.float32)
        if feature_weights is not None:
            values *= feature_weights[flat]
        if len(flat):
            lengths = np.diff(np.append(offsets, len(flat)))
            sq = np.add.reduceat(values * values, np.minimum(offsets, len(flat) - 1))
            norms = np.sqrt(np.where(lengths > 0, sq, 1.0)).clip(1e-12)
            values /= np.repeat(norms, lengths)
        return {
            "feat_ids": torch.from_numpy(np.asarray(flat, dtype=np.int64)),
            "feat_offsets": torch.from_numpy(np.asarray(offsets, dtype=np.int64)),
            "feat_values": torch.from_numpy(np.asarray(values, dtype=np.float32)),
        }

    return gather


def dense_inputs(matrix, feature_weights: np.ndarray | None = None) -> InputFn:
    """Precomputed dense features: each batch's CSR rows densified to "dense" (B, num_features)."""

    def gather(rows: np.ndarray) -> dict[str, torch.Tensor]:
        flat, offsets, values = matrix.gather(rows)
        lengths = np.diff(np.append(offsets, len(flat)))
        dense = np.zeros((len(rows), matrix.num_cols), dtype=np.float32)
        dense[np.repeat(np.arange(len(rows)), lengths), flat] = 1.0 if values is None else values
        if feature_weights is not None:
            dense *= feature_weights
        return {"dense": torch.from_numpy(dense)}

    return gather


def concat_inputs(first: InputFn, first_rows: int, second: InputFn) -> InputFn:
    """Rows < first_rows come from `first`, the rest from `second` (shifted); token batches are
    padded to a common length before concatenation."""

    def gather(rows: np.ndarray) -> dict[str, torch.Tensor]:
        low, high = rows[rows < first_rows], rows[rows >= first_rows] - first_rows
        if not len(high):
            return first(rows)
        if not len(low):
            return second(high)
        a, b = first(low), second(high)
        order = np.argsort(np.concatenate([np.nonzero(rows < first_rows)[0], np.nonzero(rows >= first_rows)[0]]),
                           kind="stable")
        merged = {}
        for key in a:
            x, y = a[key], b[key]
            if x.dim() == 2 and x.shape[1] != y.shape[1]:
                width = max(x.shape[1], y.shape[1])
                x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
                y = torch.nn.functional.pad(y, (0, width - y.shape[1]))
            merged[key] = torch.cat([x, y])[torch.from_numpy(order)]
        return merged

    return gather


class TrainingView:
    """Training rows: the split's N points, plus (optionally) one row per label text.

    `labels(rows)` -> (indptr (B+1,) int64, indices (nnz,) int64) of each row's positive labels.
    """

    def __init__(self, split, inputs: InputFn, label_inputs: InputFn | None = None, num_labels: int = 0):
        self.labels_matrix = split.labels
        self.num_points = split.num_points
        self.num_extra = num_labels if label_inputs is not None else 0
        self.inputs = concat_inputs(inputs, self.num_points, label_inputs) if label_inputs else inputs

    @property
    def num_rows(self) -> int:
        return self.num_points + self.num_extra

    def labels(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64)
        real = rows < self.num_points
        if real.all():
            flat, offsets, _ = self.labels_matrix.gather(rows)
            return np.append(offsets, len(flat)).astype(np.int64), np.asarray(flat, dtype=np.int64)
        counts = np.ones(len(rows), dtype=np.int64)
        per_row: list[np.ndarray] = [np.array([r - self.num_points]) for r in rows]
        if real.any():
            flat, offsets, _ = self.labels_matrix.gather(rows[real])
            ends = np.append(offsets[1:], len(flat))
            for slot, (a, b) in zip(np.nonzero(real)[0], zip(offsets, ends)):
                per_row[slot] = np.asarray(flat[a:b])
                counts[slot] = b - a
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return indptr, np.concatenate(per_row).astype(np.int64)
