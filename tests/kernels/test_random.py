"""Random kernels: shape, dtype, distribution, and TF's seed contract (not TF's numbers)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from distserver import errors
from distserver.kernels import create_kernel

SHAPE = np.array([200, 50], np.int32)


def _draws(make_node, ctx, op, runs=1, **attrs):
    kernel = create_kernel(make_node(op, ["shape"], **attrs))
    return [kernel.compute(ctx, [SHAPE])[0] for _ in range(runs)]


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_random_uniform_is_in_zero_one(make_node, ctx, dtype):
    (values,) = _draws(make_node, ctx, "RandomUniform", dtype=dtype, T=np.int32, seed=1)
    assert values.shape == (200, 50)
    assert values.dtype == dtype
    wide = values.astype(np.float64)
    assert wide.min() >= 0.0
    assert wide.max() < 1.0
    assert abs(wide.mean() - 0.5) < 0.02
    assert abs(wide.std() - np.sqrt(1 / 12)) < 0.02


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_random_standard_normal_moments(make_node, ctx, dtype):
    (values,) = _draws(make_node, ctx, "RandomStandardNormal", dtype=dtype, T=np.int32, seed=2)
    assert values.dtype == dtype
    assert abs(values.mean()) < 0.03
    assert abs(values.std() - 1.0) < 0.03


def test_truncated_normal_stays_within_two_standard_deviations(make_node, ctx):
    (values,) = _draws(make_node, ctx, "TruncatedNormal", dtype=np.float32, T=np.int32, seed=3)
    assert np.abs(values).max() <= 2.0
    # The standard deviation of N(0, 1) truncated at +-2 is about 0.8796.
    assert abs(values.std() - 0.8796) < 0.02
    assert abs(values.mean()) < 0.03


def test_seeds_make_sequences_repeat_in_every_new_kernel(make_node, ctx):
    first = _draws(make_node, ctx, "RandomUniform", runs=2, dtype=np.float32, seed=5, seed2=9)
    again = _draws(make_node, ctx, "RandomUniform", runs=2, dtype=np.float32, seed=5, seed2=9)
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    # Each run of the node continues the sequence.
    assert not np.array_equal(first[0], first[1])
    (other,) = _draws(make_node, ctx, "RandomUniform", dtype=np.float32, seed=5, seed2=10)
    assert not np.array_equal(first[0], other)


def test_zero_seeds_are_not_deterministic(make_node, ctx):
    (a,) = _draws(make_node, ctx, "RandomStandardNormal", dtype=np.float32)
    (b,) = _draws(make_node, ctx, "RandomStandardNormal", dtype=np.float32)
    assert not np.array_equal(a, b)


def test_negative_seeds_are_accepted(make_node, ctx):
    (values,) = _draws(make_node, ctx, "TruncatedNormal", dtype=np.float64, seed=-1, seed2=-7)
    assert values.shape == (200, 50)


def test_random_ops_are_stateful(make_node):
    assert create_kernel(make_node("RandomUniform", ["s"], dtype=np.float32)).is_stateful


def test_empty_and_scalar_shapes(run_op):
    (empty,) = run_op("RandomUniform", np.array([0, 3], np.int64), dtype=np.float32, T=np.int64)
    assert empty.shape == (0, 3)
    (scalar,) = run_op("RandomStandardNormal", np.array([], np.int32), dtype=np.float32, T=np.int32)
    assert scalar.shape == ()


def test_negative_dimensions_are_refused(run_op):
    with pytest.raises(errors.InvalidArgumentError, match=r"Dimension -2 must be >= 0"):
        run_op("RandomUniform", np.array([3, -2], np.int32), dtype=np.float32, T=np.int32)


def test_integer_dtypes_are_refused_for_float_ops(make_node):
    with pytest.raises(errors.InvalidArgumentError, match="No OpKernel was registered"):
        create_kernel(make_node("RandomUniform", ["s"], dtype=np.int32))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_random_uniform_int(run_op, dtype):
    (values,) = run_op(
        "RandomUniformInt",
        np.array([1000], np.int32),
        np.asarray(-3, dtype),
        np.asarray(4, dtype),
        Tout=dtype,
        T=np.int32,
        seed=4,
    )
    assert values.dtype == dtype
    assert set(np.unique(values)) == set(range(-3, 4))


def test_random_uniform_int_needs_minval_below_maxval(run_op):
    with pytest.raises(errors.InvalidArgumentError, match=r"Need minval < maxval: 5 >= 5"):
        run_op(
            "RandomUniformInt",
            np.array([2], np.int32),
            np.int32(5),
            np.int32(5),
            Tout=np.int32,
            T=np.int32,
        )
