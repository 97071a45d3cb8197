"""tools/experiments/hits_by_label_count.py: hits at each rank attributed to their label's training count, checked on
rankings counted by hand."""

from __future__ import annotations

import numpy as np

from tools.experiments.hits_by_label_count import BINS, hits_by_bin


def test_hits_land_in_their_labels_count_bin_at_their_rank():
    counts = np.array([0, 1, 2, 4, 10, 50, 500, 7])  # label l has counts[l] training points
    # query 0's truth {6, 1}: label 6 (500 points) at rank 1, label 1 (1 point) at rank 3; query 1's truth {4}: rank 2
    ids = np.array([[6, 3, 1, 2, 5], [0, 4, -1, -1, -1]])
    indptr, indices = np.array([0, 2, 3]), np.array([6, 1, 4])
    table = hits_by_bin(ids, indptr, indices, counts)
    want = np.zeros((len(BINS), 5))
    want[6, 0] = 50.0  # 101+ points, rank 1, one query of two
    want[1, 2] = 50.0  # 1 point, rank 3
    want[4, 1] = 50.0  # 6-20 points, rank 2
    np.testing.assert_array_equal(table, want)
    # P@k of the ranking is recovered from the table: P@1 = 1/2; P@3 = (2/3 + 1/3) / 2 = 1/2
    assert table[:, :1].sum() == 50.0 and abs(table[:, :3].sum() / 3 - 50.0) < 1e-9
