"""xc/arrays.py: the sort-based set operations equal numpy's on the keys the project builds."""
from __future__ import annotations

import numpy as np
import pytest

from xc.arrays import isin_sorted, unique_ints


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
def test_isin_sorted_equals_np_isin(set_size):
    rng = np.random.default_rng(set_size)
    members = unique_ints(rng.integers(0, 20_000, size=set_size))
    values = rng.integers(-5, 20_005, size=(300, 40))  # below, inside and above the set's range
    got = isin_sorted(values, members)
    assert got.shape == values.shape
    np.testing.assert_array_equal(got, np.isin(values, members))
