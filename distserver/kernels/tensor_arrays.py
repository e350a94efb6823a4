"""TensorArrays of control flow v1: TensorArrayV3 and its Read/Write/Gather/Scatter/Concat/
Split/Size/Close/Grad/GradWithShape ops (what `tf.TensorArray` builds under
`disable_control_flow_v2`).

Like a stack (kernels/stacks.py), an array is held by its handle's value and lives as
long as the step's values that hold it. `TensorArrayGradV3` gives the gradient array
of an array for a `source` (one per source, made on first use): same size, and several
writes to one index add up, as TensorFlow's gradient arrays do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from distserver import errors
from distserver.kernels._common import attr_shape, int_list, int_scalar, kernel_error, shape_str
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef

_FLOW = np.float32(0.0)
# Most elements an array may hold (a size or an index beyond it is refused).
MAX_ELEMENTS = 1 << 24


class TensorArray:
    """The elements of one array (None: not written yet; `_CLEARED`: read and dropped)."""

    def __init__(
        self,
        name: str,
        dtype: np.dtype[Any],
        size: int,
        *,
        dynamic_size: bool,
        clear_after_read: bool,
        element_shape: tuple[int | None, ...] | None,
        identical_element_shapes: bool = True,
        aggregates_writes: bool = False,
    ) -> None:
        self.name = name
        self.dtype = dtype
        self.elements: list[Any] = [None] * size
        self.dynamic_size = dynamic_size
        self.clear_after_read = clear_after_read
        self.element_shape = element_shape
        # The first write fixes the element shape (TensorArrayV3's identical_element_shapes,
        # what `infer_shape=True` asks for); else elements may differ within `element_shape`.
        self.identical_element_shapes = identical_element_shapes
        self.aggregates_writes = aggregates_writes
        self.grads: dict[str, TensorArray] = {}
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise errors.InvalidArgumentError(f"TensorArray {self.name} has already been closed.")

    def write(self, index: int, value: np.ndarray) -> None:
        self.check_open()
        if value.dtype != self.dtype:
            raise errors.InvalidArgumentError(
                f"TensorArray dtype is {self.dtype.name} but Op is trying to write dtype {value.dtype.name}."
            )
        if index < 0 or index >= MAX_ELEMENTS:
            raise errors.InvalidArgumentError(f"Tried to write to index {index} of TensorArray {self.name}")
        if index >= len(self.elements):
            if not self.dynamic_size:
                raise errors.InvalidArgumentError(
                    f"Tried to write to index {index} but array is not resizeable and size is: "
                    f"{len(self.elements)}"
                )
            self.elements.extend([None] * (index + 1 - len(self.elements)))
        if not self._compatible(value.shape):
            raise errors.InvalidArgumentError(
                f"Could not write to TensorArray index {index} because the value shape is "
                f"{shape_str(value.shape)} which is incompatible with the TensorArray's inferred element "
                f"shape: {shape_str(self.element_shape)} (consider setting infer_shape=False)."
            )
        old = self.elements[index]
        if old is not None:
            if not self.aggregates_writes or old is _CLEARED:
                raise errors.InvalidArgumentError(
                    f"Could not write to TensorArray index {index} because it has already been written to."
                )
            if old.shape != value.shape:
                raise errors.InvalidArgumentError(
                    f"Could not aggregate to TensorArray index {index} because the existing shape is "
                    f"{shape_str(old.shape)} but the new input shape is {shape_str(value.shape)}."
                )
            value = old + value
        if self.identical_element_shapes and (self.element_shape is None or None in self.element_shape):
            self.element_shape = tuple(value.shape)
        self.elements[index] = value

    def read(self, index: int) -> np.ndarray:
        self.check_open()
        if not 0 <= index < len(self.elements):
            raise errors.InvalidArgumentError(
                f"Tried to read from index {index} but array size is: {len(self.elements)}"
            )
        value = self.elements[index]
        if value is _CLEARED:
            raise errors.InvalidArgumentError(
                f"Could not read index {index} twice because it was cleared after a previous read "
                "(perhaps try setting clear_after_read = false?)"
            )
        if value is None:
            shape = self.element_shape
            if shape is None or None in shape:
                raise errors.InvalidArgumentError(
                    f"Could not read from TensorArray index {index} because it has not yet been written to."
                )
            return np.zeros(shape, self.dtype)  # type: ignore[arg-type]
        if self.clear_after_read and not self.aggregates_writes:
            self.elements[index] = _CLEARED
        return value  # type: ignore[no-any-return]

    def _compatible(self, shape: tuple[int, ...]) -> bool:
        known = self.element_shape
        if known is None:
            return True
        return len(known) == len(shape) and all(
            k is None or k == d for k, d in zip(known, shape, strict=True)
        )


_CLEARED = object()


def _array_of(kernel: OpKernel, value: Any) -> TensorArray:
    array = value[()] if isinstance(value, np.ndarray) and value.ndim == 0 else value
    if not isinstance(array, TensorArray):
        raise kernel_error(
            kernel, f"{kernel.op} expects a TensorArray handle as input 0, got {type(array).__name__}"
        )
    return array


def _handle(array: TensorArray) -> np.ndarray:
    out = np.empty((), dtype=object)
    out[()] = array
    return out


class _ArrayKernel(OpKernel):
    runs_on_loop = True  # keeps references; one thread touches an array
    loop_bound = True
    is_stateful = True


@register_kernel("TensorArrayV3")
class TensorArrayV3Kernel(_ArrayKernel):
    """`(size) -> (handle, flow)`: a new array of `size` unwritten elements."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = self.attr_type("dtype")
        self.element_shape = attr_shape(self, "element_shape") if self.has_attr("element_shape") else None
        self.dynamic_size = self.attr_bool("dynamic_size", False)
        self.clear_after_read = self.attr_bool("clear_after_read", True)
        self.identical_element_shapes = self.attr_bool("identical_element_shapes", False)
        self.array_name = self.attr_str("tensor_array_name", "") or self.name

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        size = int_scalar(self, np.asarray(inputs[0]), "size")
        if not 0 <= size <= MAX_ELEMENTS:
            raise kernel_error(self, f"TensorArray size must be between 0 and {MAX_ELEMENTS}, got {size}")
        array = TensorArray(
            self.array_name,
            self.dtype,
            size,
            dynamic_size=self.dynamic_size,
            clear_after_read=self.clear_after_read,
            element_shape=self.element_shape,
            identical_element_shapes=self.identical_element_shapes,
        )
        return [_handle(array), _FLOW]


@register_kernel("TensorArrayGradV3")
class TensorArrayGradV3Kernel(_ArrayKernel):
    """`(handle, flow_in) -> (grad_handle, flow_out)`: the array's gradient array for `source`."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.source = self.attr_str("source")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        array = _array_of(self, inputs[0])
        array.check_open()
        return [_handle(self.gradient_array(array, array.element_shape)), _FLOW]

    def gradient_array(self, array: TensorArray, element_shape: tuple[int | None, ...] | None) -> TensorArray:
        """The gradient array of `array` for `source`, made with `element_shape` on first use."""
        grad = array.grads.get(self.source)
        if grad is None:
            grad = TensorArray(
                f"{array.name}@{self.source}",
                array.dtype,
                len(array.elements),
                dynamic_size=array.dynamic_size,
                clear_after_read=False,
                element_shape=element_shape,
                identical_element_shapes=array.identical_element_shapes,
                aggregates_writes=True,
            )
            array.grads[self.source] = grad
        return grad


@register_kernel("TensorArrayGradWithShape")
class TensorArrayGradWithShapeKernel(TensorArrayGradV3Kernel):
    """`(handle, flow_in, shape_to_prepend) -> (grad_handle, flow_out)`: as TensorArrayGradV3,
    with elements of shape `shape_to_prepend + ` the array's element shape."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        array = _array_of(self, inputs[0])
        array.check_open()
        prepend = int_list(self, np.asarray(inputs[2]), "shape_to_prepend")
        if any(d < 0 for d in prepend):
            raise kernel_error(self, f"shape_to_prepend must not be negative, got {shape_str(prepend)}")
        shape = array.element_shape
        element_shape = None if shape is None else (*prepend, *shape)
        return [_handle(self.gradient_array(array, element_shape)), _FLOW]


@register_kernel("TensorArrayWriteV3")
class TensorArrayWriteV3Kernel(_ArrayKernel):
    """`(handle, index, value, flow_in) -> flow_out`."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        array = _array_of(self, inputs[0])
        array.write(int_scalar(self, np.asarray(inputs[1]), "index"), np.asarray(inputs[2]))
        return [_FLOW]


@register_kernel("TensorArrayReadV3")
class TensorArrayReadV3Kernel(_ArrayKernel):
    """`(handle, index, flow_in) -> value`."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        array = _array_of(self, inputs[0])
        return [array.read(int_scalar(self, np.asarray(inputs[1]), "index"))]


@register_kernel("TensorArrayGatherV3")
class TensorArrayGatherV3Kernel(_ArrayKernel):
    """`(handle, indices, flow_in) -> value`: the elements at `indices`, stacked."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.element_shape = attr_shape(self, "element_shape") if self.has_attr("element_shape") else None

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        array = _array_of(self, inputs[0])
        indices = int_list(self, np.asarray(inputs[1]), "indices")
        values = [array.read(i) for i in indices]
        if not values:
            shape = self.element_shape if self.element_shape is not None else array.element_shape
            if shape is None or None in shape:
                raise errors.InvalidArgumentError(
                    "TensorArray has size zero, but element shape is not fully defined. "
                    "Currently only static shapes are supported when packing zero-size TensorArrays."
                )
            return [np.zeros((0, *shape), array.dtype)]  # type: ignore[arg-type]
        first = values[0].shape
        for i, value in zip(indices, values, strict=True):
            if value.shape != first:
                raise errors.InvalidArgumentError(
                    f"TensorArray has inconsistent shapes. Index 0 has shape: {shape_str(first)} but "
                    f"index {i} has shape: {shape_str(value.shape)}"
                )
        return [np.stack(values)]


@register_kernel("TensorArrayConcatV3")
class TensorArrayConcatV3Kernel(_ArrayKernel):
    """`(handle, flow_in) -> (value, lengths)`: every element joined along dimension 0, and
    each element's length in it."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.except0 = (
            attr_shape(self, "element_shape_except0") if self.has_attr("element_shape_except0") else None
        )

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        array = _array_of(self, inputs[0])
        array.check_open()
        if not array.elements:
            shape = self.except0
            if shape is None or None in shape:
                raise kernel_error(
                    self,
                    "TensorArray has size zero, but element_shape_except0 "
                    f"{shape_str(shape)} is not fully defined. Currently only static shapes are "
                    "supported when concatenating zero-size TensorArrays.",
                )
            return [np.zeros((0, *shape), array.dtype), np.zeros(0, np.int64)]  # type: ignore[arg-type]
        values = [array.read(i) for i in range(len(array.elements))]
        for i, value in enumerate(values):
            if value.ndim == 0:
                raise kernel_error(
                    self,
                    f"Concat saw a scalar shape at index {i} but requires at least vectors.  "
                    "Did you mean to call pack?",
                )
            if value.shape[1:] != values[0].shape[1:]:
                raise kernel_error(
                    self,
                    "TensorArray has inconsistent shapes.  Index 0 has (excepting dimension 0) shape: "
                    f"{shape_str(values[0].shape[1:])} but index {i} has (excepting dimension 0) shape: "
                    f"{shape_str(value.shape[1:])}",
                )
        lengths = np.array([value.shape[0] for value in values], np.int64)
        return [np.concatenate(values), lengths]


@register_kernel("TensorArraySplitV3")
class TensorArraySplitV3Kernel(_ArrayKernel):
    """`(handle, value, lengths, flow_in) -> flow_out`: element k is the k-th piece of `value`
    cut along dimension 0 into pieces of `lengths`."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        array = _array_of(self, inputs[0])
        array.check_open()
        value, lengths_value = np.asarray(inputs[1]), np.asarray(inputs[2])
        if lengths_value.ndim != 1:
            raise kernel_error(
                self, f"Expected lengths to be a vector, received shape: {shape_str(lengths_value.shape)}"
            )
        lengths = int_list(self, lengths_value, "lengths")
        if value.ndim == 0:
            raise kernel_error(
                self, f"Expected value to be at least a vector, but received shape: {shape_str(value.shape)}"
            )
        if any(n < 0 for n in lengths) or sum(lengths) != value.shape[0]:
            raise kernel_error(
                self,
                "Expected sum of lengths to be equal to values.shape[0], but sum of lengths is "
                f"{sum(lengths)} and value's shape is: {shape_str(value.shape)}",
            )
        if len(lengths) > MAX_ELEMENTS:
            raise kernel_error(
                self, f"A TensorArray holds at most {MAX_ELEMENTS} elements, got {len(lengths)}"
            )
        if not array.dynamic_size and len(array.elements) != len(lengths):
            raise kernel_error(
                self,
                f"TensorArray's size is not equal to the size of lengths ({len(array.elements)} vs. "
                f"{len(lengths)}), and the TensorArray is not marked as dynamically resizeable",
            )
        start = 0
        for index, length in enumerate(lengths):
            array.write(index, value[start : start + length])
            start += length
        return [_FLOW]


@register_kernel("TensorArrayScatterV3")
class TensorArrayScatterV3Kernel(_ArrayKernel):
    """`(handle, indices, value, flow_in) -> flow_out`: `value[k]` written at `indices[k]`."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        array = _array_of(self, inputs[0])
        indices = int_list(self, np.asarray(inputs[1]), "indices")
        value = np.asarray(inputs[2])
        if value.ndim == 0 or value.shape[0] != len(indices):
            raise kernel_error(
                self,
                f"Expected len(indices) == values.shape[0], but saw: {len(indices)} vs. "
                f"{value.shape[0] if value.ndim else 'a scalar'}",
            )
        for k, index in enumerate(indices):
            array.write(index, value[k])
        return [_FLOW]


@register_kernel("TensorArraySizeV3")
class TensorArraySizeV3Kernel(_ArrayKernel):
    """`(handle, flow_in) -> size`."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [np.int32(len(_array_of(self, inputs[0]).elements))]


@register_kernel("TensorArrayCloseV3")
class TensorArrayCloseV3Kernel(_ArrayKernel):
    """`(handle) -> ()`: drops the elements; later use fails."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        array = _array_of(self, inputs[0])
        array.elements = []
        array.closed = True
        return []
