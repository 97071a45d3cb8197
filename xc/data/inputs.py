"""Turn dataset rows into encoder inputs and label lists (the bridge from memmaps to tensors).

Label-text augmentation (ASTRA Sec. 5; LF data) appends the L label texts as extra training rows:
row N + l has text lbl.raw.txt[l] and the single label l. `TrainingView` hides that from the trainer.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from xc.errors import ConfigError

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
        if "feat_offsets" in a:
            return _merge_bags(a, b, order)
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


def split_validation(num_points: int, fraction: float, max_points: int, seed: int,
                     fold: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Carve a validation split from the training points: (train_ids, valid_ids), both sorted int64.

    The valid points are a seeded uniform sample of round(fraction * N) points, at most max_points (0 = no
    cap) and never all of them; they are held out of training and serve every choice made after training
    (kNN fusion's lambda and k), so nothing is ever chosen on test.

    `fold` f > 0 gives the f-th of disjoint splits of that size under the same seed (fold 0 is the split
    above, so a run's split does not change when folds are used): a cross-fitted ensemble's members hold
    out folds 0, 1, ..., and together train on every point (xc/ensemble/members.py)."""
    count = min(int(round(fraction * num_points)), max_points or num_points, num_points - 1)
    if fraction <= 0 or count <= 0:
        return np.arange(num_points, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if fold < 0 or (fold + 1) * count > num_points - 1:
        raise ConfigError("data.valid_fold", f"fold {fold} of {count}-point validation splits does not fit in "
                          f"{num_points} training points (at most {(num_points - 1) // count - 1})")
    free = np.ones(num_points, dtype=bool)
    for f in range(fold + 1):
        key = [seed, 0x7A11D] if f == 0 else [seed, 0x7A11D, f]
        candidates = np.nonzero(free)[0]
        pick = candidates[np.random.default_rng(key).choice(len(candidates), size=count, replace=False)]
        free[pick] = False
    mask = np.zeros(num_points, dtype=bool)
    mask[pick] = True
    return np.nonzero(~mask)[0].astype(np.int64), np.nonzero(mask)[0].astype(np.int64)


def validation_split(data_cfg, num_points: int, run_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The run's (train_ids, valid_ids) under `data.valid_*` and `data.split_seed` (a DataConfig)."""
    return split_validation(num_points, data_cfg.valid_fraction, data_cfg.valid_max_points,
                            data_cfg.valid_seed(run_seed), data_cfg.valid_fold)


def _merge_bags(a: dict, b: dict, order: np.ndarray) -> dict[str, torch.Tensor]:
    """Two EmbeddingBag batches (rows of `a`, then rows of `b`) as one, its row i being concatenated row
    order[i]: offsets are rebuilt, ids and values moved row by row in one gather."""
    ids = torch.cat([a["feat_ids"], b["feat_ids"]])
    values = torch.cat([a["feat_values"], b["feat_values"]])
    starts = torch.cat([a["feat_offsets"], b["feat_offsets"] + len(a["feat_ids"])])
    ends = torch.cat([a["feat_offsets"][1:], torch.tensor([len(a["feat_ids"])]),
                      b["feat_offsets"][1:] + len(a["feat_ids"]), torch.tensor([len(ids)])])
    pick = torch.from_numpy(order)
    lengths = (ends - starts)[pick]
    offsets = torch.cumsum(lengths, 0) - lengths
    flat = torch.repeat_interleave(starts[pick] - offsets, lengths) + torch.arange(int(lengths.sum()))
    return {"feat_ids": ids[flat], "feat_offsets": offsets, "feat_values": values[flat]}


class TrainingView:
    """Training rows: the split's points (all, or the subset `point_ids` when a validation split is held
    out), plus (optionally) one row per label text.

    Row r < num_points is point point_ids[r]; row num_points + l is label l's text.
    `labels(rows)` -> (indptr (B+1,) int64, indices (nnz,) int64) of each row's positive labels.
    """

    def __init__(self, split, inputs: InputFn, label_inputs: InputFn | None = None, num_labels: int = 0,
                 point_ids: np.ndarray | None = None, valid_ids: np.ndarray | None = None):
        self.labels_matrix = split.labels
        self.split_inputs = inputs  # every point of the split, by its own index (validation, memory)
        self.point_ids = point_ids
        self.valid_ids = np.zeros(0, np.int64) if valid_ids is None else valid_ids
        self.num_points = split.num_points if point_ids is None else len(point_ids)
        self.num_extra = num_labels if label_inputs is not None else 0
        base = inputs if point_ids is None else (lambda rows: inputs(point_ids[rows]))
        self.inputs = concat_inputs(base, self.num_points, label_inputs) if label_inputs else base

    @property
    def num_rows(self) -> int:
        return self.num_points + self.num_extra

    @property
    def train_ids(self) -> np.ndarray:
        """(num_points,) int64 split indices of the points that train the model."""
        return np.arange(self.num_points, dtype=np.int64) if self.point_ids is None else self.point_ids

    def _gather_labels(self, rows: np.ndarray):
        return self.labels_matrix.gather(rows if self.point_ids is None else self.point_ids[rows])

    def labels(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64)
        real = rows < self.num_points
        if real.all():
            flat, offsets, _ = self._gather_labels(rows)
            return np.append(offsets, len(flat)).astype(np.int64), np.asarray(flat, dtype=np.int64)
        counts = np.ones(len(rows), dtype=np.int64)
        per_row: list[np.ndarray] = [np.array([r - self.num_points]) for r in rows]
        if real.any():
            flat, offsets, _ = self._gather_labels(rows[real])
            ends = np.append(offsets[1:], len(flat))
            for slot, (a, b) in zip(np.nonzero(real)[0], zip(offsets, ends)):
                per_row[slot] = np.asarray(flat[a:b])
                counts[slot] = b - a
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return indptr, np.concatenate(per_row).astype(np.int64)
