"""xc/arrays.py: the sort-based set operations equal numpy's on the keys the project builds."""
from __future__ import annotations

import numpy as np
import pytest

from xc.arrays import find_sorted, top_order, unique_ints


@pytest.mark.parametrize("size, high", [(0, 10), (1, 10), (2, 1), (1000, 50), (100_000, 2**40)])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_unique_ints_equals_np_unique(size, high, dtype):
    rng = np.random.default_rng(size + high)
    values = rng.integers(-high, high, size=size).astype(dtype)
    expected = np.unique(values)
    got = unique_ints(values)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)


def test_unique_ints_flattens_and_leaves_its_argument_unsorted():
    values = np.array([[5, 3], [3, -1]], dtype=np.int64)
    np.testing.assert_array_equal(unique_ints(values), [-1, 3, 5])
    np.testing.assert_array_equal(values, [[5, 3], [3, -1]])


def test_unique_ints_refuses_floats():
    with pytest.raises(TypeError, match="integer keys"):
        unique_ints(np.array([1.0, np.nan]))


@pytest.mark.parametrize("set_size", [0, 1, 7, 5000])
def test_find_sorted_equals_np_isin_and_points_at_the_key(set_size):
    rng = np.random.default_rng(set_size)
    members = unique_ints(rng.integers(0, 20_000, size=set_size))
    values = rng.integers(-5, 20_005, size=(300, 40))  # below, inside and above the set's range
    at, found = find_sorted(members, values)
    assert at.shape == found.shape == values.shape
    np.testing.assert_array_equal(found, np.isin(values, members))
    np.testing.assert_array_equal(members[at[found]] if members.size else at[found], values[found])


@pytest.mark.parametrize("cols, k", [(1, 1), (10, 3), (10, 5), (10, 10), (10, 20), (250, 20), (250, 5)])
@pytest.mark.parametrize("levels", [3, 1000])  # few distinct values: ties at the k-th value in most rows
def test_top_order_equals_a_stable_argsort(cols, k, levels):
    rng = np.random.default_rng(cols * k + levels)
    values = rng.integers(0, levels, size=(400, cols)).astype(np.float64)
    values[rng.random(values.shape) < 0.2] = -np.inf  # the fusion's pads
    expected = np.argsort(-values, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(top_order(values, k), expected)


def test_top_order_keeps_numpys_order_where_a_row_holds_nan():
    values = np.array([[0.5, np.nan, 0.7, 0.1, 0.2, 0.3]])
    np.testing.assert_array_equal(top_order(values, 2), np.argsort(-values, axis=1, kind="stable")[:, :2])
