"""Numpy kernels for TensorFlow's math ops: element-wise, matmul, reductions, casts.

Semantics follow TensorFlow's CPU kernels where they differ from numpy's defaults:

* Binary ops broadcast like numpy and refuse incompatible shapes with TF's text
  ("Incompatible shapes: [2,3] vs. [4]"); both inputs must have the node's dtype `T`.
* Integer division: `Div` and `TruncateDiv` truncate toward zero as C++ does (TF's
  `safe_div`); `FloorDiv` and `FloorMod` round toward negative infinity (Python's
  `//` and `%`). A zero integer divisor is an error ("Integer division by zero"),
  never a silent 0. `RealDiv` takes floats and complex only, like TF's CPU kernels
  (`tf.math.truediv` casts integers first). Float `FloorDiv` is `floor(x / y)`, as
  TF computes it.
* `Pow` refuses negative exponents of integers, as TF does.
* `Mean` of integers truncates the sum / count quotient; `Max`/`Min` over an empty
  range give the reducer's identity (-inf/+inf, or the dtype's lowest/highest).
* half and bfloat16 arithmetic that numpy does poorly (matmul, sums, transcendental
  functions) is computed in float32 and rounded back, as TF's kernels accumulate.

Float warnings (overflow, division by zero, invalid values) are silenced: inf and nan
are the IEEE results TensorFlow returns too.
"""

from __future__ import annotations

import math as _math
from collections.abc import Callable
from operator import attrgetter, is_, itemgetter
from typing import Any, ClassVar

import numpy as np
from google.protobuf.message import DecodeError

from distserver import errors
from distserver.kernels import _compiled, _intra_op
from distserver.kernels._common import (
    BFLOAT16,
    BOOL,
    COMPLEX,
    FLOATS,
    INDEX_TYPES,
    INTEGERS,
    NUMBER,
    OBJECT,
    REAL,
    SIGNED,
    array,
    attr_type_in,
    broadcast_shape,
    check_input_dtype,
    compute_dtype,
    int_list,
    int_scalar,
    kernel_error,
    normalize_axis,
    quiet,
    shape_str,
    type_name,
)
from distserver.kernels.registry import KernelContext, OpKernel, create_kernel, product_of, register_kernel
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.types_pb2 import DT_DOUBLE, DT_FLOAT

ArrayFn = Callable[..., Any]
# An element-wise op: (allowed T or None for bool-only ops without T, numpy function,
# whether the output is bool).
_OpSpec = tuple[frozenset[np.dtype[Any]] | None, ArrayFn, bool]

# half-precision sums and products accumulate in float32, as TF's reducers do.
_ACCUMULATE = {np.dtype(np.float16): np.dtype(np.float32), BFLOAT16: np.dtype(np.float32)}


class _ArithmeticError(Exception):
    """Raised by the element-wise helpers with TF's text; kernels name the node."""


# --------------------------------------------------------------------------- element-wise helpers


def _check_int_divisor(x: np.ndarray, y: np.ndarray) -> None:
    # An empty result divides nothing (TF's kernels then never see the zero divisor).
    # (`count_nonzero`, not `np.any(y == 0)`: 0.1-0.8 us, not 3.5 us, for the ids of
    # every step of an embedding split by `FloorDiv` and `FloorMod`.)
    if y.dtype in INTEGERS and x.size and (y.item() == 0 if y.size == 1 else np.count_nonzero(y) < y.size):
        raise _ArithmeticError("Integer division by zero")


def _truncate_div(x: np.ndarray, y: np.ndarray) -> Any:
    """C++ division: integers truncate toward zero; others divide exactly."""
    if x.dtype not in INTEGERS:
        return np.true_divide(x, y)
    _check_int_divisor(x, y)
    quotient = np.floor_divide(x, y)
    if x.dtype in SIGNED:
        # floor and truncation differ when the signs differ and there is a remainder.
        quotient = quotient + ((np.remainder(x, y) != 0) & ((x < 0) != (y < 0)))
    return quotient


# The dtypes whose divisions by a power of two `_true_divide` makes multiplications.
_EXACT_SCALING = {np.dtype(t): np.finfo(t) for t in (np.float32, np.float64)}


def exact_reciprocal(divisor: float, dtype: np.dtype[Any]) -> Any:
    """1 / `divisor` as a scalar of `dtype` (float32 or float64) when multiplying by it
    gives the bits dividing by `divisor` gives, for every dividend; else None. That is
    when `divisor` is a power of two whose reciprocal `dtype` holds: both are then the
    dividend scaled by the same power of two, rounded once (infinities, NaNs and signed
    zeros alike). A multiplication costs half a division here (256 x 8 x 32 float32:
    8 against 15 us)."""
    if not _math.isfinite(divisor):
        return None
    fraction, exponent = _math.frexp(divisor)  # divisor = fraction * 2**exponent
    info = _EXACT_SCALING[dtype]
    if abs(fraction) != 0.5 or not info.minexp - info.nmant <= 1 - exponent < info.maxexp:
        return None
    return dtype.type(_math.copysign(_math.ldexp(1.0, 1 - exponent), divisor))


def _true_divide(x: np.ndarray, y: np.ndarray) -> Any:
    """x / y; by a scalar power of two, as the multiplication that gives the same bits
    (`exact_reciprocal`): a mean's gradient divides by its count, often one."""
    if y.ndim == 0 and y.dtype in _EXACT_SCALING:
        reciprocal = exact_reciprocal(float(y), y.dtype)
        if reciprocal is not None:
            return np.multiply(x, reciprocal)
    return np.true_divide(x, y)


def _floor_div(x: np.ndarray, y: np.ndarray) -> Any:
    if x.dtype in INTEGERS:
        _check_int_divisor(x, y)
        return np.floor_divide(x, y)
    return np.floor(np.true_divide(x, y))


def _floor_mod(x: np.ndarray, y: np.ndarray) -> Any:
    _check_int_divisor(x, y)
    if x.dtype in INTEGERS:
        # x - floor(x / y) * y, numpy's remainder exactly: each step wraps around as
        # the true result does not (MIN // -1 wraps to MIN, and MIN - MIN * -1 is 0).
        # numpy divides by a scalar with a multiplication and a shift (libdivide) for
        # floor_divide, not for remainder: 2,048 int64 ids by a shard's size, 6.5 -> 3.4 us.
        return np.subtract(x, np.multiply(np.floor_divide(x, y), y))
    return np.remainder(x, y)


def _pow(x: np.ndarray, y: np.ndarray) -> Any:
    if y.dtype in SIGNED and np.any(y < 0):
        raise _ArithmeticError("Integers to negative integer powers are not allowed")
    return np.power(x, y)


def _squared_difference(x: np.ndarray, y: np.ndarray) -> Any:
    diff = x - y
    return diff * np.conj(diff) if diff.dtype in COMPLEX else diff * diff


def _div_no_nan(x: np.ndarray, y: np.ndarray) -> Any:
    # 0 wherever the divisor is 0, even for 0/0 and inf/0.
    return np.where(y == 0, np.zeros((), x.dtype), np.true_divide(x, np.where(y == 0, 1, y)))


def _mul_no_nan(x: np.ndarray, y: np.ndarray) -> Any:
    # 0 wherever y is 0, even when x is inf or nan.
    return np.where(y == 0, np.zeros((), x.dtype), np.multiply(x, y))


def _round(x: np.ndarray) -> Any:
    # Half to even, as TF's Round; integers are already round.
    return x if x.dtype in INTEGERS else np.rint(x)


def _sigmoid(x: np.ndarray) -> Any:
    # exp(-x) overflows to inf for very negative x, giving the correct limit 0.
    return 1 / (1 + np.exp(-x))


def _relu(x: np.ndarray) -> Any:
    return np.maximum(x, np.zeros((), x.dtype))


def _rsqrt(x: np.ndarray) -> Any:
    return 1 / np.sqrt(x)


def _reciprocal(x: np.ndarray) -> Any:
    return 1 / x


# --------------------------------------------------------------------------- element-wise kernels


class _ElementwiseKernel(OpKernel):
    """Shared input checks for the unary and binary element-wise kernels.

    `_OPS` maps each op name to (allowed T, numpy function, output is bool). Ops
    whose entry has no allowed set take no `T` attr (LogicalAnd/Or/Not: bool only).
    """

    _OPS: ClassVar[dict[str, _OpSpec]]

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        allowed, self.fn, returns_bool = self._OPS[self.op]
        self._quiet_fn = quiet(self.fn)
        self.dtype = BOOL if allowed is None else attr_type_in(self, "T", allowed)
        self.out_dtype = BOOL if returns_bool else self.dtype
        # numpy lacks some bfloat16 loops: compute in float32 and round back.
        self.work_dtype = compute_dtype(self.dtype)
        self._converts = self.work_dtype != self.dtype

    def _apply(self, *args: np.ndarray) -> np.ndarray:
        if self._converts:
            args = tuple(a.astype(self.work_dtype, copy=False) for a in args)
        try:
            result = self._quiet_fn(*args)
        except _ArithmeticError as exc:
            raise kernel_error(self, str(exc)) from None
        if type(result) is np.ndarray and result.dtype == self.out_dtype:
            return result
        return array(result, self.out_dtype)


_UNARY_FLOAT = FLOATS | COMPLEX


_UNARY_OPS: dict[str, _OpSpec] = {
    "Neg": (SIGNED | FLOATS | COMPLEX, np.negative, False),
    "Square": (NUMBER, np.square, False),
    "Sqrt": (_UNARY_FLOAT, np.sqrt, False),
    "Rsqrt": (_UNARY_FLOAT, _rsqrt, False),
    "Exp": (_UNARY_FLOAT, np.exp, False),
    "Log": (_UNARY_FLOAT, np.log, False),
    "Tanh": (_UNARY_FLOAT, np.tanh, False),
    "Sigmoid": (_UNARY_FLOAT, _sigmoid, False),
    "Reciprocal": (_UNARY_FLOAT, _reciprocal, False),
    "Relu": (REAL, _relu, False),
    "Abs": (SIGNED | FLOATS, np.abs, False),
    "Sign": (SIGNED | FLOATS | COMPLEX, np.sign, False),
    "LogicalNot": (None, np.logical_not, True),
    "Floor": (FLOATS, np.floor, False),
    "Ceil": (FLOATS, np.ceil, False),
    "Round": (FLOATS | COMPLEX | SIGNED, _round, False),
    "Log1p": (_UNARY_FLOAT, np.log1p, False),
    "Expm1": (_UNARY_FLOAT, np.expm1, False),
}


@register_kernel(*_UNARY_OPS)
class UnaryOpKernel(_ElementwiseKernel):
    """y = f(x) element-wise."""

    fusable = True

    _OPS = _UNARY_OPS

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (x,) = inputs
        if x.dtype != self.dtype:
            check_input_dtype(self, 0, x, self.dtype)
        return [self._apply(x)]


def _comparison(fn: ArrayFn) -> _OpSpec:
    return (REAL, fn, True)


_BINARY_OPS: dict[str, _OpSpec] = {
    "AddV2": (NUMBER, np.add, False),
    "Add": (NUMBER | {OBJECT}, np.add, False),  # strings concatenate
    "Sub": (NUMBER, np.subtract, False),
    "Mul": (NUMBER, np.multiply, False),
    "RealDiv": (FLOATS | COMPLEX, _true_divide, False),
    "Div": (NUMBER, _truncate_div, False),
    "TruncateDiv": (INTEGERS, _truncate_div, False),
    "FloorDiv": (REAL, _floor_div, False),
    "FloorMod": (REAL, _floor_mod, False),
    "Pow": (FLOATS | COMPLEX | SIGNED, _pow, False),
    "SquaredDifference": (FLOATS | COMPLEX | SIGNED, _squared_difference, False),
    "DivNoNan": (FLOATS | COMPLEX, _div_no_nan, False),
    "MulNoNan": (FLOATS | COMPLEX, _mul_no_nan, False),
    "Maximum": (REAL, np.maximum, False),
    "Minimum": (REAL, np.minimum, False),
    "Greater": _comparison(np.greater),
    "GreaterEqual": _comparison(np.greater_equal),
    "Less": _comparison(np.less),
    "LessEqual": _comparison(np.less_equal),
    "LogicalAnd": (None, np.logical_and, True),
    "LogicalOr": (None, np.logical_or, True),
}


@register_kernel(*_BINARY_OPS)
class BinaryOpKernel(_ElementwiseKernel):
    """z = f(x, y) element-wise, with numpy broadcasting and TF's shape error."""

    fusable = True

    _OPS = _BINARY_OPS

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, y = inputs
        if x.dtype != self.dtype or y.dtype != self.dtype:
            check_input_dtype(self, 0, x, self.dtype)
            check_input_dtype(self, 1, y, self.dtype)
        if x.shape != y.shape:
            broadcast_shape(self, x.shape, y.shape)
        return [self._apply(x, y)]


_EQUALITY_OPS: dict[str, _OpSpec] = {
    "Equal": (NUMBER | {BOOL, OBJECT}, np.equal, True),
    "NotEqual": (NUMBER | {BOOL, OBJECT}, np.not_equal, True),
}


@register_kernel(*_EQUALITY_OPS)
class EqualityKernel(_ElementwiseKernel):
    """Equal / NotEqual on any dtype; `incompatible_shape_error=False` gives a scalar."""

    fusable = True

    _OPS = _EQUALITY_OPS

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.incompatible_shape_error = self.attr_bool("incompatible_shape_error", True)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, y = inputs
        check_input_dtype(self, 0, x, self.dtype)
        check_input_dtype(self, 1, y, self.dtype)
        try:
            broadcast_shape(self, x.shape, y.shape)
        except errors.InvalidArgumentError:
            if self.incompatible_shape_error:
                raise
            # TF: tensors of incompatible shapes are simply "not equal".
            return [np.array(self.op == "NotEqual")]
        return [self._apply(x, y)]


# --------------------------------------------------------------------------- Cast


def _truncate_to_bfloat16(x: np.ndarray) -> np.ndarray:
    # Drop the low 16 mantissa bits instead of rounding (TF's Truncate=True); NaN stays NaN.
    wide = np.ascontiguousarray(x, dtype=np.float32)
    bits = wide.view(np.uint32) & np.uint32(0xFFFF0000)
    truncated = np.where(np.isnan(wide), wide, bits.view(np.float32))
    return truncated.astype(BFLOAT16)


@register_kernel("Cast")
class CastKernel(OpKernel):
    """Converts SrcT to DstT like a C++ static_cast (floats truncate toward zero).

    Complex to real keeps the real part; anything to bool is `x != 0`. Strings cannot
    be cast (TF: Unimplemented). `Truncate=True` truncates instead of rounding when
    the destination is bfloat16; for other destinations it changes nothing.
    """

    fusable = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.src = self.attr_type("SrcT")
        self.dst = self.attr_type("DstT")
        self.truncate = self.attr_bool("Truncate", False)
        if OBJECT in (self.src, self.dst) and self.src != self.dst:
            raise kernel_error(
                self,
                f"Cast {type_name(self.src)} to {type_name(self.dst)} is not supported",
                errors.UnimplementedError,
            )

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (x,) = inputs
        check_input_dtype(self, 0, x, self.src)
        if self.src == self.dst:
            return [x]
        if self.dst == BOOL:
            return [array(x != 0)]
        if self.src in COMPLEX and self.dst not in COMPLEX:
            x = np.real(x)
        if self.truncate and self.dst == BFLOAT16 and self.src in FLOATS:
            return [_truncate_to_bfloat16(x)]
        with np.errstate(all="ignore"):  # out-of-range float -> int is UB in C++ too
            return [array(x.astype(self.dst))]


# --------------------------------------------------------------------------- MatMul, BiasAdd, AddN


# A small product of two 2-D float32 or float64 arrays goes to BLAS through `np.dot`,
# which makes the same gemm call as `np.matmul` without its ufunc machinery: 0.3-0.4 us
# less a product of up to ~2^18 multiply-adds (64x32 @ 32x32: 1.49 -> 1.10 us; with
# the second operand a transposed view, a layer's input gradient: 2.17 -> 1.81). Larger
# ones stay with `np.matmul`, which `np.dot` trails there (1024x32 @ 32x32: 10 against
# 20 us; a transposed 784x256 operand, copied first: 506 against 575). Same bits either
# way (`tests/kernels/test_math.py::test_dot_and_matmul_agree`).
_BLAS_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
_DOT_MAX_MACS = 1 << 18


def _product(lhs: np.ndarray, rhs: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """lhs @ rhs of 2-D arrays: `np.dot` for a small product of two arrays of one float
    dtype BLAS takes, else `np.matmul`. A product of one row or one column gets its
    operands with unit strides: numpy hands a strided vector to BLAS as it is, and
    some of OpenBLAS's kernels (Haswell's single precision) sum a strided vector in
    another order than the same values laid out contiguously."""
    if lhs.shape[0] == 1 or rhs.shape[1] == 1:
        lhs, rhs = _unit_strides(lhs), _unit_strides(rhs)
    dtype = lhs.dtype
    if dtype in _BLAS_DTYPES and rhs.dtype == dtype and lhs.size * rhs.shape[1] <= _DOT_MAX_MACS:
        return np.dot(lhs, rhs, out)  # type: ignore[no-any-return]
    return np.matmul(lhs, rhs, out=out)  # type: ignore[no-any-return]


_quiet_product = quiet(_product)


def _unit_strides(matrix: np.ndarray) -> np.ndarray:
    """`matrix`, or a C-ordered copy when it has neither C nor Fortran order."""
    flags = matrix.flags
    return matrix if flags.c_contiguous or flags.f_contiguous else np.ascontiguousarray(matrix)


@register_kernel("MatMul")
class MatMulKernel(OpKernel):
    """2-D matrix product with optional transposes of either operand."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", FLOATS | COMPLEX | {np.dtype(np.int32), np.dtype(np.int64)})
        self.transpose_a = self.attr_bool("transpose_a", False)
        self.transpose_b = self.attr_bool("transpose_b", False)
        self.work = _ACCUMULATE.get(self.dtype, self.dtype)  # float16/bfloat16 in float32

    def output_nbytes(self, inputs: list[Any]) -> int:
        # Its multiply-adds, two to a byte: BLAS does ~50 a ns on one core here, an
        # element-wise kernel streams ~25 bytes a ns (`executor.OFFLOAD_BYTES`).
        # (Asked before every product of a step: rows x inner is the size of `a` either way.)
        a, b = inputs
        if getattr(b, "ndim", 0) != 2 or getattr(a, "ndim", 0) != 2:
            return 0
        return int(a.size * b.shape[0 if self.transpose_b else 1]) // 2

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        a, b = inputs
        if a.dtype != self.dtype or b.dtype != self.dtype or a.ndim != 2 or b.ndim != 2:
            for i, value in enumerate(inputs):
                check_input_dtype(self, i, value, self.dtype)
                if value.ndim != 2:
                    raise kernel_error(
                        self, f"In[{i}] is not a matrix. Instead it has shape {shape_str(value.shape)}"
                    )
        lhs = a.T if self.transpose_a else a
        rhs = b.T if self.transpose_b else b
        if lhs.shape[1] != rhs.shape[0]:
            raise kernel_error(
                self,
                f"Matrix size-incompatible: In[0]: {shape_str(a.shape)}, In[1]: {shape_str(b.shape)}",
            )
        if self.work is self.dtype:  # a product of matrices: an array of their dtype
            if lhs.shape[1] == 1 and self.dtype in _EXACT_SCALING:
                return [_quiet_outer_product(lhs, rhs)]
            return [_matmul(lhs, rhs)]
        product = _matmul(lhs.astype(self.work), rhs.astype(self.work))
        return [array(product, self.dtype)]


def _outer_product(column: np.ndarray, row: np.ndarray) -> np.ndarray:
    """column @ row for a column [m, 1] and a row [1, n] of float32 or float64, as one
    multiplication and an addition of zero: the bits of BLAS's product, which sums each
    element's one product from zero (so -0.0 becomes 0.0), at half its cost (a dense
    layer of one unit's input gradient, [256, 1] x [1, 32]: 13 -> 6 us)."""
    product: np.ndarray = np.multiply(column, row)
    np.add(product, product.dtype.type(0), out=product)
    return product


_quiet_outer_product = quiet(_outer_product)  # (BLAS's product raises no warnings)


def _matmul(
    lhs: np.ndarray, rhs: np.ndarray, then: Callable[[np.ndarray], object] | None = None
) -> np.ndarray:
    """lhs @ rhs; a large product in two blocks of rows, one on the intra-op helper
    thread when it runs (`_intra_op`), cut where BLAS computes each block as it does
    the whole: the same bits (`_intra_op.row_cut`).

    `then`, an element-wise pass in place (quiet: it may run on the helper thread), is
    applied to each block by the thread that computed it, while the block is still in
    that core's cache (a fused layer's bias and activation)."""
    rows = lhs.shape[0]
    if (
        rows < _intra_op.SPLIT_MIN_ROWS  # (first: the usual small product stops here)
        or rows * lhs.shape[1] * rhs.shape[1] < _intra_op.SPLIT_MACS
        or not _intra_op.enabled()
        or not (cut := _intra_op.row_cut(rows, np.result_type(lhs, rhs)))
    ):
        product: np.ndarray = _quiet_product(lhs, rhs)
        if then is not None:
            then(product)
        return product
    out = np.empty((rows, rhs.shape[1]), np.result_type(lhs, rhs))

    def block(part: slice) -> None:
        _quiet_product(lhs[part], rhs, out[part])
        if then is not None:
            then(out[part])

    _intra_op.run_halves(lambda: block(slice(None, cut)), lambda: block(slice(cut, None)))
    return out


@register_kernel("BiasAdd", "BiasAddV1")
class BiasAddKernel(OpKernel):
    """value + bias along the channel dimension (last for NHWC, 1 for NCHW)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", NUMBER)
        data_format = self.attr_str("data_format", "NHWC")
        if data_format not in ("NHWC", "NCHW"):
            raise kernel_error(self, f"Invalid data format: {data_format}")
        self.channels_first = data_format == "NCHW"

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        value, bias = inputs
        check_input_dtype(self, 0, value, self.dtype)
        check_input_dtype(self, 1, bias, self.dtype)
        if value.ndim < 2:
            raise kernel_error(self, f"Input tensor must be at least 2D: {shape_str(value.shape)}")
        if bias.ndim != 1:
            raise kernel_error(self, f"Biases must be 1D: {shape_str(bias.shape)}")
        channel_dim = 1 if self.channels_first else value.ndim - 1
        if value.shape[channel_dim] != bias.shape[0]:
            raise kernel_error(
                self,
                "Must provide as many biases as the last dimension of the input tensor: "
                f"{shape_str(bias.shape)} vs. {shape_str(value.shape)}",
            )
        # Reshape the bias so it broadcasts along the channel dimension only.
        shape = [1] * value.ndim
        shape[channel_dim] = bias.shape[0]
        with np.errstate(all="ignore"):
            return [array(value + bias.reshape(shape), self.dtype)]


# --------------------------------------------------------------------------- fused dense layers

FUSED_MATMUL_OP = "_DistserverFusedMatMul"
FUSED_NODES_ATTR = "_fused_nodes"  # list(string): the parts' serialized NodeDefs, in order
BIAS_ADD_OPS = frozenset({"BiasAdd", "AddV2", "Add"})


def _sigmoid_in_place(x: np.ndarray) -> None:
    """x = `_sigmoid`(x): its operations, element by element, so its bits."""
    t = np.negative(x)
    np.exp(t, out=t)
    np.add(1, t, out=t)
    np.divide(1, t, out=x)


# Each written into the sum's own array: the same ufuncs, the same bits.
_ACTIVATIONS: dict[str, Callable[[np.ndarray], object]] = {
    "Relu": lambda x: np.maximum(x, np.zeros((), x.dtype), out=x),
    "Tanh": lambda x: np.tanh(x, out=x),
    "Sigmoid": _sigmoid_in_place,
}
ACTIVATION_OPS = frozenset(_ACTIVATIONS)
FUSED_TYPES: frozenset[np.dtype[Any]] = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


@register_kernel(FUSED_MATMUL_OP)
class FusedMatMulKernel(OpKernel):
    """activation(a @ b + bias), inputs (a, b, bias), from its parts' NodeDefs
    (`FUSED_NODES_ATTR`: MatMul, BiasAdd/AddV2/Add[, Relu/Tanh/Sigmoid]).

    Inputs of the node's dtype, two matrices whose product has one column per bias
    value, take one pass: the product (`_matmul`, as MatMul computes it), the bias
    added into it, the activation applied in place; the numpy calls the parts would
    make, in the same order (an addition's operands commute exactly). Any other inputs
    go through the parts' own kernels one after the other, so their errors name the
    part that TensorFlow would name.
    """

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", FUSED_TYPES)
        parts = fused_parts(self)
        ops = [part.op for part in parts]
        # The sum's operands: the product (by the MatMul's name; node names have no ":")
        # and the bias.
        add_inputs = parts[1].input if len(parts) > 1 else []
        sources = [text.split(":")[0] for text in add_inputs if not text.startswith("^")]
        if not (
            len(parts) in (2, 3)
            and ops[0] == "MatMul"
            and ops[1] in BIAS_ADD_OPS
            and (len(parts) == 2 or ops[2] in ACTIVATION_OPS)
            and all(part.attr["T"].type == node.attr["T"].type for part in parts if "T" in part.attr)
            and len(sources) == 2
            and sources.count(parts[0].name) == 1
        ):
            raise errors.InvalidArgumentError(
                f"Node '{self.name}' ({FUSED_MATMUL_OP}) fuses {ops}: expected MatMul, one of "
                f"{sorted(BIAS_ADD_OPS)} adding a bias to its product, then optionally one of "
                f"{sorted(ACTIVATION_OPS)}, all of T {self.dtype.name}",
                node_name=self.name,
            )
        self.matmul, self.add, *rest = [create_kernel(part) for part in parts]
        self.activation = rest[0] if rest else None
        self.bias_first = sources[0] != parts[0].name
        self.transpose_a = self.matmul.transpose_a  # type: ignore[attr-defined]
        self.transpose_b = self.matmul.transpose_b  # type: ignore[attr-defined]
        activate = _ACTIVATIONS[ops[2]] if rest else None

        def finish(block: np.ndarray, bias: np.ndarray) -> None:  # into the product's new array
            np.add(block, bias, out=block)
            if activate is not None:
                activate(block)

        quiet_finish = quiet(finish)
        # (a stack of layers runs it after its own product: `DenseStackKernel._planned_layers`)
        self.finish = finish

        def layer(lhs: np.ndarray, rhs: np.ndarray, bias: np.ndarray) -> np.ndarray:
            if lhs.shape[0] < _intra_op.SPLIT_MIN_ROWS:  # (`_matmul`'s first test: one block, here)
                product: np.ndarray = (  # (`_product`, written out: the fused types)
                    np.dot(lhs, rhs) if lhs.size * rhs.shape[1] <= _DOT_MAX_MACS else np.matmul(lhs, rhs)
                )
                finish(product, bias)
                return product
            return _matmul(lhs, rhs, then=lambda block: quiet_finish(block, bias))

        # The fast path's arithmetic, for inputs `layer` took (numpy's warnings off):
        # a stack calls it for inputs of shapes its members took before.
        self.checked_layer = layer
        self._layer = quiet(layer)

    def output_nbytes(self, inputs: list[Any]) -> int:
        return self.matmul.output_nbytes(inputs[:2])

    def work_nbytes(self, inputs: list[Any]) -> int:
        # `OpKernel.work_nbytes`'s count, in one call: asked before every layer of a step.
        try:
            a, b, bias = inputs
            if a.ndim == b.ndim == 2:
                nbytes: int = (
                    a.nbytes + b.nbytes + bias.nbytes + a.size * b.shape[0 if self.transpose_b else 1] // 2
                )
                return nbytes
        except (AttributeError, ValueError):
            pass
        return super().work_nbytes(inputs)

    def layer(self, a: Any, b: Any, bias: Any) -> np.ndarray | None:
        """The fast path of `compute`: the layer's value, or None for inputs it does not
        take (a stack of layers calls it: `DenseStackKernel`)."""
        if a.dtype == b.dtype == bias.dtype == self.dtype and a.ndim == b.ndim == 2 and bias.ndim == 1:
            lhs = a.T if self.transpose_a else a
            rhs = b.T if self.transpose_b else b
            if lhs.shape[1] == rhs.shape[0] and rhs.shape[1] == bias.shape[0]:
                return self._layer(lhs, rhs, bias)  # type: ignore[no-any-return]
        return None

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        a, b, bias = inputs
        value = self.layer(a, b, bias)
        if value is not None:
            return [value]
        (value,) = self.matmul.compute(ctx, [a, b])
        (value,) = self.add.compute(ctx, [bias, value] if self.bias_first else [value, bias])
        if self.activation is not None:
            (value,) = self.activation.compute(ctx, [value])
        return [value]


def fused_parts(kernel: OpKernel) -> list[NodeDef]:
    """The NodeDefs a fused or grouped node carries in attr `FUSED_NODES_ATTR`."""
    parts = []
    for data in kernel._attr(FUSED_NODES_ATTR).list.s:
        try:
            parts.append(NodeDef.FromString(data))
        except DecodeError as exc:
            raise errors.InvalidArgumentError(
                f"Node '{kernel.name}' ({kernel.op}) has a part that is not a NodeDef: {exc}",
                node_name=kernel.name,
            ) from None
    return parts


# The gradients of a dense layer, as TensorFlow's gradient functions write them, fused
# when an executor is built (`runtime.executor._fuse_dense_gradients`).
FUSED_MATMUL_GRAD_OP = "_DistserverFusedMatMulGrad"
FUSED_GRADIENT_OPS = frozenset({"TanhGrad", "SigmoidGrad", "ReluGrad"})
# The input of each that is the gradient coming down (TanhGrad(y, dy), ReluGrad(dy, x)).
GRADIENT_INPUT = {"TanhGrad": 1, "SigmoidGrad": 1, "ReluGrad": 0}
# Their kinds in `_loops.activation_gradient_with_sums` (`_loops` itself is imported by
# `_compiled`'s background thread only).
_GRADIENT_LOOP_KINDS = {"ReluGrad": 0, "TanhGrad": 1, "SigmoidGrad": 2}


@register_kernel(FUSED_MATMUL_GRAD_OP)
class FusedMatMulGradKernel(OpKernel):
    """The backward pass of a dense layer `activation(h @ w + bias)` as one node, from its
    parts' NodeDefs (`FUSED_NODES_ATTR`), in this order:

    0. the activation's gradient `g` (one of `FUSED_GRADIENT_OPS`), of inputs (a, b);
    1. `Sum(g, axes)` (TensorFlow 2 keeps the dims) and 2. `Reshape(sum, shape)`: the
       bias's gradient;
    3. `MatMul(h, g, transpose_a=True)`: the weights' gradient;
    4. optionally `MatMul(g, w, transpose_b=True)`: the gradient of the layer's input.

    Inputs: a, b, axes, shape, h[, w]. Outputs: the bias's, the weights' [and the
    input's] gradients. Attr `N`: 1 with the input's product, else 0.

    Inputs of the node's dtype, in a layer's shapes, with `axes` [0] and `shape` the
    bias's, take one pass: the numpy calls the parts make, in the same order, so the
    same bits. Any other inputs go through the parts' own kernels one after the other,
    so their errors name the part TensorFlow would name.
    """

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", FUSED_TYPES)
        parts = fused_parts(self)
        if not is_dense_gradient(parts, node.attr["T"].type):
            raise errors.InvalidArgumentError(
                f"Node '{self.name}' ({FUSED_MATMUL_GRAD_OP}) fuses {[part.op for part in parts]}: expected "
                f"one of {sorted(FUSED_GRADIENT_OPS)}, then Sum and Reshape of its gradient, a MatMul "
                f"reading it as b with transpose_a, optionally a MatMul reading it as a with "
                f"transpose_b, all of T {self.dtype.name}",
                node_name=self.name,
            )
        if self.attr_int("N") != len(parts) - 4:
            raise errors.InvalidArgumentError(
                f"Node '{self.name}' ({FUSED_MATMUL_GRAD_OP}) has N = {self.attr_int('N')}, "
                f"but {len(parts) - 4} products of the layer's input",
                node_name=self.name,
            )
        kernels = [create_kernel(part) for part in parts]
        self.gradient, self.sum, self.reshape, self.weights_gradient = kernels[:4]
        self.input_gradient = kernels[4] if len(kernels) == 5 else None
        fn, alpha = self.gradient.fn, self.gradient.alpha  # type: ignore[attr-defined]
        kind = _GRADIENT_LOOP_KINDS[self.gradient.op]
        self.loop_kind = kind  # (`DenseStackKernel._planned_gradients` makes the same call)
        zero, one = self.dtype.type(0), self.dtype.type(1)
        _compiled.prepare()

        def layer(a: np.ndarray, b: np.ndarray, h: np.ndarray, w: np.ndarray | None) -> list[np.ndarray]:
            loops = _compiled.loops()
            # One compiled pass for the gradient and its column sums, where numpy's sum
            # adds the rows one after the other (more than one column).
            if loops is None or a.shape[1] < 2 or not (a.flags.c_contiguous and b.flags.c_contiguous):
                return _dense_gradients(fn(a, b, alpha), h, w)
            g = np.empty(a.shape, a.dtype)
            bias = np.empty(a.shape[1], a.dtype)
            loops.activation_gradient_with_sums(g, bias, a, b, kind, zero, one)
            return _layer_products(bias, g, h, w)

        # The fast path's arithmetic, for inputs `gradients` took (numpy's warnings
        # off): a stack calls it for inputs of shapes its members took before.
        self.checked_gradients = layer
        self._layer = quiet(layer)
        # The Sum's axes and the Reshape's shape last found to sum the gradient's
        # columns into the bias's shape, with that shape: constants, the same read-only
        # arrays every step (`_sums_columns`).
        self._summed: tuple[Any, Any, int] | None = None

    def _sums_columns(self, axes: Any, shape: Any, columns: int) -> bool:
        """Whether `axes` and `shape` make the Sum and Reshape of the fast path: the
        gradient's rows added up, as a vector of `columns`. Checked once for the same
        read-only arrays (a graph's constants), not every step."""
        summed = self._summed
        if summed is not None and summed[0] is axes and summed[1] is shape and summed[2] == columns:
            return True
        if not (_only(axes, (0, -2)) and _only(shape, (columns, -1))):
            return False
        if not (axes.flags.writeable or shape.flags.writeable):
            self._summed = (axes, shape, columns)
        return True

    def output_nbytes(self, inputs: list[Any]) -> int:
        # The products' multiply-adds, two to a byte (`MatMulKernel.output_nbytes`).
        a, h = inputs[0], inputs[4]
        if getattr(a, "ndim", 0) != 2 or getattr(h, "ndim", 0) != 2:
            return 0
        work = h.size * a.shape[1]
        if len(inputs) == 6 and getattr(inputs[5], "ndim", 0) == 2:
            work += a.size * inputs[5].shape[0]
        return int(work) // 2

    def work_nbytes(self, inputs: list[Any]) -> int:
        # `OpKernel.work_nbytes`'s count, in one call: asked before every layer of a step.
        try:
            if len(inputs) == 6:
                a, b, axes, shape, h, w = inputs
                if a.ndim == h.ndim == w.ndim == 2:
                    nbytes: int = a.nbytes + b.nbytes + axes.nbytes + shape.nbytes + h.nbytes + w.nbytes
                    nbytes += (h.size * a.shape[1] + a.size * w.shape[0]) // 2
                    return nbytes
            else:
                a, b, axes, shape, h = inputs
                if a.ndim == h.ndim == 2:
                    nbytes = a.nbytes + b.nbytes + axes.nbytes + shape.nbytes + h.nbytes
                    nbytes += h.size * a.shape[1] // 2
                    return nbytes
        except (AttributeError, ValueError):
            pass
        return super().work_nbytes(inputs)

    def gradients(self, a: Any, b: Any, axes: Any, shape: Any, h: Any, w: Any) -> list[np.ndarray] | None:
        """The fast path of `compute` (`w` None without the input's product): the
        outputs, or None for inputs it does not take (a stack calls it: `DenseStackKernel`)."""
        dtype = self.dtype
        if (
            a.dtype == b.dtype == h.dtype == dtype
            and a.ndim == h.ndim == 2
            and a.shape == b.shape
            and h.shape[0] == a.shape[0]
            and (w is None or (w.dtype == dtype and w.ndim == 2 and w.shape[1] == a.shape[1]))
            and self._sums_columns(axes, shape, a.shape[1])
        ):
            return self._layer(a, b, h, w)  # type: ignore[no-any-return]
        return None

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        a, b, axes, shape, h, *rest = inputs
        w = rest[0] if rest else None
        values = self.gradients(a, b, axes, shape, h, w)
        if values is not None:
            return values
        (g,) = self.gradient.compute(ctx, [a, b])
        (summed,) = self.sum.compute(ctx, [g, axes])
        (bias,) = self.reshape.compute(ctx, [summed, shape])
        (weights,) = self.weights_gradient.compute(ctx, [h, g])
        if self.input_gradient is None:
            return [bias, weights]
        (layer_input,) = self.input_gradient.compute(ctx, [g, w])
        return [bias, weights, layer_input]


def _dense_gradients(g: Any, h: np.ndarray, w: np.ndarray | None) -> list[np.ndarray]:
    """The fast path of `FusedMatMulGradKernel`: as the parts compute them."""
    if type(g) is not np.ndarray or g.dtype != h.dtype:  # (`ActivationGradKernel`)
        g = array(g, h.dtype)
    bias = np.add.reduce(g, axis=(0,), dtype=g.dtype)  # (`SumKernel`, in the reshape's shape)
    return _layer_products(bias, g, h, w)


def _layer_products(bias: np.ndarray, g: np.ndarray, h: np.ndarray, w: np.ndarray | None) -> list[np.ndarray]:
    """`FusedMatMulGradKernel`'s outputs, given the bias's gradient: the products (in its
    quiet `layer`: a product of one block is numpy's own, `_matmul`'s first test)."""
    if h.size * g.shape[1] <= _DOT_MAX_MACS:  # (`_product`, written out: the fused types)
        weights = np.dot(h.T, g)
    else:
        weights = np.matmul(h.T, g) if h.shape[1] < _intra_op.SPLIT_MIN_ROWS else _matmul(h.T, g)
    if w is None:
        return [bias, weights]
    if g.size * w.shape[0] <= _DOT_MAX_MACS:
        return [bias, weights, np.dot(g, w.T)]
    return [bias, weights, np.matmul(g, w.T) if g.shape[0] < _intra_op.SPLIT_MIN_ROWS else _matmul(g, w.T)]


def _only(value: Any, allowed: tuple[int, ...]) -> bool:
    """Whether `value` is an integer tensor of one value, one of `allowed`."""
    return (
        type(value) is np.ndarray
        and value.dtype in INDEX_TYPES
        and value.size == 1
        and value.ndim <= 1
        and value.item() in allowed
    )


def is_dense_gradient(parts: list[NodeDef], dtype: int) -> bool:
    """Whether `parts` are a dense layer's gradients (see `FusedMatMulGradKernel`), of
    dtype `dtype`. (Reads attrs without adding them: the parts may be a caller's.)"""
    if len(parts) not in (4, 5):
        return False
    gradient, sum_, reshape, weights, *rest = parts

    def flag(part: NodeDef, name: str) -> bool:
        return name in part.attr and part.attr[name].b

    def reads(part: NodeDef, source: NodeDef) -> list[int]:  # the inputs of `part` that are `source`
        data = [text for text in part.input if not text.startswith("^")]
        return [i for i, text in enumerate(data) if text in (source.name, source.name + ":0")]

    def product(part: NodeDef, reading: int, transposes: tuple[bool, bool]) -> bool:
        return (
            part.op == "MatMul"
            and reads(part, gradient) == [reading]
            and (flag(part, "transpose_a"), flag(part, "transpose_b")) == transposes
        )

    return (
        dtype in (DT_FLOAT, DT_DOUBLE)  # (`FUSED_TYPES`)
        and gradient.op in FUSED_GRADIENT_OPS
        and (sum_.op, reshape.op) == ("Sum", "Reshape")
        and all("T" in part.attr and part.attr["T"].type == dtype for part in parts)
        and reads(sum_, gradient) == [0]
        and reads(reshape, sum_) == [0]
        and product(weights, 1, (True, False))
        and all(product(part, 0, (False, True)) for part in rest)
    )


DENSE_STACK_OP = "_DistserverDenseStack"
# A stack weighed below this bound is small (`DenseStackKernel.work_nbytes`).
_WEIGH_EXACTLY_FROM = 1 << 20
_nbytes_of = attrgetter("nbytes")
_dtype_of = attrgetter("dtype")
_shape_of = attrgetter("shape")


def _getter(places: list[int]) -> Callable[[list[Any]], tuple[Any, ...]]:
    """A function of a list: the tuple of its items at `places` (`itemgetter`, which
    gives an item, not a tuple, for one place)."""
    if len(places) == 1:
        (place,) = places
        return lambda items: (items[place],)
    return itemgetter(*places) if places else lambda items: ()


@register_kernel(DENSE_STACK_OP)
class DenseStackKernel(OpKernel):
    """Fused dense layers that follow one another, as one node: the members
    (`FUSED_NODES_ATTR`, in the order they run) are all `FUSED_MATMUL_OP`s, each
    reading the one before's output as its `a`, or all `FUSED_MATMUL_GRAD_OP`s, each
    reading the one before's layer-input gradient (its output 2) as the gradient
    coming down (its input `GRADIENT_INPUT`). The executor makes them
    (`executor._stack_dense_layers`).

    Inputs: the first member's inputs, then each later member's but the one the chain
    gives it. Outputs: of layers, every member's output; of gradients, every member's
    bias and weights gradients, then the last one's layer-input gradient if it has one.
    Each member runs its own kernel, so the same bits, and its errors name the member
    or its part; the stack saves the executor's work between them (~1 us a layer).
    Inputs like those every member's fast path took in a step (`_like`) go to the
    members' arithmetic without their checks (another ~1 us a member); when each of
    their products is one `np.dot` (small layers), the stack makes the members' numpy
    calls itself, from a plan of where each member's inputs are (`_make_plan`: 0.7 us
    a layer and 1.5 a gradient less, 30 of each in a `small` step).
    """

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", FUSED_TYPES)
        members = fused_parts(self)
        ops = {member.op for member in members}
        self.forward = ops == {FUSED_MATMUL_OP}
        if len(members) < 2 or not (self.forward or ops == {FUSED_MATMUL_GRAD_OP}):
            raise errors.InvalidArgumentError(
                f"Node '{self.name}' ({DENSE_STACK_OP}) stacks {[member.op for member in members]}: "
                f"expected two or more of {FUSED_MATMUL_OP}, or of {FUSED_MATMUL_GRAD_OP}",
                node_name=self.name,
            )
        self.members = [create_kernel(member) for member in members]
        # Where each member takes the value the one before passes on (output 0 of a
        # layer, 2 of a gradient).
        self._taken = [0 if self.forward else GRADIENT_INPUT[m.gradient.op] for m in self.members]  # type: ignore[attr-defined]
        # Each member's own inputs: inputs[start:end].
        self._spans: list[tuple[int, int]] = []
        start = 0
        for member in members:
            count = 3 if self.forward else 6 - (member.attr["N"].i == 0)
            end = start + count - (start > 0)
            self._spans.append((start, end))
            start = end
        self._last_without_weights = not self.forward and members[-1].attr["N"].i == 0
        if not self.forward and any(member.attr["N"].i == 0 for member in members[:-1]):
            raise errors.InvalidArgumentError(
                f"Node '{self.name}' ({DENSE_STACK_OP}): every member but the last must pass a "
                "layer-input gradient on (N = 1)",
                node_name=self.name,
            )
        if self.forward and any(member.transpose_a for member in self.members):  # type: ignore[attr-defined]
            raise errors.InvalidArgumentError(
                f"Node '{self.name}' ({DENSE_STACK_OP}): a layer may not transpose its input (transpose_a)",
                node_name=self.name,
            )
        # The inputs of a gradient stack that are its members' Sum axes and Reshape
        # shapes (constants: `FusedMatMulGradKernel._sums_columns` checks their values),
        # and the others. (A later member's own inputs leave out the one the chain gives
        # it, before them.)
        constants = (
            []
            if self.forward
            else [start + place - (start > 0) for start, _ in self._spans for place in (2, 3)]
        )
        count = self._spans[-1][1]
        self._constants_of = _getter([i for i in range(count) if i in constants])
        self._others_of = _getter([i for i in range(count) if i not in constants])
        # What inputs that every member's fast path took in a step look like: the
        # others' dtypes and shapes, and the constants themselves (read-only arrays).
        # Inputs like those go to the members' arithmetic without their checks (~1 us a
        # member).
        self._took: tuple[list[Any], list[Any], tuple[Any, ...]] | None = None
        # For inputs like `_took`'s: the `_took` it was made for, and what each member
        # does with them (`_make_plan`; None: inputs of those shapes take the members'
        # own paths).
        self._plan: tuple[Any, list[tuple[Any, ...]] | None] | None = None

    def work_nbytes(self, inputs: list[Any]) -> int:
        # The heaviest member's count (`OpKernel.work_nbytes`): the stack goes to the pool
        # when a member alone would (run one by one, small members held the event loop's
        # turn as long). First a bound from the largest input, in one pass: a member
        # reads at most six inputs' bytes and, with R rows and weights (an input) of at
        # most E elements, makes at most R * E multiply-adds and an R * E activation. A
        # last gradient without its weights (N = 0) is weighed itself. Under
        # `_WEIGH_EXACTLY_FROM` (the executor's `OFFLOAD_BYTES`) it says "small"; else
        # each member is weighed from the shapes it will see.
        try:
            first = inputs[0]
            largest = max(map(_nbytes_of, inputs))
            bound = 6 * largest + first.shape[0] * (largest // first.itemsize) * (first.itemsize + 1)
            if self._last_without_weights:
                start, _ = self._spans[-1]
                own = inputs[start:]
                own.insert(self._taken[-1], own[0])
                bound = max(bound, self.members[-1].work_nbytes(own))
            if bound < _WEIGH_EXACTLY_FROM:
                return int(bound)
            heaviest = 0
            if self.forward:
                rows, columns, itemsize = first.shape[0], first.shape[1], first.itemsize
                for member, (_, end) in zip(self.members, self._spans, strict=True):
                    w, bias = inputs[end - 2], inputs[end - 1]
                    inner, out = w.shape[::-1] if member.transpose_b else w.shape  # type: ignore[attr-defined]
                    work = rows * columns * itemsize + w.nbytes + bias.nbytes + rows * inner * out // 2
                    heaviest = max(heaviest, work)
                    columns = out
                return int(heaviest)
            for member, taken, (start, end) in zip(self.members, self._taken, self._spans, strict=True):
                own = inputs[start:end]
                if start:  # (the gradient coming down has the shape of the activation's other input)
                    own.insert(taken, own[0])
                heaviest = max(heaviest, member.work_nbytes(own))
            return heaviest
        except (AttributeError, ValueError, IndexError, TypeError):
            return super().work_nbytes(inputs)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        took = self._took
        checked = took is not None and self._like(inputs, took)
        if checked:
            made = self._plan
            plan = made[1] if made is not None and made[0] is took else self._make_plan(took, inputs)
            if plan is not None:
                planned = self._planned_layers if self.forward else self._planned_gradients
                return planned(inputs, plan)
        values, every_fast = (
            self._layers(ctx, inputs, checked) if self.forward else self._gradients(ctx, inputs, checked)
        )
        if every_fast and not checked:
            self._remember(inputs)
        return values

    def _make_plan(self, took: Any, inputs: list[Any]) -> list[tuple[Any, ...]] | None:
        """What each member does with inputs like `took`'s (`inputs`, checked by
        `_like`), kept in `_plan` (for gradients, once their compiled pass is ready);
        None when the members take other calls for them. Every product must be one
        `np.dot`, each member's own choice for a product of at most `_DOT_MAX_MACS`
        multiply-adds (a layer's of fewer than `SPLIT_MIN_ROWS` rows), and every
        gradient have two or more columns (a single column is summed by numpy)."""
        plan = self._plan_layers(inputs) if self.forward else self._plan_gradients(inputs)
        if self.forward or _compiled.loops() is not None:
            self._plan = (took, plan)
        return plan

    def _plan_layers(self, inputs: list[Any]) -> list[tuple[Any, ...]] | None:
        """For each layer: its weights' and bias's places among the inputs, whether it
        transposes its weights, and its bias-and-activation pass (`finish`)."""
        rows = inputs[0].shape[0]
        plan = []
        for member, (_, end) in zip(self.members, self._spans, strict=True):
            transposed = member.transpose_b  # type: ignore[attr-defined]
            inner, out = inputs[end - 2].shape[::-1] if transposed else inputs[end - 2].shape
            if rows >= _intra_op.SPLIT_MIN_ROWS or rows * inner * out > _DOT_MAX_MACS:
                return None  # (`FusedMatMulKernel.layer`: numpy's matmul, or in blocks)
            plan.append((end - 2, end - 1, transposed, member.finish))  # type: ignore[attr-defined]
        return plan

    def _plan_gradients(self, inputs: list[Any]) -> list[tuple[Any, ...]] | None:
        """For each member: the places of its activation's two inputs, its layer's input
        and its weights (None: the value the member before passes on), its compiled
        gradient pass with that pass's arguments (`FusedMatMulGradKernel`'s), and the
        member itself."""
        loops = _compiled.loops()
        if loops is None:
            return None
        plan = []
        for member, taken, (start, end) in zip(self.members, self._taken, self._spans, strict=True):
            places: list[int | None] = list(range(start, end))
            if start:
                places.insert(taken, None)
            a_at, b_at, _, _, h_at, *w_at = places
            weights_at = w_at[0] if w_at else None
            # (the gradient coming down has the shape of the activation's other input)
            rows, columns = inputs[a_at if a_at is not None else b_at].shape  # type: ignore[index]
            h = inputs[h_at]  # type: ignore[index]
            if (
                columns < 2
                or h.size * columns > _DOT_MAX_MACS
                or (weights_at is not None and rows * columns * inputs[weights_at].shape[0] > _DOT_MAX_MACS)
            ):
                return None  # (`FusedMatMulGradKernel`: numpy's sum, `_layer_products`: numpy's matmul)
            dtype = member.dtype  # type: ignore[attr-defined]
            arguments = (member.loop_kind, dtype.type(0), dtype.type(1))  # type: ignore[attr-defined]
            gradient_pass = loops.activation_gradient_with_sums
            plan.append((a_at, b_at, h_at, weights_at, gradient_pass, arguments, member))
        return plan

    @staticmethod
    def _planned_layers(inputs: list[Any], plan: list[tuple[Any, ...]]) -> list[Any]:
        """`_layers` of checked inputs by `plan` (`_make_plan`): each member's product and
        `finish`, the numpy calls its `checked_layer` makes, without a call a member."""
        h = inputs[0]
        layers = []
        for w_at, bias_at, transposed, finish in plan:
            w = inputs[w_at]
            h = np.dot(h, w.T if transposed else w)
            finish(h, inputs[bias_at])
            layers.append(h)
        return layers

    @staticmethod
    def _planned_gradients(inputs: list[Any], plan: list[tuple[Any, ...]]) -> list[Any]:
        """`_gradients` of checked inputs by `plan` (`_make_plan`): each member's compiled
        gradient pass and products, the calls its `checked_gradients` makes, without
        a call a member (a member's activation inputs that are not C-contiguous go to
        its `checked_gradients`, which takes numpy's calls for them)."""
        gradients: list[Any] = []
        passed: Any = None
        for a_at, b_at, h_at, w_at, gradient_pass, (kind, zero, one), member in plan:
            a = passed if a_at is None else inputs[a_at]
            b = passed if b_at is None else inputs[b_at]
            h = inputs[h_at]
            if a.flags.c_contiguous and b.flags.c_contiguous:
                g = np.empty(a.shape, a.dtype)
                bias = np.empty(a.shape[1], a.dtype)
                gradient_pass(g, bias, a, b, kind, zero, one)
                gradients += (bias, np.dot(h.T, g))
                passed = None if w_at is None else np.dot(g, inputs[w_at].T)
            else:
                values = member.checked_gradients(a, b, h, None if w_at is None else inputs[w_at])
                gradients += values[:2]
                passed = values[2] if len(values) == 3 else None
        if passed is not None:
            gradients.append(passed)
        return gradients

    def _layers(self, ctx: KernelContext, inputs: list[Any], checked: bool) -> tuple[list[Any], bool]:
        """Every member's output, and whether every member's fast path took its inputs:
        `FusedMatMulKernel.layer` (the checks of its `compute` without building its
        input list) or, for inputs `checked` already, its arithmetic alone."""
        every_fast = True
        h = inputs[0]
        layers: list[Any] = []
        for member, (_, end) in zip(self.members, self._spans, strict=True):
            w, bias = inputs[end - 2], inputs[end - 1]
            if checked:
                h = member.checked_layer(h, w.T if member.transpose_b else w, bias)  # type: ignore[attr-defined]
            else:
                value = member.layer(h, w, bias)  # type: ignore[attr-defined]
                if value is None:
                    every_fast = False
                    value = self._run(member, ctx, [h, w, bias])[0]
                h = value
            layers.append(h)
        return layers, every_fast

    def _gradients(self, ctx: KernelContext, inputs: list[Any], checked: bool) -> tuple[list[Any], bool]:
        """Every member's bias and weights gradients, then the last one's input gradient
        if it has one, and whether every member's fast path took its inputs (as `_layers`,
        with `FusedMatMulGradKernel.gradients`)."""
        every_fast = True
        gradients: list[Any] = []
        passed: Any = None
        for member, taken, (start, end) in zip(self.members, self._taken, self._spans, strict=True):
            own = inputs[start:end]
            if start:
                own.insert(taken, passed)
            a, b, axes, shape, h, *w = own
            if checked:
                values = member.checked_gradients(a, b, h, w[0] if w else None)  # type: ignore[attr-defined]
            else:
                values = member.gradients(a, b, axes, shape, h, w[0] if w else None)  # type: ignore[attr-defined]
                if values is None:
                    every_fast = False
                    values = self._run(member, ctx, own)
            gradients += values[:2]
            passed = values[2] if len(values) == 3 else None
        if passed is not None:
            gradients.append(passed)
        return gradients, every_fast

    def _remember(self, inputs: list[Any]) -> None:
        """Keep what inputs that every member's fast path took look like (`_took`), when
        they are arrays and the constants read-only (a graph's)."""
        constants, others = self._constants_of(inputs), self._others_of(inputs)
        if list(map(type, inputs)).count(np.ndarray) == len(inputs) and not any(
            c.flags.writeable for c in constants
        ):
            self._took = (list(map(_dtype_of, others)), list(map(_shape_of, others)), constants)

    def _like(self, inputs: list[Any], took: tuple[list[Any], list[Any], tuple[Any, ...]]) -> bool:
        """Whether `inputs` hold `took`'s constants and arrays of its dtypes and shapes:
        every member's fast path takes them."""
        dtypes, shapes, constants = took
        others = self._others_of(inputs)
        return (
            all(map(is_, self._constants_of(inputs), constants))
            and list(map(type, others)).count(np.ndarray) == len(others)
            and list(map(_shape_of, others)) == shapes
            and list(map(_dtype_of, others)) == dtypes
        )

    @staticmethod
    def _run(member: OpKernel, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        """`member.compute` (inputs its fast path does not take), its errors naming it."""
        try:
            return member.compute(ctx, inputs)
        except errors.OpError as exc:
            raise errors.with_node(exc, member.name) from None


@register_kernel("AddN")
class AddNKernel(OpKernel):
    """Sum of N inputs of identical shape (no broadcasting, as in TF)."""

    fusable = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", NUMBER)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        for i, value in enumerate(inputs):
            check_input_dtype(self, i, value, self.dtype)
            if value.shape != inputs[0].shape:
                raise kernel_error(
                    self,
                    f"Inputs to operation {self.name} of type {self.op} must have the same size and shape.  "
                    f"Input 0: {shape_str(inputs[0].shape)} != input {i}: {shape_str(value.shape)}",
                )
        with np.errstate(all="ignore"):
            total = np.array(inputs[0], copy=True)
            for value in inputs[1:]:
                total += value
        return [total]


# --------------------------------------------------------------------------- reductions


class _ReductionKernel(OpKernel):
    """Reduce input 0 over the axes in input 1 (`reduction_indices`).

    The axes input may be int32 or int64, a scalar or a vector, with negative values
    counting from the end; an empty vector reduces nothing. `keep_dims` keeps the
    reduced dimensions with size 1.
    """

    types: ClassVar[frozenset[np.dtype[Any]]] = NUMBER

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", self.types)
        self.keep_dims = self.attr_bool("keep_dims", False)
        self._quiet_reduce = quiet(self.reduce)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, indices = inputs
        check_input_dtype(self, 0, x, self.dtype)
        axes = self._axes(x.ndim, int_list(self, indices, "reduction_indices", allow_scalar=True))
        work = _ACCUMULATE.get(self.dtype, self.dtype)
        result = self._quiet_reduce(x.astype(work, copy=False), axes)
        return [array(result, self.dtype)]

    def _axes(self, rank: int, indices: list[int]) -> tuple[int, ...]:
        axes: list[int] = []
        for index in indices:
            if not -rank <= index < rank:
                raise kernel_error(
                    self, f"Invalid reduction dimension ({index} for input with {rank} dimension(s)"
                )
            axis = index % rank
            if axis in axes:
                raise kernel_error(
                    self, f"Invalid reduction arguments: Axes contains duplicate dimension: {axis}"
                )
            axes.append(axis)
        return tuple(sorted(axes))

    def reduce(self, x: np.ndarray, axes: tuple[int, ...]) -> Any:
        raise NotImplementedError


# A sum over one inner axis, of an array with many rows before that axis and few values
# after it, is added slice by slice: numpy's reduction runs a short inner loop per row
# (an embedding's looked-up rows pooled, [256, 8, 32] over axis 1: 41 -> 21 us), and
# with the compiled loops in one pass (`_loops.sum_middle_axis`, 5 us). All three add
# the entries of each output in axis order, from zero, so the bits are the same. Where the
# slices pay (measured): ...
_SLICED_SUM_MIN_ROWS = 64  # ... at least this many rows before the axis,
_SLICED_SUM_MAX_ENTRIES = 64  # at most this many entries along it,
_SLICED_SUM_MAX_AFTER = 64  # and at most this many values after it.


def _sum(x: np.ndarray, axes: tuple[int, ...], keep_dims: bool) -> Any:
    """`x` summed over `axes` in its dtype, as np.add.reduce sums it."""
    # (Checked cheapest first: most Sums reduce axis 0, or every axis.)
    if len(axes) == 1 and axes[0] and 2 <= x.shape[axes[0]] <= _SLICED_SUM_MAX_ENTRIES:
        (axis,) = axes
        rows = _math.prod(x.shape[:axis])
        entries = x.shape[axis]
        after = _math.prod(x.shape[axis + 1 :])
        if rows >= _SLICED_SUM_MIN_ROWS and 2 <= after <= _SLICED_SUM_MAX_AFTER and x.flags.c_contiguous:
            shape = (*x.shape[:axis], *((1,) if keep_dims else ()), *x.shape[axis + 1 :])
            if x.dtype in _compiled.DTYPES:  # (one compiled pass: 21 -> 5 us, warm)
                loops = _compiled.loops()
                if loops is not None:
                    total = np.empty((rows, after), x.dtype)
                    loops.sum_middle_axis(total, _compiled.read_only(x, rows, entries, after))
                    return total.reshape(shape)
                _compiled.prepare()  # (compiling in the background, once a process: slices meanwhile)
            slices = x.reshape(rows, entries, after)
            total = slices[:, 0] + x.dtype.type(0)  # (from zero, as numpy: -0.0 + -0.0 sums to 0.0)
            for i in range(1, entries):
                total += slices[:, i]
            return total.reshape(shape)
    return np.add.reduce(x, axis=axes, dtype=x.dtype, keepdims=keep_dims)  # type: ignore[call-overload]


@register_kernel("Sum")
class SumKernel(_ReductionKernel):
    def reduce(self, x: np.ndarray, axes: tuple[int, ...]) -> Any:
        # `_sum`: numpy's reduction (or slices) without np.sum's Python wrapper (a
        # gradient's Sum: 30 a step).
        return _sum(x, axes, self.keep_dims)


@register_kernel("Prod")
class ProdKernel(_ReductionKernel):
    def reduce(self, x: np.ndarray, axes: tuple[int, ...]) -> Any:
        return np.prod(x, axis=axes, dtype=x.dtype, keepdims=self.keep_dims)


class _LogicalReductionKernel(_ReductionKernel):
    """All / Any: reductions of a bool tensor (these ops have no `T` attr)."""

    def __init__(self, node: NodeDef) -> None:
        OpKernel.__init__(self, node)
        self.dtype = BOOL
        self.keep_dims = self.attr_bool("keep_dims", False)
        self._quiet_reduce = quiet(self.reduce)


@register_kernel("All")
class AllKernel(_LogicalReductionKernel):
    def reduce(self, x: np.ndarray, axes: tuple[int, ...]) -> Any:
        return np.all(x, axis=axes, keepdims=self.keep_dims)


@register_kernel("Any")
class AnyKernel(_LogicalReductionKernel):
    def reduce(self, x: np.ndarray, axes: tuple[int, ...]) -> Any:
        return np.any(x, axis=axes, keepdims=self.keep_dims)


@register_kernel("Mean")
class MeanKernel(_ReductionKernel):
    def reduce(self, x: np.ndarray, axes: tuple[int, ...]) -> Any:
        total = _sum(x, axes, self.keep_dims)
        count = _math.prod(x.shape[a] for a in axes)
        if x.dtype in INTEGERS:
            if count == 0:
                return np.zeros_like(total)
            return _truncate_div(np.asarray(total), np.asarray(count, dtype=x.dtype))
        reciprocal = exact_reciprocal(count, total.dtype) if total.dtype in _EXACT_SCALING else None
        if reciprocal is not None:  # (`_true_divide`)
            return np.multiply(total, reciprocal)
        return np.true_divide(total, count)  # 0 / 0 = nan for an empty range, as in TF


class _ExtremumKernel(_ReductionKernel):
    types = REAL
    _numpy: ClassVar[ArrayFn]
    _largest: ClassVar[bool]  # identity is the largest value (Min) or the lowest (Max)

    def reduce(self, x: np.ndarray, axes: tuple[int, ...]) -> Any:
        if x.dtype in INTEGERS:
            info = np.iinfo(x.dtype)
            identity: Any = info.max if self._largest else info.min
        else:
            identity = np.inf if self._largest else -np.inf
        return self._numpy(x, axis=axes, keepdims=self.keep_dims, initial=identity)


@register_kernel("Max")
class MaxKernel(_ExtremumKernel):
    _numpy = staticmethod(np.max)
    _largest = False


@register_kernel("Min")
class MinKernel(_ExtremumKernel):
    _numpy = staticmethod(np.min)
    _largest = True


@register_kernel("ArgMax", "ArgMin")
class ArgExtremumKernel(OpKernel):
    """Index of the largest (ArgMax) or smallest (ArgMin) value along one axis."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", REAL | {BOOL})
        self.output_type = attr_type_in(self, "output_type", INDEX_TYPES, default=np.dtype(np.int64))
        self.fn = np.argmax if self.op == "ArgMax" else np.argmin

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, dimension = inputs
        check_input_dtype(self, 0, x, self.dtype)
        if dimension.ndim != 0 or dimension.dtype not in INDEX_TYPES:
            raise kernel_error(
                self, f"dim must be a scalar, but received tensor of shape: {shape_str(dimension.shape)}"
            )
        dim = int(dimension)
        if not -x.ndim <= dim < x.ndim:
            raise kernel_error(self, f"Expected dimension in the range [{-x.ndim}, {x.ndim}), but got {dim}")
        axis = dim % x.ndim
        if x.shape[axis] == 0:
            raise kernel_error(self, f"Reduction axis {dim} is empty in shape {shape_str(x.shape)}")
        return [array(self.fn(x.astype(compute_dtype(self.dtype), copy=False), axis=axis), self.output_type)]


__all__ = [
    "AddNKernel",
    "AllKernel",
    "AnyKernel",
    "ArgExtremumKernel",
    "BiasAddKernel",
    "BinaryOpKernel",
    "CastKernel",
    "EqualityKernel",
    "MatMulKernel",
    "MaxKernel",
    "MeanKernel",
    "MinKernel",
    "ProdKernel",
    "SumKernel",
    "UnaryOpKernel",
]


# --------------------------------------------------------------------------- scans


@register_kernel("Cumsum", "Cumprod")
class CumulativeKernel(OpKernel):
    """`(x, axis)` -> running sums (products) along `axis`; `exclusive` starts from the
    identity, `reverse` runs from the end."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", NUMBER)
        self.exclusive = self.attr_bool("exclusive", False)
        self.reverse = self.attr_bool("reverse", False)
        self.ufunc = np.add if self.op == "Cumsum" else np.multiply

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, axis_value = inputs
        check_input_dtype(self, 0, x, self.dtype)
        if x.ndim == 0:
            raise kernel_error(self, "ScanOp: input must be at least 1-D, got a scalar")
        axis = normalize_axis(self, int_scalar(self, axis_value, "axis"), x.ndim)
        values = np.flip(x, axis) if self.reverse else x
        result = self.ufunc.accumulate(values, axis=axis, dtype=x.dtype)
        if self.exclusive:
            identity = np.zeros_like if self.op == "Cumsum" else np.ones_like
            first = identity(np.take(result, [0], axis=axis))
            result = np.concatenate([first, np.delete(result, -1, axis=axis)], axis=axis)
        return [np.flip(result, axis) if self.reverse else result]


@register_kernel("DenseBincount")
class DenseBincountKernel(OpKernel):
    """`(input, size, weights)` -> per value in [0, size): its count, or the sum of its
    weights (`binary_output`: 1 where present); a 2-D input counts row by row."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", REAL)
        self.binary = self.attr_bool("binary_output", False)

    def output_nbytes(self, inputs: list[Any]) -> int:
        # `size` comes from the graph (or a feed) and may dwarf the input.
        rows = inputs[0].shape[0] if inputs[0].ndim == 2 else 1
        return rows * max(product_of(inputs[1]), 0) * self.dtype.itemsize

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        values, size_value, weights = inputs
        size = int_scalar(self, size_value, "size")
        if size < 0:
            raise kernel_error(self, f"size ({size}) must be non-negative")
        if values.ndim not in (1, 2):
            raise kernel_error(self, f"input must be 1-D or 2-D, got shape {shape_str(values.shape)}")
        if values.size and (values.min() < 0):
            raise kernel_error(self, "Input arr must be non-negative!")
        weighted = weights.size > 0
        if weighted and weights.shape != values.shape:
            raise kernel_error(
                self,
                f"Input and weights must have the same shape: {shape_str(values.shape)} vs "
                f"{shape_str(weights.shape)}",
            )
        rows = values.reshape(-1, values.shape[-1]) if values.ndim == 2 else values.reshape(1, -1)
        row_weights = weights.reshape(rows.shape) if weighted else None
        out = np.zeros((rows.shape[0], size), dtype=self.dtype)
        for i, row in enumerate(rows):
            keep = row < size  # values at or above size are dropped, as in TensorFlow
            counts = np.bincount(
                row[keep].astype(np.int64), None if row_weights is None else row_weights[i][keep], size
            )
            out[i] = (counts > 0) if self.binary else counts
        return [out if values.ndim == 2 else out[0]]
