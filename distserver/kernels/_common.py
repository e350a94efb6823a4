"""Helpers shared by the numpy kernels: dtype groups, TF-style texts, input checks.

Every error raised through `kernel_error` names the node in TensorFlow's style
(`"...\\n\\t [[{{node NAME}}]]"`) and carries `node_name`, so the executor passes it
on unchanged and clients see the text TensorFlow would have shown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, TypeVar

import ml_dtypes
import numpy as np

from distserver import errors, tensors
from distserver.protos import types_pb2
from distserver.tensors import ResourceHandle, as_datatype, as_numpy_dtype, shape_from_proto

if TYPE_CHECKING:
    from distserver.kernels.registry import OpKernel

# --------------------------------------------------------------------------- dtype groups

DTypes = frozenset[np.dtype[Any]]

BFLOAT16: Final[np.dtype[Any]] = np.dtype(ml_dtypes.bfloat16)
BOOL: Final[np.dtype[Any]] = np.dtype(np.bool_)
INT32: Final[np.dtype[Any]] = np.dtype(np.int32)
INT64: Final[np.dtype[Any]] = np.dtype(np.int64)
OBJECT: Final[np.dtype[Any]] = np.dtype(object)  # DT_STRING and DT_RESOURCE values


def _dtypes(datatypes: frozenset[int]) -> DTypes:
    # The groups are defined once, as DataTypes, in `distserver.tensors`.
    return frozenset(as_numpy_dtype(datatype) for datatype in datatypes)


FLOATS: Final = _dtypes(tensors.FLOAT_DATATYPES)
COMPLEX: Final = _dtypes(tensors.COMPLEX_DATATYPES)
SIGNED: Final = _dtypes(tensors.SIGNED_DATATYPES)
UNSIGNED: Final = _dtypes(tensors.UNSIGNED_DATATYPES)
INTEGERS: Final = SIGNED | UNSIGNED
REAL: Final = FLOATS | INTEGERS
NUMBER: Final = REAL | COMPLEX
ALL_TYPES: Final = NUMBER | {BOOL, OBJECT}
INDEX_TYPES: Final = _dtypes(tensors.INDEX_DATATYPES)

# numpy has no native bfloat16 kernels for everything (matmul returns float32,
# transcendental functions are slow); such ops compute in float32 and cast back.
_COMPUTE_DTYPE: Final = {BFLOAT16: np.dtype(np.float32)}


def compute_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype numpy should compute in for values of `dtype`."""
    return _COMPUTE_DTYPE.get(dtype, dtype)


# --------------------------------------------------------------------------- texts


def type_name(dtype: np.dtype[Any] | int) -> str:
    """TensorFlow's `DataTypeString`: "float", "int32", "string", "bfloat16", ..."""
    datatype = dtype if isinstance(dtype, int) else as_datatype(dtype)
    try:
        return types_pb2.DataType.Name(datatype)[3:].lower()  # type: ignore[arg-type]
    except ValueError:
        return f"DataType({datatype})"


def enum_name(dtype: np.dtype[Any]) -> str:
    """The DataType enum name of `dtype`, e.g. "DT_FLOAT"."""
    return types_pb2.DataType.Name(as_datatype(dtype))  # type: ignore[arg-type]


def shape_str(shape: Iterable[int | None] | None) -> str:
    """TensorFlow's `TensorShape::DebugString`: "[2,3]", "[]", "[?,3]", "<unknown>"."""
    if shape is None:
        return "<unknown>"
    return "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


def kernel_error(
    kernel: OpKernel, message: str, cls: type[errors.OpError] = errors.InvalidArgumentError
) -> errors.OpError:
    """An error of type `cls` whose message and `node_name` name `kernel`'s node."""
    return errors.with_node(cls(message), kernel.name)


# --------------------------------------------------------------------------- attrs


def attr_type_in(
    kernel: OpKernel, attr: str, allowed: Iterable[np.dtype[Any]], **default: Any
) -> np.dtype[Any]:
    """Read the type attr `attr` and refuse types the kernel has no implementation for.

    The text is TensorFlow's, raised when a graph names an unregistered kernel.
    """
    dtype = kernel.attr_type(attr, default.get("default"))
    allowed = frozenset(allowed)
    if dtype not in allowed:
        names = ", ".join(sorted(enum_name(t) for t in allowed))
        raise errors.with_node(
            errors.InvalidArgumentError(
                f"No OpKernel was registered to support Op '{kernel.op}' used by {{{{node {kernel.name}}}}} "
                f"with these attrs: [{attr}={enum_name(dtype)}]. distserver supports {attr} in [{names}]"
            ),
            kernel.name,
        )
    return dtype


def attr_type_list(kernel: OpKernel, attr: str) -> list[np.dtype[Any]]:
    """Read a `list(type)` attr as numpy dtypes."""
    return [as_numpy_dtype(t) for t in kernel._attr(attr).list.type]


def attr_shape(kernel: OpKernel, attr: str) -> tuple[int | None, ...] | None:
    """Read a `shape` attr; None for unknown rank, None entries for unknown dims."""
    return shape_from_proto(kernel._attr(attr).shape)


# --------------------------------------------------------------------------- inputs


def check_input_dtype(kernel: OpKernel, index: int, value: np.ndarray, expected: np.dtype[Any]) -> None:
    """Refuse input `index` unless it has dtype `expected` (the node's type attr)."""
    if value.dtype != expected:
        raise kernel_error(
            kernel,
            f"{kernel.op} input {index} has type {_value_type_name(value)} but the node expects "
            f"{type_name(expected)}",
        )


def _value_type_name(value: np.ndarray) -> str:
    try:
        return type_name(value.dtype)
    except TypeError:
        return str(value.dtype)


def int_list(kernel: OpKernel, value: np.ndarray, what: str, *, allow_scalar: bool = False) -> list[int]:
    """The values of an int32/int64 vector input (e.g. a shape or a list of axes)."""
    if value.dtype not in INDEX_TYPES:
        raise kernel_error(kernel, f"{what} must be int32 or int64, got {_value_type_name(value)}")
    if value.ndim != 1 and not (allow_scalar and value.ndim == 0):
        raise kernel_error(kernel, f"{what} must be a vector, got shape {shape_str(value.shape)}")
    return value.reshape(-1).tolist()  # type: ignore[no-any-return]


def int_scalar(kernel: OpKernel, value: np.ndarray, what: str) -> int:
    """The value of a 0-d integer input."""
    if value.dtype not in INTEGERS:
        raise kernel_error(kernel, f"{what} must be an integer, got {_value_type_name(value)}")
    if value.ndim != 0:
        raise kernel_error(kernel, f"{what} must be a scalar, got shape {shape_str(value.shape)}")
    return int(value)


def normalize_axis(kernel: OpKernel, axis: int, rank: int, what: str = "axis") -> int:
    """`axis` in [0, rank), from TF's accepted range [-rank, rank)."""
    if not -rank <= axis < rank:
        raise kernel_error(kernel, f"Expected {what} in the range [{-rank}, {rank}), but got {axis}")
    return axis + rank if axis < 0 else axis


def broadcast_shape(kernel: OpKernel, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    """The numpy/TF broadcast of `shapes`, or TF's "Incompatible shapes" error."""
    if len(shapes) == 2:  # what the binary kernels ask: by hand (np.broadcast_shapes: ~2 us)
        a, b = shapes
        if a == b:
            return tuple(a)
        if len(a) < len(b):
            a, b = b, a
        out = list(a)
        offset = len(a) - len(b)
        for i, size in enumerate(b):
            have = out[offset + i]
            if have == 1:
                out[offset + i] = size
            elif size != 1 and size != have:
                break
        else:
            return tuple(out)
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise kernel_error(
            kernel, "Incompatible shapes: " + " vs. ".join(shape_str(s) for s in shapes)
        ) from None


_F = TypeVar("_F", bound=Callable[..., Any])


# True in a context whose numpy floating-point warnings are already off (a step of an
# executor, `warnings_off`): `quiet` functions then skip entering an errstate of their own.
_WARNINGS_OFF: ContextVar[bool] = ContextVar("distserver_fp_warnings_off", default=False)


def quiet(fn: _F) -> _F:
    """`fn`, run with numpy's floating-point warnings off (TF computes inf and nan
    silently). For the numeric part of a hot kernel, wrapped once when the kernel is
    built. Inside `warnings_off` (an executor's step) `fn` runs as it is: the step
    turned the warnings off once, instead of every kernel (0.33 vs 0.76 us a call,
    and kernels run hundreds of times a step); elsewhere (a thread of the pool, a
    kernel called directly) numpy's errstate is entered around it. Never wrap a
    kernel's `compute` itself (the registry wraps those, see `OpKernel.__init_subclass__`)."""
    guarded = np.errstate(all="ignore")(fn)

    def run(*args: Any, **kwargs: Any) -> Any:
        if _WARNINGS_OFF.get():
            return fn(*args, **kwargs)
        return guarded(*args, **kwargs)

    return run  # type: ignore[return-value]


@contextmanager
def warnings_off() -> Iterator[None]:
    """numpy's floating-point warnings off in this context (a task's, or a thread's), and
    `quiet` functions told so."""
    with np.errstate(all="ignore"):
        token = _WARNINGS_OFF.set(True)
        try:
            yield
        finally:
            _WARNINGS_OFF.reset(token)


def array(value: Any, dtype: np.dtype[Any] | None = None) -> np.ndarray:
    """`value` as an ndarray of `dtype`: ufuncs on 0-d arrays return numpy scalars."""
    result = np.asarray(value)
    if dtype is not None and result.dtype != dtype:
        result = result.astype(dtype)
    return result


# --------------------------------------------------------------------------- resources


def handle_input(kernel: OpKernel, value: Any) -> ResourceHandle:
    """The `ResourceHandle` a DT_RESOURCE input holds."""
    handle = value[()] if isinstance(value, np.ndarray) and value.ndim == 0 else value
    if not isinstance(handle, ResourceHandle):
        raise kernel_error(
            kernel, f"{kernel.op} expects a resource handle as input 0, got {type(handle).__name__}"
        )
    return handle


def handle_output(handle: ResourceHandle) -> np.ndarray:
    """A 0-d DT_RESOURCE value holding `handle`."""
    out = np.empty((), dtype=object)
    out[()] = handle
    return out


def summarize(value: np.ndarray, limit: int) -> str:
    """TensorFlow's `Tensor::SummarizeValue(limit)`, as used by `Assert`'s message."""
    flat = value.reshape(-1)
    count = min(flat.size, flat.size if limit < 0 else limit)
    items = [_element_text(v) for v in flat[:count].tolist()]
    shape = value.shape
    if not shape:
        text = " ".join(items)
    else:
        parts: list[str] = []
        _summarize_dim(shape, 0, items, [0], parts)
        text = "".join(parts)
    return text + ("..." if flat.size > count else "")


def _summarize_dim(
    shape: Sequence[int], dim: int, items: list[str], cursor: list[int], out: list[str]
) -> None:
    # Mirrors TensorFlow's PrintOneDim: nested brackets, cut off after `len(items)`.
    limit = len(items)
    if cursor[0] >= limit:
        return
    if dim == len(shape) - 1:
        for i in range(shape[dim]):
            if cursor[0] >= limit:
                if dim != 0:
                    out.append("...")
                return
            if i > 0:
                out.append(" ")
            out.append(items[cursor[0]])
            cursor[0] += 1
        return
    for _ in range(shape[dim]):
        opened = cursor[0] < limit
        if opened:
            out.append("[")
        _summarize_dim(shape, dim + 1, items, cursor, out)
        if cursor[0] < limit or opened:
            out.append("]")


def _element_text(value: Any) -> str:
    if isinstance(value, bytes):
        return repr(value)[2:-1]  # C-style escapes, like TF's CEscape
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


# --------------------------------------------------------------------------- scatter updates

SCATTER_MODES = {"Add": np.add, "Sub": np.subtract, "Update": None}


def scatter(
    kernel: OpKernel, current: np.ndarray, indices: np.ndarray, updates: np.ndarray, mode: str
) -> np.ndarray:
    """A new array: `current` with rows `indices` added to, subtracted from or replaced by `updates`.

    `updates` has shape `indices.shape + current.shape[1:]` (or is a scalar, applied to
    every row named). Repeated indices all count for Add/Sub (the last wins for
    Update). Indices outside [0, rows) are TF's InvalidArgumentError.
    """
    if current.ndim == 0:
        raise kernel_error(kernel, "Scatter op requires a variable of rank >= 1")
    limit = current.shape[0]
    flat = indices.reshape(-1)
    bad = np.flatnonzero((flat < 0) | (flat >= limit))
    if bad.size:
        raise kernel_error(kernel, f"indices[{int(bad[0])}] = {int(flat[bad[0]])} is not in [0, {limit})")
    row_shape = current.shape[1:]
    if updates.ndim == 0:
        rows = np.broadcast_to(updates, (flat.size, *row_shape))
    elif updates.shape != indices.shape + row_shape:
        raise kernel_error(
            kernel,
            "updates must have shape indices.shape + params.shape[1:] or be a scalar, got "
            f"updates.shape {shape_str(updates.shape)}, indices.shape {shape_str(indices.shape)}, "
            f"params.shape {shape_str(current.shape)}",
        )
    else:
        rows = updates.reshape((flat.size, *row_shape))
    result = np.array(current, copy=True)
    fn = SCATTER_MODES[mode]
    with np.errstate(all="ignore"):
        if fn is None:
            result[flat] = rows
        else:
            fn.at(result, flat, rows)
    return result
