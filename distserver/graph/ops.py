"""Op constructors with TensorFlow's names, op types and attrs (as `tf.compat.v1` builds them).

Each constructor checks its arguments, infers the static dtype and shape of its
outputs, and adds nodes to the graph of its tensor arguments (else the default
graph). Nodes are named as TensorFlow names them, so our GraphDefs read like
TensorFlow's: the op is named after its scope (``Add``, ``add_1``, ``outer/MatMul``),
Python and numpy arguments become ``Const`` nodes named after the argument inside
that scope (``add/y``, ``Sum/reduction_indices``), and TensorFlow's graph-time
foldings are kept (``shape`` of a fully known shape is a ``Const``, small ``zeros``
are a ``Const``, bigger ones a ``Fill``).

Conversions: Python numbers and numpy arrays take the dtype of the tensor operands of
the same op (``x + 1`` with a float32 `x` adds a float32 1; ``1.5`` to an int32
operand raises `TypeError`); lists holding tensors are packed (``Pack``). Tensors of
different dtypes raise `TypeError` naming both dtypes and the op, incompatible static
shapes raise `ValueError` naming the node, as TensorFlow does at graph-build time.

Deliberate differences from TensorFlow: a Python value given for the first operand
of a binary op function takes the dtype of a tensor second operand (``add(1, x)``;
TensorFlow converts 1 to int32 and fails); `select` builds SelectV2 like `where`;
`matmul` supports rank-2 operands only (TensorFlow switches to BatchMatMulV3);
`softmax` only over the last axis; constants built from a scalar and a shape store
every element (TensorFlow stores the scalar once).
"""

from __future__ import annotations

import builtins
import math
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from distserver import tensors
from distserver.graph.graph import (
    Operation,
    Shape,
    Tensor,
    _merge_shapes,
    _TensorLike,
    as_datatype,
    as_shape,
    dtype_name,
    get_default_graph,
    name_scope,
    register_operator_builders,
    shape_text,
)
from distserver.protos import types_pb2
from distserver.protos.attr_value_pb2 import AttrValue

__all__ = [
    "abs",
    "add",
    "add_n",
    "argmax",
    "argmin",
    "bias_add",
    "binary_operator",
    "cast",
    "concat",
    "constant",
    "convert_to_tensor",
    "divide",
    "dynamic_partition",
    "dynamic_stitch",
    "embedding_lookup",
    "equal",
    "exp",
    "expand_dims",
    "fill",
    "floordiv",
    "floormod",
    "gather",
    "greater",
    "greater_equal",
    "group",
    "identity",
    "less",
    "less_equal",
    "log",
    "log1p",
    "log_softmax",
    "logical_and",
    "logical_not",
    "logical_or",
    "matmul",
    "maximum",
    "minimum",
    "multiply",
    "negative",
    "no_op",
    "not_equal",
    "one_hot",
    "ones",
    "ones_like",
    "placeholder",
    "placeholder_with_default",
    "pow",
    "random_uniform",
    "range",
    "rank",
    "reduce_all",
    "reduce_any",
    "reduce_max",
    "reduce_mean",
    "reduce_min",
    "reduce_prod",
    "reduce_sum",
    "relu",
    "reshape",
    "select",
    "shape",
    "sigmoid",
    "sigmoid_cross_entropy_with_logits",
    "size",
    "slice_helper",
    "softmax",
    "softmax_cross_entropy_with_logits",
    "sparse_softmax_cross_entropy_with_logits",
    "sqrt",
    "square",
    "squeeze",
    "stack",
    "stop_gradient",
    "strided_slice",
    "subtract",
    "tanh",
    "tile",
    "transpose",
    "truediv",
    "where",
    "zeros",
    "zeros_like",
]

_DT = types_pb2
_FLOATS: Final = tensors.FLOAT_DATATYPES
_COMPLEX: Final = tensors.COMPLEX_DATATYPES
_INTS: Final = tensors.INTEGER_DATATYPES
_REAL: Final = _FLOATS | _INTS
_NUMBERS: Final = _REAL | _COMPLEX
_INEXACT: Final = _FLOATS | _COMPLEX
_BOOL: Final = tensors.BOOL_DATATYPES
_INDEX: Final = tensors.INDEX_DATATYPES
_ANY: Final[frozenset[int] | None] = None

# tf.math.truediv casts integer operands to a float type first (None: divide as is).
_TRUEDIV_TYPES: Final[dict[int, int | None]] = {
    _DT.DT_UINT8: _DT.DT_FLOAT,
    _DT.DT_INT8: _DT.DT_FLOAT,
    _DT.DT_UINT16: _DT.DT_FLOAT,
    _DT.DT_INT16: _DT.DT_FLOAT,
    _DT.DT_UINT32: _DT.DT_DOUBLE,
    _DT.DT_UINT64: _DT.DT_DOUBLE,
    _DT.DT_INT32: _DT.DT_DOUBLE,
    _DT.DT_INT64: _DT.DT_DOUBLE,
    **dict.fromkeys(_INEXACT),
}
# tf.range casts its arguments to the "widest" of their dtypes, in this order.
_RANGE_ORDER: Final = (_DT.DT_INT32, _DT.DT_INT64, _DT.DT_HALF, _DT.DT_BFLOAT16, _DT.DT_FLOAT, _DT.DT_DOUBLE)
# zeros() and friends build a Const below this many elements, else a Fill.
_MAX_CONSTANT_FILL: Final = 1000


# --------------------------------------------------------------------------- helpers


def _type_attr(datatype: int) -> AttrValue:
    return AttrValue(type=typing.cast(types_pb2.DataType, datatype))


def _datatype_of(value: Any) -> int | None:
    # The dtype of a tensor or variable operand; None for Python/numpy values.
    if isinstance(value, _TensorLike):
        return value.datatype
    return None


def _contains_tensor(value: Any) -> bool:
    if isinstance(value, _TensorLike):
        return True
    return isinstance(value, list | tuple) and builtins.any(_contains_tensor(v) for v in value)


def _first_datatype(value: Any) -> int | None:
    datatype = _datatype_of(value)
    if datatype is None and isinstance(value, list | tuple):
        for item in value:
            datatype = _first_datatype(item)
            if datatype is not None:
                break
    return datatype


def _allowed_text(allowed: Iterable[int]) -> str:
    return ", ".join(sorted(dtype_name(d) for d in allowed))


def _check_allowed(arg: str, tensor: Tensor, allowed: frozenset[int] | None) -> None:
    if allowed is not None and tensor.datatype not in allowed:
        raise TypeError(
            f"Value passed to parameter '{arg}' has DataType {dtype_name(tensor.datatype)} not in list "
            f"of allowed values: {_allowed_text(allowed)}"
        )


def _convert_inputs(
    op_type: str,
    args: Sequence[tuple[str, Any]],
    *,
    default_dtype: Any = None,
    allowed: frozenset[int] | None = _ANY,
) -> list[Tensor]:
    """Convert the inputs of `op_type` that share one type attr, in order.

    Python/numpy values take the dtype of the first tensor among `args` (else
    `default_dtype`, else their own) and become Consts named after their argument.
    """
    target = next((d for _, v in args if (d := _datatype_of(v)) is not None), None)
    if target is None and default_dtype is not None:
        target = as_datatype(default_dtype)
    converted = [
        convert_to_tensor(value, dtype=target if _datatype_of(value) is None else None, name=arg)
        for arg, value in args
    ]
    first_arg, first = args[0][0], converted[0]
    for (arg, _), tensor in zip(args[1:], converted[1:], strict=True):
        if tensor.datatype != first.datatype:
            raise TypeError(
                f"Input '{arg}' of '{op_type}' Op has type {dtype_name(tensor.datatype)} that does not "
                f"match type {dtype_name(first.datatype)} of argument '{first_arg}'."
            )
    _check_allowed(first_arg, first, allowed)
    return converted


def _convert_list(
    op_type: str, arg: str, values: Sequence[Any], allowed: frozenset[int] | None = _ANY
) -> list[Tensor]:
    """Convert a list input (``N`` tensors of one type ``T``), as ConcatV2/Pack/AddN take."""
    target = _first_datatype(list(values))
    converted = [
        convert_to_tensor(v, dtype=target if _datatype_of(v) is None else None, name=f"{arg}_{i}")
        for i, v in enumerate(values)
    ]
    types = [t.datatype for t in converted]
    if len(set(types)) > 1:
        raise TypeError(
            f"Tensors in list passed to '{arg}' of '{op_type}' Op have types "
            f"[{', '.join(dtype_name(t) for t in types)}] that don't all match."
        )
    _check_allowed(arg, converted[0], allowed)
    return converted


def _make(
    scope: str,
    op_type: str,
    inputs: Sequence[Tensor],
    attrs: dict[str, AttrValue],
    datatype: int,
    shape: Shape,
) -> Tensor:
    """Create a one-output op named exactly after `scope` (as TensorFlow's gen ops do)."""
    op = get_default_graph().create_op(op_type, inputs, [datatype], name=scope, attrs=attrs, shapes=[shape])
    return op.outputs[0]


def _shape_error(scope: str, op_type: str, detail: str, shapes: Iterable[Shape]) -> ValueError:
    node = scope.rstrip("/")
    shapes_text = ", ".join(shape_text(s) for s in shapes)
    return ValueError(f"{detail} for '{{{{node {node}}}}} = {op_type}' with input shapes: {shapes_text}.")


def _fully_defined(shape: Shape) -> bool:
    return shape is not None and None not in shape


def _known_dims(shape: Shape) -> tuple[int, ...]:
    return tuple(typing.cast(int, d) for d in typing.cast(tuple[int | None, ...], shape))


def _rank(shape: Shape) -> int | None:
    return None if shape is None else len(shape)


def _static_value(tensor: Tensor) -> NDArray[Any] | None:
    """The value of a Const (or a Cast of one), else None: TensorFlow's `constant_value`, in short."""
    op = tensor.op
    if op.type == "Cast":
        source = _static_value(op.inputs[0])
        return None if source is None else source.astype(tensor.dtype)
    if op.type != "Const":
        return None
    if op._static_value is None:
        op._static_value = tensors.from_tensor_proto(op._node_def.attr["value"].tensor)
    return op._static_value


def _static_ints(tensor: Tensor) -> list[int | None] | None:
    """The elements of a 1-D int tensor as far as they are known statically.

    Consts give all values; a Pack of scalars gives the Const ones (None for others);
    any other vector of known length gives Nones. None when even the length is unknown.
    """
    value = _static_value(tensor)
    if value is not None:
        return [int(v) for v in value.reshape(-1)]
    if tensor.op.type == "Pack" and builtins.all(t.shape == () for t in tensor.op.inputs):
        items: list[int | None] = []
        for item in tensor.op.inputs:
            item_value = _static_value(item)
            items.append(None if item_value is None else int(item_value))
        return items
    if tensor.shape is not None and len(tensor.shape) == 1 and tensor.shape[0] is not None:
        return [None] * tensor.shape[0]
    return None


def _static_int(tensor: Tensor) -> int | None:
    value = _static_value(tensor)
    return None if value is None or value.size != 1 else int(value.reshape(()))


def _static_axes(tensor: Tensor) -> list[int] | None:
    value = _static_value(tensor)
    return None if value is None else [int(v) for v in value.reshape(-1)]


def _shape_of_dims(dims: list[int | None] | None) -> Shape:
    # A shape given as a (partially known) 1-D tensor value.
    if dims is None:
        return None
    return tuple(None if d is None or d < 0 else d for d in dims)


def _normalize_axis(axis: int, rank: int, scope: str, op_type: str, shapes: Iterable[Shape]) -> int:
    if not -rank <= axis < rank:
        raise _shape_error(
            scope,
            op_type,
            f"Invalid axis {axis}: expected a value in [{-rank}, {rank})",
            shapes,
        )
    return axis % rank


def _broadcast(scope: str, op_type: str, *shapes: Shape) -> Shape:
    """The broadcast shape of `shapes`, as TensorFlow's shape functions compute it."""
    result: Shape = ()
    for shape in shapes:
        if result is None or shape is None:
            result = None
            continue
        rank = builtins.max(len(result), len(shape))
        a = (1,) * (rank - len(result)) + result
        b = (1,) * (rank - len(shape)) + shape
        dims: list[int | None] = []
        for x, y in zip(a, b, strict=True):
            if x == 1:
                dims.append(y)
            elif y == 1 or y is None:
                dims.append(x)
            elif x is None or x == y:
                dims.append(y)
            else:
                raise _shape_error(scope, op_type, f"Dimensions must be equal, but are {x} and {y}", shapes)
        result = tuple(dims)
    return result


def _merge_all(scope: str, op_type: str, shapes: Sequence[Shape]) -> Shape:
    merged: Shape = None
    for shape in shapes:
        try:
            merged = _merge_shapes(merged, shape)
        except ValueError as exc:
            raise _shape_error(scope, op_type, f"Shapes must be equal, but {exc}", shapes) from None
    return merged


def _check_rank(scope: str, op_type: str, tensor: Tensor, rank: int, shapes: Iterable[Shape]) -> None:
    if tensor.shape is not None and len(tensor.shape) != rank:
        raise _shape_error(
            scope, op_type, f"Shape must be rank {rank} but is rank {len(tensor.shape)}", shapes
        )


# --------------------------------------------------------------------------- conversion and constants


def convert_to_tensor(
    value: Any, dtype: Any = None, name: str | None = None, dtype_hint: Any = None
) -> Tensor:
    """Return `value` as a tensor, adding a Const (or a Pack) when needed.

    Args:
        value: A `Tensor` (returned as is), a `Variable` (read), a Python or numpy
            value (a ``Const``), or a (nested) list mixing tensors and values (packed
            with ``Pack``).
        dtype: The required dtype.
        name: Name for new nodes (default ``"Const"``, ``"packed"`` for lists).
        dtype_hint: A dtype to try for Python values when `dtype` is not given.

    Raises:
        ValueError: When a tensor has another dtype than `dtype`.
        TypeError: When `value` cannot become a tensor (of `dtype`).
    """
    datatype = None if dtype is None else as_datatype(dtype)
    if isinstance(value, Tensor):
        if datatype is not None and value.datatype != datatype:
            raise ValueError(
                f"Tensor conversion requested dtype {dtype_name(datatype)} for Tensor with dtype "
                f"{dtype_name(value.datatype)}: {value!r}"
            )
        return value
    if isinstance(value, _TensorLike):
        return value._as_tensor(datatype, name)
    if isinstance(value, Operation):
        raise TypeError(
            f"Can't convert Operation '{value.name}' to Tensor (target dtype={dtype}, name={name!r})"
        )
    if _contains_tensor(value):
        return _autopack(value, datatype, name or "packed")
    if datatype is None and dtype_hint is not None:
        try:
            return constant(value, dtype=dtype_hint, name=name or "Const")
        except (TypeError, ValueError):
            pass
    return constant(value, dtype=datatype, name=name or "Const")


def _autopack(values: list[Any] | tuple[Any, ...], datatype: int | None, name: str) -> Tensor:
    # TensorFlow's auto-packing of lists that hold tensors: Consts "<name>/<i>" + Pack "<name>".
    if datatype is None:
        datatype = _first_datatype(values)
    with name_scope(name, None, [v for v in values if isinstance(v, _TensorLike)]) as scope:
        items: list[Tensor] = []
        for i, value in enumerate(values):
            if isinstance(value, list | tuple) and _contains_tensor(value):
                items.append(_autopack(value, datatype, str(i)))
            elif isinstance(value, _TensorLike):
                item = convert_to_tensor(value)
                if datatype is not None and item.datatype != datatype:
                    raise TypeError(
                        f"Cannot convert a list containing a tensor of dtype {dtype_name(item.datatype)} "
                        f"to {dtype_name(datatype)} (Tensor is: {item!r})"
                    )
                items.append(item)
            else:
                items.append(constant(value, dtype=datatype, name=str(i)))
        return _pack(scope, items, 0)


def constant(value: Any, dtype: Any = None, shape: Any = None, name: str = "Const") -> Tensor:
    """A ``Const`` node holding `value`.

    Args:
        value: A Python or numpy value (scalar, nested lists, array, text or bytes).
            Python floats become float32 and ints int32 (int64 when they do not fit),
            as in TensorFlow; numpy values keep their dtype unless `dtype` is given.
        dtype: The dtype to convert to.
        shape: The shape of the constant; `value` then holds one element (repeated)
            or exactly as many elements as `shape` (reshaped).
        name: The node name.

    Raises:
        TypeError: When `value` cannot be converted to `dtype` (e.g. 1.5 to int32).
        ValueError: When `value` does not fit `shape`.
    """
    if isinstance(value, _TensorLike | Operation):
        raise TypeError(f"constant() takes a Python or numpy value, not {value!r}; use identity() or cast()")
    datatype = None if dtype is None else as_datatype(dtype)
    proto = tensors.to_tensor_proto(value, datatype)
    if shape is not None:
        dims = as_shape(shape)
        if not _fully_defined(dims):
            raise ValueError(f"The shape of a constant must be fully defined, got {dims}")
        dims = _known_dims(dims)
        if tensors.shape_from_proto(proto.tensor_shape) != dims:
            array = tensors.from_tensor_proto(proto)
            count = math.prod(dims)
            if array.size == count:
                array = array.reshape(dims)
            elif array.size == 1:
                array = np.broadcast_to(array.reshape(()), dims)
            else:
                raise ValueError(
                    f"Cannot make a constant of shape {list(dims)} from {array.size} values; "
                    f"give one value or {count}"
                )
            proto = tensors.to_tensor_proto(array, proto.dtype)
    datatype = int(proto.dtype)
    op = get_default_graph().create_op(
        "Const",
        [],
        [datatype],
        name=name,
        attrs={"value": AttrValue(tensor=proto), "dtype": _type_attr(datatype)},
        shapes=[tensors.shape_from_proto(proto.tensor_shape)],
    )
    return op.outputs[0]


def placeholder(dtype: Any, shape: Any = None, name: str | None = None) -> Tensor:
    """A ``Placeholder``: a value fed when the graph runs.

    Args:
        dtype: The dtype of the fed value.
        shape: Its shape (`None` for any; `None`/-1 entries for any size).
        name: The node name (default ``"Placeholder"``).
    """
    datatype = as_datatype(dtype)
    static_shape = as_shape(shape)
    op = get_default_graph().create_op(
        "Placeholder",
        [],
        [datatype],
        name=name,
        attrs={"dtype": _type_attr(datatype), "shape": AttrValue(shape=tensors.shape_to_proto(static_shape))},
        shapes=[static_shape],
    )
    return op.outputs[0]


def placeholder_with_default(input: Any, shape: Any, name: str | None = None) -> Tensor:
    """A ``PlaceholderWithDefault``: `input` unless a value is fed.

    Raises:
        ValueError: When `shape` is incompatible with the shape of `input`.
    """
    with name_scope(name, "PlaceholderWithDefault", [input]) as scope:
        (default,) = _convert_inputs("PlaceholderWithDefault", [("input", input)])
        static_shape = as_shape(shape)
        try:
            _merge_shapes(default.shape, static_shape)
        except ValueError:
            raise _shape_error(
                scope,
                "PlaceholderWithDefault",
                f"Shape {shape_text(static_shape)} is not compatible with the default's shape",
                [default.shape],
            ) from None
        attrs = {
            "dtype": _type_attr(default.datatype),
            "shape": AttrValue(shape=tensors.shape_to_proto(static_shape)),
        }
        return _make(scope, "PlaceholderWithDefault", [default], attrs, default.datatype, static_shape)


# --------------------------------------------------------------------------- grouping


def identity(input: Any, name: str | None = None) -> Tensor:
    """An ``Identity`` of `input` (a variable is read)."""
    return _unary("Identity", input, name, arg="input", allowed=_ANY)


def no_op(name: str | None = None) -> Operation:
    """A ``NoOp``: does nothing; useful with control inputs."""
    return get_default_graph().create_op("NoOp", [], [], name=name)


def group(*inputs: Any, name: str | None = None) -> Operation:
    """A ``NoOp`` that runs after all `inputs` (operations, tensors, variables, lists of them).

    As in TensorFlow, inputs on several devices are first grouped by one ``NoOp``
    per device (``<name>/NoOp``, ``<name>/NoOp_1``, in device order).
    """
    flat: list[Any] = []
    pending = list(reversed(inputs))
    while pending:
        item = pending.pop()
        if isinstance(item, list | tuple):
            pending.extend(reversed(item))
        else:
            flat.append(item)
    with name_scope(name, "group_deps", flat) as scope:
        if not flat:
            return no_op(name=scope)
        by_device: dict[str, list[Any]] = {}
        for item in flat:
            if not isinstance(getattr(item, "device", None), str):
                raise TypeError(
                    f"'inputs' should be zero or more (nested) Tensors. Received '{item!r}' with type "
                    f"'{type(item).__name__}'."
                )
            by_device.setdefault(item.device, []).append(item)
        if len(by_device) == 1:
            ((dev, deps),) = by_device.items()
            return _group_on_device(dev, deps, scope)
        per_device = [_group_on_device(dev, by_device[dev], None) for dev in sorted(by_device)]
        with get_default_graph().control_dependencies(per_device):
            return no_op(name=scope)


def _group_on_device(dev: str, deps: list[Any], name: str | None) -> Operation:
    graph = get_default_graph()
    with graph.control_dependencies(deps), graph.device(dev):
        return no_op(name=name)


# --------------------------------------------------------------------------- elementwise math


def _unary(
    op_type: str,
    x: Any,
    name: str | None,
    *,
    arg: str = "x",
    allowed: frozenset[int] | None = _NUMBERS,
    typed: bool = True,
) -> Tensor:
    with name_scope(name, op_type, [x]) as scope:
        (tensor,) = _convert_inputs(op_type, [(arg, x)], allowed=allowed)
        attrs = {"T": _type_attr(tensor.datatype)} if typed else {}
        return _make(scope, op_type, [tensor], attrs, tensor.datatype, tensor.shape)


def _binary(
    op_type: str,
    x: Any,
    y: Any,
    name: str | None,
    *,
    default_name: str | None = None,
    allowed: frozenset[int] | None = _NUMBERS,
    out_datatype: int | None = None,
    extra_attrs: dict[str, AttrValue] | None = None,
    typed: bool = True,
) -> Tensor:
    with name_scope(name, default_name or op_type, [x, y]) as scope:
        a, b = _convert_inputs(op_type, [("x", x), ("y", y)], allowed=allowed)
        attrs = {"T": _type_attr(a.datatype)} if typed else {}
        attrs.update(extra_attrs or {})
        out_shape = _broadcast(scope, op_type, a.shape, b.shape)
        return _make(scope, op_type, [a, b], attrs, out_datatype or a.datatype, out_shape)


def negative(x: Any, name: str | None = None) -> Tensor:
    """``Neg``: elementwise ``-x``."""
    return _unary("Neg", x, name)


def abs(x: Any, name: str | None = None) -> Tensor:
    """``Abs``: elementwise absolute value."""
    return _unary("Abs", x, name, allowed=_REAL)


def square(x: Any, name: str | None = None) -> Tensor:
    """``Square``: elementwise ``x * x``."""
    return _unary("Square", x, name)


def sqrt(x: Any, name: str | None = None) -> Tensor:
    """``Sqrt``: elementwise square root (float and complex types)."""
    return _unary("Sqrt", x, name, allowed=_INEXACT)


def exp(x: Any, name: str | None = None) -> Tensor:
    """``Exp``: elementwise exponential (float and complex types)."""
    return _unary("Exp", x, name, allowed=_INEXACT)


def log(x: Any, name: str | None = None) -> Tensor:
    """``Log``: elementwise natural logarithm (float and complex types)."""
    return _unary("Log", x, name, allowed=_INEXACT)


def log1p(x: Any, name: str | None = None) -> Tensor:
    """``Log1p``: elementwise ``log(1 + x)``, accurate for small `x` (float and complex types)."""
    return _unary("Log1p", x, name, allowed=_INEXACT)


def tanh(x: Any, name: str | None = None) -> Tensor:
    """``Tanh``: elementwise hyperbolic tangent (float and complex types)."""
    return _unary("Tanh", x, name, allowed=_INEXACT)


def sigmoid(x: Any, name: str | None = None) -> Tensor:
    """``Sigmoid``: elementwise ``1 / (1 + exp(-x))`` (float and complex types)."""
    return _unary("Sigmoid", x, name, allowed=_INEXACT)


def relu(features: Any, name: str | None = None) -> Tensor:
    """``Relu``: elementwise ``max(features, 0)``."""
    return _unary("Relu", features, name, arg="features", allowed=_REAL)


def logical_not(x: Any, name: str | None = None) -> Tensor:
    """``LogicalNot`` of a bool tensor (the ``~`` operator)."""
    return _unary("LogicalNot", x, name, allowed=_BOOL, typed=False)


def add(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``AddV2`` (``Add`` for strings, which concatenates): ``x + y`` with broadcasting.

    Named ``Add`` by default (``add`` when built by the ``+`` operator).
    """
    strings = _DT.DT_STRING in (_datatype_of(x), _datatype_of(y)) or builtins.any(
        isinstance(v, str | bytes) for v in (x, y)
    )
    op_type = "Add" if strings else "AddV2"
    return _binary(op_type, x, y, name, default_name="Add", allowed=_NUMBERS | {_DT.DT_STRING})


def subtract(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``Sub``: ``x - y`` with broadcasting."""
    return _binary("Sub", x, y, name)


def multiply(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``Mul``: ``x * y`` with broadcasting."""
    return _binary("Mul", x, y, name)


def truediv(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``RealDiv`` in scope ``truediv``: ``x / y``, as `tf.math.truediv`.

    Integer operands are first cast (``Cast``) to float64 (32- and 64-bit ints) or
    float32 (8- and 16-bit ints).

    Raises:
        TypeError: For operands of different dtypes, or of a dtype that cannot be
            divided (bool, string).
    """
    with name_scope(name, "truediv", [x, y]) as scope:
        a, b = _convert_inputs("RealDiv", [("x", x), ("y", y)], allowed=_ANY)
        if a.datatype not in _TRUEDIV_TYPES:
            raise TypeError(f"Invalid dtype {dtype_name(a.datatype)} in __truediv__")
        target = _TRUEDIV_TYPES[a.datatype]
        if target is not None:
            a, b = cast(a, target), cast(b, target)
        return _binary("RealDiv", a, b, scope)


def divide(x: Any, y: Any, name: str | None = None) -> Tensor:
    """`truediv` (TensorFlow's `tf.math.divide`): named ``truediv`` by default."""
    return truediv(x, y, name)


def floordiv(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``FloorDiv`` in scope ``floordiv``: ``x // y``."""
    return _binary("FloorDiv", x, y, name, default_name="floordiv", allowed=_REAL)


def floormod(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``FloorMod``: ``x % y`` with the sign of `y`, as Python's ``%``."""
    return _binary("FloorMod", x, y, name, allowed=_REAL)


def pow(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``Pow``: ``x ** y``."""
    return _binary("Pow", x, y, name)


def maximum(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``Maximum``: elementwise larger of `x` and `y`."""
    return _binary("Maximum", x, y, name, allowed=_REAL)


def minimum(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``Minimum``: elementwise smaller of `x` and `y`."""
    return _binary("Minimum", x, y, name, allowed=_REAL)


def _compare(op_type: str, x: Any, y: Any, name: str | None, allowed: frozenset[int] | None) -> Tensor:
    extra = {"incompatible_shape_error": AttrValue(b=True)} if op_type in ("Equal", "NotEqual") else None
    return _binary(op_type, x, y, name, allowed=allowed, out_datatype=_DT.DT_BOOL, extra_attrs=extra)


def equal(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``Equal``: elementwise ``x == y`` (a bool tensor)."""
    return _compare("Equal", x, y, name, _ANY)


def not_equal(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``NotEqual``: elementwise ``x != y`` (a bool tensor)."""
    return _compare("NotEqual", x, y, name, _ANY)


def less(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``Less``: elementwise ``x < y`` (a bool tensor)."""
    return _compare("Less", x, y, name, _REAL)


def less_equal(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``LessEqual``: elementwise ``x <= y`` (a bool tensor)."""
    return _compare("LessEqual", x, y, name, _REAL)


def greater(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``Greater``: elementwise ``x > y`` (a bool tensor)."""
    return _compare("Greater", x, y, name, _REAL)


def greater_equal(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``GreaterEqual``: elementwise ``x >= y`` (a bool tensor)."""
    return _compare("GreaterEqual", x, y, name, _REAL)


def logical_and(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``LogicalAnd`` of bool tensors (the ``&`` operator)."""
    return _binary("LogicalAnd", x, y, name, allowed=_BOOL, typed=False)


def logical_or(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``LogicalOr`` of bool tensors (the ``|`` operator)."""
    return _binary("LogicalOr", x, y, name, allowed=_BOOL, typed=False)


def matmul(
    a: Any, b: Any, transpose_a: bool = False, transpose_b: bool = False, name: str | None = None
) -> Tensor:
    """``MatMul`` of two matrices (rank-2 tensors).

    Raises:
        ValueError: For operands that are not matrices or whose inner dimensions differ.
    """
    with name_scope(name, "MatMul", [a, b]) as scope:
        x, y = _convert_inputs("MatMul", [("a", a), ("b", b)], allowed=_NUMBERS)
        shapes = [x.shape, y.shape]
        for tensor in (x, y):
            _check_rank(scope, "MatMul", tensor, 2, shapes)
        rows: int | None = None
        cols: int | None = None
        if x.shape is not None and y.shape is not None:
            inner_a = x.shape[0] if transpose_a else x.shape[1]
            inner_b = y.shape[1] if transpose_b else y.shape[0]
            if inner_a is not None and inner_b is not None and inner_a != inner_b:
                raise _shape_error(
                    scope, "MatMul", f"Dimensions must be equal, but are {inner_a} and {inner_b}", shapes
                )
        if x.shape is not None:
            rows = x.shape[1] if transpose_a else x.shape[0]
        if y.shape is not None:
            cols = y.shape[0] if transpose_b else y.shape[1]
        attrs = {
            "T": _type_attr(x.datatype),
            "transpose_a": AttrValue(b=transpose_a),
            "transpose_b": AttrValue(b=transpose_b),
            "grad_a": AttrValue(b=False),
            "grad_b": AttrValue(b=False),
        }
        return _make(scope, "MatMul", [x, y], attrs, x.datatype, (rows, cols))


def add_n(inputs: Sequence[Any], name: str | None = None) -> Tensor:
    """``AddN``: the sum of tensors of one dtype and shape (one input is returned as is)."""
    if not isinstance(inputs, list | tuple) or not inputs:
        raise ValueError("Inputs must be an iterable of at least one Tensor with the same dtype and shape.")
    if len(inputs) == 1:
        single = convert_to_tensor(inputs[0])
        return identity(single, name=name) if name else single
    with name_scope(name, "AddN", list(inputs)) as scope:
        values = _convert_list("AddN", "inputs", inputs, allowed=_NUMBERS)
        merged = _merge_all(scope, "AddN", [t.shape for t in values])
        attrs = {"N": AttrValue(i=len(values)), "T": _type_attr(values[0].datatype)}
        return _make(scope, "AddN", values, attrs, values[0].datatype, merged)


def bias_add(value: Any, bias: Any, data_format: str | None = None, name: str | None = None) -> Tensor:
    """``BiasAdd``: adds a 1-D `bias` along the channel dimension of `value`.

    Args:
        value: A tensor of rank 2 or more.
        bias: A vector with one element per channel.
        data_format: ``"N...C"`` (channels last, the default) or ``"NC..."``.
        name: The node name.
    """
    if data_format is None or (data_format.startswith("N") and data_format.endswith("C")):
        data_format = "NHWC"
    elif data_format.startswith("NC"):
        data_format = "NCHW"
    else:
        raise ValueError("data_format must be of the form `N...C` or `NC...`")
    with name_scope(name, "BiasAdd", [value, bias]) as scope:
        x, b = _convert_inputs("BiasAdd", [("value", value), ("bias", bias)], allowed=_NUMBERS)
        shapes = [x.shape, b.shape]
        _check_rank(scope, "BiasAdd", b, 1, shapes)
        if x.shape is not None and len(x.shape) < 2:
            raise _shape_error(
                scope, "BiasAdd", f"Shape must be at least rank 2 but is rank {len(x.shape)}", shapes
            )
        out_shape = x.shape
        if x.shape is not None and b.shape is not None:
            channel = -1 if data_format == "NHWC" else 1
            channels, size = x.shape[channel], b.shape[0]
            if channels is not None and size is not None and channels != size:
                raise _shape_error(
                    scope, "BiasAdd", f"Dimensions must be equal, but are {channels} and {size}", shapes
                )
            dims = list(x.shape)
            dims[channel] = channels if channels is not None else size
            out_shape = tuple(dims)
        attrs = {"T": _type_attr(x.datatype), "data_format": AttrValue(s=data_format.encode())}
        return _make(scope, "BiasAdd", [x, b], attrs, x.datatype, out_shape)


def softmax(logits: Any, axis: int | None = None, name: str | None = None) -> Tensor:
    """``Softmax`` over the last axis of float `logits`.

    Raises:
        ValueError: For `axis` other than the last one, or scalar `logits`.
    """
    with name_scope(name, "Softmax", [logits]) as scope:
        (x,) = _convert_inputs("Softmax", [("logits", logits)], allowed=_FLOATS)
        rank = _rank(x.shape)
        if rank == 0:
            raise _shape_error(scope, "Softmax", "Shape must be at least rank 1 but is rank 0", [x.shape])
        if axis not in (None, -1) and not (rank is not None and axis == rank - 1):
            raise ValueError(f"softmax() supports only the last axis, got axis={axis}")
        return _make(scope, "Softmax", [x], {"T": _type_attr(x.datatype)}, x.datatype, x.shape)


def log_softmax(logits: Any, name: str | None = None) -> Tensor:
    """``LogSoftmax`` over the last axis of float `logits`."""
    with name_scope(name, "LogSoftmax", [logits]) as scope:
        (x,) = _convert_inputs("LogSoftmax", [("logits", logits)], allowed=_FLOATS)
        return _make(scope, "LogSoftmax", [x], {"T": _type_attr(x.datatype)}, x.datatype, x.shape)


def softmax_cross_entropy_with_logits(labels: Any, logits: Any, name: str | None = None) -> Tensor:
    """``SoftmaxCrossEntropyWithLogits``: per-row cross entropy of `labels` (probabilities)
    against ``softmax(logits)``, both ``[batch, classes]``; gradients flow to both (TF 2's
    `tf.nn.softmax_cross_entropy_with_logits`).
    """
    with name_scope(name, "softmax_cross_entropy_with_logits", [labels, logits]) as scope:
        x, y = _convert_inputs(
            "SoftmaxCrossEntropyWithLogits", [("features", logits), ("labels", labels)], allowed=_FLOATS
        )
        shapes = [x.shape, y.shape]
        for tensor in (x, y):
            _check_rank(scope, "SoftmaxCrossEntropyWithLogits", tensor, 2, shapes)
        merged = _merge_all(scope, "SoftmaxCrossEntropyWithLogits", shapes)
        op = get_default_graph().create_op(
            "SoftmaxCrossEntropyWithLogits",
            [x, y],
            [x.datatype, x.datatype],
            name=scope,
            attrs={"T": _type_attr(x.datatype)},
            shapes=[None if merged is None else merged[:1], merged],
        )
        return op.outputs[0]


def sparse_softmax_cross_entropy_with_logits(labels: Any, logits: Any, name: str | None = None) -> Tensor:
    """``SparseSoftmaxCrossEntropyWithLogits``: per-row cross entropy of class ids `labels`
    (``[batch]``, int32/int64) against ``softmax(logits)`` (``[batch, classes]``).
    """
    with name_scope(name, "SparseSoftmaxCrossEntropyWithLogits", [labels, logits]) as scope:
        (x,) = _convert_inputs("SparseSoftmaxCrossEntropyWithLogits", [("features", logits)], allowed=_FLOATS)
        (y,) = _convert_inputs(
            "SparseSoftmaxCrossEntropyWithLogits",
            [("labels", labels)],
            default_dtype=np.int32,
            allowed=frozenset({_DT.DT_INT32, _DT.DT_INT64}),
        )
        shapes = [x.shape, y.shape]
        _check_rank(scope, "SparseSoftmaxCrossEntropyWithLogits", x, 2, shapes)
        _check_rank(scope, "SparseSoftmaxCrossEntropyWithLogits", y, 1, shapes)
        rows = _merge_all(
            scope,
            "SparseSoftmaxCrossEntropyWithLogits",
            [None if x.shape is None else x.shape[:1], y.shape],
        )
        op = get_default_graph().create_op(
            "SparseSoftmaxCrossEntropyWithLogits",
            [x, y],
            [x.datatype, x.datatype],
            name=scope,
            attrs={"T": _type_attr(x.datatype), "Tlabels": _type_attr(y.datatype)},
            shapes=[rows, x.shape],
        )
        return op.outputs[0]


def sigmoid_cross_entropy_with_logits(labels: Any, logits: Any, name: str | None = None) -> Tensor:
    """Elementwise logistic loss of `logits` against `labels` (probabilities of the same
    shape), computed as TensorFlow's `tf.nn.sigmoid_cross_entropy_with_logits` does
    without overflow: ``max(x, 0) - x * z + log1p(exp(-abs(x)))``.

    Raises:
        ValueError: When the shapes of `labels` and `logits` differ.
    """
    with name_scope(name, "logistic_loss", [logits, labels]) as scope:
        x, z = _convert_inputs("logistic_loss", [("logits", logits), ("labels", labels)], allowed=_FLOATS)
        _merge_all(scope, "logistic_loss", [x.shape, z.shape])
        zeros = zeros_like(x)
        positive = greater_equal(x, zeros)
        relu_logits = where(positive, x, zeros)
        minus_abs = where(positive, negative(x), x)
        return add(subtract(relu_logits, multiply(x, z)), log1p(exp(minus_abs)), name=scope)


def stop_gradient(input: Any, name: str | None = None) -> Tensor:
    """``StopGradient``: `input` unchanged, but `gradients` treats it as a constant."""
    return _unary("StopGradient", input, name, arg="input", allowed=_ANY)


def cast(x: Any, dtype: Any, name: str | None = None) -> Tensor:
    """``Cast`` to `dtype` (a tensor that has it already is returned as is)."""
    target = as_datatype(dtype)
    if isinstance(x, Tensor) and x.datatype == target:
        return x
    with name_scope(name, "Cast", [x]) as scope:
        tensor = convert_to_tensor(x, name="x")
        if tensor.datatype == target:
            return tensor
        attrs = {
            "SrcT": _type_attr(tensor.datatype),
            "DstT": _type_attr(target),
            "Truncate": AttrValue(b=False),
        }
        return _make(scope, "Cast", [tensor], attrs, target, tensor.shape)


# --------------------------------------------------------------------------- reductions


def _reduce(
    op_type: str,
    input_tensor: Any,
    axis: Any,
    keepdims: bool,
    name: str | None,
    allowed: frozenset[int] | None = _NUMBERS,
) -> Tensor:
    """A reduction op (input, reduction_indices; keep_dims, T, Tidx)."""
    x = convert_to_tensor(input_tensor, name="input")
    reduce_all = axis is None
    if reduce_all:
        # Outside the op's scope, as TensorFlow's _ReductionDims builds it.
        x_rank = _rank(x.shape)
        axis = constant(np.arange(x_rank, dtype=np.int32)) if x_rank is not None else range(0, rank(x))
    with name_scope(name, op_type, [x]) as scope:
        (x,) = _convert_inputs(op_type, [("input", x)], allowed=allowed)
        (axes,) = _convert_inputs(
            op_type, [("reduction_indices", axis)], default_dtype=np.int32, allowed=_INDEX
        )
        if reduce_all and not keepdims:
            out_shape: Shape = ()
        else:
            out_shape = _reduced_shape(scope, op_type, x.shape, axes, keepdims)
        attrs = {"keep_dims": AttrValue(b=keepdims), "Tidx": _type_attr(axes.datatype)}
        if op_type not in ("All", "Any"):
            attrs["T"] = _type_attr(x.datatype)
        return _make(scope, op_type, [x, axes], attrs, x.datatype, out_shape)


def _reduced_shape(scope: str, op_type: str, shape: Shape, axes_tensor: Tensor, keepdims: bool) -> Shape:
    axes = _static_axes(axes_tensor)
    if shape is None:
        return None
    if axes is None:
        return (None,) * len(shape) if keepdims else None
    rank = len(shape)
    reduced = set()
    for axis in axes:
        if not -rank <= axis < rank:
            raise _shape_error(
                scope,
                op_type,
                f"Invalid reduction dimension {axis} for input with {rank} dimensions.",
                [shape, axes_tensor.shape],
            )
        reduced.add(axis % rank)
    if keepdims:
        return tuple(1 if i in reduced else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in reduced)


def reduce_sum(
    input_tensor: Any, axis: Any = None, keepdims: bool = False, name: str | None = None
) -> Tensor:
    """``Sum`` over `axis` (an int, a list, or `None` for all axes)."""
    return _reduce("Sum", input_tensor, axis, keepdims, name)


def reduce_mean(
    input_tensor: Any, axis: Any = None, keepdims: bool = False, name: str | None = None
) -> Tensor:
    """``Mean`` over `axis` (an int, a list, or `None` for all axes)."""
    return _reduce("Mean", input_tensor, axis, keepdims, name)


def reduce_max(
    input_tensor: Any, axis: Any = None, keepdims: bool = False, name: str | None = None
) -> Tensor:
    """``Max`` over `axis` (an int, a list, or `None` for all axes)."""
    return _reduce("Max", input_tensor, axis, keepdims, name, allowed=_REAL)


def reduce_min(
    input_tensor: Any, axis: Any = None, keepdims: bool = False, name: str | None = None
) -> Tensor:
    """``Min`` over `axis` (an int, a list, or `None` for all axes)."""
    return _reduce("Min", input_tensor, axis, keepdims, name, allowed=_REAL)


def reduce_prod(
    input_tensor: Any, axis: Any = None, keepdims: bool = False, name: str | None = None
) -> Tensor:
    """``Prod`` over `axis` (an int, a list, or `None` for all axes)."""
    return _reduce("Prod", input_tensor, axis, keepdims, name)


def reduce_all(
    input_tensor: Any, axis: Any = None, keepdims: bool = False, name: str | None = None
) -> Tensor:
    """``All``: logical and of a bool tensor over `axis`."""
    return _reduce("All", input_tensor, axis, keepdims, name, allowed=_BOOL)


def reduce_any(
    input_tensor: Any, axis: Any = None, keepdims: bool = False, name: str | None = None
) -> Tensor:
    """``Any``: logical or of a bool tensor over `axis`."""
    return _reduce("Any", input_tensor, axis, keepdims, name, allowed=_BOOL)


def _arg_reduce(op_type: str, input: Any, axis: Any, output_type: Any, name: str | None) -> Tensor:
    out = as_datatype(output_type)
    with name_scope(name, op_type, [input]) as scope:
        (x,) = _convert_inputs(op_type, [("input", input)], allowed=_REAL)
        (dim,) = _convert_inputs(
            op_type, [("dimension", 0 if axis is None else axis)], default_dtype=np.int32
        )
        _check_allowed("dimension", dim, _INDEX)
        out_shape = _reduced_shape(scope, op_type, x.shape, dim, keepdims=False)
        attrs = {
            "T": _type_attr(x.datatype),
            "Tidx": _type_attr(dim.datatype),
            "output_type": _type_attr(out),
        }
        return _make(scope, op_type, [x, dim], attrs, out, out_shape)


def argmax(input: Any, axis: Any = None, output_type: Any = np.int64, name: str | None = None) -> Tensor:
    """``ArgMax``: index of the largest value along `axis` (default 0)."""
    return _arg_reduce("ArgMax", input, axis, output_type, name)


def argmin(input: Any, axis: Any = None, output_type: Any = np.int64, name: str | None = None) -> Tensor:
    """``ArgMin``: index of the smallest value along `axis` (default 0)."""
    return _arg_reduce("ArgMin", input, axis, output_type, name)


# --------------------------------------------------------------------------- shapes


def shape(input: Any, out_type: Any = np.int32, name: str | None = None) -> Tensor:
    """``Shape`` of `input` (a ``Const`` named ``Shape`` when fully known, as TensorFlow folds it)."""
    out = as_datatype(out_type)
    with name_scope(name, "Shape", [input]) as scope:
        x = convert_to_tensor(input, name="input")
        if _fully_defined(x.shape):
            return constant(np.array(x.shape, dtype=tensors.as_numpy_dtype(out)), name=scope)
        attrs = {"T": _type_attr(x.datatype), "out_type": _type_attr(out)}
        return _make(scope, "Shape", [x], attrs, out, (_rank(x.shape),))


def size(input: Any, out_type: Any = np.int32, name: str | None = None) -> Tensor:
    """``Size``: the number of elements of `input` (a ``Const`` when known)."""
    out = as_datatype(out_type)
    with name_scope(name, "Size", [input]) as scope:
        x = convert_to_tensor(input, name="input")
        if _fully_defined(x.shape):
            count = math.prod(_known_dims(x.shape))
            return constant(np.array(count, dtype=tensors.as_numpy_dtype(out)), name=scope)
        attrs = {"T": _type_attr(x.datatype), "out_type": _type_attr(out)}
        return _make(scope, "Size", [x], attrs, out, ())


def rank(input: Any, name: str | None = None) -> Tensor:
    """``Rank``: the number of dimensions of `input` (a ``Const`` when known)."""
    with name_scope(name, "Rank", [input]) as scope:
        x = convert_to_tensor(input, name="input")
        if x.shape is not None:
            return constant(np.int32(len(x.shape)), name=scope)
        return _make(scope, "Rank", [x], {"T": _type_attr(x.datatype)}, _DT.DT_INT32, ())


def reshape(tensor: Any, shape: Any, name: str | None = None) -> Tensor:
    """``Reshape`` `tensor` to `shape` (one entry may be -1: inferred).

    Raises:
        ValueError: When the element counts cannot match.
    """
    with name_scope(name, "Reshape", [tensor, shape]) as scope:
        (x,) = _convert_inputs("Reshape", [("tensor", tensor)], allowed=_ANY)
        (target,) = _convert_inputs("Reshape", [("shape", shape)], default_dtype=np.int32, allowed=_INDEX)
        out_shape = _reshaped(scope, x.shape, _static_ints(target), [x.shape, target.shape])
        attrs = {"T": _type_attr(x.datatype), "Tshape": _type_attr(target.datatype)}
        return _make(scope, "Reshape", [x, target], attrs, x.datatype, out_shape)


def _reshaped(scope: str, in_shape: Shape, dims: list[int | None] | None, shapes: list[Shape]) -> Shape:
    if dims is None:
        return None
    wildcards = [i for i, d in enumerate(dims) if d == -1]
    if len(wildcards) > 1:
        raise _shape_error(scope, "Reshape", "Cannot infer multiple unknown dimensions in shape", shapes)
    out = [None if d is None or d < 0 else d for d in dims]
    if not _fully_defined(in_shape) or None in [d for i, d in enumerate(out) if i not in wildcards]:
        return tuple(out)
    elements = math.prod(_known_dims(in_shape))
    known = math.prod(typing.cast(int, d) for i, d in enumerate(out) if i not in wildcards)
    target_text = "[" + ",".join(str(d) for d in dims) + "]"
    if wildcards:
        if known == 0 or elements % known:
            raise _shape_error(
                scope,
                "Reshape",
                f"Cannot reshape a tensor with {elements} elements to shape {target_text} "
                f"(a multiple of {known} elements)",
                shapes,
            )
        out[wildcards[0]] = elements // known
    elif known != elements:
        raise _shape_error(
            scope,
            "Reshape",
            f"Cannot reshape a tensor with {elements} elements to shape {target_text} ({known} elements)",
            shapes,
        )
    return tuple(out)


def transpose(a: Any, perm: Any = None, name: str = "transpose") -> Tensor:
    """``Transpose`` `a` by `perm` (default: reverse the dimensions)."""
    with name_scope(name, "transpose", [a]) as scope:
        x = convert_to_tensor(a, name="a")
        if perm is None:
            x_rank = _rank(x.shape)
            if x_rank is not None:
                perm = constant(np.arange(x_rank - 1, -1, -1, dtype=np.int32), name="perm")
            else:
                perm = _range_op(rank(x) - 1, -1, -1, None)
        (order,) = _convert_inputs("Transpose", [("perm", perm)], default_dtype=np.int32, allowed=_INDEX)
        axes = _static_axes(order)
        out_shape: Shape = None
        if axes is not None and x.shape is not None:
            if sorted(i % len(x.shape) for i in axes) != list(builtins.range(len(x.shape))):
                raise _shape_error(scope, "Transpose", f"{axes} is not a valid permutation", [x.shape])
            out_shape = tuple(x.shape[i] for i in axes)
        elif axes is not None:
            out_shape = (None,) * len(axes)
        elif x.shape is not None:
            out_shape = (None,) * len(x.shape)
        attrs = {"T": _type_attr(x.datatype), "Tperm": _type_attr(order.datatype)}
        return _make(scope, "Transpose", [x, order], attrs, x.datatype, out_shape)


def expand_dims(input: Any, axis: Any, name: str | None = None) -> Tensor:
    """``ExpandDims``: insert a dimension of size 1 at `axis`."""
    with name_scope(name, "ExpandDims", [input]) as scope:
        x = convert_to_tensor(input, name="input")
        (dim,) = _convert_inputs("ExpandDims", [("dim", axis)], default_dtype=np.int32, allowed=_INDEX)
        position = _static_int(dim)
        out_shape: Shape = None
        if x.shape is not None and position is not None:
            position = _normalize_axis(position, len(x.shape) + 1, scope, "ExpandDims", [x.shape])
            out_shape = (*x.shape[:position], 1, *x.shape[position:])
        elif x.shape is not None:
            out_shape = (None,) * (len(x.shape) + 1)
        attrs = {"T": _type_attr(x.datatype), "Tdim": _type_attr(dim.datatype)}
        return _make(scope, "ExpandDims", [x, dim], attrs, x.datatype, out_shape)


def squeeze(input: Any, axis: int | Sequence[int] | None = None, name: str | None = None) -> Tensor:
    """``Squeeze``: remove dimensions of size 1 (all of them, or those in `axis`).

    Raises:
        ValueError: When a dimension in `axis` is known and not 1.
    """
    axes = [] if axis is None else [axis] if isinstance(axis, int) else list(axis)
    with name_scope(name, "Squeeze", [input]) as scope:
        x = convert_to_tensor(input, name="input")
        out_shape: Shape = None
        if x.shape is not None and axes:
            drop = {_normalize_axis(a, len(x.shape), scope, "Squeeze", [x.shape]) for a in axes}
            for i in sorted(drop):
                if x.shape[i] not in (1, None):
                    raise _shape_error(
                        scope,
                        "Squeeze",
                        f"Can not squeeze dim[{i}], expected a dimension of 1, got {x.shape[i]}",
                        [x.shape],
                    )
            out_shape = tuple(d for i, d in enumerate(x.shape) if i not in drop)
        elif _fully_defined(x.shape):
            out_shape = tuple(d for d in typing.cast(tuple[int, ...], x.shape) if d != 1)
        attrs = {"T": _type_attr(x.datatype), "squeeze_dims": AttrValue(list=AttrValue.ListValue(i=axes))}
        return _make(scope, "Squeeze", [x], attrs, x.datatype, out_shape)


def tile(input: Any, multiples: Any, name: str | None = None) -> Tensor:
    """``Tile``: repeat `input` `multiples[i]` times along dimension i."""
    with name_scope(name, "Tile", [input]) as scope:
        x = convert_to_tensor(input, name="input")
        (times,) = _convert_inputs("Tile", [("multiples", multiples)], default_dtype=np.int32, allowed=_INDEX)
        counts = _static_ints(times)
        out_shape: Shape = None
        if counts is not None:
            if x.shape is not None and len(x.shape) != len(counts):
                raise _shape_error(
                    scope,
                    "Tile",
                    f"Shape must be rank {len(counts)} but is rank {len(x.shape)}",
                    [x.shape, times.shape],
                )
            dims = x.shape if x.shape is not None else (None,) * len(counts)
            out_shape = tuple(
                None if d is None or n is None else d * n for d, n in zip(dims, counts, strict=True)
            )
        elif x.shape is not None:
            out_shape = (None,) * len(x.shape)
        attrs = {"T": _type_attr(x.datatype), "Tmultiples": _type_attr(times.datatype)}
        return _make(scope, "Tile", [x, times], attrs, x.datatype, out_shape)


def fill(dims: Any, value: Any, name: str | None = None) -> Tensor:
    """``Fill``: a tensor of shape `dims` with every element `value`."""
    with name_scope(name, "Fill", [dims, value]) as scope:
        (shape_t,) = _convert_inputs("Fill", [("dims", dims)], default_dtype=np.int32, allowed=_INDEX)
        scalar = convert_to_tensor(value, name="value")
        _check_rank(scope, "Fill", scalar, 0, [shape_t.shape, scalar.shape])
        attrs = {"T": _type_attr(scalar.datatype), "index_type": _type_attr(shape_t.datatype)}
        return _make(
            scope, "Fill", [shape_t, scalar], attrs, scalar.datatype, _shape_of_dims(_static_ints(shape_t))
        )


def _filled(shape: Any, fill_value: int, dtype: Any, name: str | None, default_name: str) -> Tensor:
    """`zeros`/`ones`: a Const when small and static, else Fill(shape_as_tensor, Const)."""
    datatype = as_datatype(dtype)
    if datatype == _DT.DT_STRING:
        if fill_value:
            raise TypeError("ones() is not defined for strings")
        element: Any = np.array(b"", dtype=object)
    else:
        element = np.array(fill_value, dtype=tensors.as_numpy_dtype(datatype))
    with name_scope(name, default_name, [shape]) as scope:
        if isinstance(shape, _TensorLike) or _contains_tensor(shape):
            shape_t = convert_to_tensor(shape, dtype=np.int32)
        else:
            dims = as_shape(shape)
            if not _fully_defined(dims):
                raise ValueError(f"The shape of {default_name}() must be fully defined, got {shape!r}")
            dims = _known_dims(dims)
            if math.prod(dims) < _MAX_CONSTANT_FILL:
                return constant(element, dtype=datatype, shape=dims, name=scope)
            index_type = np.int64 if builtins.any(d > 2**31 - 1 for d in dims) else np.int32
            shape_t = constant(np.array(dims, dtype=index_type), name="shape_as_tensor")
        if shape_t.shape == ():
            shape_t = reshape(shape_t, [-1])
        return fill(shape_t, constant(element, dtype=datatype), name=scope)


def zeros(shape: Any, dtype: Any = np.float32, name: str | None = None) -> Tensor:
    """A tensor of zeros (``Const`` below 1000 elements, else ``Fill``)."""
    return _filled(shape, 0, dtype, name, "zeros")


def ones(shape: Any, dtype: Any = np.float32, name: str | None = None) -> Tensor:
    """A tensor of ones (``Const`` below 1000 elements, else ``Fill``)."""
    return _filled(shape, 1, dtype, name, "ones")


def _like(
    op_type: str, fill_value: int, tensor: Any, dtype: Any, name: str | None, default_name: str
) -> Tensor:
    with name_scope(name, default_name, [tensor]) as scope:
        x = convert_to_tensor(tensor, name="tensor")
        target = x.datatype if dtype is None else as_datatype(dtype)
        if _fully_defined(x.shape) and target != _DT.DT_VARIANT:
            return _filled(x.shape, fill_value, target, scope, default_name)
        if target != x.datatype:
            return _filled(shape(x), fill_value, target, scope, default_name)
        return _make(scope, op_type, [x], {"T": _type_attr(x.datatype)}, x.datatype, x.shape)


def zeros_like(tensor: Any, dtype: Any = None, name: str | None = None) -> Tensor:
    """Zeros shaped like `tensor` (a ``Const`` when its shape is known, else ``ZerosLike``)."""
    return _like("ZerosLike", 0, tensor, dtype, name, "zeros_like")


def ones_like(tensor: Any, dtype: Any = None, name: str | None = None) -> Tensor:
    """Ones shaped like `tensor` (a ``Const`` when its shape is known, else ``OnesLike``)."""
    return _like("OnesLike", 1, tensor, dtype, name, "ones_like")


def _range_op(start: Any, limit: Any, delta: Any, name: str | None) -> Tensor:
    # The raw Range op: start, limit, delta of one type (Tidx).
    with name_scope(name, "Range", [start, limit, delta]) as scope:
        args = [("start", start), ("limit", limit), ("delta", delta)]
        first, end, step = _convert_inputs("Range", args, default_dtype=np.int32, allowed=_REAL)
        values = [_static_value(t) for t in (first, end, step)]
        length: int | None = None
        if builtins.all(v is not None for v in values):
            begin, stop, increment = (typing.cast(NDArray[Any], v).item() for v in values)
            if increment == 0:
                raise _shape_error(scope, "Range", "Requires delta != 0", [(), (), ()])
            length = builtins.max(0, math.ceil((stop - begin) / increment))
        return _make(
            scope,
            "Range",
            [first, end, step],
            {"Tidx": _type_attr(first.datatype)},
            first.datatype,
            (length,),
        )


def range(start: Any, limit: Any = None, delta: Any = 1, dtype: Any = None, name: str = "range") -> Tensor:
    """``Range``: ``[start, start + delta, ...]`` up to (excluding) `limit`.

    With one argument, counts from 0 to `start`. Arguments of different dtypes are cast
    to the widest one (int32 < int64 < float16 < bfloat16 < float32 < float64).
    """
    if limit is None:
        start, limit = 0, start
    with name_scope(name, "Range", [start, limit, delta]) as scope:
        # Tensors keep their dtype (and are cast below); Python values take `dtype`.
        converted = [
            convert_to_tensor(value, dtype=None if isinstance(value, _TensorLike) else dtype, name=arg)
            for arg, value in (("start", start), ("limit", limit), ("delta", delta))
        ]
        if dtype is None:
            for t in converted:
                if t.datatype not in _RANGE_ORDER:
                    raise TypeError(f"range() does not support dtype {dtype_name(t.datatype)}")
            target = builtins.max((t.datatype for t in converted), key=_RANGE_ORDER.index)
        else:
            target = as_datatype(dtype)
        first, end, step = (cast(t, target) for t in converted)
        return _range_op(first, end, step, scope)


def concat(values: Any, axis: Any, name: str = "concat") -> Tensor:
    """``ConcatV2``: join `values` along `axis` (one value: an ``Identity`` of it)."""
    if not isinstance(values, list | tuple):
        values = [values]
    if len(values) == 1:
        with name_scope(name):
            axis_t = convert_to_tensor(axis, dtype=np.int32, name="concat_dim")
            if axis_t.shape not in ((), None):
                raise ValueError(f"concat() takes a scalar axis, got shape {axis_t.shape}")
            return identity(values[0], name=name)
    with name_scope(name, "concat", list(values)) as scope:
        tensors_ = _convert_list("ConcatV2", "values", values)
        (axis_t,) = _convert_inputs("ConcatV2", [("axis", axis)], default_dtype=np.int32, allowed=_INDEX)
        out_shape = _concat_shape(scope, [t.shape for t in tensors_], _static_int(axis_t))
        attrs = {
            "N": AttrValue(i=len(tensors_)),
            "T": _type_attr(tensors_[0].datatype),
            "Tidx": _type_attr(axis_t.datatype),
        }
        return _make(scope, "ConcatV2", [*tensors_, axis_t], attrs, tensors_[0].datatype, out_shape)


def _concat_shape(scope: str, shapes: list[Shape], axis: int | None) -> Shape:
    ranks = {len(s) for s in shapes if s is not None}
    if len(ranks) > 1:
        low, high = sorted(ranks)[:2]
        raise _shape_error(scope, "ConcatV2", f"Shape must be rank {high} but is rank {low}", shapes)
    if not ranks:
        return None
    (x_rank,) = ranks
    if axis is None:
        return (None,) * x_rank
    axis = _normalize_axis(axis, x_rank, scope, "ConcatV2", shapes)
    total: int | None = 0
    others: Shape = None
    for s in shapes:
        if s is None:
            total = None
            continue
        total = None if total is None or s[axis] is None else total + typing.cast(int, s[axis])
        try:
            others = _merge_shapes(others, s[:axis] + s[axis + 1 :])
        except ValueError as exc:
            raise _shape_error(scope, "ConcatV2", f"Dimensions must be equal, but {exc}", shapes) from None
    rest = others if others is not None else (None,) * (x_rank - 1)
    return (*rest[:axis], total, *rest[axis:])


def _pack(scope: str, values: list[Tensor], axis: int) -> Tensor:
    # The Pack op named after `scope`: stack same-dtype tensors along a new `axis`.
    base = _merge_all(scope, "Pack", [t.shape for t in values])
    out_shape: Shape = None
    if base is not None:
        position = _normalize_axis(axis, len(base) + 1, scope, "Pack", [t.shape for t in values])
        out_shape = (*base[:position], len(values), *base[position:])
    attrs = {"N": AttrValue(i=len(values)), "T": _type_attr(values[0].datatype), "axis": AttrValue(i=axis)}
    return _make(scope, "Pack", values, attrs, values[0].datatype, out_shape)


def stack(values: Sequence[Any], axis: int = 0, name: str = "stack") -> Tensor:
    """Stack `values` along a new `axis` (``Pack``; a ``Const`` when all are Python values)."""
    if axis == 0:
        try:
            return convert_to_tensor(values, name=name)
        except (TypeError, ValueError):
            pass  # Not convertible as one value (e.g. tensors of different dtypes): Pack reports it.
    with name_scope(name, "stack", list(values)) as scope:
        return _pack(scope, _convert_list("Pack", "values", values), axis)


def where(condition: Any, x: Any = None, y: Any = None, name: str | None = None) -> Tensor:
    """``SelectV2``: elements of `x` where `condition`, else of `y` (with broadcasting).

    With `condition` alone: ``Where``, the int64 coordinates of its true elements.

    Raises:
        ValueError: When only one of `x` and `y` is given.
    """
    if x is None and y is None:
        with name_scope(name, "Where", [condition]) as scope:
            cond = convert_to_tensor(condition, name="input")
            out_shape: Shape = (None, _rank(cond.shape))
            return _make(scope, "Where", [cond], {"T": _type_attr(cond.datatype)}, _DT.DT_INT64, out_shape)
    if x is None or y is None:
        raise ValueError("x and y must both be non-None or both be None.")
    with name_scope(name, "SelectV2", [condition, x, y]) as scope:
        (cond,) = _convert_inputs(
            "SelectV2", [("condition", condition)], default_dtype=np.bool_, allowed=_BOOL
        )
        then, other = _convert_inputs("SelectV2", [("t", x), ("e", y)], allowed=_ANY)
        out_shape = _broadcast(scope, "SelectV2", cond.shape, then.shape, other.shape)
        return _make(
            scope, "SelectV2", [cond, then, other], {"T": _type_attr(then.datatype)}, then.datatype, out_shape
        )


def select(condition: Any, x: Any, y: Any, name: str | None = None) -> Tensor:
    """`where` with both branches: a ``SelectV2`` (broadcasting)."""
    return where(condition, x, y, name)


def gather(
    params: Any, indices: Any, axis: Any = None, batch_dims: int = 0, name: str | None = None
) -> Tensor:
    """``GatherV2``: slices of `params` along `axis` (default 0) at `indices`.

    Gathering rows (axis 0) of a `Variable` reads only those rows (``ResourceGather``,
    as TensorFlow's `tf.gather` does), and its gradient is sparse.
    """
    sparse_read = getattr(params, "sparse_read", None)
    if sparse_read is not None and batch_dims == 0 and (axis is None or _static_int_value(axis) == 0):
        return typing.cast(Tensor, sparse_read(indices, name=name))
    with name_scope(name, "GatherV2", [params, indices]) as scope:
        source = convert_to_tensor(params, name="params")
        (index,) = _convert_inputs("GatherV2", [("indices", indices)], default_dtype=np.int32, allowed=_INDEX)
        (axis_t,) = _convert_inputs(
            "GatherV2", [("axis", 0 if axis is None else axis)], default_dtype=np.int32, allowed=_INDEX
        )
        position = _static_int(axis_t)
        out_shape: Shape = None
        if batch_dims == 0 and position is not None and source.shape is not None and index.shape is not None:
            position = _normalize_axis(position, len(source.shape), scope, "GatherV2", [source.shape])
            out_shape = (*source.shape[:position], *index.shape, *source.shape[position + 1 :])
        attrs = {
            "Tparams": _type_attr(source.datatype),
            "Tindices": _type_attr(index.datatype),
            "Taxis": _type_attr(axis_t.datatype),
            "batch_dims": AttrValue(i=batch_dims),
        }
        return _make(scope, "GatherV2", [source, index, axis_t], attrs, source.datatype, out_shape)


def _static_int_value(value: Any) -> int | None:
    if isinstance(value, Tensor):
        return _static_int(value)
    if isinstance(value, int | np.integer):
        return int(value)
    return None


def one_hot(
    indices: Any,
    depth: Any,
    on_value: Any = None,
    off_value: Any = None,
    axis: int | None = None,
    dtype: Any = None,
    name: str | None = None,
) -> Tensor:
    """``OneHot``: `on_value` at each index, `off_value` elsewhere, along a new `axis`.

    The dtype is `dtype`, else that of `on_value`/`off_value`, else float32.
    """
    with name_scope(name, "one_hot", [indices, depth, on_value, off_value]) as scope:
        if dtype is not None:
            target = as_datatype(dtype)
        else:
            given = [v for v in (on_value, off_value) if v is not None]
            target = next((d for v in given if (d := _datatype_of(v)) is not None), None) or (
                int(tensors.to_tensor_proto(given[0]).dtype) if given else _DT.DT_FLOAT
            )
        on = convert_to_tensor(1 if on_value is None else on_value, dtype=target, name="on_value")
        off = convert_to_tensor(0 if off_value is None else off_value, dtype=target, name="off_value")
        (index,) = _convert_inputs(
            "OneHot",
            [("indices", indices)],
            default_dtype=np.int32,
            allowed=frozenset({_DT.DT_UINT8, _DT.DT_INT8, _DT.DT_INT32, _DT.DT_INT64}),
        )
        (count,) = _convert_inputs(
            "OneHot", [("depth", depth)], default_dtype=np.int32, allowed=frozenset({_DT.DT_INT32})
        )
        position = -1 if axis is None else axis
        out_shape: Shape = None
        if index.shape is not None:
            position = _normalize_axis(position, len(index.shape) + 1, scope, "OneHot", [index.shape])
            out_shape = (*index.shape[:position], _static_int(count), *index.shape[position:])
        attrs = {
            "T": _type_attr(target),
            "TI": _type_attr(index.datatype),
            "axis": AttrValue(i=-1 if axis is None else axis),
        }
        return _make(scope, "OneHot", [index, count, on, off], attrs, target, out_shape)


# --------------------------------------------------------------------------- indexing


def strided_slice(
    input_: Any,
    begin: Any,
    end: Any,
    strides: Any = None,
    begin_mask: int = 0,
    end_mask: int = 0,
    ellipsis_mask: int = 0,
    new_axis_mask: int = 0,
    shrink_axis_mask: int = 0,
    name: str | None = None,
) -> Tensor:
    """``StridedSlice``: the general form of ``t[...]`` indexing (see TensorFlow's docs)."""
    masks = {
        "begin_mask": begin_mask,
        "end_mask": end_mask,
        "ellipsis_mask": ellipsis_mask,
        "new_axis_mask": new_axis_mask,
        "shrink_axis_mask": shrink_axis_mask,
    }
    with name_scope(name, "StridedSlice", [input_, begin, end, strides]) as scope:
        x = convert_to_tensor(input_, name="input")
        if strides is None:
            strides = ones_like(begin)
        b, e, s = _convert_inputs(
            "StridedSlice",
            [("begin", begin), ("end", end), ("strides", strides)],
            default_dtype=np.int32,
            allowed=_INDEX,
        )
        out_shape = _sliced_shape(scope, x.shape, b, e, s, masks)
        attrs = {"T": _type_attr(x.datatype), "Index": _type_attr(b.datatype)}
        attrs.update({key: AttrValue(i=value) for key, value in masks.items()})
        return _make(scope, "StridedSlice", [x, b, e, s], attrs, x.datatype, out_shape)


def _sliced_shape(scope: str, shape: Shape, b: Tensor, e: Tensor, s: Tensor, masks: dict[str, int]) -> Shape:
    begin, end, strides = _static_axes(b), _static_axes(e), _static_axes(s)
    if shape is None or begin is None or end is None or strides is None:
        return None

    def bit(mask: str, i: int) -> bool:
        return bool(masks[mask] >> i & 1)

    spec = builtins.range(len(begin))
    from_spec = sum(1 for i in spec if not bit("ellipsis_mask", i) and not bit("new_axis_mask", i))
    shapes = [shape, b.shape, e.shape, s.shape]
    out: list[int | None] = []
    dim = 0
    for i in spec:
        if bit("ellipsis_mask", i):
            count = builtins.max(len(shape) - from_spec, 0)
            out.extend(shape[dim : dim + count])
            dim += count
        elif bit("new_axis_mask", i):
            out.append(1)
        else:
            if dim >= len(shape):
                raise _shape_error(scope, "StridedSlice", f"Index out of range using input dim {dim}", shapes)
            size = shape[dim]
            if strides[i] == 0:
                raise _shape_error(scope, "StridedSlice", f"strides[{i}] must be non-zero", shapes)
            if bit("shrink_axis_mask", i):
                if size is not None and not -size <= begin[i] < size:
                    raise _shape_error(
                        scope,
                        "StridedSlice",
                        f"slice index {begin[i]} of dimension {dim} out of bounds.",
                        shapes,
                    )
            elif size is None:
                out.append(None)
            else:
                start = None if bit("begin_mask", i) else begin[i]
                stop = None if bit("end_mask", i) else end[i]
                out.append(len(builtins.range(size)[start : stop : strides[i]]))
            dim += 1
    out.extend(shape[dim:])
    return tuple(out)


_SLICE_TYPE_ERROR: Final = (
    "Only integers, slices (`:`), ellipsis (`...`), tf.newaxis (`None`) and scalar tf.int32/tf.int64 "
    "tensors are valid indices"
)


def _check_index(index: Any) -> None:
    if isinstance(index, int | np.integer):
        return
    if (
        isinstance(index, _TensorLike)
        and _datatype_of(index) in _INDEX
        and getattr(index, "shape", None) in ((), None)
    ):
        return
    raise TypeError(f"{_SLICE_TYPE_ERROR}, got {index!r}")


def slice_helper(tensor: Tensor, slice_spec: Any) -> Tensor:
    """``tensor[slice_spec]``: ints, slices, ``...`` and ``None`` (new axis) as a StridedSlice.

    Raises:
        TypeError: For another kind of index (lists, floats, non-scalar tensors).
    """
    if not isinstance(slice_spec, tuple):
        slice_spec = (slice_spec,)
    begin: list[Any] = []
    end: list[Any] = []
    strides: list[Any] = []
    masks = dict.fromkeys(("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask"), 0)
    for index, item in enumerate(slice_spec):
        bit = 1 << index
        if isinstance(item, slice):
            for part in (item.start, item.stop, item.step):
                if part is not None:
                    _check_index(part)
            begin.append(0 if item.start is None else item.start)
            end.append(0 if item.stop is None else item.stop)
            strides.append(1 if item.step is None else item.step)
            masks["begin_mask"] |= bit if item.start is None else 0
            masks["end_mask"] |= bit if item.stop is None else 0
        elif item is Ellipsis or item is None:
            if item is Ellipsis and masks["ellipsis_mask"]:
                raise ValueError("Multiple ellipses in slice spec not allowed")
            begin.append(0)
            end.append(0)
            strides.append(1)
            masks["ellipsis_mask" if item is Ellipsis else "new_axis_mask"] |= bit
        else:
            _check_index(item)
            begin.append(item)
            end.append(item + 1)
            strides.append(1)
            masks["shrink_axis_mask"] |= bit
    parts = [v for v in (*begin, *end, *strides) if isinstance(v, _TensorLike)]
    with name_scope(None, "strided_slice", [tensor, *parts]) as scope:
        if begin:
            packed = [stack(begin), stack(end), stack(strides)]
            if builtins.any(p.datatype == _DT.DT_INT64 for p in packed):
                packed = [cast(p, np.int64) for p in packed]
        else:
            empty = constant([], dtype=np.int32)
            packed = [empty, empty, empty]
        return strided_slice(
            tensor,
            packed[0],
            packed[1],
            packed[2],
            begin_mask=masks["begin_mask"],
            end_mask=masks["end_mask"],
            ellipsis_mask=masks["ellipsis_mask"],
            new_axis_mask=masks["new_axis_mask"],
            shrink_axis_mask=masks["shrink_axis_mask"],
            name=scope,
        )


# --------------------------------------------------------------------------- random numbers

DEFAULT_GRAPH_SEED: Final = 87654321
"""The graph-level seed TensorFlow gives random ops that have an op seed in a graph without one."""
_MAX_INT32: Final = 2**31 - 1


def random_uniform(
    shape: Any,
    minval: Any = 0,
    maxval: Any = None,
    dtype: Any = np.float32,
    seed: int | None = None,
    name: str | None = None,
) -> Tensor:
    """Floats drawn uniformly from ``[minval, maxval)`` (``maxval`` defaults to 1):
    ``RandomUniform`` scaled and shifted, as `tf.compat.v1.random_uniform` builds it.

    With a `seed`, the op's seeds are the ones TensorFlow gives an op seed in a graph
    without a graph-level seed (``seed`` 87654321, ``seed2`` the op seed), so every run
    of the graph on a fresh kernel draws the same numbers; without one, fresh numbers.

    Raises:
        TypeError: For a dtype that is not a float type.
    """
    target = as_datatype(dtype)
    if target not in _FLOATS:
        raise TypeError(f"random_uniform draws floats; got dtype {dtype_name(target)}")
    with name_scope(name, "random_uniform", [shape, minval, maxval]) as scope:
        (dims,) = _convert_inputs(
            "RandomUniform",
            [("shape", shape)],
            default_dtype=np.int32,
            allowed=frozenset({_DT.DT_INT32, _DT.DT_INT64}),
        )
        low = convert_to_tensor(minval, dtype=target, name="min")
        high = convert_to_tensor(1 if maxval is None else maxval, dtype=target, name="max")
        seed1, seed2 = (0, 0) if seed is None else (DEFAULT_GRAPH_SEED, seed % _MAX_INT32)
        attrs = {
            "T": _type_attr(dims.datatype),
            "dtype": _type_attr(target),
            "seed": AttrValue(i=seed1),
            "seed2": AttrValue(i=seed2),
        }
        out_shape = _shape_of_dims(_static_ints(dims))
        drawn = get_default_graph().create_op(
            "RandomUniform", [dims], [target], name="RandomUniform", attrs=attrs, shapes=[out_shape]
        )
        scaled = multiply(drawn.outputs[0], subtract(high, low, name="sub"), name="mul")
        return add(scaled, low, name=scope)


# --------------------------------------------------------------------------- partitions and embeddings


def dynamic_partition(
    data: Any, partitions: Any, num_partitions: int, name: str | None = None
) -> list[Tensor]:
    """``DynamicPartition``: `data` split by the int32 `partitions` (shaped like a prefix
    of `data`'s shape) into `num_partitions` tensors; output ``i`` holds, in order, the
    slices of `data` whose partition is ``i``.

    Raises:
        ValueError: When `num_partitions` is less than 1.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be at least 1, got {num_partitions}")
    with name_scope(name, "DynamicPartition", [data, partitions]) as scope:
        source = convert_to_tensor(data, name="data")
        (parts,) = _convert_inputs(
            "DynamicPartition",
            [("partitions", partitions)],
            default_dtype=np.int32,
            allowed=frozenset({_DT.DT_INT32}),
        )
        out_shape: Shape = None
        if source.shape is not None and parts.shape is not None:
            out_shape = (None, *source.shape[len(parts.shape) :])
        op = get_default_graph().create_op(
            "DynamicPartition",
            [source, parts],
            [source.datatype] * num_partitions,
            name=scope,
            attrs={"T": _type_attr(source.datatype), "num_partitions": AttrValue(i=num_partitions)},
            shapes=[out_shape] * num_partitions,
        )
        return list(op.outputs)


def dynamic_stitch(indices: Sequence[Any], data: Sequence[Any], name: str | None = None) -> Tensor:
    """``DynamicStitch``: one tensor whose slice ``indices[i][j]`` is ``data[i][j]`` (a
    later position wins when indices repeat): the inverse of `dynamic_partition`.

    Raises:
        ValueError: When `indices` and `data` are empty or of different lengths.
    """
    return _stitch("DynamicStitch", indices, data, name)


def _stitch(op_type: str, indices: Sequence[Any], data: Sequence[Any], name: str | None) -> Tensor:
    if not indices or len(indices) != len(data):
        raise ValueError(
            f"{op_type} needs as many data tensors as index tensors (at least one); "
            f"got {len(indices)} and {len(data)}"
        )
    with name_scope(name, op_type, [*indices, *data]) as scope:
        positions = _convert_list(op_type, "indices", indices, allowed=frozenset({_DT.DT_INT32}))
        values = _convert_list(op_type, "data", data)
        out_shape: Shape = None
        if positions[0].shape is not None and values[0].shape is not None:
            out_shape = (None, *values[0].shape[len(positions[0].shape) :])
        attrs = {"N": AttrValue(i=len(positions)), "T": _type_attr(values[0].datatype)}
        return _make(scope, op_type, [*positions, *values], attrs, values[0].datatype, out_shape)


def embedding_lookup(params: Any, ids: Any, name: str | None = None) -> Tensor:
    """The rows `ids` of a table: TensorFlow 2's `tf.nn.embedding_lookup`.

    `params` is a tensor or `Variable`, or a list of them: the shards of one table
    split by rows ("div": shard ``i`` holds the next block of rows; when the rows do
    not divide evenly, the first shards hold one row more). Each shard is read where
    it lives (a ``ResourceGather`` colocated with a variable shard, so only the rows
    asked for leave a parameter server), the rows are put back in the order of `ids`
    (``DynamicPartition`` of the ids, ``ParallelDynamicStitch`` of the rows), and the
    gradient of a variable shard is sparse (`IndexedSlices`), so optimizers update
    only the rows looked up.

    Returns: a tensor of shape ``ids.shape + params[0].shape[1:]``.

    Raises:
        ValueError: For no shards, shards whose shapes are not static or whose rows
            differ in shape or dtype, or fewer rows than shards.
    """
    given = list(params) if isinstance(params, list | tuple) else [params]
    if not given:
        raise ValueError("embedding_lookup needs at least one shard in params")
    with name_scope(name, "embedding_lookup", [*given, ids]) as scope:
        shards: list[Any] = [
            s if isinstance(s, _TensorLike) else convert_to_tensor(s, name="params") for s in given
        ]
        if len(shards) == 1:
            with get_default_graph().colocate_with(shards[0]):
                return gather(shards[0], ids, name=scope)
        shapes = [s.shape for s in shards]
        if builtins.any(not _fully_defined(dims) or not dims for dims in shapes):
            raise ValueError(
                f"embedding_lookup needs shards of static shapes; got {[shape_text(s) for s in shapes]}"
            )
        known = [_known_dims(shape) for shape in shapes]
        row_shapes = {dims[1:] for dims in known}
        datatypes = {s.datatype for s in shards}
        if len(row_shapes) > 1 or len(datatypes) > 1:
            raise ValueError(
                "embedding_lookup: the shards' rows differ in shape or dtype: "
                f"{[shape_text(s) for s in shapes]}, {sorted(dtype_name(d) for d in datatypes)}"
            )
        total = builtins.sum(dims[0] for dims in known)
        if total < len(shards):
            raise ValueError(f"embedding_lookup: {len(shards)} shards but only {total} rows")
        (index,) = _convert_inputs("embedding_lookup", [("ids", ids)], default_dtype=np.int64, allowed=_INDEX)
        flat = reshape(index, [-1])
        positions = range(size(flat))
        per_shard, extras = divmod(total, len(shards))
        # Rows [0, extras * (per_shard + 1)) are in the first `extras` shards (one row more each).
        shard_of = maximum(floordiv(flat, per_shard + 1), floordiv(flat - extras, per_shard))
        row = where(less(shard_of, extras), floormod(flat, per_shard + 1), floormod(flat - extras, per_shard))
        shard_of = cast(shard_of, np.int32)
        rows_by_shard = dynamic_partition(row, shard_of, len(shards))
        positions_by_shard = dynamic_partition(positions, shard_of, len(shards))
        found = []
        for shard, shard_rows in zip(shards, rows_by_shard, strict=True):
            with get_default_graph().colocate_with(shard):
                found.append(gather(shard, shard_rows))
        stitched = _stitch("ParallelDynamicStitch", positions_by_shard, found, None)
        row_dims = list(known[0][1:])
        if _fully_defined(index.shape):
            return reshape(stitched, [*_known_dims(index.shape), *row_dims], name=scope)
        looked_up = reshape(
            stitched, concat([shape(index), constant(np.array(row_dims, np.int32))], 0), name=scope
        )
        if index.shape is not None:
            looked_up.set_shape((*index.shape, *row_dims))
        return looked_up


# --------------------------------------------------------------------------- operators

# Python operator -> (op constructor, whether TensorFlow opens a lower-case scope for it).
_OPERATORS: Final[dict[str, tuple[Callable[..., Tensor], bool]]] = {
    "add": (add, True),
    "sub": (subtract, True),
    "mul": (multiply, True),
    "truediv": (truediv, True),
    "floordiv": (floordiv, True),
    "mod": (floormod, True),
    "pow": (pow, True),
    "matmul": (matmul, True),
    "and": (logical_and, True),
    "or": (logical_or, True),
    "Less": (less, False),
    "LessEqual": (less_equal, False),
    "Greater": (greater, False),
    "GreaterEqual": (greater_equal, False),
}


def binary_operator(py_name: str, x: Any, y: Any) -> Tensor:
    """Build the op of a Python binary operator, named as TensorFlow names it.

    Arithmetic operators open a scope named after the Python operator (``add``,
    ``sub``, ``mul``, ``truediv``, ``matmul``, ...), so ``x + 1.0`` gives ``add/y``
    and ``add``; comparisons use the op's own name (``Less``).

    Args:
        py_name: A key of the operator table (``"add"``, ``"Less"``, ...).
        x: The left operand.
        y: The right operand.
    """
    function, scoped = _OPERATORS[py_name]
    if not scoped:
        return function(x, y)
    with name_scope(None, py_name, [x, y]) as scope:
        return function(x, y, name=scope)


register_operator_builders(
    {
        "binary": binary_operator,
        "negative": negative,
        "abs": abs,
        "logical_not": logical_not,
        "slice": slice_helper,
    }
)
