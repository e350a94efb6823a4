"""TensorLists: the variant tensor control flow v2 loops accumulate values in.

`tf.while_loop`'s gradient under control flow v2 pushes every intermediate the
gradient needs onto a list in the forward loop (`EmptyTensorList`,
`TensorListPushBack`) and pops them in the backward loop (`TensorListPopBack`);
`TensorArray`s and `map_fn` under v2 are lists too (`TensorListReserve`,
`TensorListFromTensor`, `TensorListSetItem`/`GetItem`, `TensorListStack`).

A list is a 0-d object array holding a `TensorList`. Lists are values: every op
returns a new list and leaves its input as it was, as TensorFlow's kernels do when
the input may have other readers. An element never set is None; reading it gives
zeros of the element shape, as TensorFlow does. A list crossing tasks travels as
TensorFlow's `VariantTensorDataProto` ("tensorflow::TensorList": the set elements as
tensors; metadata = varints of the unset indices' count and indices, the element
dtype, max_num_elements, then the element shape's TensorShapeProto), so a
TensorFlow task reads it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from distserver import errors
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel
from distserver.protos.tensor_pb2 import VariantTensorDataProto
from distserver.protos.tensor_shape_pb2 import TensorShapeProto
from distserver.tensors import (
    as_datatype,
    as_numpy_dtype,
    from_tensor_proto,
    shape_from_proto,
    shape_to_proto,
    to_tensor_proto,
)
from distserver.wire import encode_varint

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef

# Largest list a client may ask `TensorListReserve` for (the elements are references,
# but a hostile size would still allocate a Python list of that length).
MAX_RESERVED_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class TensorList:
    elements: tuple[Any, ...]
    element_dtype: np.dtype[Any]
    element_shape: tuple[int, ...] | None
    """Dims with -1 where unknown; None for unknown rank."""
    max_num_elements: int = -1

    TYPE_NAME = "tensorflow::TensorList"

    def to_variant_proto(self) -> VariantTensorDataProto:
        """TensorFlow's encoding of a TensorList (what crosses tasks)."""
        proto = VariantTensorDataProto(type_name=self.TYPE_NAME)
        unset = [i for i, item in enumerate(self.elements) if item is None]
        metadata = bytearray(encode_varint(len(unset)))
        for index in unset:
            metadata += encode_varint(index)
        metadata += encode_varint(as_datatype(self.element_dtype))
        metadata += encode_varint(self.max_num_elements % (1 << 64))
        metadata += shape_to_proto(self.element_shape).SerializeToString()
        proto.metadata = bytes(metadata)
        proto.tensors.extend(to_tensor_proto(item) for item in self.elements if item is not None)
        return proto

    @classmethod
    def from_variant_proto(cls, proto: VariantTensorDataProto) -> TensorList:
        """The list a `VariantTensorDataProto` from another task holds.

        Raises:
            InvalidArgumentError: not a TensorList, or malformed metadata.
        """
        if proto.type_name != cls.TYPE_NAME:
            raise errors.InvalidArgumentError(f"Expected a {cls.TYPE_NAME} variant, got '{proto.type_name}'")
        data, at = proto.metadata, 0

        def number() -> int:
            nonlocal at
            value, shift = 0, 0
            while True:
                if at >= len(data) or shift > 63:
                    raise errors.InvalidArgumentError("Malformed TensorList metadata")
                byte = data[at]
                at += 1
                value |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    return value

        count = number()
        total = count + len(proto.tensors)
        if total > MAX_RESERVED_ELEMENTS:
            raise errors.InvalidArgumentError(f"A TensorList of {total} elements is too long")
        unset = {number() for _ in range(count)}
        dtype = as_numpy_dtype(number())
        max_elements = number()
        if max_elements >= 1 << 63:
            max_elements -= 1 << 64
        shape_proto = TensorShapeProto.FromString(data[at:])
        known = shape_from_proto(shape_proto)
        shape = None if known is None else tuple(-1 if d is None else d for d in known)
        tensors = iter(proto.tensors)
        elements = tuple(None if i in unset else from_tensor_proto(next(tensors)) for i in range(total))
        return cls(elements, dtype, shape, max_elements)


def _wrap(items: TensorList) -> np.ndarray:
    out = np.empty((), dtype=object)
    out[()] = items
    return out


def _shape(value: Any) -> tuple[int, ...] | None:
    """An element_shape input: -1 (a scalar) is unknown rank; -1 dims are unknown."""
    array = np.asarray(value)
    if array.shape == () and int(array) == -1:
        return None
    if array.ndim != 1:
        raise errors.InvalidArgumentError(
            f"element_shape must be a scalar -1 or a vector, got shape {array.shape}"
        )
    return tuple(int(d) for d in array)


def _merged(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> tuple[int, ...] | None:
    if a is None:
        return b
    if b is None:
        return a
    if len(a) != len(b) or any(x != y and x != -1 and y != -1 for x, y in zip(a, b, strict=True)):
        raise errors.InvalidArgumentError(f"Incompatible shapes during merge: {list(a)} vs. {list(b)}")
    return tuple(x if x != -1 else y for x, y in zip(a, b, strict=True))


class _ListKernel(OpKernel):
    runs_on_loop = True  # moves references; stacking is the only copy

    def _list(self, value: Any) -> TensorList:
        array = np.asarray(value, dtype=object)
        item = array[()] if array.shape == () else None
        if isinstance(item, VariantTensorDataProto):  # from another task
            item = TensorList.from_variant_proto(item)
        if not isinstance(item, TensorList):
            raise errors.InvalidArgumentError(
                "Input handle is not a list. Saw: a tensor that is not a TensorList"
            )
        if self.has_attr("element_dtype"):
            dtype = self.attr_type("element_dtype")
            if item.element_dtype != dtype:
                raise errors.InvalidArgumentError(
                    f"Invalid data types; op elements {dtype} but list elements {item.element_dtype}"
                )
        return item

    def _index(self, items: TensorList, value: Any) -> int:
        index = int(np.asarray(value))
        if not 0 <= index < len(items.elements):
            raise errors.InvalidArgumentError(
                f"Trying to access element {index} in a list with {len(items.elements)} elements."
            )
        return index

    def _element(self, items: TensorList, item: Any, shape: tuple[int, ...] | None) -> Any:
        if item is not None:
            return item
        full = _merged(items.element_shape, shape)
        if full is None or any(d < 0 for d in full):
            raise errors.InvalidArgumentError(
                "Trying to read an uninitialized tensor with a partially defined element shape"
            )
        return np.zeros(full, dtype=items.element_dtype)

    def _checked(self, items: TensorList, value: Any) -> np.ndarray:
        array = np.asarray(value)
        if array.dtype != items.element_dtype:
            raise errors.InvalidArgumentError(
                f"Invalid data types; list elements {items.element_dtype} but the tensor is {array.dtype}"
            )
        if items.element_shape is not None:
            _merged(items.element_shape, array.shape)
        return array


@register_kernel("EmptyTensorList")
class EmptyTensorListKernel(_ListKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        shape, max_elements = inputs
        dtype = self.attr_type("element_dtype")
        return [_wrap(TensorList((), dtype, _shape(shape), int(np.asarray(max_elements))))]


@register_kernel("TensorListReserve")
class TensorListReserveKernel(_ListKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        shape, count = inputs
        count = int(np.asarray(count))
        if not 0 <= count <= MAX_RESERVED_ELEMENTS:
            raise errors.InvalidArgumentError(
                f"num_elements must be between 0 and {MAX_RESERVED_ELEMENTS}, got {count}"
            )
        dtype = self.attr_type("element_dtype")
        return [_wrap(TensorList((None,) * count, dtype, _shape(shape)))]


@register_kernel("TensorListFromTensor")
class TensorListFromTensorKernel(_ListKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        tensor, shape = np.asarray(inputs[0]), inputs[1]
        if tensor.ndim < 1:
            raise errors.InvalidArgumentError("Tensor must be at least a vector, but saw shape: []")
        element_shape = _merged(_shape(shape), tensor.shape[1:])
        return [_wrap(TensorList(tuple(tensor[i] for i in range(len(tensor))), tensor.dtype, element_shape))]


@register_kernel("TensorListStack")
class TensorListStackKernel(_ListKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        items = self._list(inputs[0])
        shape = _merged(items.element_shape, _shape(inputs[1]))
        expected = self.attr_int("num_elements", -1)
        if expected != -1 and expected != len(items.elements):
            raise errors.InvalidArgumentError(
                f"Operation expected a list with {expected} elements but got a list with "
                f"{len(items.elements)} elements."
            )
        if not items.elements:
            if shape is None or any(d < 0 for d in shape):
                raise errors.InvalidArgumentError(
                    "Tried to stack elements of an empty list with non-fully-defined element_shape"
                )
            return [np.zeros((0, *shape), dtype=items.element_dtype)]
        return [np.stack([self._element(items, item, shape) for item in items.elements])]


@register_kernel("TensorListGetItem")
class TensorListGetItemKernel(_ListKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        items = self._list(inputs[0])
        index = self._index(items, inputs[1])
        return [self._element(items, items.elements[index], _shape(inputs[2]))]


@register_kernel("TensorListSetItem")
class TensorListSetItemKernel(_ListKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        items = self._list(inputs[0])
        index = self._index(items, inputs[1])
        value = self._checked(items, inputs[2])
        elements = (*items.elements[:index], value, *items.elements[index + 1 :])
        return [_wrap(TensorList(elements, items.element_dtype, items.element_shape, items.max_num_elements))]


@register_kernel("TensorListPushBack")
class TensorListPushBackKernel(_ListKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        items = self._list(inputs[0])
        value = self._checked(items, inputs[1])
        if 0 <= items.max_num_elements <= len(items.elements):
            raise errors.InvalidArgumentError(
                f"Tried to push item into a full list list size: {len(items.elements)}, "
                f"max_num_elements: {items.max_num_elements}"
            )
        elements = (*items.elements, value)
        return [_wrap(TensorList(elements, items.element_dtype, items.element_shape, items.max_num_elements))]


@register_kernel("TensorListPopBack")
class TensorListPopBackKernel(_ListKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        items = self._list(inputs[0])
        if not items.elements:
            raise errors.InvalidArgumentError("Trying to pop from an empty list.")
        last = self._element(items, items.elements[-1], _shape(inputs[1]))
        rest = TensorList(
            items.elements[:-1], items.element_dtype, items.element_shape, items.max_num_elements
        )
        return [_wrap(rest), last]


@register_kernel("TensorListLength")
class TensorListLengthKernel(_ListKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [np.int32(len(self._list(inputs[0]).elements))]


@register_kernel("TensorListElementShape")
class TensorListElementShapeKernel(_ListKernel):
    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.shape_type = self.attr_type("shape_type", np.dtype(np.int32))

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        shape = self._list(inputs[0]).element_shape
        if shape is None:
            return [np.array(-1, dtype=self.shape_type)]
        return [np.array(shape, dtype=self.shape_type)]
