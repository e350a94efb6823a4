"""Split, SplitV, ReverseV2, Cumsum/Cumprod, TopKV2, InTopKV2, RandomShuffle and CountUpTo."""

from __future__ import annotations

import numpy as np
import pytest

from distserver import errors
from distserver.kernels import create_kernel
from tests.kernels.conftest import Context, make_node, run_op

F32, I32 = np.float32, np.int32


def test_split_and_split_v():
    x = np.arange(12, dtype=F32).reshape(2, 6)
    pieces = run_op("Split", np.int32(1), x, T=F32, num_split=3)
    assert [p.tolist() for p in pieces] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    with pytest.raises(errors.InvalidArgumentError, match="evenly divide"):
        run_op("Split", np.int32(1), x, T=F32, num_split=4)
    pieces = run_op("SplitV", x, np.array([1, -1, 2], I32), np.int32(-1), T=F32, Tlen=I32, num_split=3)
    assert [p.shape for p in pieces] == [(2, 1), (2, 3), (2, 2)]
    with pytest.raises(errors.InvalidArgumentError, match="only be one -1"):
        run_op("SplitV", x, np.array([-1, -1], I32), np.int32(1), T=F32, Tlen=I32, num_split=2)


def test_reverse_v2():
    x = np.arange(6, dtype=F32).reshape(2, 3)
    (out,) = run_op("ReverseV2", x, np.array([1, 0], I32), T=F32, Tidx=I32)
    np.testing.assert_array_equal(out, x[::-1, ::-1])
    (same,) = run_op("ReverseV2", x, np.zeros(0, I32), T=F32, Tidx=I32)
    np.testing.assert_array_equal(same, x)


@pytest.mark.parametrize(
    ("exclusive", "reverse"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_cumsum_and_cumprod(exclusive, reverse):
    x = np.array([[1, 2, 3], [4, 5, 6]], F32)
    attrs = dict(T=F32, Tidx=I32, exclusive=exclusive, reverse=reverse)
    (summed,) = run_op("Cumsum", x, np.int32(1), **attrs)
    (product,) = run_op("Cumprod", x, np.int32(1), **attrs)
    row = x[:, ::-1] if reverse else x
    expected_sum = np.cumsum(row, axis=1)
    expected_product = np.cumprod(row, axis=1)
    if exclusive:
        expected_sum = np.concatenate([np.zeros((2, 1), F32), expected_sum[:, :-1]], axis=1)
        expected_product = np.concatenate([np.ones((2, 1), F32), expected_product[:, :-1]], axis=1)
    if reverse:
        expected_sum, expected_product = expected_sum[:, ::-1], expected_product[:, ::-1]
    np.testing.assert_array_equal(summed, expected_sum)
    np.testing.assert_array_equal(product, expected_product)


def test_top_k_keeps_index_order_among_equal_values():
    x = np.array([[1, 3, 3, 2], [5, 5, 5, 5]], F32)
    values, indices = run_op("TopKV2", x, np.int32(2), T=F32, sorted=True)
    np.testing.assert_array_equal(values, [[3, 3], [5, 5]])
    np.testing.assert_array_equal(indices, [[1, 2], [0, 1]])
    with pytest.raises(errors.InvalidArgumentError, match="at least k columns"):
        run_op("TopKV2", x, np.int32(5), T=F32, sorted=True)


def test_in_top_k_counts_ties_at_the_boundary_as_in():
    predictions = np.array([[0.1, 0.9, 0.9, 0.3], [0.5, np.nan, 0.2, 0.1]], F32)
    (inside,) = run_op("InTopKV2", predictions, np.array([2, 0], I32), np.int32(1), T=I32)
    np.testing.assert_array_equal(inside, [True, False])  # a tie for first; a NaN row
    (out_of_range,) = run_op("InTopKV2", predictions, np.array([7, 0], I32), np.int32(4), T=I32)
    np.testing.assert_array_equal(out_of_range, [False, False])


def test_random_shuffle_permutes_the_first_dimension_reproducibly():
    x = np.arange(20, dtype=F32).reshape(10, 2)
    first = run_op("RandomShuffle", x, T=F32, seed=3, seed2=4)[0]
    again = run_op("RandomShuffle", x, T=F32, seed=3, seed2=4)[0]
    np.testing.assert_array_equal(first, again)
    assert sorted(first[:, 0].tolist()) == x[:, 0].tolist()
    np.testing.assert_array_equal(first[:, 1] - first[:, 0], 1)  # rows stay whole


def test_count_up_to_stops_at_the_limit():
    ctx = Context()
    variable = create_kernel(make_node("VariableV2", name="counter", dtype=I32, shape=[]))
    (ref,) = variable.compute(ctx, [])
    create_kernel(make_node("Assign", ["counter", "zero"], name="init", T=I32)).compute(
        ctx, [ref, np.int32(0)]
    )
    count = create_kernel(make_node("CountUpTo", ["counter"], name="count", T=I32, limit=2))
    assert [int(count.compute(ctx, [ref])[0]) for _ in range(2)] == [0, 1]
    with pytest.raises(errors.OutOfRangeError, match="Reached limit of 2"):
        count.compute(ctx, [ref])
