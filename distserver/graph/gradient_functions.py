"""The gradient functions of the ops the graph API builds (registered on import).

Each function emits the ops TensorFlow's registered gradient for that op emits
(tensorflow/python/ops/math_grad.py, array_grad.py, nn_grad.py,
resource_variable_ops.py), so a gradient graph built here runs on TensorFlow's
servers and computes what TensorFlow computes. Where TensorFlow folds shapes known
at graph-building time into constants, so do we.
"""

from __future__ import annotations

import typing
from typing import Any

import numpy as np

from distserver.graph import ops
from distserver.graph.autodiff import (
    Gradient,
    IndexedSlices,
    NotDifferentiable,
    RegisterGradient,
    to_dense,
    unsorted_segment_sum,
)
from distserver.graph.graph import Operation, Shape, Tensor, get_default_graph, name_scope
from distserver.protos import types_pb2
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.tensors import COMPLEX_DATATYPES, FLOAT_DATATYPES

_DT = types_pb2

# --------------------------------------------------------------------------- helpers


def _raw(
    op_type: str,
    inputs: list[Tensor],
    attrs: dict[str, AttrValue],
    datatype: int,
    shape: Shape = None,
    name: str | None = None,
) -> Tensor:
    """A one-output op without a graph-API constructor (ReluGrad, BroadcastTo, ...)."""
    with name_scope(name, op_type) as scope:
        return ops._make(scope, op_type, inputs, attrs, datatype, shape)


def _t(tensor: Tensor) -> dict[str, AttrValue]:
    return {"T": ops._type_attr(tensor.datatype)}


def _fully_defined(shape: Shape) -> bool:
    return shape is not None and None not in shape


def _dims(shape: Shape) -> tuple[int, ...]:
    return ops._known_dims(shape)


def _int32(values: Any) -> np.ndarray[Any, Any]:
    return np.asarray(values, dtype=np.int32)


def _reduce_to(grad: Tensor | None, x: Tensor, out: Tensor) -> Tensor | None:
    """Sum `grad` (shaped like `out`) over the dimensions along which `x` was broadcast.

    With static shapes the reduction axes are constants (TensorFlow's
    SmartBroadcastGradientArgs); otherwise ``BroadcastGradientArgs`` finds them.
    """
    if grad is None:
        return None
    if _fully_defined(x.shape) and _fully_defined(out.shape):
        x_dims, out_dims = _dims(x.shape), _dims(out.shape)
        if x_dims == out_dims:
            return grad
        padded = (1,) * (len(out_dims) - len(x_dims)) + x_dims
        axes = [
            i
            for i, (a, b) in enumerate(zip(padded, out_dims, strict=True))
            if i < len(out_dims) - len(x_dims) or (a == 1 and b != 1)
        ]
        summed = ops.reduce_sum(grad, _int32(axes)) if axes else grad
        return ops.reshape(summed, _int32(x_dims))
    x_shape = ops.shape(x)
    out_shape = ops.shape(out)
    reduce_x = _broadcast_gradient_args(x_shape, out_shape)[0]
    return ops.reshape(ops.reduce_sum(grad, reduce_x, keepdims=True), x_shape)


def _broadcast_gradient_args(s0: Tensor, s1: Tensor) -> list[Tensor]:
    with name_scope(None, "BroadcastGradientArgs") as scope:
        op = get_default_graph().create_op(
            "BroadcastGradientArgs",
            [s0, s1],
            [s0.datatype, s0.datatype],
            name=scope,
            attrs=_t(s0),
            shapes=[(None,), (None,)],
        )
    return op.outputs


def _binary_grads(op: Operation, gx: Tensor | None, gy: Tensor | None) -> list[Gradient | None]:
    out = op.outputs[0]
    return [_reduce_to(gx, op.inputs[0], out), _reduce_to(gy, op.inputs[1], out)]


def _reduced_shape(input_shape: Tensor, axes: Tensor) -> Tensor:
    """The shape of a reduction with kept dimensions (TensorFlow's math_ops.reduced_shape)."""
    input_shape = ops.cast(input_shape, np.int32)
    axes = ops.cast(axes, np.int32)
    rank = ops.size(input_shape)
    axes = ops.floormod(ops.add(axes, rank), rank)
    axes_shape = ops.shape(axes)
    ones = ops.fill(axes_shape, ops.constant(np.int32(1)))
    indices = [ops.range(rank), axes]
    data = [input_shape, ones]
    with name_scope(None, "DynamicStitch") as scope:
        op = get_default_graph().create_op(
            "DynamicStitch",
            [*indices, *data],
            [_DT.DT_INT32],
            name=scope,
            attrs={"N": AttrValue(i=2), "T": ops._type_attr(_DT.DT_INT32)},
            shapes=[(None,)],
        )
    return op.outputs[0]


def _kept_dims(x: Tensor, axes: Tensor) -> list[int] | None:
    """The static shape of reducing `x` over `axes` with kept dimensions, when known."""
    axis_values = ops._static_axes(axes)
    if not _fully_defined(x.shape) or axis_values is None:
        return None
    dims = _dims(x.shape)
    reduced = {a % len(dims) for a in axis_values} if dims else set()
    return [1 if i in reduced else d for i, d in enumerate(dims)]


def _conj(x: Tensor) -> Tensor:
    if x.datatype in COMPLEX_DATATYPES:
        return _raw("Conj", [x], _t(x), x.datatype, x.shape)
    return x


def _flag(op: Operation, name: str) -> bool:
    # A bool attr, false when absent (its default in TensorFlow's op registry).
    return name in op.node_def.attr and bool(op.get_attr(name))


def _same_type_constant(value: float, like: Tensor) -> Tensor:
    return ops.constant(np.array(value, dtype=like.dtype))


# --------------------------------------------------------------------------- not differentiable

for _op_type in (
    "StopGradient",
    "Shape",
    "ShapeN",
    "Size",
    "Rank",
    "ZerosLike",
    "OnesLike",
    "Range",
    "ArgMax",
    "ArgMin",
    "Equal",
    "NotEqual",
    "Less",
    "LessEqual",
    "Greater",
    "GreaterEqual",
    "LogicalAnd",
    "LogicalOr",
    "LogicalNot",
    "OneHot",
    "Where",
    "FloorDiv",
    "Floor",
    "Ceil",
    "Round",
    "Sign",
    "BroadcastGradientArgs",
    "ConcatOffset",
    "Unique",
    "ListDiff",
    "InvertPermutation",
    "ScatterNd",
    "VarIsInitializedOp",
    "VariableShape",
    "Const",
    "Placeholder",
    "VarHandleOp",
    "NoOp",
    "All",
    "Any",
    "RandomUniform",
    "RandomStandardNormal",
    "TruncatedNormal",
    "RandomUniformInt",
):
    NotDifferentiable(_op_type)


# --------------------------------------------------------------------------- identities


def _identity_grad(op: Operation, grad: Gradient) -> list[Gradient | None]:
    return [grad]


for _op_type in ("Identity", "Snapshot", "PlaceholderWithDefault", "ReadVariableOp"):
    RegisterGradient(_op_type, takes_indexed_slices=True)(_identity_grad)


@RegisterGradient("Cast", takes_indexed_slices=True)
def _cast_grad(op: Operation, grad: Gradient) -> list[Gradient | None]:
    differentiable = FLOAT_DATATYPES | COMPLEX_DATATYPES
    source = op.inputs[0].datatype
    if source not in differentiable or op.outputs[0].datatype not in differentiable:
        return [None]
    if isinstance(grad, IndexedSlices):
        return [IndexedSlices(ops.cast(grad.values, op.inputs[0].dtype), grad.indices, grad.dense_shape)]
    return [ops.cast(grad, op.inputs[0].dtype)]


@RegisterGradient("AddN", takes_indexed_slices=True)
def _add_n_grad(op: Operation, grad: Gradient) -> list[Gradient | None]:
    return [grad] * len(op.inputs)


# --------------------------------------------------------------------------- element-wise


@RegisterGradient("Neg")
def _neg_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [ops.negative(grad)]


@RegisterGradient("Abs")
def _abs_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x = op.inputs[0]
    return [ops.multiply(grad, _raw("Sign", [x], _t(x), x.datatype, x.shape))]


@RegisterGradient("Square")
def _square_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x = op.inputs[0]
    with get_default_graph().control_dependencies([grad]):
        x = _conj(x)
        two = _same_type_constant(2.0, x)
        return [ops.multiply(grad, ops.multiply(x, two))]


def _unary_grad_op(op_type: str, y: Tensor, dy: Tensor) -> Tensor:
    return _raw(op_type, [y, dy], _t(y), y.datatype, y.shape)


@RegisterGradient("Sqrt")
def _sqrt_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_unary_grad_op("SqrtGrad", op.outputs[0], grad)]


@RegisterGradient("Rsqrt")
def _rsqrt_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_unary_grad_op("RsqrtGrad", op.outputs[0], grad)]


@RegisterGradient("Reciprocal")
def _reciprocal_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_unary_grad_op("ReciprocalGrad", op.outputs[0], grad)]


@RegisterGradient("Tanh")
def _tanh_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_unary_grad_op("TanhGrad", _conj(op.outputs[0]), grad)]


@RegisterGradient("Sigmoid")
def _sigmoid_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_unary_grad_op("SigmoidGrad", _conj(op.outputs[0]), grad)]


@RegisterGradient("Exp")
def _exp_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    y = op.outputs[0]
    with get_default_graph().control_dependencies([grad]):
        return [ops.multiply(grad, _conj(y))]


@RegisterGradient("Log")
def _log_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x = op.inputs[0]
    with get_default_graph().control_dependencies([grad]):
        x = _conj(x)
        return [ops.multiply(grad, _raw("Reciprocal", [x], _t(x), x.datatype, x.shape))]


@RegisterGradient("Relu")
def _relu_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    y = op.outputs[0]
    return [_raw("ReluGrad", [grad, y], _t(y), y.datatype, y.shape)]


# --------------------------------------------------------------------------- binary (broadcasting)


@RegisterGradient("AddV2")
def _add_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return _binary_grads(op, grad, grad)


RegisterGradient("Add")(_add_grad)


@RegisterGradient("Sub")
def _sub_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return _binary_grads(op, grad, ops.negative(grad))


@RegisterGradient("Mul")
def _mul_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, y = op.inputs
    gx = ops.multiply(grad, _conj(y))
    gy = ops.multiply(_conj(x), grad)
    return _binary_grads(op, gx, gy)


@RegisterGradient("RealDiv")
def _real_div_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, y = (_conj(t) for t in op.inputs)
    gx = _raw("RealDiv", [grad, y], _t(y), y.datatype, op.outputs[0].shape)
    minus_x_over_y = _raw("RealDiv", [ops.negative(x), y], _t(y), y.datatype)
    gy = ops.multiply(grad, _raw("RealDiv", [minus_x_over_y, y], _t(y), y.datatype))
    return _binary_grads(op, gx, gy)


@RegisterGradient("FloorMod")
def _floor_mod_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, y = op.inputs
    floor_xy = _raw("FloorDiv", [x, y], _t(x), x.datatype)
    return _binary_grads(op, grad, ops.multiply(grad, ops.negative(floor_xy)))


@RegisterGradient("Pow")
def _pow_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, y = op.inputs
    z = _conj(op.outputs[0])
    x, y = _conj(x), _conj(y)
    one = _same_type_constant(1.0, y)
    gx = ops.multiply(ops.multiply(grad, y), ops.pow(x, ops.subtract(y, one)))
    if x.datatype in COMPLEX_DATATYPES:
        log_x = ops.where(ops.not_equal(x, 0), ops.log(x), ops.zeros_like(x))
    else:
        mask = ops.greater(x, _same_type_constant(0.0, x))
        safe_x = ops.where(mask, x, ops.ones_like(x))
        log_x = ops.where(mask, ops.log(safe_x), ops.zeros_like(x))
    gy = ops.multiply(ops.multiply(grad, z), log_x)
    return _binary_grads(op, gx, gy)


def _maximum_minimum_grad(op: Operation, grad: Tensor, selector: Any) -> list[Gradient | None]:
    x, y = op.inputs
    x_mask = selector(x, y)
    zeros = ops.zeros_like(grad)
    gx = ops.where(x_mask, grad, zeros)
    gy = ops.where(x_mask, zeros, grad)
    return _binary_grads(op, gx, gy)


@RegisterGradient("Maximum")
def _maximum_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return _maximum_minimum_grad(op, grad, ops.greater_equal)


@RegisterGradient("Minimum")
def _minimum_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return _maximum_minimum_grad(op, grad, ops.less_equal)


@RegisterGradient("SelectV2")
def _select_v2_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    condition, x, y = op.inputs
    zeros = _raw("ZerosLike", [grad], _t(grad), grad.datatype, grad.shape)
    gx = ops.where(condition, grad, zeros)
    gy = ops.where(condition, zeros, grad)
    out = op.outputs[0]
    return [None, _reduce_to(gx, x, out), _reduce_to(gy, y, out)]


@RegisterGradient("MatMul")
def _matmul_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    a, b = (_conj(t) for t in op.inputs)
    t_a = bool(op.get_attr("transpose_a"))
    t_b = bool(op.get_attr("transpose_b"))

    def product(x: Tensor, y: Tensor, transpose_x: bool, transpose_y: bool, which: str) -> Tensor:
        result = ops.matmul(x, y, transpose_a=transpose_x, transpose_b=transpose_y)
        result.op._set_attr(which, AttrValue(b=True))
        return result

    if not t_a and not t_b:
        return [product(grad, b, False, True, "grad_a"), product(a, grad, True, False, "grad_b")]
    if not t_a and t_b:
        return [product(grad, b, False, False, "grad_a"), product(grad, a, True, False, "grad_b")]
    if t_a and not t_b:
        return [product(b, grad, False, True, "grad_a"), product(a, grad, False, False, "grad_b")]
    return [product(b, grad, True, True, "grad_a"), product(grad, a, True, True, "grad_b")]


@RegisterGradient("BiasAdd")
def _bias_add_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    data_format = op.get_attr("data_format")
    bias = op.inputs[1]
    attrs = {**_t(grad), "data_format": AttrValue(s=data_format or b"NHWC")}
    return [grad, _raw("BiasAddGrad", [grad], attrs, grad.datatype, bias.shape)]


# --------------------------------------------------------------------------- reductions


@RegisterGradient("Sum")
def _sum_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_broadcast_reduction_grad(op, grad), None]


def _broadcast_reduction_grad(op: Operation, grad: Tensor) -> Tensor:
    """`grad` (shaped like the reduction's output) spread back over the reduced input."""
    x, axes = op.inputs
    axis_values = ops._static_axes(axes)
    if x.shape is not None and axis_values is not None:
        rank = len(x.shape)
        reduced = {a % rank for a in axis_values} if rank else set()
        if reduced == set(range(rank)):
            grad = ops.reshape(grad, _int32([1] * rank))
            multiples = ops.constant(_int32(x.shape)) if _fully_defined(x.shape) else ops.shape(x)
            return ops.tile(grad, multiples)
        kept = _kept_dims(x, axes)
        if kept is not None:
            grad = ops.reshape(grad, _int32(kept))
            scaling = [d // k if k else 0 for d, k in zip(_dims(x.shape), kept, strict=True)]
            return ops.tile(grad, _int32(scaling))
    input_shape = ops.shape(x)
    if not op.get_attr("keep_dims"):
        grad = ops.reshape(grad, _reduced_shape(input_shape, axes))
    return _raw(
        "BroadcastTo",
        [grad, input_shape],
        {**_t(grad), "Tidx": ops._type_attr(input_shape.datatype)},
        grad.datatype,
        x.shape,
    )


@RegisterGradient("Mean")
def _mean_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    sum_grad = _broadcast_reduction_grad(op, grad)
    x, y = op.inputs[0], op.outputs[0]
    if _fully_defined(x.shape) and _fully_defined(y.shape):
        input_size = int(np.prod(_dims(x.shape)))
        output_size = int(np.prod(_dims(y.shape)))
        factor = ops.constant(np.array(input_size // max(output_size, 1), dtype=np.int32))
    else:
        input_size_t = ops.reduce_prod(ops.shape(x))
        output_size_t = ops.reduce_prod(ops.shape(y))
        factor = ops.floordiv(input_size_t, ops.maximum(output_size_t, 1))
    return [ops.truediv(sum_grad, ops.cast(factor, sum_grad.dtype)), None]


def _min_or_max_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, axes = op.inputs
    y = op.outputs[0]
    if not op.get_attr("keep_dims"):
        kept = _kept_dims(x, axes)
        kept_shape = ops.constant(_int32(kept)) if kept is not None else _reduced_shape(ops.shape(x), axes)
        y = ops.reshape(y, kept_shape)
        grad = ops.reshape(grad, kept_shape)
    else:
        kept_shape = ops.shape(y)
    indicators = ops.cast(ops.equal(y, x), grad.dtype)
    num_selected = ops.reshape(ops.reduce_sum(indicators, axes), kept_shape)
    return [ops.multiply(ops.truediv(indicators, num_selected), grad), None]


RegisterGradient("Max")(_min_or_max_grad)
RegisterGradient("Min")(_min_or_max_grad)


@RegisterGradient("Prod")
def _prod_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    # The product of all other elements: exclusive cumulative products from both sides
    # over the reduced axes (moved to the front and flattened), as TensorFlow computes it.
    x, axes = op.inputs
    graph = get_default_graph()
    input_shape = ops.shape(x)
    reduction_indices = ops.reshape(axes, [-1])
    if not op.get_attr("keep_dims"):
        grad = ops.reshape(grad, _reduced_shape(input_shape, axes))
    grad = _raw(
        "BroadcastTo",
        [grad, input_shape],
        {**_t(grad), "Tidx": ops._type_attr(input_shape.datatype)},
        grad.datatype,
        x.shape,
    )
    rank = ops.rank(x)
    reduction_indices = ops.floormod(ops.add(reduction_indices, rank), rank)
    reduced = ops.cast(reduction_indices, np.int32)
    indices = ops.range(0, rank)
    with name_scope(None, "ListDiff") as scope:
        other = graph.create_op(
            "ListDiff",
            [indices, reduced],
            [_DT.DT_INT32, _DT.DT_INT32],
            name=scope,
            attrs={"T": ops._type_attr(_DT.DT_INT32), "out_idx": ops._type_attr(_DT.DT_INT32)},
            shapes=[(None,), (None,)],
        ).outputs[0]
    perm = ops.concat([reduced, other], 0)
    reduced_count = ops.reduce_prod(ops.gather(input_shape, reduced))
    other_count = ops.reduce_prod(ops.gather(input_shape, other))
    permuted = ops.transpose(x, perm)
    permuted_shape = ops.shape(permuted)
    reshaped = ops.reshape(permuted, ops.stack([reduced_count, other_count]))

    def cumprod(reverse: bool) -> Tensor:
        attrs = {
            **_t(reshaped),
            "Tidx": ops._type_attr(_DT.DT_INT32),
            "exclusive": AttrValue(b=True),
            "reverse": AttrValue(b=reverse),
        }
        return _raw(
            "Cumprod", [reshaped, ops.constant(np.int32(0))], attrs, reshaped.datatype, reshaped.shape
        )

    left, right = cumprod(False), cumprod(True)
    y = ops.reshape(ops.multiply(_conj(left), _conj(right)), permuted_shape)
    inverse = _raw("InvertPermutation", [perm], _t(perm), perm.datatype, perm.shape)
    out = ops.multiply(grad, ops.transpose(y, inverse))
    return [ops.reshape(out, input_shape), None]


# --------------------------------------------------------------------------- shapes


def _reshape_to_input(op: Operation, grad: Tensor) -> Tensor:
    return ops.reshape(grad, ops.shape(op.inputs[0]))


@RegisterGradient("Reshape")
def _reshape_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_reshape_to_input(op, grad), None]


@RegisterGradient("ExpandDims")
def _expand_dims_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_reshape_to_input(op, grad), None]


@RegisterGradient("Squeeze")
def _squeeze_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_reshape_to_input(op, grad)]


@RegisterGradient("Transpose")
def _transpose_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    perm = op.inputs[1]
    inverse = _raw("InvertPermutation", [perm], _t(perm), perm.datatype, perm.shape)
    return [ops.transpose(grad, inverse), None]


@RegisterGradient("Tile")
def _tile_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, multiples = op.inputs
    input_shape = ops.shape(x, out_type=multiples.dtype)
    split_shape = ops.reshape(ops.transpose(ops.stack([multiples, input_shape])), [-1])
    axes = ops.range(0, ops.size(split_shape), 2)
    input_grad = ops.reduce_sum(ops.reshape(grad, split_shape), axes)
    input_grad.set_shape(x.shape)
    return [input_grad, None]


@RegisterGradient("Fill")
def _fill_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [None, ops.reduce_sum(grad)]


@RegisterGradient("ConcatV2")
def _concat_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    values, axis = list(op.inputs[:-1]), op.inputs[-1]
    axis_value = ops._static_value(axis)
    if axis_value is not None:
        axis = ops.constant(axis_value)  # TF duplicates a constant axis
    non_negative_axis = ops.floormod(axis, ops.rank(values[0]))
    sizes = [ops.shape(v) for v in values]
    with name_scope(None, "ConcatOffset") as scope:
        offsets = (
            get_default_graph()
            .create_op(
                "ConcatOffset",
                [non_negative_axis, *sizes],
                [_DT.DT_INT32] * len(sizes),
                name=scope,
                attrs={"N": AttrValue(i=len(sizes)), "shape_type": ops._type_attr(_DT.DT_INT32)},
                shapes=[s.shape for s in sizes],
            )
            .outputs
        )
    grads: list[Gradient | None] = []
    for value, begin, size in zip(values, offsets, sizes, strict=True):
        attrs = {**_t(grad), "Index": ops._type_attr(_DT.DT_INT32)}
        grads.append(_raw("Slice", [grad, begin, size], attrs, grad.datatype, value.shape))
    return [*grads, None]


@RegisterGradient("Pack")
def _pack_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    count = int(op.get_attr("N"))
    axis = int(op.get_attr("axis"))
    element_shape = op.inputs[0].shape
    with name_scope(None, "unstack") as scope:
        unpacked = (
            get_default_graph()
            .create_op(
                "Unpack",
                [grad],
                [grad.datatype] * count,
                name=scope,
                attrs={**_t(grad), "num": AttrValue(i=count), "axis": AttrValue(i=axis)},
                shapes=[element_shape] * count,
            )
            .outputs
        )
    return list(unpacked)


@RegisterGradient("StridedSlice")
def _strided_slice_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, begin, end, strides = op.inputs
    attrs = {
        **_t(grad),
        "Index": ops._type_attr(begin.datatype),
        **{
            key: AttrValue(i=int(op.get_attr(key)))
            for key in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")
        },
    }
    shape = ops.shape(x, out_type=begin.dtype)
    return [
        _raw("StridedSliceGrad", [shape, begin, end, strides, grad], attrs, grad.datatype, x.shape),
        None,
        None,
        None,
    ]


# --------------------------------------------------------------------------- gathers (sparse gradients)


@RegisterGradient("GatherV2")
def _gather_v2_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    params, indices, axis = op.inputs
    graph = get_default_graph()
    with graph.colocate_with(params.op):
        params_shape = ops.cast(ops.shape(params, out_type=np.int64), np.int32)
    axis_value = ops._static_int(axis)
    if int(op.get_attr("batch_dims")) != 0:
        raise LookupError(
            f"No gradient defined for GatherV2 '{op.name}' with batch_dims != 0 in distserver; "
            "gather with batch_dims=0."
        )
    indices_size = ops.expand_dims(ops.size(indices), 0)
    if axis_value == 0:
        values_shape = ops.concat([indices_size, params_shape[1:]], 0)
        values = ops.reshape(grad, values_shape)
        flat_indices = _flat(indices, indices_size)
        return [IndexedSlices(values, flat_indices, params_shape), None, None]
    # Another axis: move it to the front, sum the rows by index, move it back.
    outer_shape = params_shape[:axis]
    outer_dims = ops.size(outer_shape)
    inner_shape = params_shape[axis:][1:]
    inner_dims = ops.size(inner_shape)
    outer_axes = ops.range(outer_dims)
    inner_axes = ops.range(outer_dims + 1, outer_dims + 1 + inner_dims)
    values_shape = ops.concat([outer_shape, indices_size, inner_shape], 0)
    values = ops.reshape(grad, values_shape)
    flat_indices = ops.reshape(indices, indices_size)
    transpose_dims = ops.concat([ops.expand_dims(outer_dims, 0), outer_axes, inner_axes], 0)
    values_transposed = ops.transpose(values, transpose_dims)
    num_segments = ops.gather(params_shape, axis)
    summed = unsorted_segment_sum(values_transposed, flat_indices, num_segments)
    invert = ops.concat([ops.range(1, outer_dims + 1), ops.expand_dims(0, 0), inner_axes], 0)
    params_grad = ops.transpose(summed, invert)
    params_grad.set_shape(params.shape)
    return [params_grad, None, None]


@RegisterGradient("ResourceGather")
def _resource_gather_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    indices = op.inputs[1]
    shape = _variable_shape(op)
    size = ops.expand_dims(ops.size(indices), 0)
    values_shape = ops.concat([size, shape[1:]], 0)
    values = ops.reshape(grad, values_shape)
    flat_indices = _flat(indices, size)
    return [IndexedSlices(values, flat_indices, shape), None]


def _flat(indices: Tensor, size: Tensor) -> Tensor:
    flat = ops.reshape(indices, size)
    if _fully_defined(indices.shape):
        flat.set_shape((int(np.prod(_dims(indices.shape))),))
    return flat


def _variable_shape(op: Operation) -> Tensor:
    # The shape of the variable `op` reads: a constant when the variable's is static.
    declared = op.inputs[0].op.get_attr("shape") if op.inputs[0].op.type == "VarHandleOp" else None
    if _fully_defined(declared):
        return ops.constant(_int32(declared))
    read = get_default_graph().create_op(
        "ReadVariableOp", [op.inputs[0]], [op.get_attr("dtype")], attrs={"dtype": op.node_def.attr["dtype"]}
    )
    return ops.shape(read.outputs[0])


# --------------------------------------------------------------------------- neural networks


@RegisterGradient("Softmax")
def _softmax_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    y = op.outputs[0]
    sum_channels = ops.reduce_sum(ops.multiply(grad, y), -1, keepdims=True)
    return [ops.multiply(ops.subtract(grad, sum_channels), y)]


@RegisterGradient("LogSoftmax")
def _log_softmax_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    softmax = ops.exp(op.outputs[0])
    return [ops.subtract(grad, ops.multiply(ops.reduce_sum(grad, -1, keepdims=True), softmax))]


def _broadcast_mul(vector: Tensor, matrix: Tensor) -> Tensor:
    """A [batch] vector times a [batch, classes] matrix, row by row (TF's _BroadcastMul)."""
    return ops.multiply(ops.expand_dims(vector, -1), matrix)


def _is_zero(grad: Tensor | None) -> bool:
    if grad is None:
        return True
    if grad.op.type in ("ZerosLike", "Zeros"):
        return True
    value = ops._static_value(grad)
    return value is not None and not np.any(value)


@RegisterGradient("SoftmaxCrossEntropyWithLogits")
def _softmax_cross_entropy_grad(
    op: Operation, grad_loss: Tensor, grad_backprop: Tensor | None
) -> list[Gradient | None]:
    backprop = op.outputs[1]
    grad = _broadcast_mul(grad_loss, backprop)
    logits = op.inputs[0]
    if not _is_zero(grad_backprop):
        # The second-order term (TF writes the row sums as a batched matmul).
        softmax = ops.softmax(logits)
        grad_backprop = typing.cast(Tensor, grad_backprop)
        product = ops.reduce_sum(ops.multiply(grad_backprop, softmax), 1, keepdims=True)
        grad = ops.add(grad, ops.multiply(ops.subtract(grad_backprop, product), softmax))
    log_softmax = _raw("LogSoftmax", [logits], _t(logits), logits.datatype, logits.shape)
    return [grad, _broadcast_mul(grad_loss, ops.negative(log_softmax))]


@RegisterGradient("SparseSoftmaxCrossEntropyWithLogits")
def _sparse_softmax_cross_entropy_grad(
    op: Operation, grad_loss: Tensor, grad_backprop: Tensor | None
) -> list[Gradient | None]:
    return [_broadcast_mul(grad_loss, op.outputs[1]), None]


# --------------------------------------------------------------------------- other kernels we ship
# Ops the graph API has no constructor for, which GraphDefs built elsewhere hold.


def _grad_op(op_type: str, grad: Tensor, x: Tensor, **attrs: AttrValue) -> Tensor:
    return _raw(op_type, [grad, x], {**_t(x), **attrs}, x.datatype, x.shape)


@RegisterGradient("Relu6")
def _relu6_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_grad_op("Relu6Grad", grad, op.inputs[0])]


@RegisterGradient("Elu")
def _elu_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_grad_op("EluGrad", grad, op.outputs[0])]


@RegisterGradient("Selu")
def _selu_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_grad_op("SeluGrad", grad, op.outputs[0])]


@RegisterGradient("Softplus")
def _softplus_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_grad_op("SoftplusGrad", grad, op.inputs[0])]


@RegisterGradient("Softsign")
def _softsign_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_grad_op("SoftsignGrad", grad, op.inputs[0])]


@RegisterGradient("LeakyRelu")
def _leaky_relu_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    alpha = AttrValue(f=float(op.get_attr("alpha")))
    return [_grad_op("LeakyReluGrad", grad, op.inputs[0], alpha=alpha)]


@RegisterGradient("L2Loss")
def _l2_loss_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [ops.multiply(op.inputs[0], grad)]


@RegisterGradient("Log1p")
def _log1p_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x = op.inputs[0]
    with get_default_graph().control_dependencies([grad]):
        x = _conj(x)
        one_plus_x = ops.add(_same_type_constant(1.0, x), x)
        return [ops.multiply(grad, _raw("Reciprocal", [one_plus_x], _t(x), x.datatype, x.shape))]


@RegisterGradient("Expm1")
def _expm1_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x = op.inputs[0]
    with get_default_graph().control_dependencies([grad]):
        return [ops.multiply(grad, ops.exp(_conj(x)))]


@RegisterGradient("SquaredDifference")
def _squared_difference_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, y = op.inputs
    with get_default_graph().control_dependencies([grad]):
        x_grad = ops.multiply(ops.multiply(_same_type_constant(2.0, grad), grad), ops.subtract(x, y))
    return _binary_grads(op, x_grad, ops.negative(x_grad))


@RegisterGradient("Div")
def _div_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    if op.inputs[0].datatype not in FLOAT_DATATYPES | COMPLEX_DATATYPES:
        return [None, None]  # integer division
    return list(_real_div_grad(op, grad))


def _no_nan_grads(op: Operation, grad: Tensor, op_type: str) -> tuple[Tensor, Tensor]:
    x, y = op.inputs
    if op_type == "MulNoNan":
        return (
            _raw("MulNoNan", [grad, y], _t(y), y.datatype),
            _raw("MulNoNan", [x, grad], _t(x), x.datatype),
        )
    minus_x_over_y = _raw("DivNoNan", [ops.negative(x), y], _t(y), y.datatype)
    return (
        _raw("DivNoNan", [grad, y], _t(y), y.datatype),
        ops.multiply(grad, _raw("DivNoNan", [minus_x_over_y, y], _t(y), y.datatype)),
    )


@RegisterGradient("DivNoNan")
def _div_no_nan_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return _binary_grads(op, *_no_nan_grads(op, grad, "DivNoNan"))


@RegisterGradient("MulNoNan")
def _mul_no_nan_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return _binary_grads(op, *_no_nan_grads(op, grad, "MulNoNan"))


@RegisterGradient("BiasAddV1")
def _bias_add_v1_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    axes = ops.range(ops.subtract(ops.rank(grad), 1))
    return [grad, ops.reduce_sum(grad, axes)]


@RegisterGradient("IdentityN", takes_indexed_slices=True)
def _identity_n_grad(op: Operation, *grads: Gradient) -> list[Gradient | None]:
    return list(grads)


@RegisterGradient("Unpack")
def _unpack_grad(op: Operation, *grads: Tensor) -> list[Gradient | None]:
    return [ops.stack(list(grads), axis=int(op.get_attr("axis")))]


@RegisterGradient("Split")
def _split_grad(op: Operation, *grads: Tensor) -> list[Gradient | None]:
    return [None, ops.concat(list(grads), op.inputs[0])]


@RegisterGradient("SplitV")
def _split_v_grad(op: Operation, *grads: Tensor) -> list[Gradient | None]:
    return [ops.concat(list(grads), op.inputs[2]), None, None]


@RegisterGradient("Slice")
def _slice_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, begin = op.inputs[0], op.inputs[1]
    index_dtype = begin.dtype
    rank = ops.rank(x)
    slice_size = ops.shape(op.outputs[0], out_type=index_dtype)
    shape = ops.stack([ops.cast(rank, index_dtype), ops.constant(np.array(1, dtype=index_dtype))])
    before = ops.reshape(begin, shape)
    after = ops.reshape(
        ops.subtract(ops.subtract(ops.shape(x, out_type=index_dtype), slice_size), begin), shape
    )
    paddings = ops.concat([before, after], 1)
    attrs = {**_t(grad), "Tpaddings": ops._type_attr(paddings.datatype)}
    return [_raw("Pad", [grad, paddings], attrs, grad.datatype, x.shape), None, None]


def _pad_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, paddings = op.inputs[0], op.inputs[1]
    before = _raw(
        "Slice",
        [paddings, ops.constant(np.zeros(2, np.int32)), ops.stack([ops.rank(x), 1])],
        {**_t(paddings), "Index": ops._type_attr(_DT.DT_INT32)},
        paddings.datatype,
    )
    begin = ops.reshape(before, [-1])
    sizes = ops.shape(x, out_type=begin.dtype)
    attrs = {**_t(grad), "Index": ops._type_attr(begin.datatype)}
    x_grad = _raw("Slice", [grad, begin, sizes], attrs, grad.datatype, x.shape)
    rest: list[Gradient | None] = [None] * (len(op.inputs) - 1)
    return [x_grad, *rest]


RegisterGradient("Pad")(_pad_grad)
RegisterGradient("PadV2")(_pad_grad)


@RegisterGradient("ReverseV2")
def _reverse_v2_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    axis = op.inputs[1]
    attrs = {**_t(grad), "Tidx": ops._type_attr(axis.datatype)}
    return [_raw("ReverseV2", [grad, axis], attrs, grad.datatype, grad.shape), None]


@RegisterGradient("BroadcastTo")
def _broadcast_to_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, shape = op.inputs
    x_shape = ops.shape(x, out_type=shape.dtype)
    reduction_axes = _broadcast_gradient_args(shape, x_shape)[1]
    summed = ops.reduce_sum(grad, reduction_axes, keepdims=True)
    return [ops.reshape(summed, x_shape), None]


@RegisterGradient("Cumsum")
def _cumsum_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    axis = op.inputs[1]
    attrs = {
        **_t(grad),
        "Tidx": ops._type_attr(axis.datatype),
        "exclusive": AttrValue(b=_flag(op, "exclusive")),
        "reverse": AttrValue(b=not _flag(op, "reverse")),
    }
    return [_raw("Cumsum", [grad, axis], attrs, grad.datatype, grad.shape), None]


@RegisterGradient("Select")
def _select_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    condition, x = op.inputs[0], op.inputs[1]
    zeros = ops.zeros_like(x)
    return [
        None,
        _raw("Select", [condition, grad, zeros], _t(grad), grad.datatype, x.shape),
        _raw("Select", [condition, zeros, grad], _t(grad), grad.datatype, x.shape),
    ]


@RegisterGradient("Gather")
def _gather_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    params, indices = op.inputs
    with get_default_graph().colocate_with(params.op):
        params_shape = ops.cast(ops.shape(params, out_type=np.int64), np.int32)
    size = ops.expand_dims(ops.size(indices), 0)
    values = ops.reshape(grad, ops.concat([size, params_shape[1:]], 0))
    return [IndexedSlices(values, _flat(indices, size), params_shape), None]


def _gather_drop_negatives(
    params: Tensor, ids: Tensor, clipped: Tensor | None = None, is_positive: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Rows `ids` of `params`, zeros for negative ids (rows a segment op dropped).

    Returns the rows, the ids clipped at 0 and the mask of valid ids (broadcastable
    to the rows), so a second call can reuse the last two, as TF's helper does.
    """
    if clipped is None:
        clipped = ops.maximum(ids, ops.zeros_like(ids))
    gathered = ops.gather(params, clipped)
    if is_positive is None:
        is_positive = ops.greater_equal(ids, ops.constant(np.array(0, dtype=ids.dtype)))
        positive_shape = ops.shape(is_positive)
        extra_rank = ops.reshape(ops.subtract(ops.rank(gathered), ops.rank(is_positive)), [-1])
        extra_ones = ops.ones(extra_rank, dtype=positive_shape.dtype)
        is_positive = ops.reshape(is_positive, ops.concat([positive_shape, extra_ones], 0))
        is_positive = ops.logical_and(is_positive, ops.ones_like(is_positive))
    return ops.where(is_positive, gathered, ops.zeros_like(gathered)), clipped, is_positive


@RegisterGradient("UnsortedSegmentSum")
def _unsorted_segment_sum_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    return [_gather_drop_negatives(grad, op.inputs[1])[0], None, None]


def _unsorted_segment_min_or_max_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    # The gradient goes to the elements equal to their segment's result, shared equally.
    data, ids, num_segments = op.inputs
    gathered_outputs, clipped, is_positive = _gather_drop_negatives(op.outputs[0], ids)
    is_selected = ops.logical_and(ops.equal(data, gathered_outputs), is_positive)
    num_selected = unsorted_segment_sum(ops.cast(is_selected, grad.dtype), ids, num_segments)
    weighted = ops.truediv(grad, num_selected)
    gathered_grads = _gather_drop_negatives(weighted, ids, clipped, is_positive)[0]
    return [ops.where(is_selected, gathered_grads, ops.zeros_like(gathered_grads)), None, None]


RegisterGradient("UnsortedSegmentMax")(_unsorted_segment_min_or_max_grad)
RegisterGradient("UnsortedSegmentMin")(_unsorted_segment_min_or_max_grad)


@RegisterGradient("UnsortedSegmentProd")
def _unsorted_segment_prod_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    # d(prod)/d(x) = prod / x, or the product of the other elements where x is 0;
    # zero when a segment holds two zeros or more.
    data, ids, num_segments = op.inputs
    is_zero = ops.equal(data, _same_type_constant(0.0, data))
    num_zeros = unsorted_segment_sum(ops.cast(is_zero, np.int32), ids, num_segments)
    grad = ops.where(ops.greater(num_zeros, 1), ops.zeros_like(grad), grad)
    non_zero_data = ops.where(is_zero, ops.ones_like(data), data)
    attrs = {
        **_t(data),
        "Tindices": ops._type_attr(ids.datatype),
        "Tnumsegments": ops._type_attr(num_segments.datatype),
    }
    non_zero_prod = _raw("UnsortedSegmentProd", [non_zero_data, ids, num_segments], attrs, data.datatype)
    clipped = ops.maximum(ids, ops.zeros_like(ids))
    gathered_prod = ops.gather(op.outputs[0], clipped)
    gathered_non_zero_prod = ops.gather(non_zero_prod, clipped)
    prod_divided_by_element = ops.truediv(gathered_prod, data)
    partial = ops.where(is_zero, gathered_non_zero_prod, prod_divided_by_element)
    gathered_grad = _gather_drop_negatives(grad, ids, clipped)[0]
    return [ops.multiply(gathered_grad, partial), None, None]


@RegisterGradient("TopKV2")
def _top_k_grad(op: Operation, grad: Tensor, unused_indices_grad: Tensor | None) -> list[Gradient | None]:
    # Scatter the gradients of the k values back to their positions (ScatterNd over
    # the flattened input, as TF does).
    x, indices = op.inputs[0], op.outputs[1]
    in_shape = ops.shape(x)
    indices_shape = ops.shape(indices)
    indices_last = ops.gather(ops.cast(indices_shape, np.int64), ops.subtract(ops.size(indices_shape), 1))
    indices_2d = ops.reshape(indices, ops.stack([ops.constant(np.int64(-1)), indices_last]))
    in_last = ops.gather(ops.cast(in_shape, np.int64), ops.subtract(ops.size(in_shape), 1))
    outer = ops.shape(indices_2d)[0]
    offsets = ops.range(ops.constant(np.int64(0)), ops.multiply(ops.cast(outer, np.int64), in_last), in_last)
    flat = ops.reshape(ops.add(indices_2d, ops.cast(ops.expand_dims(offsets, -1), np.int32)), [-1])
    total = ops.reshape(ops.reduce_prod(in_shape), [1])
    scattered = _raw(
        "ScatterNd",
        [ops.expand_dims(flat, -1), ops.reshape(grad, [-1]), total],
        {**_t(grad), "Tindices": ops._type_attr(_DT.DT_INT32)},
        grad.datatype,
    )
    return [ops.reshape(scattered, in_shape), ops.zeros([], np.int32)]


@RegisterGradient("Cumprod")
def _cumprod_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, axis = op.inputs
    exclusive, reverse = _flag(op, "exclusive"), _flag(op, "reverse")

    def running(op_type: str, value: Tensor, backwards: bool) -> Tensor:
        attrs = {
            **_t(value),
            "Tidx": ops._type_attr(axis.datatype),
            "exclusive": AttrValue(b=exclusive),
            "reverse": AttrValue(b=backwards),
        }
        return _raw(op_type, [value, axis], attrs, value.datatype, value.shape)

    prod = running("Cumprod", x, reverse)
    out = running("Cumsum", ops.multiply(prod, grad), not reverse)
    return [_raw("DivNoNan", [out, x], _t(x), x.datatype, x.shape), None]


def _dynamic_stitch_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    count = len(op.inputs) // 2
    indices = [ops.cast(t, np.int32) for t in op.inputs[:count]]
    values: list[Gradient | None] = [ops.gather(grad, index) for index in indices]
    return [*([None] * count), *values]


RegisterGradient("DynamicStitch")(_dynamic_stitch_grad)
RegisterGradient("ParallelDynamicStitch")(_dynamic_stitch_grad)


@RegisterGradient("DynamicPartition")
def _dynamic_partition_grad(op: Operation, *grads: Tensor) -> list[Gradient | None]:
    data, partitions = op.inputs
    count = int(op.get_attr("num_partitions"))
    graph = get_default_graph()
    prefix_shape = ops.shape(partitions)
    original = ops.reshape(ops.range(ops.reduce_prod(prefix_shape)), prefix_shape)
    with name_scope(None, "DynamicPartition") as scope:
        positions = graph.create_op(
            "DynamicPartition",
            [original, partitions],
            [_DT.DT_INT32] * count,
            name=scope,
            attrs={**_t(original), "num_partitions": AttrValue(i=count)},
            shapes=[(None,)] * count,
        ).outputs
    with name_scope(None, "ParallelDynamicStitch") as scope:
        stitched = graph.create_op(
            "ParallelDynamicStitch",
            [*positions, *grads],
            [grads[0].datatype],
            name=scope,
            attrs={**_t(grads[0]), "N": AttrValue(i=count)},
        ).outputs[0]
    return [ops.reshape(stitched, ops.shape(data)), None]


@RegisterGradient("MirrorPad")
def _mirror_pad_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, paddings = op.inputs
    attrs = {**_t(grad), "Tpaddings": ops._type_attr(paddings.datatype), "mode": op.node_def.attr["mode"]}
    return [_raw("MirrorPadGrad", [grad, paddings], attrs, grad.datatype, x.shape), None]


def _copied_attrs(op: Operation, names: tuple[str, ...]) -> dict[str, AttrValue]:
    node = op.node_def
    return {name: node.attr[name] for name in names if name in node.attr}


_CONV_ATTRS = ("T", "strides", "padding", "explicit_paddings", "use_cudnn_on_gpu", "data_format", "dilations")
_POOL_ATTRS = ("T", "ksize", "strides", "padding", "explicit_paddings", "data_format")


@RegisterGradient("Conv2D")
def _conv2d_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x, kernel = op.inputs
    with name_scope(None, "ShapeN") as scope:
        shapes = (
            get_default_graph()
            .create_op(
                "ShapeN",
                [x, kernel],
                [_DT.DT_INT32, _DT.DT_INT32],
                name=scope,
                attrs={"N": AttrValue(i=2), **_t(x), "out_type": ops._type_attr(_DT.DT_INT32)},
                shapes=[(4,), (4,)],
            )
            .outputs
        )
    attrs = _copied_attrs(op, _CONV_ATTRS)
    return [
        _raw("Conv2DBackpropInput", [shapes[0], kernel, grad], attrs, grad.datatype, x.shape),
        _raw("Conv2DBackpropFilter", [x, shapes[1], grad], attrs, grad.datatype, kernel.shape),
    ]


@RegisterGradient("MaxPool")
def _max_pool_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x = op.inputs[0]
    attrs = _copied_attrs(op, _POOL_ATTRS)
    return [_raw("MaxPoolGrad", [x, op.outputs[0], grad], attrs, grad.datatype, x.shape)]


@RegisterGradient("AvgPool")
def _avg_pool_grad(op: Operation, grad: Tensor) -> list[Gradient | None]:
    x = op.inputs[0]
    attrs = _copied_attrs(op, _POOL_ATTRS)
    attrs.pop("explicit_paddings", None)  # AvgPoolGrad has none
    return [_raw("AvgPoolGrad", [ops.shape(x), grad], attrs, grad.datatype, x.shape)]


__all__: list[str] = ["to_dense"]
