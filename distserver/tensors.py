"""Tensor values as numpy arrays, and their `TensorProto` wire form.

A tensor value in distserver is a numpy array (0-d for a scalar):

* numeric dtypes are the matching numpy dtypes (DT_BFLOAT16 is `ml_dtypes.bfloat16`);
* DT_STRING tensors are object arrays of `bytes`;
* DT_RESOURCE tensors are object arrays of `ResourceHandle` (one handle, 0-d, for a
  variable);
* DT_VARIANT tensors are object arrays of `VariantTensorDataProto`, or of values with a
  `to_variant_proto()` method (kernels' variants, such as TensorLists), encoded by it.

`to_tensor_proto` writes numeric tensors as `tensor_content` (the raw little-endian,
row-major buffer, as TensorFlow's `AsProtoTensorContent` does), strings as
`string_val`, resources as `resource_handle_val` and variants as `variant_val`.

`from_tensor_proto` reads everything TensorFlow writes: `tensor_content` for every
dtype (strings, resources and variants in TensorFlow's length-prefixed list encoding),
or the typed `*_val` field of the dtype, where fewer values than elements are padded
with the last value (the one-element broadcast of the proto's comment is the common
case) and no values at all mean zeros.

Padding lets a few bytes claim any amount of memory (a shape of ``[2**40]`` with no
values), so every decode is charged to a `DecodeBudget` before anything is
allocated: by default each tensor may take `DEFAULT_DECODE_LIMIT_BYTES`; callers
that decode a whole request share one budget across its tensors.

Example::

    >>> proto = to_tensor_proto([1.0, 2.0])
    >>> datatype_name(proto.dtype), shape_from_proto(proto.tensor_shape)
    ('DT_FLOAT', (2,))
    >>> from_tensor_proto(proto)
    array([1., 2.], dtype=float32)
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Final, SupportsIndex, cast

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

from distserver import errors
from distserver.protos import types_pb2
from distserver.protos.resource_handle_pb2 import ResourceHandleProto
from distserver.protos.tensor_pb2 import TensorProto, VariantTensorDataProto
from distserver.protos.tensor_shape_pb2 import TensorShapeProto

__all__ = [
    "BOOL_DATATYPES",
    "COMPLEX_DATATYPES",
    "DEFAULT_DECODE_LIMIT_BYTES",
    "FLOAT_DATATYPES",
    "INDEX_DATATYPES",
    "INTEGER_DATATYPES",
    "MAX_RANK",
    "SIGNED_DATATYPES",
    "UNSIGNED_DATATYPES",
    "DecodeBudget",
    "ResourceHandle",
    "Shape",
    "as_datatype",
    "as_numpy_dtype",
    "datatype_name",
    "decode_elements",
    "decode_tensors",
    "from_tensor_proto",
    "holdable",
    "make_tensor_proto",
    "shape_from_proto",
    "shape_to_proto",
    "tensor_nbytes",
    "to_tensor_proto",
    "write_tensor_proto",
]

Shape = tuple[int | None, ...]
"""A possibly partial shape: `None` marks a dimension of unknown size."""

_DT = types_pb2
_REF_OFFSET: Final = 100
_OBJECT: Final = np.dtype(object)
_BFLOAT16: Final = np.dtype(ml_dtypes.bfloat16)

# DataType -> numpy dtype, for every base type distserver can hold.
_NUMPY_BY_DATATYPE: Final[dict[int, np.dtype[Any]]] = {
    _DT.DT_FLOAT: np.dtype(np.float32),
    _DT.DT_DOUBLE: np.dtype(np.float64),
    _DT.DT_INT32: np.dtype(np.int32),
    _DT.DT_UINT8: np.dtype(np.uint8),
    _DT.DT_INT16: np.dtype(np.int16),
    _DT.DT_INT8: np.dtype(np.int8),
    _DT.DT_STRING: _OBJECT,
    _DT.DT_COMPLEX64: np.dtype(np.complex64),
    _DT.DT_INT64: np.dtype(np.int64),
    _DT.DT_BOOL: np.dtype(np.bool_),
    _DT.DT_BFLOAT16: _BFLOAT16,
    _DT.DT_UINT16: np.dtype(np.uint16),
    _DT.DT_COMPLEX128: np.dtype(np.complex128),
    _DT.DT_HALF: np.dtype(np.float16),
    _DT.DT_RESOURCE: _OBJECT,
    _DT.DT_VARIANT: _OBJECT,
    _DT.DT_UINT32: np.dtype(np.uint32),
    _DT.DT_UINT64: np.dtype(np.uint64),
}

# Numeric (memcpy-able) numpy dtype, in native byte order -> DataType.
_DATATYPE_BY_NUMPY: Final[dict[np.dtype[Any], int]] = {
    dtype: datatype for datatype, dtype in _NUMPY_BY_DATATYPE.items() if dtype != _OBJECT
}

# The numpy dtypes whose arrays are written as they are to `tensor_content` (little-endian
# machines: the wire's byte order is theirs) -> DataType.
_CONTENT_DATATYPE_BY_NUMPY: Final[dict[np.dtype[Any], int]] = (
    dict(_DATATYPE_BY_NUMPY) if sys.byteorder == "little" else {}
)

# Names numpy does not know (or knows differently) but TensorFlow users write.
_DATATYPE_BY_TF_NAME: Final[dict[str, int]] = {
    "string": _DT.DT_STRING,
    "resource": _DT.DT_RESOURCE,
    "variant": _DT.DT_VARIANT,
    "bfloat16": _DT.DT_BFLOAT16,
}

# Dtype groups, as DataType values: the one definition (graph ops and kernels derive
# theirs from these).
FLOAT_DATATYPES: Final = frozenset({_DT.DT_HALF, _DT.DT_BFLOAT16, _DT.DT_FLOAT, _DT.DT_DOUBLE})
COMPLEX_DATATYPES: Final = frozenset({_DT.DT_COMPLEX64, _DT.DT_COMPLEX128})
SIGNED_DATATYPES: Final = frozenset({_DT.DT_INT8, _DT.DT_INT16, _DT.DT_INT32, _DT.DT_INT64})
UNSIGNED_DATATYPES: Final = frozenset({_DT.DT_UINT8, _DT.DT_UINT16, _DT.DT_UINT32, _DT.DT_UINT64})
INTEGER_DATATYPES: Final = SIGNED_DATATYPES | UNSIGNED_DATATYPES
INDEX_DATATYPES: Final = frozenset({_DT.DT_INT32, _DT.DT_INT64})
BOOL_DATATYPES: Final = frozenset({_DT.DT_BOOL})

# Kinds of values a python input may hold for each numeric target, so that e.g.
# `to_tensor_proto([1.5], dtype="int32")` is refused instead of truncated (as TF does).
_ACCEPTED_KINDS: Final[dict[frozenset[int], str]] = {
    BOOL_DATATYPES: "b",
    INTEGER_DATATYPES: "biu",
    FLOAT_DATATYPES: "biuf",
    COMPLEX_DATATYPES: "biufc",
}

# TensorFlow refuses to build a TensorProto whose content is 2 GiB or more: protobuf
# cannot serialize it.
_MAX_CONTENT_BYTES: Final = (1 << 31) - 1

_INT32_MIN: Final = -(1 << 31)
_INT32_MAX: Final = (1 << 31) - 1


# --------------------------------------------------------------------------- dtypes


def datatype_name(datatype: int) -> str:
    """Return the enum name of a DataType value, e.g. ``"DT_FLOAT"`` for 1.

    Args:
        datatype: A `DataType` enum value.

    Returns:
        The name; ``"DataType(<n>)"`` for a value the enum does not define, so the
        function is safe to use while formatting error messages.
    """
    try:
        return _DT.DataType.Name(datatype)
    except ValueError:
        return f"DataType({datatype})"


def _base_datatype(datatype: int) -> int:
    # DT_*_REF = 100 + base; a reference carries the same values as its base type.
    if datatype > _REF_OFFSET and datatype - _REF_OFFSET in _NUMPY_BY_DATATYPE:
        return datatype - _REF_OFFSET
    return datatype


def as_numpy_dtype(datatype: int) -> np.dtype[Any]:
    """Return the numpy dtype that holds values of a DataType.

    Reference types (``DT_FLOAT_REF`` = 101, ...) map like their base type. DT_STRING,
    DT_RESOURCE and DT_VARIANT map to the object dtype.

    Args:
        datatype: A `DataType` enum value.

    Returns:
        The numpy dtype; DT_BFLOAT16 gives ``ml_dtypes.bfloat16``, DT_HALF float16.

    Raises:
        errors.InvalidArgumentError: For DT_INVALID, the quantized types (DT_QINT8, ...)
            and values the enum does not define.
    """
    dtype = _NUMPY_BY_DATATYPE.get(_base_datatype(datatype))
    if dtype is None:
        raise errors.InvalidArgumentError(
            f"Tensors of type {datatype_name(datatype)} are not supported by distserver (no numpy equivalent)"
        )
    return dtype


def as_datatype(dtype_like: Any) -> int:
    """Return the DataType enum value for a numpy dtype or something naming one.

    Accepted: a numpy dtype or scalar type (``np.float32``), a python type (following
    numpy: ``float`` is float64 -> DT_DOUBLE, ``int`` is int64 -> DT_INT64), a string
    numpy understands (``"float32"``, ``"<i8"``, ``"bfloat16"``), a TensorFlow name
    (``"string"``, ``"resource"``, ``"variant"``) or enum name (``"DT_FLOAT"``), a
    DataType enum value, or an object with an ``as_datatype_enum`` attribute (such as
    ``tf.float32``). Text, bytes and object dtypes (``str``, ``bytes``, ``np.str_``,
    ``object``) map to DT_STRING. Byte order is ignored.

    Args:
        dtype_like: The dtype to convert.

    Returns:
        The `DataType` enum value.

    Raises:
        TypeError: When `dtype_like` names no DataType distserver supports.
    """
    if isinstance(dtype_like, np.dtype):  # (most calls: an array's dtype, in native byte order)
        found = _DATATYPE_BY_NUMPY.get(dtype_like)
        if found is not None:
            return found
    if isinstance(dtype_like, bool) or dtype_like is None:
        raise TypeError(f"Cannot convert {dtype_like!r} to a tensor DataType")
    if isinstance(dtype_like, int):
        if datatype_name(dtype_like).startswith("DataType("):
            raise TypeError(f"{dtype_like} is not a DataType enum value")
        return int(dtype_like)
    enum = getattr(dtype_like, "as_datatype_enum", None)
    if isinstance(enum, int) and not isinstance(dtype_like, np.dtype | type):
        return as_datatype(enum)
    if isinstance(dtype_like, str):
        if dtype_like.startswith("DT_"):
            try:
                return int(_DT.DataType.Value(dtype_like))
            except ValueError:
                raise TypeError(f"{dtype_like!r} is not a DataType enum name") from None
        if dtype_like in _DATATYPE_BY_TF_NAME:
            return _DATATYPE_BY_TF_NAME[dtype_like]
    try:
        dtype = np.dtype(dtype_like)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"Cannot convert {dtype_like!r} to a tensor DataType: {exc}") from None
    if dtype.kind in "USO":
        return _DT.DT_STRING
    datatype = _DATATYPE_BY_NUMPY.get(dtype.newbyteorder("="))
    if datatype is None:
        raise TypeError(
            f"Cannot convert {dtype_like!r} to a tensor DataType: numpy dtype {dtype} has no "
            "TensorFlow equivalent"
        )
    return datatype


# --------------------------------------------------------------------------- shapes


def shape_to_proto(shape: Iterable[SupportsIndex | None] | None) -> TensorShapeProto:
    """Return the TensorShapeProto of a shape.

    Args:
        shape: ``None`` for a shape of unknown rank, else the dimension sizes (ints or
            numpy integers); a size of ``None`` (or -1) is an unknown dimension. ``()``
            is a scalar.

    Returns:
        The proto: ``unknown_rank`` set for ``None``; unknown dimensions as size -1.

    Raises:
        ValueError: For a negative size other than -1.
        TypeError: For a size that is not an integer.
    """
    proto = TensorShapeProto()
    if shape is None:
        proto.unknown_rank = True
        return proto
    for size in shape:
        if size is None:
            proto.dim.add(size=-1)
            continue
        value = operator.index(size)
        if value < -1:
            raise ValueError(f"Dimension sizes must be >= 0 (or None/-1 for unknown), got {value}")
        proto.dim.add(size=value)
    return proto


def shape_from_proto(proto: TensorShapeProto) -> Shape | None:
    """Return the shape a TensorShapeProto describes.

    Args:
        proto: The shape proto.

    Returns:
        ``None`` when the rank is unknown, else a tuple of sizes with ``None`` for
        unknown (-1) dimensions.

    Raises:
        errors.InvalidArgumentError: For a size below -1.
    """
    if proto.unknown_rank:
        return None
    sizes: list[int | None] = []
    for dim in proto.dim:
        if dim.size < -1:
            raise errors.InvalidArgumentError(f"Shape {_shape_text(proto)} has a negative dimension")
        sizes.append(None if dim.size == -1 else dim.size)
    return tuple(sizes)


def _shape_text(proto: TensorShapeProto) -> str:
    # TensorFlow's PartialTensorShape::DebugString form: "[2,?]" or "<unknown>".
    if proto.unknown_rank:
        return "<unknown>"
    return "[" + ",".join("?" if d.size == -1 else str(d.size) for d in proto.dim) + "]"


# The most dimensions a numpy array, so a tensor value here, may have (TensorFlow's
# limit is 254): a TensorProto with more is refused before its shape is used.
MAX_RANK: Final = 64

_MAX_ARRAY_BYTES: Final = int(np.iinfo(np.intp).max)


def holdable(shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether numpy can make an array of `shape` with elements of `itemsize` bytes,
    memory aside: its sizes other than 0 multiplied by `itemsize` must fit an intp,
    even when a 0 makes it empty (numpy refuses [0, 2**45, 2**45])."""
    return math.prod(max(size, 1) for size in shape) * itemsize <= _MAX_ARRAY_BYTES


# Shape protos of fully known shapes, by shape: a step sends the same shapes every time.
_SHAPE_PROTOS: dict[tuple[int, ...], TensorShapeProto] = {}
_SHAPE_PROTOS_KEPT = 1024


def _known_shape_proto(shape: tuple[int, ...]) -> TensorShapeProto:
    """`shape_to_proto(shape)` of an array's shape, from a bounded cache (callers copy it:
    a message field set from a message takes a copy)."""
    proto = _SHAPE_PROTOS.get(shape)
    if proto is None:
        if len(_SHAPE_PROTOS) >= _SHAPE_PROTOS_KEPT:
            _SHAPE_PROTOS.clear()
        proto = _SHAPE_PROTOS[shape] = shape_to_proto(shape)
    return proto


# Fully known shapes by their protos' wire bytes (serialising a shape proto is cheaper
# than reading its dims one by one); bounded, as a peer could send any number of shapes.
_SHAPES_BY_WIRE: dict[bytes, tuple[int, ...]] = {}


def _known_shape(shape_proto: TensorShapeProto) -> tuple[int, ...] | None:
    """The sizes of `shape_proto`, or None when its rank or a size is unknown, or it has
    more than `MAX_RANK` dimensions (never cached)."""
    if len(shape_proto.dim) > MAX_RANK:
        return None
    wire = shape_proto.SerializeToString()
    shape = _SHAPES_BY_WIRE.get(wire)
    if shape is None:
        if shape_proto.unknown_rank:
            return None
        shape = tuple(dim.size for dim in shape_proto.dim)
        if min(shape, default=0) < 0:
            return None
        if len(_SHAPES_BY_WIRE) >= _SHAPE_PROTOS_KEPT:
            _SHAPES_BY_WIRE.clear()
        _SHAPES_BY_WIRE[wire] = shape
    return shape


def _value_shape(proto: TensorProto) -> tuple[int, ...]:
    # A tensor value needs every dimension known, and at most `MAX_RANK` of them.
    shape_proto = proto.tensor_shape
    if len(shape_proto.dim) > MAX_RANK:
        raise errors.InvalidArgumentError(
            f"TensorProto of type {datatype_name(proto.dtype)} has {len(shape_proto.dim)} dimensions; "
            f"a tensor value here has at most {MAX_RANK} (numpy's limit)"
        )
    if shape_proto.unknown_rank or any(dim.size < 0 for dim in shape_proto.dim):
        raise errors.InvalidArgumentError(
            f"TensorProto of type {datatype_name(proto.dtype)} has shape {_shape_text(shape_proto)}; "
            "a tensor value needs a fully defined shape"
        )
    return tuple(dim.size for dim in shape_proto.dim)


# --------------------------------------------------------------------------- resources


@dataclasses.dataclass(frozen=True)
class ResourceHandle:
    """Names a resource (such as a variable) that lives on one device.

    A DT_RESOURCE tensor is an object array of handles; a variable's handle is a 0-d
    array holding one. The wire form is `ResourceHandleProto`.

    Attributes:
        device: Full name of the device holding the resource.
        container: Container in that device's resource manager ("" is the default one).
        name: Name of the resource within its container.
        dtype: Dtype of the value the resource holds, when known.
        shape: Shape of that value (``None`` entries for unknown dimensions), when known.
        hash_code: TensorFlow's hash of the resource's C++ type (kept for round trips).
        maybe_type_name: TensorFlow's name of that C++ type (kept for round trips).

    Only one (dtype, shape) pair is kept: `from_proto` ignores any further entries of
    ``dtypes_and_shapes`` (TensorFlow variables have exactly one).
    """

    device: str
    container: str
    name: str
    dtype: np.dtype[Any] | None = None
    shape: Shape | None = None
    hash_code: int = 0
    maybe_type_name: str = ""

    def __post_init__(self) -> None:
        if self.dtype is not None and not isinstance(self.dtype, np.dtype):
            object.__setattr__(self, "dtype", as_numpy_dtype(as_datatype(self.dtype)))
        if self.shape is not None and not isinstance(self.shape, tuple):
            object.__setattr__(self, "shape", tuple(self.shape))

    def to_proto(self) -> ResourceHandleProto:
        """Return the `ResourceHandleProto` of this handle."""
        proto = ResourceHandleProto(
            device=self.device,
            container=self.container,
            name=self.name,
            hash_code=self.hash_code,
            maybe_type_name=self.maybe_type_name,
        )
        if self.dtype is not None or self.shape is not None:
            entry = proto.dtypes_and_shapes.add()
            entry.dtype = cast(
                types_pb2.DataType,
                _DT.DT_INVALID if self.dtype is None else as_datatype(self.dtype),
            )
            entry.shape.CopyFrom(shape_to_proto(self.shape))
        return proto

    @classmethod
    def from_proto(cls, proto: ResourceHandleProto) -> ResourceHandle:
        """Return the handle a `ResourceHandleProto` describes.

        Raises:
            errors.InvalidArgumentError: When the handle's dtype is not supported.
        """
        dtype: np.dtype[Any] | None = None
        shape: Shape | None = None
        if proto.dtypes_and_shapes:
            entry = proto.dtypes_and_shapes[0]
            if entry.dtype != _DT.DT_INVALID:
                dtype = as_numpy_dtype(entry.dtype)
            shape = shape_from_proto(entry.shape)
        return cls(
            device=proto.device,
            container=proto.container,
            name=proto.name,
            dtype=dtype,
            shape=shape,
            hash_code=proto.hash_code,
            maybe_type_name=proto.maybe_type_name,
        )


# --------------------------------------------------------------------------- numpy -> proto


def to_tensor_proto(value: Any, dtype: Any = None) -> TensorProto:
    """Return the TensorProto of a tensor value.

    `value` is a numpy array or scalar, a `ResourceHandle`, or anything `np.asarray`
    accepts (python scalars, nested lists). Like TensorFlow's `make_tensor_proto`,
    python values (not numpy ones) are narrowed when no `dtype` is given: floats become
    float32 (not numpy's float64) and integers int32 when every value fits (else
    int64). Numpy arrays and scalars keep their dtype. Python text and bytes become
    DT_STRING (``str`` is encoded as UTF-8, and no trailing NUL is lost).

    Numeric tensors are written to ``tensor_content`` as one little-endian, C-order
    buffer (one copy of the data; big-endian and non-contiguous inputs are handled).

    Args:
        value: The tensor value.
        dtype: The DataType to write (anything `as_datatype` accepts); the value is
            converted to it. Default: the value's own dtype.

    Returns:
        A new TensorProto.

    Raises:
        TypeError: When the value cannot be converted (e.g. text to a numeric dtype,
            ``1.5`` to an integer dtype, an object array holding other objects).
        ValueError: For ragged nested lists, python integers out of the dtype's range, or
            numeric content of 2 GiB or more.
    """
    if dtype is None:
        proto = TensorProto()
        if _write_numeric(proto, value):
            return proto
    datatype = None if dtype is None else _base_datatype(as_datatype(dtype))
    if datatype is not None:
        as_numpy_dtype(datatype)  # Refuse unsupported types early.
    array = _as_array(value, datatype)
    if datatype is None:
        datatype = _infer_datatype(array)

    proto = TensorProto()
    proto.dtype = cast(types_pb2.DataType, datatype)
    proto.tensor_shape.CopyFrom(shape_to_proto(array.shape))
    if datatype == _DT.DT_STRING:
        proto.string_val.extend(_string_elements(array))
    elif datatype == _DT.DT_RESOURCE:
        proto.resource_handle_val.extend(_resource_elements(array))
    elif datatype == _DT.DT_VARIANT:
        proto.variant_val.extend(_variant_elements(array))
    else:
        if array.nbytes > _MAX_CONTENT_BYTES:
            raise ValueError("Cannot create a tensor proto whose content is larger than 2GB.")
        if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
            array = array.astype(array.dtype.newbyteorder("<"))
        # tobytes(order="C") copies once, whatever the input's strides.
        proto.tensor_content = array.tobytes(order="C")
    return proto


make_tensor_proto = to_tensor_proto
"""Alias of `to_tensor_proto`, named like TensorFlow's function."""


def write_tensor_proto(proto: TensorProto, value: Any) -> None:
    """Write `value` into `proto`, an empty message (a field of a request or response
    being built): `proto.CopyFrom(to_tensor_proto(value))` without the intermediate
    message for a numeric array (1.9 vs 3.1 us for 4 KiB)."""
    if not _write_numeric(proto, value):
        proto.CopyFrom(to_tensor_proto(value))


def _write_numeric(proto: TensorProto, value: Any) -> bool:
    """The usual case of `to_tensor_proto`, in short: a numeric array in native
    (little-endian) order written into `proto`. False, and nothing written, otherwise."""
    if type(value) is not np.ndarray:
        return False
    datatype = _CONTENT_DATATYPE_BY_NUMPY.get(value.dtype)
    if datatype is None or value.nbytes > _MAX_CONTENT_BYTES:
        return False
    proto.dtype = datatype  # type: ignore[assignment]
    proto.tensor_shape.CopyFrom(_known_shape_proto(value.shape))
    proto.tensor_content = value.tobytes(order="C")
    return True


def _as_array(value: Any, datatype: int | None) -> NDArray[Any]:
    if isinstance(value, ResourceHandle | ResourceHandleProto | VariantTensorDataProto):
        array = np.empty((), dtype=object)
        array[()] = value
        return array
    if datatype is not None and _NUMPY_BY_DATATYPE[datatype] == _OBJECT:
        if isinstance(value, np.ndarray):
            return value
        return np.array(value, dtype=object)
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        if datatype is None:
            return array
        if array.dtype.kind in "USV" and array.dtype != _BFLOAT16:
            raise TypeError(
                f"Cannot convert an array of dtype {array.dtype} to a {datatype_name(datatype)} tensor"
            )
        return array.astype(_NUMPY_BY_DATATYPE[datatype], copy=False)
    inferred = _asarray_from_python(value)
    if datatype is None:
        return _narrow_python_array(inferred)
    accepted = next(kinds for group, kinds in _ACCEPTED_KINDS.items() if datatype in group)
    if inferred.size and inferred.dtype.kind not in accepted:
        raise TypeError(
            f"Cannot convert {_describe(value)} (inferred dtype {inferred.dtype}) to a "
            f"{datatype_name(datatype)} tensor"
        )
    if inferred.dtype.kind == "O":
        raise TypeError(f"Cannot convert {_describe(value)} to a {datatype_name(datatype)} tensor")
    # Convert from the python values again (not from `inferred`), so that numpy reports
    # integers out of the target's range instead of wrapping them.
    try:
        return np.asarray(value, dtype=_NUMPY_BY_DATATYPE[datatype])
    except OverflowError as exc:
        raise ValueError(
            f"Cannot convert {_describe(value)} to a {datatype_name(datatype)} tensor: {exc}"
        ) from exc


def _asarray_from_python(value: Any) -> NDArray[Any]:
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"Cannot convert {_describe(value)} to a tensor: {exc}") from exc
    if array.dtype.kind in "US":
        # Numpy's fixed-width text types drop trailing NULs; keep the python objects.
        array = np.array(value, dtype=object)
    return array


def _narrow_python_array(array: NDArray[Any]) -> NDArray[Any]:
    # TensorFlow's make_tensor_proto prefers 32-bit types for python numbers; like it,
    # let floats beyond float32's range become inf without a warning.
    if array.dtype == np.float64:
        with np.errstate(over="ignore"):
            return array.astype(np.float32)
    if array.dtype == np.int64 and (
        array.size == 0 or (int(array.min()) >= _INT32_MIN and int(array.max()) <= _INT32_MAX)
    ):
        return array.astype(np.int32)
    return array


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} of type {type(value).__name__}"


def _infer_datatype(array: NDArray[Any]) -> int:
    if array.dtype.kind in "US":
        return _DT.DT_STRING
    if array.dtype != _OBJECT:
        try:
            return as_datatype(array.dtype)
        except TypeError:
            raise TypeError(f"Cannot convert an array of dtype {array.dtype} to a tensor") from None
    elements = array.ravel()
    if elements.size == 0:
        return _DT.DT_STRING
    first = elements[0]
    if isinstance(first, ResourceHandle | ResourceHandleProto):
        return _DT.DT_RESOURCE
    if isinstance(first, VariantTensorDataProto) or hasattr(first, "to_variant_proto"):
        return _DT.DT_VARIANT
    if isinstance(first, bytes | str):
        return _DT.DT_STRING
    raise TypeError(
        f"Cannot convert an object array holding {type(first).__name__} to a tensor; "
        "expected bytes or str (DT_STRING), ResourceHandle (DT_RESOURCE) or "
        "VariantTensorDataProto (DT_VARIANT) elements"
    )


def _string_elements(array: NDArray[Any]) -> list[bytes]:
    out: list[bytes] = []
    for item in array.ravel().tolist():
        if isinstance(item, bytes):
            out.append(item)
        elif isinstance(item, str):
            out.append(item.encode("utf-8"))
        else:
            raise TypeError(
                f"Cannot convert a {type(item).__name__} element to a DT_STRING tensor; expected bytes or str"
            )
    return out


def _resource_elements(array: NDArray[Any]) -> list[ResourceHandleProto]:
    out: list[ResourceHandleProto] = []
    for item in array.ravel().tolist():
        if isinstance(item, ResourceHandle):
            out.append(item.to_proto())
        elif isinstance(item, ResourceHandleProto):
            out.append(item)
        else:
            raise TypeError(
                f"Cannot convert a {type(item).__name__} element to a DT_RESOURCE tensor; "
                "expected ResourceHandle"
            )
    return out


def _variant_elements(array: NDArray[Any]) -> list[VariantTensorDataProto]:
    out: list[VariantTensorDataProto] = []
    for item in array.ravel().tolist():
        if hasattr(item, "to_variant_proto"):  # a kernel's variant value (a TensorList, ...)
            item = item.to_variant_proto()
        if not isinstance(item, VariantTensorDataProto):
            raise TypeError(
                f"Cannot convert a {type(item).__name__} element to a DT_VARIANT tensor; "
                "expected VariantTensorDataProto"
            )
        out.append(item)
    return out


# --------------------------------------------------------------------------- proto -> numpy

DECODE_LIMIT_ENV: Final = "DISTSERVER_DECODE_LIMIT_BYTES"
PADDING_LIMIT_ENV: Final = "DISTSERVER_DECODE_PADDING_LIMIT_BYTES"
DEFAULT_DECODE_LIMIT_BYTES: Final = int(os.environ.get(DECODE_LIMIT_ENV, "") or 4 << 30)
"""What the tensors decoded from one message may take in memory (4 GiB unless the
`DISTSERVER_DECODE_LIMIT_BYTES` environment variable says otherwise)."""
DEFAULT_PADDING_LIMIT_BYTES: Final = int(os.environ.get(PADDING_LIMIT_ENV, "") or 256 << 20)
"""What the elements a message claims without carrying them (padding of typed fields)
may take (256 MiB unless `DISTSERVER_DECODE_PADDING_LIMIT_BYTES` says otherwise): a
few bytes on the wire must not make a task allocate gigabytes."""

# What one element of a string, resource or variant tensor takes at least: its pointer.
_OBJECT_ELEMENT_BYTES: Final = 8


class DecodeBudget:
    """The memory the tensors decoded from one message may take, charged before allocating.

    Two limits: everything decoded (`limit_bytes`), and the part of it that the
    message claims without carrying (`padding_limit_bytes`: elements a typed field
    leaves out, which TensorFlow fills with the last value or zeros).

    Args:
        limit_bytes: Default `DEFAULT_DECODE_LIMIT_BYTES`.
        padding_limit_bytes: Default `DEFAULT_PADDING_LIMIT_BYTES`.
        what: What is being decoded, for the error ("a RunGraph request").

    Raises (from `charge`):
        errors.ResourceExhaustedError: a tensor would exceed what is left; the message
            names the tensor's type and shape, the limit, and how to raise it.
    """

    def __init__(
        self,
        limit_bytes: int | None = None,
        padding_limit_bytes: int | None = None,
        *,
        what: str = "a message",
    ) -> None:
        self.limit_bytes = DEFAULT_DECODE_LIMIT_BYTES if limit_bytes is None else limit_bytes
        self.padding_limit_bytes = (
            DEFAULT_PADDING_LIMIT_BYTES if padding_limit_bytes is None else padding_limit_bytes
        )
        self.what = what
        self.used_bytes = 0
        self.padding_bytes = 0

    def charge(self, proto: TensorProto, nbytes: int, padding_nbytes: int) -> None:
        """Take `nbytes` for `proto`'s value, `padding_nbytes` of them not carried by the message."""
        for used, limit, kind, env in (
            (self.used_bytes + nbytes, self.limit_bytes, "decoded tensors", DECODE_LIMIT_ENV),
            (self.padding_bytes + padding_nbytes, self.padding_limit_bytes, "padding", PADDING_LIMIT_ENV),
        ):
            if used > limit:
                raise errors.ResourceExhaustedError(
                    f"A TensorProto of type {datatype_name(proto.dtype)} and shape "
                    f"{_shape_text(proto.tensor_shape)} in {self.what} would take {nbytes} bytes once "
                    f"decoded, over the limit of {limit} bytes of {kind} per message. If that tensor "
                    f"is meant, raise the limit with the {env} environment variable of the server "
                    "process."
                )
        self.used_bytes += nbytes
        self.padding_bytes += padding_nbytes


def from_tensor_proto(
    proto: TensorProto, *, writable: bool = False, budget: DecodeBudget | None = None
) -> NDArray[Any]:
    """Return the numpy array a TensorProto holds.

    Reads ``tensor_content`` when it is set, else the typed field of the dtype
    (``float_val``, ``int_val`` for int8/16/32 and uint8/16, ``half_val`` bit
    patterns for half and bfloat16, ``scomplex_val``/``dcomplex_val`` as (real,
    imaginary) pairs, ``string_val``, ...). As in TensorFlow, a typed field with fewer
    values than the shape has elements is padded with its last value (so one value
    fills the whole shape), and an empty one means zeros (empty strings, empty
    handles). Reference dtypes are read as their base type.

    A numeric array read from ``tensor_content`` shares the proto's bytes without a
    copy and is therefore **read-only**; pass ``writable=True`` to get a private,
    writable copy. Arrays built from typed fields are always writable.

    Args:
        proto: The tensor proto.
        writable: Return an array that may be modified in place.
        budget: Charged with the decoded size before anything is allocated; by
            default a budget of `DEFAULT_DECODE_LIMIT_BYTES` for this tensor alone.

    Returns:
        The tensor value: a numeric array, or an object array of bytes (DT_STRING),
        `ResourceHandle` (DT_RESOURCE) or `VariantTensorDataProto` (DT_VARIANT).

    Raises:
        errors.InvalidArgumentError: For an unsupported dtype, a shape that is not
            fully defined, a ``tensor_content`` whose size does not match the shape,
            or more typed values than the shape has elements.
        errors.ResourceExhaustedError: The tensor would take more than the budget.
    """
    content = proto.tensor_content
    if content and not writable and sys.byteorder == "little":
        # The usual case, in short: a numeric tensor_content of the right size.
        dtype = _NUMPY_BY_DATATYPE.get(proto.dtype)
        shape = _known_shape(proto.tensor_shape)
        if (
            dtype is not None
            and dtype is not _OBJECT
            and shape is not None
            and len(content) == math.prod(shape) * dtype.itemsize
        ):
            (budget or DecodeBudget()).charge(proto, len(content), 0)
            return np.frombuffer(content, dtype=dtype).reshape(shape)
    datatype = _base_datatype(proto.dtype)
    dtype = as_numpy_dtype(datatype)
    shape = _value_shape(proto)
    count = math.prod(shape)
    element_bytes = _OBJECT_ELEMENT_BYTES if dtype == _OBJECT else dtype.itemsize
    if not holdable(shape, element_bytes):
        raise errors.InvalidArgumentError(
            f"TensorProto of type {datatype_name(datatype)} and shape {_shape_text(proto.tensor_shape)} "
            "has more elements than an array can hold"
        )
    padding = 0 if content else max(count - _typed_length(proto, datatype), 0)
    nbytes = count * element_bytes + (len(content) if dtype == _OBJECT else 0)
    (budget or DecodeBudget()).charge(proto, nbytes, padding * element_bytes)

    if dtype == _OBJECT:
        if content:
            return _object_from_content(proto, datatype, content, count).reshape(shape)
        return _from_typed_field(proto, datatype, dtype, count).reshape(shape)

    if content:
        expected = count * dtype.itemsize
        if len(content) != expected:
            raise errors.InvalidArgumentError(
                f"TensorProto of type {datatype_name(datatype)} and shape {_shape_text(proto.tensor_shape)} "
                f"has {len(content)} bytes of tensor_content, expected {expected}"
            )
        array: NDArray[Any] = np.frombuffer(content, dtype=dtype.newbyteorder("<"))
        if sys.byteorder == "big":
            array = array.astype(dtype)
        array = array.reshape(shape)
        return array.copy() if writable and not array.flags.writeable else array
    return _from_typed_field(proto, datatype, dtype, count).reshape(shape)


def decode_tensors(protos: Iterable[TensorProto], *, what: str) -> list[NDArray[Any]]:
    """Decode the tensors of one message, all charged to one `DecodeBudget` (its limits are per message).

    Args:
        protos: The message's tensors.
        what: The message, for errors ("a RunGraph request").
    """
    budget = DecodeBudget(what=what)
    return [from_tensor_proto(proto, budget=budget) for proto in protos]


def decode_elements(protos: Iterable[TensorProto]) -> int:
    """How many elements decoding `protos` builds one by one: those of typed fields and padding.

    ``tensor_content`` counts nothing (protobuf copies it to answer: the transports read
    messages of `wire.HAND_DECODED_MESSAGE_BYTES` or more by hand). A measure of the CPU
    a decode takes, known before decoding (a caller moves large decodes off its event
    loop); the shapes are what the message claims, checked by the decode itself.
    """
    return sum(
        0 if proto.tensor_content else math.prod(max(dim.size, 0) for dim in proto.tensor_shape.dim)
        for proto in protos
    )


def _from_typed_field(proto: TensorProto, datatype: int, dtype: np.dtype[Any], count: int) -> NDArray[Any]:
    values = _typed_values(proto, datatype, dtype)
    present = len(values)
    if present == count:
        return values
    name = datatype_name(datatype)
    if present > count:
        raise errors.InvalidArgumentError(
            f"TensorProto of type {name} and shape {_shape_text(proto.tensor_shape)} has {present} "
            f"values, more than its {count} elements"
        )
    if present == 0:
        return _zeros(datatype, dtype, count)
    # TensorFlow's FromProtoField: repeat the last value to fill the shape.
    out = np.empty(count, dtype=dtype)
    out[:present] = values
    out[present:].fill(values[-1])  # object tensors: the same (immutable) item, no Python loop
    return out


def _typed_length(proto: TensorProto, datatype: int) -> int:
    """How many values the dtype's typed field carries (before anything is decoded)."""
    field = _TYPED_FIELDS.get(datatype)
    if field is None:
        return 0
    count = len(getattr(proto, field))
    return count // 2 if datatype in (_DT.DT_COMPLEX64, _DT.DT_COMPLEX128) else count


_TYPED_FIELDS: Final[dict[int, str]] = {
    _DT.DT_FLOAT: "float_val",
    _DT.DT_DOUBLE: "double_val",
    _DT.DT_INT32: "int_val",
    _DT.DT_INT16: "int_val",
    _DT.DT_INT8: "int_val",
    _DT.DT_UINT8: "int_val",
    _DT.DT_UINT16: "int_val",
    _DT.DT_INT64: "int64_val",
    _DT.DT_BOOL: "bool_val",
    _DT.DT_UINT32: "uint32_val",
    _DT.DT_UINT64: "uint64_val",
    _DT.DT_HALF: "half_val",
    _DT.DT_BFLOAT16: "half_val",
    _DT.DT_COMPLEX64: "scomplex_val",
    _DT.DT_COMPLEX128: "dcomplex_val",
    _DT.DT_STRING: "string_val",
    _DT.DT_RESOURCE: "resource_handle_val",
    _DT.DT_VARIANT: "variant_val",
}


def _typed_values(proto: TensorProto, datatype: int, dtype: np.dtype[Any]) -> NDArray[Any]:
    # One flat array of the values present in the dtype's typed field.
    if datatype == _DT.DT_FLOAT:
        return _fromiter(proto.float_val, dtype)
    if datatype == _DT.DT_DOUBLE:
        return _fromiter(proto.double_val, dtype)
    if datatype in (_DT.DT_INT32, _DT.DT_INT16, _DT.DT_INT8, _DT.DT_UINT8, _DT.DT_UINT16):
        # int_val holds each value widened to int32; narrowing wraps like a C cast.
        return _fromiter(proto.int_val, np.dtype(np.int32)).astype(dtype)
    if datatype == _DT.DT_INT64:
        return _fromiter(proto.int64_val, dtype)
    if datatype == _DT.DT_BOOL:
        return _fromiter(proto.bool_val, dtype)
    if datatype == _DT.DT_UINT32:
        return _fromiter(proto.uint32_val, dtype)
    if datatype == _DT.DT_UINT64:
        return _fromiter(proto.uint64_val, dtype)
    if datatype in (_DT.DT_HALF, _DT.DT_BFLOAT16):
        bits = _fromiter(proto.half_val, np.dtype(np.int32)).astype(np.uint16)
        return bits.view(dtype)
    if datatype in (_DT.DT_COMPLEX64, _DT.DT_COMPLEX128):
        field = proto.scomplex_val if datatype == _DT.DT_COMPLEX64 else proto.dcomplex_val
        if len(field) % 2:
            raise errors.InvalidArgumentError(
                f"TensorProto of type {datatype_name(datatype)} has an odd number ({len(field)}) of "
                "real/imaginary values"
            )
        part = np.dtype(np.float32 if datatype == _DT.DT_COMPLEX64 else np.float64)
        return _fromiter(field, part).view(dtype)
    if datatype == _DT.DT_STRING:
        return _object_array(list(proto.string_val))
    if datatype == _DT.DT_RESOURCE:
        return _object_array([ResourceHandle.from_proto(item) for item in proto.resource_handle_val])
    if datatype == _DT.DT_VARIANT:
        return _object_array([_copy_variant(item) for item in proto.variant_val])
    raise AssertionError(f"no typed field for {datatype_name(datatype)}")  # pragma: no cover


def _fromiter(field: Sequence[Any], dtype: np.dtype[Any]) -> NDArray[Any]:
    return np.fromiter(field, dtype=dtype, count=len(field))


def _object_array(items: Sequence[Any]) -> NDArray[Any]:
    # Filled element by element so numpy never looks inside the items.
    out = np.empty(len(items), dtype=object)
    for index, item in enumerate(items):
        out[index] = item
    return out


def _copy_variant(item: VariantTensorDataProto) -> VariantTensorDataProto:
    copy = VariantTensorDataProto()
    copy.CopyFrom(item)
    return copy


def _zeros(datatype: int, dtype: np.dtype[Any], count: int) -> NDArray[Any]:
    if dtype != _OBJECT:
        return np.zeros(count, dtype=dtype)
    out = np.empty(count, dtype=dtype)
    if datatype == _DT.DT_STRING:
        out.fill(b"")
    elif datatype == _DT.DT_RESOURCE:
        out.fill(ResourceHandle("", "", ""))
    else:  # one empty variant shared by every element (values are never changed in place)
        out.fill(VariantTensorDataProto())
    return out


def _object_from_content(proto: TensorProto, datatype: int, content: bytes, count: int) -> NDArray[Any]:
    # TensorFlow's AsProtoTensorContent encodes strings, resource handles and variants
    # as a list: the varint32 length of every element, then all elements' bytes.
    pieces = _decode_string_list(content, count)
    if pieces is None:
        raise errors.InvalidArgumentError(
            f"TensorProto of type {datatype_name(datatype)} and shape {_shape_text(proto.tensor_shape)} "
            f"has a tensor_content of {len(content)} bytes that does not encode {count} elements"
        )
    if datatype == _DT.DT_STRING:
        return _object_array(pieces)
    items: list[Any] = []
    for piece in pieces:
        message: ResourceHandleProto | VariantTensorDataProto = (
            ResourceHandleProto() if datatype == _DT.DT_RESOURCE else VariantTensorDataProto()
        )
        try:
            message.ParseFromString(piece)
        except Exception as exc:  # protobuf's DecodeError
            raise errors.InvalidArgumentError(
                f"TensorProto of type {datatype_name(datatype)} has an element that does not parse: {exc}"
            ) from exc
        items.append(
            ResourceHandle.from_proto(message) if isinstance(message, ResourceHandleProto) else message
        )
    return _object_array(items)


def _decode_string_list(data: bytes, count: int) -> list[bytes] | None:
    sizes: list[int] = []
    position = 0
    for _ in range(count):
        size = 0
        for shift in range(0, 35, 7):
            if position >= len(data):
                return None
            byte = data[position]
            position += 1
            size |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
        else:
            return None
        if size > 0xFFFFFFFF:
            return None
        sizes.append(size)
    if sum(sizes) != len(data) - position:
        return None
    pieces: list[bytes] = []
    for size in sizes:
        pieces.append(data[position : position + size])
        position += size
    return pieces


# --------------------------------------------------------------------------- sizes


def tensor_nbytes(value: Any) -> int:
    """Return the number of payload bytes of a tensor value.

    For a numeric array this is ``value.nbytes``; for DT_STRING the total length of the
    (UTF-8 encoded) elements; for resources and variants the serialized size of their
    protos. Useful for statistics and for deciding whether to stream a tensor.

    Args:
        value: A tensor value (anything `to_tensor_proto` accepts).
    """
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if array.dtype.kind in "US":
        return sum(
            len(item) if isinstance(item, bytes) else len(item.encode()) for item in array.ravel().tolist()
        )
    if array.dtype != _OBJECT:
        return int(array.nbytes)
    total = 0
    for item in array.ravel().tolist():
        if isinstance(item, bytes):
            total += len(item)
        elif isinstance(item, str):
            total += len(item.encode("utf-8"))
        elif isinstance(item, ResourceHandle):
            total += item.to_proto().ByteSize()
        elif isinstance(item, ResourceHandleProto | VariantTensorDataProto):
            total += item.ByteSize()
        elif hasattr(item, "to_variant_proto"):
            total += item.to_variant_proto().ByteSize()
        else:
            raise TypeError(f"Cannot size a {type(item).__name__} tensor element")
    return total
