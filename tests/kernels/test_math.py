"""Math kernels against numpy references: broadcasting, 0-d, empty, dtypes, TF errors."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from distserver import errors
from distserver._blas import blas_threads, set_blas_threads
from distserver._cpus import current_cpu
from distserver.kernels import _intra_op, create_kernel
from distserver.kernels._common import broadcast_shape

from .conftest import Context, make_node, run_op

RNG = np.random.default_rng(0)

# (x shape, y shape): same, broadcast row, scalar vs vector, both 0-d, empty, outer.
BROADCAST_SHAPES = [
    ((2, 3), (2, 3)),
    ((2, 3), (3,)),
    ((), (4,)),
    ((), ()),
    ((0, 3), (1, 3)),
    ((3, 1), (1, 4)),
]


def _values(shape, dtype, *, nonzero=False, positive=False):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return RNG.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        low = 1 if positive or nonzero else (-5 if dtype.kind == "i" else 0)
        values = RNG.integers(low, 6, size=shape)
        if nonzero and dtype.kind == "i":
            values = values * RNG.choice([-1, 1], size=shape)
        return np.asarray(values, dtype=dtype)
    values = RNG.uniform(0.5 if positive or nonzero else -2, 2, size=shape)
    return np.asarray(values, dtype=dtype)


def _floor_div_reference(x, y):
    return np.floor_divide(x, y) if x.dtype.kind in "iu" else np.floor(x / y)


def _truncate_reference(x, y):
    if x.dtype.kind in "iu":
        return np.trunc(x.astype(np.float64) / y.astype(np.float64)).astype(x.dtype)
    return x / y


BINARY_CASES = [
    ("AddV2", np.add, [np.float32, np.int32, np.int64, np.complex64, np.uint8]),
    ("Add", np.add, [np.float64, np.int16]),
    ("Sub", np.subtract, [np.float32, np.int64]),
    ("Mul", np.multiply, [np.float16, np.int32]),
    ("RealDiv", _truncate_reference, [np.float32, np.float64]),
    ("Div", _truncate_reference, [np.float32, np.int32, np.int64]),
    ("FloorDiv", _floor_div_reference, [np.float32, np.int32, np.int64]),
    ("FloorMod", np.mod, [np.float64, np.int32]),
    ("Pow", np.power, [np.float32, np.int32]),
    ("Maximum", np.maximum, [np.float32, np.int64]),
    ("Minimum", np.minimum, [np.float32, np.uint8]),
    ("Greater", np.greater, [np.float32, np.int32]),
    ("GreaterEqual", np.greater_equal, [np.float32]),
    ("Less", np.less, [np.int64]),
    ("LessEqual", np.less_equal, [np.float64]),
    ("Equal", np.equal, [np.float32, np.int32, np.bool_]),
    ("NotEqual", np.not_equal, [np.int64, np.bool_]),
]


@pytest.mark.parametrize(("x_shape", "y_shape"), BROADCAST_SHAPES)
@pytest.mark.parametrize(("op", "reference", "dtypes"), BINARY_CASES, ids=[c[0] for c in BINARY_CASES])
def test_binary_ops_match_numpy(run_op, op, reference, dtypes, x_shape, y_shape):
    for dtype in dtypes:
        divides = op in ("RealDiv", "Div", "FloorDiv", "FloorMod")
        x = _values(x_shape, dtype)
        y = _values(y_shape, dtype, nonzero=divides, positive=op == "Pow")
        (out,) = run_op(op, x, y, T=dtype)
        with np.errstate(invalid="ignore"):  # negative ** fractional is nan in both
            expected = np.asarray(reference(x, y))
        assert isinstance(out, np.ndarray)
        assert out.shape == np.broadcast_shapes(x_shape, y_shape)
        assert out.dtype == (np.bool_ if expected.dtype == np.bool_ else np.dtype(dtype))
        np.testing.assert_allclose(out, expected.astype(out.dtype), rtol=1e-3)


def test_integer_division_semantics(run_op):
    x = np.array([-7, 7, -7, 7, 6], np.int32)
    y = np.array([2, 2, -2, -2, 3], np.int32)
    # Div truncates toward zero (C++); FloorDiv/FloorMod round toward -inf (Python).
    np.testing.assert_array_equal(run_op("Div", x, y, T=np.int32)[0], [-3, 3, 3, -3, 2])
    np.testing.assert_array_equal(run_op("TruncateDiv", x, y, T=np.int32)[0], [-3, 3, 3, -3, 2])
    np.testing.assert_array_equal(run_op("FloorDiv", x, y, T=np.int32)[0], [-4, 3, 3, -4, 2])
    np.testing.assert_array_equal(run_op("FloorMod", x, y, T=np.int32)[0], [1, 1, -1, -1, 0])


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8, np.uint32, np.uint64])
def test_integer_floor_mod_is_numpys_remainder_at_the_extremes(run_op, dtype):
    info = np.iinfo(dtype)
    edges = [info.min, info.min + 1, info.max, info.max - 1, 0, 1, 2, 3, 7]
    if info.min < 0:
        edges += [-1, -2, -3, -7]
    random = RNG.integers(info.min, info.max, 500, dtype=dtype, endpoint=True)
    x = np.concatenate([np.array(edges, dtype), random])
    divisors = [d for d in edges if d != 0] + [int(RNG.integers(1, info.max, dtype=dtype))]
    for divisor in divisors:
        (out,) = run_op("FloorMod", x, np.array(divisor, dtype), T=dtype)
        with np.errstate(all="ignore"):
            expected = np.remainder(x, np.array(divisor, dtype))
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out, expected, err_msg=f"divisor {divisor}")
    y = np.array(divisors, dtype)
    (out,) = run_op("FloorMod", np.resize(x, y.shape), y, T=dtype)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(out, np.remainder(np.resize(x, y.shape), y))


def test_float_floor_div_and_mod(run_op):
    x = np.array([-7.5, 7.5, 1.0], np.float64)
    y = np.array([2.0, -2.0, 0.1], np.float64)
    np.testing.assert_array_equal(run_op("FloorDiv", x, y, T=np.float64)[0], np.floor(x / y))
    np.testing.assert_allclose(run_op("FloorMod", x, y, T=np.float64)[0], [0.5, -0.5, np.mod(1.0, 0.1)])


@pytest.mark.parametrize("divisor", [[1, 0], 0, [[0]], [0, 0]])
@pytest.mark.parametrize("op", ["Div", "TruncateDiv", "FloorDiv", "FloorMod"])
def test_integer_division_by_zero_is_an_error(run_op, op, divisor):
    with pytest.raises(errors.InvalidArgumentError, match="Integer division by zero") as info:
        run_op(op, np.array([1, 2], np.int32), np.array(divisor, np.int32), T=np.int32, name="divide")
    assert info.value.node_name == "divide"
    assert "{{node divide}}" in info.value.message
    # Divisors without a zero, one or many: no error.
    run_op(op, np.array([1, 2], np.int32), np.array(3, np.int32), T=np.int32)
    run_op(op, np.array([1, 2], np.int32), np.array([3, -1], np.int32), T=np.int32)


def test_float_division_by_zero_gives_ieee_results(run_op):
    (out,) = run_op("RealDiv", np.array([1.0, -1.0, 0.0], np.float32), np.zeros(3, np.float32), T=np.float32)
    np.testing.assert_array_equal(out[:2], [np.inf, -np.inf])
    assert np.isnan(out[2])


def _special_dividends(dtype):
    """Values whose quotients by a power of two cover every case of rounding: normal,
    subnormal and overflowing quotients, signed zeros, infinities and NaN."""
    dtype = np.dtype(dtype)
    info = np.finfo(dtype)
    special = [0.0, -0.0, 1.0, -3.0, np.inf, -np.inf, np.nan, info.max, -info.max, info.tiny]
    special.append(info.smallest_subnormal)
    odd_subnormals = info.smallest_subnormal * np.array([3, 5, 7, 255, 1023], dtype)  # (halves round to even)
    scales = dtype.type(2.0) ** RNG.integers(-40, 40, 4096).astype(dtype)
    random = RNG.standard_normal(4096).astype(dtype) * scales
    return np.concatenate([np.array(special, dtype), odd_subnormals, -odd_subnormals, random])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_division_by_a_power_of_two_gives_the_bits_of_division(run_op, dtype):
    """RealDiv by a scalar power of two multiplies by its reciprocal (`exact_reciprocal`):
    the same bits as numpy's division, for every kind of dividend and power."""
    from distserver.kernels.math import exact_reciprocal

    dtype = np.dtype(dtype)
    info = np.finfo(dtype)
    x = _special_dividends(dtype)
    lowest = info.minexp - info.nmant  # (the smallest subnormal's exponent)
    # (from the smallest divisor whose reciprocal the dtype holds to the largest power)
    powers = [1 - info.maxexp, -3, 0, 1, 3, 11, info.maxexp - 1]
    for exponent in powers:
        for sign in (1.0, -1.0):
            divisor = np.array(sign * 2.0**exponent, dtype)
            assert exact_reciprocal(float(divisor), dtype) is not None, divisor
            (out,) = run_op("RealDiv", x, divisor, T=dtype)
            with np.errstate(all="ignore"):
                expected = np.true_divide(x, divisor)
            assert out.dtype == dtype
            np.testing.assert_array_equal(out.view(f"u{dtype.itemsize}"), expected.view(f"u{dtype.itemsize}"))
    # What stays a division: not a power of two, zero, an infinity, NaN, a power whose
    # reciprocal the dtype cannot hold (it overflows).
    for divisor in (3.0, 0.75, 0.0, -0.0, np.inf, np.nan, 2.0**lowest, 2.0**-info.maxexp):
        assert exact_reciprocal(float(dtype.type(divisor)), dtype) is None, divisor
    # Others still divide as numpy does (a vector divisor, a divisor of 3).
    for divisor in (np.array(3.0, dtype), np.full(x.shape, 8.0, dtype)):
        (out,) = run_op("RealDiv", x, divisor, T=dtype)
        with np.errstate(all="ignore"):
            expected = np.true_divide(x, divisor)
        np.testing.assert_array_equal(out.view(f"u{dtype.itemsize}"), expected.view(f"u{dtype.itemsize}"))


@pytest.mark.parametrize("count", [8, 6])
def test_mean_over_a_power_of_two_gives_the_bits_of_division(run_op, count):
    x = _special_dividends(np.float32)[: 64 * count].reshape(64, count)
    (out,) = run_op("Mean", x, np.array(1, np.int32), T=np.float32, Tidx=np.int32)
    with np.errstate(all="ignore"):
        expected = np.true_divide(np.add.reduce(x, axis=1, dtype=np.float32), count)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_integer_pow_negative_exponent_is_an_error(run_op):
    with pytest.raises(
        errors.InvalidArgumentError, match="Integers to negative integer powers are not allowed"
    ):
        run_op("Pow", np.array([2], np.int32), np.array([-1], np.int32), T=np.int32)


def test_incompatible_shapes_error_names_node(run_op):
    with pytest.raises(errors.InvalidArgumentError) as info:
        run_op("AddV2", np.ones((2, 3), np.float32), np.ones(4, np.float32), T=np.float32, name="add")
    assert info.value.message.startswith("Incompatible shapes: [2,3] vs. [4]")
    assert "[[{{node add}}]]" in info.value.message
    assert info.value.node_name == "add"


def test_input_dtype_must_match_attr(run_op):
    with pytest.raises(
        errors.InvalidArgumentError, match=r"AddV2 input 1 has type int32 but the node expects float"
    ):
        run_op("AddV2", np.ones(2, np.float32), np.ones(2, np.int32), T=np.float32, name="mixed")


def test_unsupported_type_attr_is_refused_at_creation(make_node):

    with pytest.raises(
        errors.InvalidArgumentError, match=r"No OpKernel was registered to support Op 'AddV2'"
    ):
        create_kernel(make_node("AddV2", ["a", "b"], name="add", T=np.bool_))
    with pytest.raises(errors.InvalidArgumentError, match=r"\[T=DT_STRING\]"):
        create_kernel(make_node("Sqrt", ["a"], T=object))
    with pytest.raises(errors.InvalidArgumentError, match=r"\[T=DT_INT32\]"):
        create_kernel(make_node("RealDiv", ["a", "b"], T=np.int32))  # TF casts ints before truediv


def test_equal_with_incompatible_shapes_and_no_error(run_op):
    a, b = np.ones(2, np.int32), np.ones(3, np.int32)
    assert run_op("Equal", a, b, T=np.int32, incompatible_shape_error=False)[0].item() is False
    assert run_op("NotEqual", a, b, T=np.int32, incompatible_shape_error=False)[0].item() is True
    with pytest.raises(errors.InvalidArgumentError, match="Incompatible shapes"):
        run_op("Equal", a, b, T=np.int32)


def test_strings_add_and_compare(run_op):
    x = np.array([b"ab", b"c"], dtype=object)
    y = np.array([b"x", b"c"], dtype=object)
    np.testing.assert_array_equal(run_op("Add", x, y, T=object)[0], np.array([b"abx", b"cc"], dtype=object))
    np.testing.assert_array_equal(run_op("Equal", x, y, T=object)[0], [False, True])


def test_logical_ops(run_op):
    x = np.array([True, True, False, False])
    y = np.array([True, False, True, False])
    np.testing.assert_array_equal(run_op("LogicalAnd", x, y)[0], x & y)
    np.testing.assert_array_equal(run_op("LogicalOr", x, y)[0], x | y)
    np.testing.assert_array_equal(run_op("LogicalNot", x)[0], ~x)
    with pytest.raises(errors.InvalidArgumentError, match="LogicalAnd input 0 has type int32"):
        run_op("LogicalAnd", np.ones(2, np.int32), y[:2])


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


UNARY_CASES = [
    ("Neg", np.negative, [np.float32, np.int32, np.complex64], {}),
    ("Square", np.square, [np.float64, np.int64], {}),
    ("Sqrt", np.sqrt, [np.float32, np.float64], {"positive": True}),
    ("Rsqrt", lambda x: 1 / np.sqrt(x), [np.float32], {"positive": True}),
    ("Exp", np.exp, [np.float32, np.complex128], {}),
    ("Log", np.log, [np.float64], {"positive": True}),
    ("Tanh", np.tanh, [np.float32], {}),
    ("Sigmoid", _sigmoid, [np.float32, np.float64], {}),
    ("Relu", lambda x: np.maximum(x, 0), [np.float32, np.int32], {}),
    ("Abs", np.abs, [np.float32, np.int64], {}),
    ("Sign", np.sign, [np.float32, np.int32], {}),
    ("Reciprocal", lambda x: 1 / x, [np.float64], {"nonzero": True}),
]


@pytest.mark.parametrize("shape", [(), (0,), (2, 3)])
@pytest.mark.parametrize(
    ("op", "reference", "dtypes", "value_kwargs"), UNARY_CASES, ids=[c[0] for c in UNARY_CASES]
)
def test_unary_ops_match_numpy(run_op, op, reference, dtypes, value_kwargs, shape):
    for dtype in dtypes:
        x = _values(shape, dtype, **value_kwargs)
        if np.dtype(dtype).kind == "c":
            x = (x + 1j * _values(shape, np.float32)).astype(dtype)
        (out,) = run_op(op, x, T=dtype)
        assert isinstance(out, np.ndarray)
        assert out.dtype == np.dtype(dtype)
        assert out.shape == shape
        np.testing.assert_allclose(out, np.asarray(reference(x)).astype(dtype), rtol=1e-5)


def test_sigmoid_saturates_without_warnings(run_op):
    (out,) = run_op("Sigmoid", np.array([-1000.0, 0.0, 1000.0], np.float32), T=np.float32)
    np.testing.assert_array_equal(out, [0.0, 0.5, 1.0])


def test_bfloat16_unary_rounds_back(run_op):
    x = np.array([1.0, 4.0, 9.0], ml_dtypes.bfloat16)
    (out,) = run_op("Sqrt", x, T=ml_dtypes.bfloat16)
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out.astype(np.float32), [1.0, 2.0, 3.0])


# --------------------------------------------------------------------------- Cast


@pytest.mark.parametrize(
    ("value", "src", "dst", "expected"),
    [
        ([1.7, -1.7, 0.2], np.float32, np.int32, [1, -1, 0]),  # truncation toward zero
        ([0.0, 2.5, -1.0], np.float64, np.bool_, [False, True, True]),
        ([1, 0, 3], np.int64, np.float32, [1.0, 0.0, 3.0]),
        ([True, False], np.bool_, np.int32, [1, 0]),
        ([300, -1], np.int32, np.uint8, [44, 255]),  # wraps like a C cast
        ([], np.float32, np.int64, []),
    ],
)
def test_cast(run_op, value, src, dst, expected):
    (out,) = run_op("Cast", np.array(value, dtype=src), SrcT=src, DstT=dst)
    assert out.dtype == np.dtype(dst)
    np.testing.assert_array_equal(out, np.array(expected, dtype=dst))


def test_cast_complex_to_real_keeps_real_part(run_op):
    (out,) = run_op("Cast", np.array([1.5 + 2j, -3 - 1j], np.complex64), SrcT=np.complex64, DstT=np.float32)
    np.testing.assert_array_equal(out, [1.5, -3.0])


def test_cast_scalar_and_same_type(run_op):
    (out,) = run_op("Cast", np.array(2.9, np.float32), SrcT=np.float32, DstT=np.int64)
    assert isinstance(out, np.ndarray)
    assert out.shape == ()
    assert out == 2
    x = np.array([1, 2], np.int32)
    assert run_op("Cast", x, SrcT=np.int32, DstT=np.int32)[0] is x


def test_cast_truncate_to_bfloat16(run_op):
    # 1 + 2**-8 + 2**-9 rounds up to 1 + 2**-7 in bfloat16 but truncates to 1.
    x = np.array([1 + 2**-8 + 2**-9, np.nan], np.float32)
    (rounded,) = run_op("Cast", x, SrcT=np.float32, DstT=ml_dtypes.bfloat16)
    (truncated,) = run_op("Cast", x, SrcT=np.float32, DstT=ml_dtypes.bfloat16, Truncate=True)
    assert float(rounded[0]) == 1 + 2**-7
    assert float(truncated[0]) == 1.0
    assert np.isnan(float(truncated[1]))


def test_cast_of_strings_is_unimplemented(make_node):

    with pytest.raises(errors.UnimplementedError, match="Cast string to float is not supported"):
        create_kernel(make_node("Cast", ["x"], name="cast", SrcT=object, DstT=np.float32))


# --------------------------------------------------------------------------- MatMul, BiasAdd, AddN


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.complex64])
def test_matmul(run_op, transpose_a, transpose_b, dtype):
    a = _values((3, 2) if transpose_a else (2, 3), dtype)
    b = _values((4, 3) if transpose_b else (3, 4), dtype)
    (out,) = run_op("MatMul", a, b, T=dtype, transpose_a=transpose_a, transpose_b=transpose_b)
    expected = (a.T if transpose_a else a) @ (b.T if transpose_b else b)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_allclose(out, expected, rtol=1e-5)


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_of_one_inner_column_gives_the_bits_of_blas(run_op, transpose_a, transpose_b, dtype):
    """A product over an inner dimension of one is an outer product (`_outer_product`):
    the bits numpy's matmul gives, signed zeros, infinities and NaNs among the factors."""
    column = _special_dividends(dtype)[:300].reshape(300, 1)
    row = np.concatenate([_special_dividends(dtype)[:11], _values((29,), dtype)]).reshape(1, 40)
    a = column.T.copy() if transpose_a else column
    b = row.T.copy() if transpose_b else row
    (out,) = run_op("MatMul", a, b, T=dtype, transpose_a=transpose_a, transpose_b=transpose_b)
    with np.errstate(all="ignore"):
        expected = np.matmul(column, row)
    assert out.dtype == np.dtype(dtype)
    assert out.shape == (300, 40)
    bits = f"u{np.dtype(dtype).itemsize}"
    np.testing.assert_array_equal(out.view(bits), expected.view(bits))
    # (an empty side)
    (out,) = run_op("MatMul", np.ones((0, 1), dtype), np.ones((1, 3), dtype), T=dtype)
    assert out.shape == (0, 3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "shape", [(64, 32, 32), (256, 784, 512), (256, 512, 10), (1, 32, 32), (3, 5, 7), (64, 1, 32), (5, 300, 1)]
)
def test_dot_and_matmul_agree(run_op, dtype, shape):
    """MatMul of two float32 or float64 matrices takes `np.dot` when the product is small,
    else `np.matmul` (`math._product`): the bits of `np.matmul` either way, for every pair
    of transposes (a dense layer's gradients read transposed views), and for an operand
    BLAS cannot take as it is (a strided view) the bits of the same values laid out
    contiguously."""
    rows, inner, columns = shape
    rng = np.random.default_rng(rows * inner + columns)
    a = (rng.standard_normal((rows, inner)) * 3).astype(dtype)
    b = (rng.standard_normal((inner, columns)) * 3).astype(dtype)
    bits = f"u{np.dtype(dtype).itemsize}"
    for transpose_a in (False, True):
        for transpose_b in (False, True):
            x = np.ascontiguousarray(a.T) if transpose_a else a
            y = np.ascontiguousarray(b.T) if transpose_b else b
            (out,) = run_op("MatMul", x, y, T=dtype, transpose_a=transpose_a, transpose_b=transpose_b)
            want = np.matmul(x.T if transpose_a else x, y.T if transpose_b else y)
            np.testing.assert_array_equal(out.view(bits), want.view(bits))
    strided = np.repeat(a, 2, axis=1)[:, ::2]  # (not a layout BLAS takes: copied first)
    (out,) = run_op("MatMul", strided, b, T=dtype)
    np.testing.assert_array_equal(out.view(bits), np.matmul(a, b).view(bits))


def test_matmul_empty_inner_dimension_gives_zeros(run_op):
    (out,) = run_op("MatMul", np.ones((2, 0), np.float32), np.ones((0, 3), np.float32), T=np.float32)
    np.testing.assert_array_equal(out, np.zeros((2, 3)))


def test_matmul_half_precision(run_op):
    for dtype in (np.float16, ml_dtypes.bfloat16):
        a = np.arange(6).reshape(2, 3).astype(dtype)
        (out,) = run_op("MatMul", a, a, T=dtype, transpose_b=True)
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out.astype(np.float32), [[5, 14], [14, 50]])


def test_matmul_errors(run_op):
    with pytest.raises(errors.InvalidArgumentError) as info:
        run_op("MatMul", np.ones((2, 3), np.float32), np.ones((4, 5), np.float32), T=np.float32, name="mm")
    assert info.value.message.startswith("Matrix size-incompatible: In[0]: [2,3], In[1]: [4,5]")
    assert info.value.node_name == "mm"
    with pytest.raises(
        errors.InvalidArgumentError, match=r"In\[1\] is not a matrix. Instead it has shape \[3\]"
    ):
        run_op("MatMul", np.ones((2, 3), np.float32), np.ones(3, np.float32), T=np.float32)


@pytest.fixture
def intra_op_helper():
    # (as `distserver serve` runs it: BLAS on one thread, set first)
    before = blas_threads()
    set_blas_threads(1)
    _intra_op.enable()
    yield
    _intra_op.disable()
    set_blas_threads(before or 1)


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.complex64, np.float16])
@pytest.mark.parametrize("rows", [257, 256])
def test_a_large_product_is_cut_in_two_on_the_helper_thread_and_gives_the_same_bits(
    run_op, intra_op_helper, monkeypatch, transpose_a, dtype, rows
):
    # An mlp layer's shapes: (rows x 784) @ (784 x 512), rows odd or even.
    inner, columns = 784, 512
    rng = np.random.default_rng(rows)
    a = (rng.standard_normal((inner, rows) if transpose_a else (rows, inner)) * 4).astype(dtype)
    b = (rng.standard_normal((inner, columns)) * 4).astype(dtype)
    whole = run_op("MatMul", a, b, T=dtype, transpose_a=transpose_a)[0]
    halves = []
    real_run_halves = _intra_op.run_halves
    monkeypatch.setattr(_intra_op, "run_halves", lambda *parts: halves.append(real_run_halves(*parts)))
    split = run_op("MatMul", a, b, T=dtype, transpose_a=transpose_a)[0]
    assert len(halves) == 1
    assert split.dtype == whole.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(split, whole)
    _intra_op.disable()
    np.testing.assert_array_equal(run_op("MatMul", a, b, T=dtype, transpose_a=transpose_a)[0], whole)
    assert len(halves) == 1  # off: one call, not split


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
def test_a_product_is_cut_only_where_each_block_keeps_the_wholes_bits(intra_op_helper, dtype):
    """BLAS computes rows in panels, and a panel cut short sums in another order
    (OpenBLAS's Haswell kernels, float32: a 256-row product cut at 128 changes its rows
    120-127): `row_cut` cuts on the panels it probed, or not at all; and not at all
    while BLAS shares each product among threads of its own (it then shares the rows
    by the product's size)."""
    rng = np.random.default_rng(7)
    for rows in (128, 129, 200, 256, 257, 300, 384, 511, 784):
        a = (rng.standard_normal((rows, 300)) * 4).astype(dtype)
        b = (rng.standard_normal((300, 96)) * 4).astype(dtype)
        whole = np.matmul(a, b)
        cut = _intra_op.row_cut(rows, np.dtype(dtype))
        assert cut == 0 or _intra_op.SPLIT_MIN_ROWS // 2 <= cut <= rows - _intra_op.SPLIT_MIN_ROWS // 2
        assert cut == 0 or abs(rows - 2 * cut) <= 2 * 96  # near the middle
        if cut:
            for lhs in (a, a.T.copy().T):
                blocks = np.concatenate([np.matmul(lhs[:cut], b), np.matmul(lhs[cut:], b)])
                assert blocks.tobytes() == whole.tobytes(), (rows, cut)
    assert _intra_op.row_cut(784, np.dtype(dtype))  # a layer's gradient's rows are cut
    set_blas_threads(2)
    _intra_op.enable()  # (asks the threads again)
    assert _intra_op.row_cut(784, np.dtype(dtype)) == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_helper_runs_its_half_off_the_callers_cpu(intra_op_helper):
    """On a VM, Linux wakes a thread on its waker's CPU when the other vCPU sat idle,
    behind the waker's own half: the helper may run on every CPU but its caller's."""
    cpus = os.sched_getaffinity(0)
    seen = []

    def second():
        seen.append((os.sched_getaffinity(0), current_cpu()))

    try:
        for cpu in sorted(cpus)[:2] * 2:  # (and back: the helper follows its caller)
            os.sched_setaffinity(0, {cpu})
            _intra_op.run_halves(lambda: None, second)
            allowed, ran_on = seen[-1]
            assert allowed == cpus - {cpu}
            assert ran_on != cpu
    finally:
        os.sched_setaffinity(0, cpus)
    assert len(seen) == 4


def test_products_are_cut_only_while_the_host_leaves_the_helper_a_cpu(run_op, intra_op_helper, monkeypatch):
    # `distserver serve` passes `HostTasks.leave_a_cpu`: a ps and two workers on two
    # CPUs compute at once, and halves would wait for each other.
    rng = np.random.default_rng(1)
    a = rng.standard_normal((256, 784)).astype(np.float32)
    b = rng.standard_normal((784, 512)).astype(np.float32)
    halves, asked = [], []
    real_run_halves = _intra_op.run_halves
    monkeypatch.setattr(_intra_op, "run_halves", lambda *parts: halves.append(real_run_halves(*parts)))
    room = [False]

    def leave_a_cpu():
        asked.append(room[0])
        return room[0]

    monkeypatch.setattr(_intra_op, "ALLOWED_EVERY", 3600.0)
    _intra_op.share_while(leave_a_cpu)
    try:
        whole = [run_op("MatMul", a, b, T=np.float32)[0] for _ in range(3)]
        assert (halves, asked) == ([], [False])  # asked once for the three products
        monkeypatch.setattr(_intra_op, "ALLOWED_EVERY", 0.0)
        room[0] = True
        _intra_op.share_while(leave_a_cpu)  # (asks again at once)
        split = run_op("MatMul", a, b, T=np.float32)[0]
        assert (len(halves), asked) == (1, [False, True])
        np.testing.assert_array_equal(split, whole[0])
        room[0] = False
        run_op("MatMul", a, b, T=np.float32)
        assert (len(halves), asked) == (1, [False, True, False])  # an answer lasts ALLOWED_EVERY
    finally:
        _intra_op.share_while(None)


@pytest.mark.parametrize("activation", [None, "Relu", "Tanh", "Sigmoid"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_large_fused_layer_is_cut_in_two_and_each_half_finished_by_its_thread_with_the_same_bits(
    intra_op_helper, monkeypatch, activation, dtype
):
    import threading

    from distserver.kernels import math as kernels_math

    parts = [make_node("MatMul", ["x", "w"], name="product", T=dtype)]
    parts.append(make_node("BiasAdd", ["product", "b"], name="sum", T=dtype))
    if activation is not None:
        parts.append(make_node(activation, ["sum"], name="y", T=dtype))
    node = make_node(kernels_math.FUSED_MATMUL_OP, name="layer", T=dtype)
    node.attr[kernels_math.FUSED_NODES_ATTR].list.s.extend(part.SerializeToString() for part in parts)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((256, 784)) * 4).astype(dtype)  # an mlp's first layer
    w = (rng.standard_normal((784, 512)) * 0.05).astype(dtype)
    b = (rng.standard_normal(512) * 4).astype(dtype)
    finished_by = []
    real_finish = kernels_math._matmul

    def matmul(lhs, rhs, then=None):
        def finish(block):
            finished_by.append((threading.current_thread().name, block.shape[0]))
            then(block)

        return real_finish(lhs, rhs, then=finish)

    want = run_op("BiasAdd", run_op("MatMul", x, w, T=dtype)[0], b, T=dtype)[0]  # the parts' kernels
    if activation is not None:
        want = run_op(activation, want, T=dtype)[0]
    monkeypatch.setattr(kernels_math, "_matmul", matmul)
    (got,) = create_kernel(node).compute(Context(), [x, w, b])
    cut = _intra_op.row_cut(256, np.dtype(dtype))
    assert sorted(rows for _, rows in finished_by) == sorted([cut, 256 - cut])
    assert {name.startswith("distserver-intra-op") for name, _ in finished_by} == {True, False}
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_a_small_product_or_one_of_few_rows_is_not_cut(run_op, intra_op_helper, monkeypatch):
    monkeypatch.setattr(_intra_op, "run_halves", None)  # any use fails
    run_op("MatMul", np.ones((256, 64), np.float32), np.ones((64, 64), np.float32), T=np.float32)
    rows = _intra_op.SPLIT_MIN_ROWS - 1
    columns = _intra_op.SPLIT_MACS // (rows * 784) + 1
    (out,) = run_op(
        "MatMul", np.ones((rows, 784), np.float32), np.ones((784, columns), np.float32), T=np.float32
    )
    assert out.shape == (rows, columns)


def test_halves_wait_for_each_other_and_report_errors(intra_op_helper):
    import threading
    import time

    ran = []

    def second():
        time.sleep(0.05)
        ran.append(threading.current_thread().name)

    with pytest.raises(ZeroDivisionError):
        _intra_op.run_halves(lambda: 1 / 0, second)
    assert len(ran) == 1  # waited for, though the first failed
    assert ran[0].startswith("distserver-intra-op")

    def fails():
        raise KeyError("second")

    with pytest.raises(KeyError, match="second"):
        _intra_op.run_halves(lambda: None, fails)
    _intra_op.disable()
    _intra_op.run_halves(lambda: ran.append("first"), lambda: ran.append(threading.current_thread().name))
    assert ran[1:] == ["first", threading.current_thread().name]  # off: both here, in order


@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
def test_bias_add(run_op, data_format):
    value = _values((2, 3, 4, 5), np.float32)
    channels = 3 if data_format == "NCHW" else 5
    bias = _values((channels,), np.float32)
    (out,) = run_op("BiasAdd", value, bias, T=np.float32, data_format=data_format)
    expected = value + (bias.reshape(1, 3, 1, 1) if data_format == "NCHW" else bias)
    np.testing.assert_allclose(out, expected)


def test_bias_add_errors(run_op):
    with pytest.raises(errors.InvalidArgumentError, match=r"Input tensor must be at least 2D: \[3\]"):
        run_op("BiasAdd", np.ones(3, np.float32), np.ones(3, np.float32), T=np.float32)
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"Must provide as many biases as the last dimension of the input tensor: \[4\] vs. \[2,3\]",
    ):
        run_op("BiasAdd", np.ones((2, 3), np.float32), np.ones(4, np.float32), T=np.float32)


def test_add_n(run_op):
    inputs = [_values((2, 3), np.float32) for _ in range(4)]
    (out,) = run_op("AddN", *inputs, T=np.float32, N=4)
    np.testing.assert_allclose(out, sum(inputs), rtol=1e-6)
    assert all(out is not x for x in inputs)
    (single,) = run_op("AddN", np.array(5, np.int32), T=np.int32, N=1)
    assert single.shape == ()
    assert single == 5
    with pytest.raises(errors.InvalidArgumentError, match=r"Input 0: \[2\] != input 1: \[3\]"):
        run_op("AddN", np.ones(2, np.float32), np.ones(3, np.float32), T=np.float32, N=2)


# --------------------------------------------------------------------------- reductions

REDUCTIONS = {
    "Sum": np.sum,
    "Prod": np.prod,
    "Mean": np.mean,
    "Max": np.max,
    "Min": np.min,
}

REDUCTION_AXES = [
    ((2, 3, 4), [1]),
    ((2, 3, 4), [0, 2]),
    ((2, 3, 4), [-1]),
    ((2, 3, 4), 1),  # scalar axis
    ((2, 3, 4), []),  # nothing reduced
    ((2, 3, 4), [0, 1, 2]),
    ((5,), [0]),
    ((), []),
]


@pytest.mark.parametrize("keep_dims", [False, True])
@pytest.mark.parametrize(("shape", "axes"), REDUCTION_AXES)
@pytest.mark.parametrize("op", sorted(REDUCTIONS))
@pytest.mark.parametrize("index_type", [np.int32, np.int64])
def test_reductions_match_numpy(run_op, op, shape, axes, keep_dims, index_type):
    x = _values(shape, np.float64)
    (out,) = run_op(op, x, np.array(axes, index_type), T=np.float64, Tidx=index_type, keep_dims=keep_dims)
    axis = tuple(np.atleast_1d(axes).tolist())
    expected = REDUCTIONS[op](x, axis=axis, keepdims=keep_dims)
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.float64
    assert out.shape == np.shape(expected)
    np.testing.assert_allclose(out, expected)


# Shapes whose sum over axis 1 is added slice by slice (`math._sum`), then two that are not.
SLICED_SUMS = [
    (64, 2, 2),
    (256, 8, 32),
    (128, 64, 64),
    (64, 4, 2, 3),
    (1024, 3, 7),
    (32, 8, 32),
    (256, 8, 128),
]


@pytest.mark.parametrize("keep_dims", [False, True])
@pytest.mark.parametrize("shape", SLICED_SUMS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.complex64])
def test_sums_over_an_inner_axis_keep_numpys_bits(run_op, shape, dtype, keep_dims):
    """Added slice by slice or not, a Sum (and a Mean) over an inner axis has the bits of
    numpy's own reduction: each output adds its entries in the same order."""
    rng = np.random.default_rng(len(shape))
    # Magnitudes over many octaves: a different order of additions changes the bits.
    x = (rng.normal(size=shape) * 10.0 ** rng.integers(-6, 7, size=shape)).astype(dtype)
    if dtype == np.complex64:
        x = x + 1j * x[..., ::-1]
    x[0] = -0.0  # (numpy's reduction starts from zero: negative zeros sum to 0.0)
    axis = np.array([1], np.int32)
    (total,) = run_op("Sum", x, axis, T=dtype, Tidx=np.int32, keep_dims=keep_dims)
    expected = np.add.reduce(x, axis=1, dtype=x.dtype, keepdims=keep_dims)
    assert total.dtype == x.dtype
    assert total.shape == expected.shape
    assert np.array_equal(total.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))
    if dtype != np.int32:
        (mean,) = run_op("Mean", x, axis, T=dtype, Tidx=np.int32, keep_dims=keep_dims)
        np.testing.assert_array_equal(mean, np.true_divide(expected, shape[1]))


def test_a_sliced_sum_leaves_its_input_alone(run_op):
    x = np.arange(256 * 4 * 8, dtype=np.float32).reshape(256, 4, 8)
    before = x.copy()
    (total,) = run_op("Sum", x, np.array(1, np.int32), T=np.float32, Tidx=np.int32)
    np.testing.assert_array_equal(x, before)
    np.testing.assert_array_equal(total, before.sum(axis=1))
    assert not np.shares_memory(total, x)


def test_reductions_of_empty_ranges(run_op):
    empty = np.zeros((0, 3), np.float32)
    axis = np.array([0], np.int32)
    np.testing.assert_array_equal(run_op("Sum", empty, axis, T=np.float32)[0], [0, 0, 0])
    np.testing.assert_array_equal(run_op("Prod", empty, axis, T=np.float32)[0], [1, 1, 1])
    np.testing.assert_array_equal(run_op("Max", empty, axis, T=np.float32)[0], [-np.inf] * 3)
    np.testing.assert_array_equal(run_op("Min", empty, axis, T=np.float32)[0], [np.inf] * 3)
    assert np.isnan(run_op("Mean", empty, axis, T=np.float32)[0]).all()
    int_empty = np.zeros((0,), np.int32)
    assert run_op("Max", int_empty, axis, T=np.int32)[0] == np.iinfo(np.int32).min


def test_integer_reductions_keep_dtype_and_truncate_mean(run_op):
    x = np.array([[-3, -4], [3, 4]], np.int32)
    axis = np.array([1], np.int32)
    (mean,) = run_op("Mean", x, axis, T=np.int32)
    assert mean.dtype == np.int32
    np.testing.assert_array_equal(mean, [-3, 3])  # -3.5 truncates toward zero
    (total,) = run_op("Sum", np.full(3, 2**30, np.int32), np.array(0, np.int32), T=np.int32)
    assert total.dtype == np.int32  # no silent widening to int64


def test_half_sum_accumulates_in_float32(run_op):
    x = np.full(4096, 1.0, np.float16)
    x[0] = 2048
    (out,) = run_op("Sum", x, np.array([0], np.int32), T=np.float16)
    assert out.dtype == np.float16
    assert float(out) == 6144.0  # 2048 + 4095 in float32, rounded once


def test_reduction_axis_errors(run_op):
    x = np.ones((2, 3), np.float32)
    with pytest.raises(errors.InvalidArgumentError) as info:
        run_op("Sum", x, np.array([2], np.int32), T=np.float32, name="total")
    assert info.value.message.startswith("Invalid reduction dimension (2 for input with 2 dimension(s)")
    assert info.value.node_name == "total"
    with pytest.raises(errors.InvalidArgumentError, match="Axes contains duplicate dimension: 1"):
        run_op("Sum", x, np.array([1, -1], np.int32), T=np.float32)
    with pytest.raises(errors.InvalidArgumentError, match="reduction_indices must be int32 or int64"):
        run_op("Sum", x, np.array([1.0], np.float32), T=np.float32)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("output_type", [np.int32, np.int64])
def test_arg_extremum(run_op, op, output_type):
    x = _values((3, 4, 5), np.float32)
    reference = np.argmax if op == "ArgMax" else np.argmin
    for dim in (0, 1, -1):
        (out,) = run_op(op, x, np.array(dim, np.int32), T=np.float32, output_type=output_type)
        assert out.dtype == np.dtype(output_type)
        np.testing.assert_array_equal(out, reference(x, axis=dim))
    (scalar,) = run_op(op, np.array([1, 5, 2], np.int32), np.array(0, np.int64), T=np.int32, Tidx=np.int64)
    assert scalar.shape == ()
    assert scalar.dtype == np.int64  # the default output_type


def test_arg_extremum_errors(run_op):
    with pytest.raises(errors.InvalidArgumentError, match=r"Reduction axis 0 is empty in shape \[0,2\]"):
        run_op("ArgMax", np.zeros((0, 2), np.float32), np.array(0, np.int32), T=np.float32)
    with pytest.raises(
        errors.InvalidArgumentError, match=r"Expected dimension in the range \[-2, 2\), but got 2"
    ):
        run_op("ArgMax", np.zeros((1, 2), np.float32), np.array(2, np.int32), T=np.float32)


@pytest.mark.parametrize("shape", [(5,), (2, 3), (2, 0), (2, 3, 4)])
def test_softmax(run_op, shape):
    x = _values(shape, np.float32) * 50
    (out,) = run_op("Softmax", x, T=np.float32)
    if x.size:
        e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
        np.testing.assert_allclose(out, e / e.sum(axis=-1, keepdims=True), rtol=1e-5, atol=1e-7)
    assert out.shape == shape
    assert out.dtype == np.float32


def test_softmax_needs_a_vector(run_op):
    with pytest.raises(errors.InvalidArgumentError, match=r"logits must have >= 1 dimension, got \[\]"):
        run_op("Softmax", np.array(1.0, np.float32), T=np.float32)


@pytest.mark.parametrize(("op", "fn"), [("All", np.all), ("Any", np.any)])
@pytest.mark.parametrize("keep_dims", [False, True])
def test_logical_reductions(op, fn, keep_dims, run_op):
    x = np.array([[True, False, True], [True, True, True]])
    for axis in ([0], [1], [0, 1], []):
        (out,) = run_op(op, x, np.array(axis, np.int32), keep_dims=keep_dims, Tidx=np.int32)
        np.testing.assert_array_equal(out, fn(x, axis=tuple(axis), keepdims=keep_dims))


# --------------------------------------------------------------------------- ops of TF 1.x training graphs


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.complex64])
def test_squared_difference(run_op, dtype):
    x, y = _values((2, 3), dtype), _values((3,), dtype)
    (z,) = run_op("SquaredDifference", x, y, T=dtype)
    diff = x - y
    np.testing.assert_allclose(z, diff * np.conj(diff), rtol=1e-6)
    assert z.dtype == dtype


def test_div_no_nan_gives_zero_for_zero_divisors(run_op):
    x = np.array([1.0, 0.0, np.inf, 6.0], np.float32)
    y = np.array([0.0, 0.0, 0.0, 3.0], np.float32)
    (z,) = run_op("DivNoNan", x, y, T=np.float32)
    np.testing.assert_array_equal(z, [0.0, 0.0, 0.0, 2.0])


def test_mul_no_nan_gives_zero_for_zero_factors(run_op):
    x = np.array([np.nan, np.inf, 2.0], np.float64)
    y = np.array([0.0, 0.0, 3.0], np.float64)
    (z,) = run_op("MulNoNan", x, y, T=np.float64)
    np.testing.assert_array_equal(z, [0.0, 0.0, 6.0])


@pytest.mark.parametrize(
    ("op", "reference"),
    [("Floor", np.floor), ("Ceil", np.ceil), ("Log1p", np.log1p), ("Expm1", np.expm1)],
)
def test_more_unary_float_ops(run_op, op, reference):
    x = _values((3, 4), np.float64, positive=True)
    (y,) = run_op(op, x, T=np.float64)
    np.testing.assert_allclose(y, reference(x))


def test_round_is_half_to_even(run_op):
    (y,) = run_op("Round", np.array([0.5, 1.5, 2.5, -0.5, -1.7], np.float32), T=np.float32)
    np.testing.assert_array_equal(y, [0.0, 2.0, 2.0, -0.0, -2.0])
    (ints,) = run_op("Round", np.array([3, -4], np.int32), T=np.int32)
    np.testing.assert_array_equal(ints, [3, -4])


@pytest.mark.parametrize(
    ("op", "inputs", "attrs"),
    [
        ("MatMul", [np.full((2, 2), 3e38, np.float32), np.full((2, 2), 3e38, np.float32)], {}),
        ("Sum", [np.full(4, 3e38, np.float32), np.int32(0)], {"Tidx": np.int32}),
        ("Exp", [np.float32([1000.0])], {}),
        ("RealDiv", [np.float32([0.0]), np.float32([0.0])], {}),
        ("TanhGrad", [np.float32([np.inf]), np.float32([np.inf])], {}),
    ],
)
def test_hot_kernels_compute_inf_and_nan_without_a_warning(run_op, op, inputs, attrs):
    # Their numeric part runs under `_common.quiet` (numpy's warnings off, as TF is
    # silent); pytest turns any warning into an error here.
    result = run_op(op, *inputs, T=np.float32, **attrs)[0]
    assert not np.isfinite(result).all()


def test_broadcast_shape_agrees_with_numpy():
    # The binary kernels' hand-written broadcast of two shapes, against numpy's, on every
    # pair of shapes of rank <= 3 with sizes 0-3, compatible or not.
    sizes = (0, 1, 2, 3)
    shapes = [()] + [(a,) for a in sizes] + [(a, b) for a in sizes for b in sizes]
    shapes += [(a, b, c) for a in (1, 2) for b in sizes for c in (0, 1, 3)]
    kernel = create_kernel(make_node("AddV2", ["x", "y"], T=np.float32))
    for x in shapes:
        for y in shapes:
            try:
                expected = np.broadcast_shapes(x, y)
            except ValueError:
                with pytest.raises(errors.InvalidArgumentError, match="Incompatible shapes"):
                    broadcast_shape(kernel, x, y)
            else:
                assert broadcast_shape(kernel, x, y) == expected, (x, y)
