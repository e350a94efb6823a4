"""Numpy kernels for TensorFlow's array ops: constants, shapes, slicing, gathering.

Outputs may be views of inputs (Reshape, StridedSlice, Identity, ...): kernels never
mutate their inputs or outputs in place, so sharing buffers is safe and saves copies.
Error texts are TensorFlow's, and name the node.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from distserver import errors
from distserver.kernels import _compiled
from distserver.kernels._common import (
    ALL_TYPES,
    BOOL,
    INDEX_TYPES,
    INT32,
    OBJECT,
    REAL,
    array,
    attr_shape,
    attr_type_in,
    broadcast_shape,
    check_input_dtype,
    int_list,
    int_scalar,
    kernel_error,
    normalize_axis,
    shape_str,
    summarize,
    type_name,
)
from distserver.kernels.registry import KernelContext, OpKernel, product_of, register_kernel
from distserver.tensors import from_tensor_proto

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef


class _TypedKernel(OpKernel):
    """A kernel whose inputs/outputs have the node's type attr `T` (any dtype)."""

    type_attr = "T"

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, self.type_attr, ALL_TYPES)


# --------------------------------------------------------------------------- constants and feeds


@register_kernel("Const")
class ConstKernel(OpKernel):
    """Outputs the `value` attr; decoded once, returned read-only on every step."""

    outputs_fixed = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        dtype = self.attr_type("dtype")
        try:
            value = from_tensor_proto(self._attr("value").tensor)
        except errors.OpError as exc:
            raise kernel_error(self, f"Const node has an invalid value: {exc.message}") from None
        if value.dtype != dtype:
            raise kernel_error(
                self,
                f"Type mismatch between value ({type_name(value.dtype)}) and dtype ({type_name(dtype)})",
            )
        value.flags.writeable = False  # shared by every step
        self.value = value

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [self.value]


@register_kernel("Placeholder")
class PlaceholderKernel(OpKernel):
    """Must be fed; running it means the client forgot to (TF's error text)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.datatype = int(self._attr("dtype").type)
        self.shape = attr_shape(self, "shape") if self.has_attr("shape") else None

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        message = (
            f"You must feed a value for placeholder tensor '{self.name}' "
            f"with dtype {type_name(self.datatype)}"
        )
        if self.shape:  # TF names the shape only when its rank is known and > 0
            message += f" and shape {shape_str(self.shape)}"
        raise kernel_error(self, message)


@register_kernel("Identity", "StopGradient", "Snapshot", "PlaceholderWithDefault")
class IdentityKernel(OpKernel):
    """Passes its input through (PlaceholderWithDefault: the default, when not fed)."""

    runs_on_loop = True  # a view or the shape: no thread hop
    passes_through = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [inputs[0]]


@register_kernel("IdentityN")
class IdentityNKernel(OpKernel):
    runs_on_loop = True  # a view or the shape: no thread hop

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return list(inputs)


@register_kernel("NoOp")
class NoOpKernel(OpKernel):
    passes_through = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return []


# --------------------------------------------------------------------------- shapes


@register_kernel("Reshape")
class ReshapeKernel(_TypedKernel):
    """Reshape with TF's rules: one -1 may be inferred, even next to zero-sized dims."""

    fusable = True

    runs_on_loop = True  # a view or the shape: no thread hop

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        tensor, shape = inputs
        sizes = int_list(self, shape, "shape", allow_scalar=True)
        unknown: int | None = None
        product = 1  # of the known, non-zero sizes
        has_zero = False
        for i, size in enumerate(sizes):
            if size == -1:
                if unknown is not None:
                    raise kernel_error(self, f"Only one input size may be -1, not both {unknown} and {i}")
                unknown = i
            elif size < 0:
                raise kernel_error(self, f"Size {i} must be non-negative, not {size}")
            elif size == 0:
                has_zero = True
            else:
                product *= size
        if unknown is not None:
            # Zero-sized input dims are left out when the request has a zero too, so the
            # other dimensions can still be inferred (TF's ValidateSizes).
            known = [d for d in tensor.shape if d > 0 or not has_zero]
            count = math.prod(known)
            missing = count // product
            if len(known) == tensor.ndim and missing * product != count:
                raise kernel_error(
                    self,
                    f"Input to reshape is a tensor with {count} values, but the requested shape "
                    f"requires a multiple of {product}",
                )
            sizes[unknown] = missing
        if math.prod(sizes) != tensor.size:
            raise kernel_error(
                self,
                f"Input to reshape is a tensor with {tensor.size} values, but the requested shape "
                f"has {math.prod(sizes)}",
            )
        return [tensor.reshape(sizes)]


class _OutTypeKernel(OpKernel):
    """Shape / Size / Rank: an int32 or int64 result chosen by `out_type`."""

    fusable = True

    runs_on_loop = True  # a view or the shape: no thread hop

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.out_type = attr_type_in(self, "out_type", INDEX_TYPES, default=INT32)


@register_kernel("Shape")
class ShapeKernel(_OutTypeKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [np.array(inputs[0].shape, dtype=self.out_type)]


@register_kernel("Size")
class SizeKernel(_OutTypeKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [np.array(inputs[0].size, dtype=self.out_type)]


@register_kernel("Rank")
class RankKernel(_OutTypeKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [np.array(inputs[0].ndim, dtype=self.out_type)]


@register_kernel("Fill")
class FillKernel(_TypedKernel):
    def output_nbytes(self, inputs: list[Any]) -> int:
        return product_of(inputs[0]) * self.dtype.itemsize

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        dims, value = inputs
        if dims.ndim != 1:
            raise kernel_error(self, f"dims must be a vector, got shape {shape_str(dims.shape)}")
        if value.ndim != 0:
            raise kernel_error(self, f"value must be a scalar, got shape {shape_str(value.shape)}")
        check_input_dtype(self, 1, value, self.dtype)
        shape = int_list(self, dims, "dims")
        for i, size in enumerate(shape):
            if size < 0:
                raise kernel_error(self, f"Dimension {size} must be >= 0 (dims[{i}])")
        return [np.full(shape, value, dtype=self.dtype)]


@register_kernel("ZerosLike", "OnesLike")
class FillLikeKernel(_TypedKernel):
    fusable = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (x,) = inputs
        check_input_dtype(self, 0, x, self.dtype)
        if self.dtype == OBJECT:
            if self.op == "OnesLike":
                raise kernel_error(self, "OnesLike is not defined for strings")
            return [np.full(x.shape, b"", dtype=object)]
        return [(np.zeros if self.op == "ZerosLike" else np.ones)(x.shape, dtype=self.dtype)]


@register_kernel("Transpose")
class TransposeKernel(_TypedKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, perm_value = inputs
        if perm_value.ndim != 1:
            raise kernel_error(self, f"perm must be rank 1, got shape {shape_str(perm_value.shape)}")
        perm = int_list(self, perm_value, "perm")
        if len(perm) != x.ndim:
            raise kernel_error(
                self,
                f"transpose expects a vector of size {x.ndim}. But input(1) is a vector of size {len(perm)}",
            )
        for d in perm:
            if not 0 <= d < x.ndim:
                raise kernel_error(self, f"{d} is out of range [0 .. {x.ndim})")
        for i in range(x.ndim):
            if i not in perm:
                raise kernel_error(self, f"{i} is missing from {{{','.join(map(str, perm))}}}.")
        return [np.transpose(x, perm)]


@register_kernel("InvertPermutation")
class InvertPermutationKernel(_TypedKernel):
    """y[x[i]] = i: the permutation that undoes `x` (the gradient of a Transpose uses it)."""

    runs_on_loop = True  # a short vector

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (x,) = inputs
        if x.ndim != 1:
            raise kernel_error(
                self, f"invert_permutation expects a 1D vector, got shape {shape_str(x.shape)}"
            )
        perm = int_list(self, x, "x")
        inverse = np.full(len(perm), -1, dtype=x.dtype)
        for i, d in enumerate(perm):
            if not 0 <= d < len(perm):
                raise kernel_error(self, f"{d} is not between 0 and {len(perm)}")
            if inverse[d] != -1:
                raise kernel_error(self, f"{d} is duplicated in the input.")
            inverse[d] = i
        return [inverse]


@register_kernel("ListDiff")
class ListDiffKernel(_TypedKernel):
    """out: the values of `x` not in `y` (in `x`'s order); idx: their positions in `x`."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.index_type = attr_type_in(self, "out_idx", INDEX_TYPES, default=INT32)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, y = inputs
        for name, value in (("x", x), ("y", y)):
            if value.ndim != 1:
                raise kernel_error(self, f"{name} should be a 1D vector, got shape {shape_str(value.shape)}")
        keep = ~np.isin(x, y)
        return [x[keep], np.flatnonzero(keep).astype(self.index_type)]


@register_kernel("ExpandDims")
class ExpandDimsKernel(_TypedKernel):
    runs_on_loop = True  # a view or the shape: no thread hop
    fusable = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, dim_value = inputs
        if dim_value.size != 1:
            raise kernel_error(self, "'dim' must be a tensor with a single value")
        dim = int_list(self, dim_value.reshape(-1), "dim")[0]
        if not -1 - x.ndim <= dim <= x.ndim:
            raise kernel_error(self, f"Tried to expand dim index {dim} for tensor with {x.ndim} dimensions.")
        place = dim if dim >= 0 else dim + x.ndim + 1
        return [x.reshape((*x.shape[:place], 1, *x.shape[place:]))]  # (np.expand_dims: ~1.5 us more)


@register_kernel("Squeeze")
class SqueezeKernel(_TypedKernel):
    runs_on_loop = True  # a view or the shape: no thread hop
    fusable = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.squeeze_dims = self.attr_ints("squeeze_dims", [])

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (x,) = inputs
        if not self.squeeze_dims:
            return [x.reshape([d for d in x.shape if d != 1])]
        axes = set()
        for dim in self.squeeze_dims:
            if not -x.ndim <= dim < x.ndim:
                raise kernel_error(
                    self, f"Tried to squeeze dim index {dim} for tensor with {x.ndim} dimensions."
                )
            axis = dim % x.ndim
            if x.shape[axis] != 1:
                raise kernel_error(
                    self, f"Can not squeeze dim[{axis}], expected a dimension of 1, got {x.shape[axis]}"
                )
            axes.add(axis)
        return [x.reshape([d for i, d in enumerate(x.shape) if i not in axes])]


@register_kernel("Tile")
class TileKernel(_TypedKernel):
    def output_nbytes(self, inputs: list[Any]) -> int:
        return int(getattr(inputs[0], "nbytes", 0)) * product_of(inputs[1])

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, multiples_value = inputs
        multiples = int_list(self, multiples_value, "multiples")
        if len(multiples) != x.ndim:
            raise kernel_error(
                self,
                f"Expected multiples argument to be a vector of length {x.ndim} "
                f"but got length {len(multiples)}",
            )
        for i, m in enumerate(multiples):
            if m < 0:
                raise kernel_error(self, f"Expected multiples[{i}] >= 0, but got {m}")
        return [np.tile(x, multiples) if x.ndim else np.array(x, copy=True)]


@register_kernel("BroadcastTo")
class BroadcastToKernel(_TypedKernel):
    def output_nbytes(self, inputs: list[Any]) -> int:
        return product_of(inputs[1]) * self.dtype.itemsize

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, shape_value = inputs
        shape = tuple(int_list(self, shape_value, "shape"))
        if broadcast_shape(self, x.shape, shape) != shape:
            raise kernel_error(
                self,
                f"Unable to broadcast tensor of shape {shape_str(x.shape)} "
                f"to tensor of shape {shape_str(shape)}",
            )
        # A real array, not numpy's read-only zero-stride view.
        return [np.array(np.broadcast_to(x, shape))]


@register_kernel("BroadcastGradientArgs")
class BroadcastGradientArgsKernel(OpKernel):
    """For shapes s0, s1: the axes each gradient must be summed over (TF's BCast)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", INDEX_TYPES, default=INT32)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        shapes = []
        for i, value in enumerate(inputs):
            if value.ndim != 1:
                raise kernel_error(self, f"In[{i}] must be a vector.{shape_str(value.shape)}")
            shapes.append(tuple(int_list(self, value, f"In[{i}]")))
        out = broadcast_shape(self, *shapes)
        reductions = []
        for shape in shapes:
            padded = (1,) * (len(out) - len(shape)) + shape
            # Every axis where this input has size 1 was broadcast (or is 1 everywhere).
            reductions.append(np.array([k for k, d in enumerate(padded) if d == 1], dtype=self.dtype))
        return reductions


# --------------------------------------------------------------------------- joining and splitting


@register_kernel("ConcatV2")
class ConcatV2Kernel(_TypedKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        *values, axis_value = inputs
        if axis_value.ndim != 0:
            raise kernel_error(
                self,
                f"Concat dim tensor should be a scalar integer, but got shape {shape_str(axis_value.shape)}",
            )
        axis = int_scalar(self, axis_value, "axis")
        first = values[0]
        if first.ndim == 0:
            raise kernel_error(self, "ConcatOp : Can't concatenate scalars (use tf.stack instead)")
        if not -first.ndim <= axis < first.ndim:
            raise kernel_error(
                self,
                f"ConcatOp : Expected concatenating dimensions in the range [{-first.ndim}, {first.ndim}), "
                f"but got {axis}",
            )
        axis %= first.ndim
        for i, value in enumerate(values):
            check_input_dtype(self, i, value, self.dtype)
            if value.ndim != first.ndim:
                raise kernel_error(
                    self,
                    "ConcatOp : Ranks of all input tensors should match: shape[0] = "
                    f"{shape_str(first.shape)} vs. shape[{i}] = {shape_str(value.shape)}",
                )
            for d in range(first.ndim):
                if d != axis and value.shape[d] != first.shape[d]:
                    raise kernel_error(
                        self,
                        f"ConcatOp : Dimension {d} in both shapes must be equal: shape[0] = "
                        f"{shape_str(first.shape)} vs. shape[{i}] = {shape_str(value.shape)}",
                    )
        return [np.concatenate(values, axis=axis)]


@register_kernel("Pack")
class PackKernel(_TypedKernel):
    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.axis = self.attr_int("axis", 0)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        first = inputs[0]
        rank = first.ndim + 1
        if not -rank <= self.axis < rank:
            raise kernel_error(self, f"axis = {self.axis} not in [{-rank}, {rank})")
        for i, value in enumerate(inputs):
            check_input_dtype(self, i, value, self.dtype)
            if value.shape != first.shape:
                raise kernel_error(
                    self,
                    f"Shapes of all inputs must match: values[0].shape = {shape_str(first.shape)} != "
                    f"values[{i}].shape = {shape_str(value.shape)}",
                )
        return [np.stack(inputs, axis=self.axis % rank)]


@register_kernel("Unpack")
class UnpackKernel(_TypedKernel):
    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.num = self.attr_int("num")
        self.axis = self.attr_int("axis", 0)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (x,) = inputs
        if not -x.ndim <= self.axis < x.ndim:
            raise kernel_error(self, f"axis = {self.axis} not in [{-x.ndim}, {x.ndim})")
        axis = self.axis % x.ndim
        if x.shape[axis] != self.num:
            raise kernel_error(
                self, f"Input shape axis {axis} must equal {self.num}, got shape {shape_str(x.shape)}"
            )
        moved = np.moveaxis(x, axis, 0)
        return [moved[i, ...] for i in range(self.num)]  # `[i, ...]` keeps 0-d results arrays


@register_kernel("Split")
class SplitKernel(_TypedKernel):
    """`(axis, value)` -> `num_split` equal pieces along `axis`."""

    runs_on_loop = True  # views

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.num_split = self.attr_int("num_split")
        if self.num_split < 1:
            raise kernel_error(self, f"num_split must be at least 1, got {self.num_split}")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        axis_value, value = inputs
        axis = normalize_axis(self, int_scalar(self, axis_value, "split_dim"), value.ndim, "split_dim")
        if value.shape[axis] % self.num_split:
            raise kernel_error(
                self,
                f"Number of ways to split should evenly divide the split dimension, but got split_dim {axis} "
                f"(size = {value.shape[axis]}) and num_split {self.num_split}",
            )
        return list(np.split(value, self.num_split, axis=axis))


@register_kernel("SplitV")
class SplitVKernel(_TypedKernel):
    """`(value, size_splits, axis)` -> pieces of the given sizes along `axis`; one size may be -1."""

    runs_on_loop = True  # views

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.num_split = self.attr_int("num_split")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        value, sizes_value, axis_value = inputs
        axis = normalize_axis(self, int_scalar(self, axis_value, "split_dim"), value.ndim, "split_dim")
        sizes = int_list(self, sizes_value, "size_splits")
        total = value.shape[axis]
        if len(sizes) != self.num_split:
            raise kernel_error(
                self, f"Number of split sizes {len(sizes)} does not match num_split {self.num_split}"
            )
        unknown = [i for i, size in enumerate(sizes) if size == -1]
        if len(unknown) > 1:
            raise kernel_error(self, "There can only be one -1 in the input.")
        known = sum(size for size in sizes if size != -1)
        if unknown:
            sizes[unknown[0]] = total - known
        if any(size < 0 for size in sizes) or sum(sizes) != total:
            raise kernel_error(
                self,
                f"Determined shape must either match input shape along split_dim exactly if fully "
                f"specified, or be less than the size of the input along split_dim if not fully "
                f"specified.  Got: {known}",
            )
        return list(np.split(value, np.cumsum(sizes)[:-1], axis=axis))


@register_kernel("ReverseV2")
class ReverseV2Kernel(_TypedKernel):
    """`(tensor, axis)` -> the tensor with the listed axes reversed."""

    runs_on_loop = True  # a view

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        value, axis_value = inputs
        axes = [normalize_axis(self, a, value.ndim) for a in int_list(self, axis_value, "axis")]
        if len(set(axes)) != len(axes):
            raise kernel_error(self, f"axis {axes} specified more than once.")
        return [np.flip(value, axis=tuple(axes)) if axes else value]


# --------------------------------------------------------------------------- ranges and slices


@register_kernel("Range")
class RangeKernel(OpKernel):
    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "Tidx", REAL, default=INT32)

    def output_nbytes(self, inputs: list[Any]) -> int:
        try:
            start, limit, delta = (float(np.asarray(v).reshape(-1)[0]) for v in inputs)
            return int(max((limit - start) / delta, 0.0)) * self.dtype.itemsize
        except (TypeError, ValueError, IndexError, ZeroDivisionError, OverflowError):
            return 0

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        for i, (value, what) in enumerate(zip(inputs, ("start", "limit", "delta"), strict=True)):
            if value.ndim != 0:
                raise kernel_error(self, f"{what} must be a scalar, not shape {shape_str(value.shape)}")
            check_input_dtype(self, i, value, self.dtype)
        start, limit, delta = (v.item() for v in inputs)
        if delta == 0:
            raise kernel_error(self, f"Requires delta != 0: {delta}")
        if delta > 0 and start > limit:
            raise kernel_error(self, f"Requires start <= limit when delta > 0: {start}/{limit}")
        if delta < 0 and start < limit:
            raise kernel_error(self, f"Requires start >= limit when delta < 0: {start}/{limit}")
        if isinstance(start, int):
            size = (abs(limit - start) + abs(delta) - 1) // abs(delta)
            return [
                np.arange(size, dtype=self.dtype) * np.asarray(delta, self.dtype)
                + np.asarray(start, self.dtype)
            ]
        size = math.ceil(abs((limit - start) / delta))
        # TF accumulates `value += delta` step by step; a cumulative sum rounds the same way.
        steps = np.full(size, delta, dtype=self.dtype)
        if size:
            steps[0] = start
        return [np.cumsum(steps, dtype=self.dtype)]


@register_kernel("Slice")
class SliceKernel(_TypedKernel):
    runs_on_loop = True  # a view or the shape: no thread hop

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, begin_value, size_value = inputs
        if not (
            begin_value.ndim == 1 and size_value.ndim == 1 and begin_value.size == size_value.size == x.ndim
        ):
            raise kernel_error(
                self,
                f"Expected begin and size arguments to be 1-D tensors of size {x.ndim}, but got shapes "
                f"{shape_str(begin_value.shape)} and {shape_str(size_value.shape)} instead.",
            )
        begin = int_list(self, begin_value, "begin")
        size = int_list(self, size_value, "size")
        index = []
        for i, (b, s, dim) in enumerate(zip(begin, size, x.shape, strict=True)):
            if s == -1:
                s = dim - b
            if not 0 <= b <= dim:
                raise kernel_error(self, f"Expected begin[{i}] in [0, {dim}], but got {b}")
            if not 0 <= s <= dim - b:
                raise kernel_error(self, f"Expected size[{i}] in [0, {dim - b}], but got {s}")
            index.append(slice(b, b + s))
        return [x[tuple(index)]]


@register_kernel("StridedSlice")
class StridedSliceKernel(_TypedKernel):
    """Python-style slicing `x[begin:end:stride, ...]` encoded as TF's masks.

    Each position i of begin/end/strides is, by precedence: an ellipsis (bit i of
    `ellipsis_mask`), a new axis of size 1 (`new_axis_mask`), a single index that
    removes the dimension (`shrink_axis_mask`: begin[i] only, which must be in range),
    or a range whose begin/end are ignored when `begin_mask`/`end_mask` has bit i.
    Without an ellipsis, one is implied at the end. Clamping of out-of-range ends is
    Python's, which is also TF's.
    """

    runs_on_loop = True  # a view or the shape: no thread hop

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.index_type = attr_type_in(self, "Index", INDEX_TYPES, default=INT32)
        self.begin_mask, self.end_mask, self.ellipsis_mask, self.new_axis_mask, self.shrink_axis_mask = (
            self.attr_int(name, 0)
            for name in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")
        )
        if self.ellipsis_mask & (self.ellipsis_mask - 1):
            raise kernel_error(self, "Multiple ellipses in slice spec not allowed")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, begin_value, end_value, strides_value = inputs
        spec = (begin_value, end_value, strides_value)
        if any(v.ndim != 1 for v in spec) or not begin_value.size == end_value.size == strides_value.size:
            raise kernel_error(
                self,
                "Expected begin, end, and strides to be 1D equal size tensors, but got shapes "
                f"{shape_str(begin_value.shape)}, {shape_str(end_value.shape)}, and "
                f"{shape_str(strides_value.shape)} instead.",
            )
        begin, end, strides = (
            int_list(self, v, name) for v, name in zip(spec, ("begin", "end", "strides"), strict=True)
        )
        return [np.asarray(x[self._index(x.shape, begin, end, strides)])]

    def _index(
        self, shape: Sequence[int], begin: list[int], end: list[int], strides: list[int]
    ) -> tuple[Any, ...]:
        n = len(strides)

        def bit(mask: int, i: int) -> bool:
            return bool(mask >> i & 1)

        # Dimensions consumed by entries that are neither ellipsis nor new axis.
        real = [i for i in range(n) if not bit(self.ellipsis_mask, i) and not bit(self.new_axis_mask, i)]
        if len(real) > len(shape):
            raise kernel_error(
                self, f"Index out of range using input dim {len(shape)}; input has only {len(shape)} dims"
            )
        index: list[Any] = []
        dim = 0  # the input dimension the next entry applies to
        for i in range(n):
            if bit(self.ellipsis_mask, i):
                covered = len(shape) - len(real)
                index.append(Ellipsis)
                dim += covered
            elif bit(self.new_axis_mask, i):
                index.append(None)
            else:
                stride = strides[i]
                if stride == 0:
                    raise kernel_error(self, f"strides[{i}] must be non-zero")
                if bit(self.shrink_axis_mask, i):
                    if stride < 0:
                        raise kernel_error(self, "only stride 1 allowed on non-range indexing.")
                    position = begin[i] + shape[dim] if begin[i] < 0 else begin[i]
                    if not 0 <= position < shape[dim]:
                        raise kernel_error(self, f"slice index {position} of dimension {dim} out of bounds.")
                    index.append(position)
                else:
                    start = None if bit(self.begin_mask, i) else begin[i]
                    stop = None if bit(self.end_mask, i) else end[i]
                    index.append(slice(start, stop, stride))
                dim += 1
        if Ellipsis not in index:
            index.append(Ellipsis)  # keeps numpy returning an array even when all dims shrink
        return tuple(index)


@register_kernel("StridedSliceGrad")
class StridedSliceGradKernel(StridedSliceKernel):
    """The gradient of StridedSlice: zeros of `shape` with `dy` written where the slice was."""

    runs_on_loop = False

    def output_nbytes(self, inputs: list[Any]) -> int:
        return product_of(inputs[0]) * self.dtype.itemsize

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        shape_value, begin_value, end_value, strides_value, dy = inputs
        if shape_value.ndim != 1:
            raise kernel_error(self, f"shape must be a vector, got shape {shape_str(shape_value.shape)}")
        shape = int_list(self, shape_value, "shape")
        if any(size < 0 for size in shape):
            raise kernel_error(self, f"shape must not have negative sizes, got {shape}")
        spec = (begin_value, end_value, strides_value)
        if any(v.ndim != 1 for v in spec) or not begin_value.size == end_value.size == strides_value.size:
            raise kernel_error(self, "Expected begin, end, and strides to be 1D equal size tensors")
        begin, end, strides = (
            int_list(self, v, name) for v, name in zip(spec, ("begin", "end", "strides"), strict=True)
        )
        check_input_dtype(self, 4, dy, self.dtype)
        result = np.zeros(shape, dtype=self.dtype)
        window = result[self._index(shape, begin, end, strides)]
        if window.size != dy.size:
            raise kernel_error(
                self,
                f"shape of dy was {shape_str(dy.shape)} instead of {shape_str(window.shape)}",
            )
        window[...] = dy.reshape(window.shape)
        return [result]


# --------------------------------------------------------------------------- selection and gathering


@register_kernel("Select")
class SelectKernel(_TypedKernel):
    """TF1 `where(c, t, e)`: c is a scalar, has t's shape, or is a vector over t's rows."""

    fusable = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        cond, then, other = inputs
        check_input_dtype(self, 0, cond, BOOL)
        check_input_dtype(self, 1, then, self.dtype)
        check_input_dtype(self, 2, other, self.dtype)
        if then.shape != other.shape:
            raise kernel_error(
                self,
                "'then' and 'else' must have the same size.  but received: "
                f"{shape_str(then.shape)} vs. {shape_str(other.shape)}",
            )
        if cond.ndim == 0:
            return [then if bool(cond) else other]
        if cond.ndim == 1 and then.ndim != 1:
            if then.ndim == 0:
                raise kernel_error(
                    self, f"'then' must be at least a vector, but saw shape: {shape_str(then.shape)}"
                )
            if then.shape[0] != cond.shape[0]:
                raise kernel_error(
                    self,
                    f"Number of batches of 'then' must match size of 'condition', but saw: "
                    f"{then.shape[0]} vs. {cond.shape[0]}",
                )
            cond = cond.reshape(cond.shape + (1,) * (then.ndim - 1))
        elif cond.shape != then.shape:
            raise kernel_error(
                self,
                "'condition', 'then' and 'else' must have the same size.  but received: "
                f"{shape_str(cond.shape)} vs. {shape_str(then.shape)} vs. {shape_str(other.shape)}",
            )
        return [np.where(cond, then, other)]


@register_kernel("SelectV2")
class SelectV2Kernel(_TypedKernel):
    """`where(c, t, e)` with numpy broadcasting of all three."""

    fusable = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        cond, then, other = inputs
        check_input_dtype(self, 0, cond, BOOL)
        check_input_dtype(self, 1, then, self.dtype)
        check_input_dtype(self, 2, other, self.dtype)
        try:
            if not cond.shape == then.shape == other.shape:  # (alike, most often: 1.7 us saved)
                np.broadcast_shapes(cond.shape, then.shape, other.shape)
        except ValueError:
            raise kernel_error(
                self,
                f"condition {shape_str(cond.shape)}, then {shape_str(then.shape)}, and else "
                f"{shape_str(other.shape)} must be broadcastable",
            ) from None
        return [array(np.where(cond, then, other), self.dtype)]


@register_kernel("Gather", "GatherV2")
class GatherKernel(OpKernel):
    """params[..., indices, ...] along `axis` (GatherV2's input; 0 for Gather).

    `batch_dims` (GatherV2) pairs the leading dims of params and indices: each batch
    gathers from its own slice. Indices out of range are an error, as on TF's CPU.
    """

    params_type_attr = "Tparams"

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, self.params_type_attr, ALL_TYPES)
        self.index_type = attr_type_in(self, "Tindices", INDEX_TYPES)
        self.batch_dims = self.attr_int("batch_dims", 0) if self.op != "Gather" else 0
        if self.dtype in _compiled.DTYPES:
            _compiled.prepare()

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        params, indices = inputs[0], inputs[1]
        check_input_dtype(self, 0, params, self.dtype)
        axis = int_scalar(self, inputs[2], "axis") if self.op == "GatherV2" else 0
        return [self.gather(params, indices, axis)]

    def gather(self, params: np.ndarray, indices: np.ndarray, axis: int) -> np.ndarray:
        """The gathered values, after TF's checks of `indices` and `axis`."""
        check_input_dtype(self, 1, indices, self.index_type)
        if params.ndim == 0:
            raise kernel_error(self, "params must be at least 1 dimensional")
        axis = normalize_axis(self, axis, params.ndim)
        batch_dims = self._batch_dims(params, indices, axis)
        if axis == 0 and batch_dims == 0:
            rows = _take_rows(params, indices)
            if rows is not None:
                return rows
        limit = params.shape[axis]
        if indices.size and (indices.min() < 0 or indices.max() >= limit):  # (no temporaries)
            bad = np.flatnonzero((indices < 0) | (indices >= limit))
            position = np.unravel_index(bad[0], indices.shape)
            where = f"[{','.join(map(str, position))}]" if indices.ndim else ""
            raise kernel_error(self, f"indices{where} = {indices.reshape(-1)[bad[0]]} is not in [0, {limit})")
        if batch_dims == 0:
            return np.take(params, indices, axis=axis)
        return _batched_take(params, indices, axis, batch_dims)

    def _batch_dims(self, params: np.ndarray, indices: np.ndarray, axis: int) -> int:
        batch_dims = self.batch_dims
        if batch_dims == 0:
            return 0
        if not -indices.ndim <= batch_dims <= indices.ndim:
            raise kernel_error(
                self,
                f"Expected batch_dims in the range [{-indices.ndim}, {indices.ndim}], but got {batch_dims}",
            )
        if batch_dims < 0:
            batch_dims += indices.ndim
        if batch_dims >= params.ndim:
            raise kernel_error(
                self, f"batch_dims ({batch_dims}) must be less than rank(params) ({params.ndim})."
            )
        if axis < batch_dims:
            raise kernel_error(
                self, f"batch_dims ({batch_dims}) must be less than or equal to axis ({axis})."
            )
        for i in range(batch_dims):
            if params.shape[i] != indices.shape[i]:
                raise kernel_error(
                    self,
                    f"params.shape[{i}]: {params.shape[i]} should be equal to "
                    f"indices.shape[{i}]: {indices.shape[i]}",
                )
        return batch_dims


def _take_rows(params: np.ndarray, indices: np.ndarray) -> np.ndarray | None:
    """`np.take(params, indices, axis=0)` of float rows by the compiled loop (one pass
    that checks each index as it copies its row, where numpy's way takes a pass for the
    smallest, one for the largest, then the copy: 1,024 rows of 32 floats ~8 -> ~6 us);
    None, having changed nothing, when the loop does not apply or an index is out of
    range (numpy's way then names it)."""
    loops = _compiled.loops()
    if (
        loops is None
        or params.ndim < 2
        or params.dtype not in _compiled.DTYPES
        or not _compiled.contiguous(params, indices)
    ):
        return None
    rows = np.empty(indices.shape + params.shape[1:], params.dtype)
    if params.ndim == 2 and indices.ndim == 1:  # (the loop's shapes already: no views)
        bad = loops.take_rows(rows, params, indices)
    else:
        width = math.prod(params.shape[1:])
        flat = params.reshape(params.shape[0], width)
        bad = loops.take_rows(rows.reshape(indices.size, width), flat, indices.reshape(indices.size))
    return rows if bad < 0 else None


def _batched_take(params: np.ndarray, indices: np.ndarray, axis: int, batch_dims: int) -> np.ndarray:
    """Gather with `batch_dims` leading dims shared by params and indices, vectorised.

    Result shape: params.shape[:axis] + indices.shape[batch_dims:] + params.shape[axis+1:].
    """
    batch_shape = params.shape[:batch_dims]
    batches = math.prod(batch_shape)
    flat_params = params.reshape((batches, *params.shape[batch_dims:]))
    flat_indices = indices.reshape((batches, *indices.shape[batch_dims:]))
    # (B, N, pre..., post...): the gathered axis right after the batch.
    moved = np.moveaxis(flat_params, axis - batch_dims + 1, 1)
    rows = np.arange(batches).reshape((batches,) + (1,) * (flat_indices.ndim - 1))
    gathered = moved[rows, flat_indices]  # (B, idx..., pre..., post...)
    n_idx, n_pre = flat_indices.ndim - 1, axis - batch_dims
    order = [
        0,
        *range(1 + n_idx, 1 + n_idx + n_pre),
        *range(1, 1 + n_idx),
        *range(1 + n_idx + n_pre, gathered.ndim),
    ]
    result = gathered.transpose(order)
    return result.reshape(batch_shape + result.shape[1:])


@register_kernel("OneHot")
class OneHotKernel(_TypedKernel):
    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.axis = self.attr_int("axis", -1)

    def output_nbytes(self, inputs: list[Any]) -> int:
        return int(getattr(inputs[0], "size", 0)) * product_of(inputs[1]) * self.dtype.itemsize

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        indices, depth_value, on_value, off_value = inputs
        out_rank = indices.ndim + 1
        if self.axis != -1 and not 0 <= self.axis < out_rank:
            raise kernel_error(
                self, f"Expected axis to be -1 or between [0, {out_rank}).  But received: {self.axis}"
            )
        if depth_value.ndim != 0:
            raise kernel_error(self, f"depth must be a scalar, but got: {shape_str(depth_value.shape)}")
        depth = int_scalar(self, depth_value, "depth")
        if depth < 0:
            raise kernel_error(self, f"depth must be non-negative, got: {depth}")
        for what, value in (("on_value", on_value), ("off_value", off_value)):
            if value.ndim != 0:
                raise kernel_error(self, f"{what} must be a scalar, but got: {shape_str(value.shape)}")
            check_input_dtype(self, 2 if what == "on_value" else 3, value, self.dtype)
        # Indices outside [0, depth) match no position, so their rows are all off_value.
        hot = indices[..., np.newaxis] == np.arange(depth)
        result = np.where(hot, on_value, off_value).astype(self.dtype, copy=False)
        return [result if self.axis == -1 else np.moveaxis(result, -1, self.axis)]


@register_kernel("Where")
class WhereKernel(_TypedKernel):
    """The coordinates of the true (non-zero) elements: int64 [count, rank], row-major order."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        if self.dtype == OBJECT:
            raise kernel_error(self, "Where does not support string inputs", errors.UnimplementedError)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (condition,) = inputs
        check_input_dtype(self, 0, condition, self.dtype)
        return [np.argwhere(condition).astype(np.int64, copy=False)]


@register_kernel("ScatterNd")
class ScatterNdKernel(_TypedKernel):
    """`(indices [..., K], updates, shape)` -> zeros of `shape` with `updates` added at
    `indices` (each index names a slice of the last `rank - K` dimensions; repeats add up)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.index_type = attr_type_in(self, "Tindices", INDEX_TYPES)

    def output_nbytes(self, inputs: list[Any]) -> int:
        return product_of(inputs[2]) * self.dtype.itemsize

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        indices, updates, shape_value = inputs
        check_input_dtype(self, 1, updates, self.dtype)
        shape = int_list(self, shape_value, "shape")
        if any(size < 0 for size in shape):
            raise kernel_error(self, f"shape must not have negative sizes, got {shape}")
        if indices.ndim < 1 or indices.dtype not in INDEX_TYPES:
            raise kernel_error(
                self, f"indices must be an int tensor of rank >= 1, got {shape_str(indices.shape)}"
            )
        depth = indices.shape[-1]
        expected = (*indices.shape[:-1], *shape[depth:])
        if depth > len(shape) or updates.shape != expected:
            raise kernel_error(
                self,
                f"Dimensions mismatch: indices {shape_str(indices.shape)}, updates "
                f"{shape_str(updates.shape)}, shape {shape}",
            )
        flat = indices.reshape(-1, depth)
        for k in range(depth):
            bad = (flat[:, k] < 0) | (flat[:, k] >= shape[k])
            if bad.any():
                position = int(np.flatnonzero(bad)[0])
                raise kernel_error(
                    self, f"indices[{position}] = {flat[position].tolist()} does not index into shape {shape}"
                )
        result = np.zeros(shape, dtype=self.dtype)
        np.add.at(result, tuple(flat[:, k] for k in range(depth)), updates.reshape(-1, *shape[depth:]))
        return [result]


@register_kernel("DynamicStitch", "ParallelDynamicStitch")
class DynamicStitchKernel(OpKernel):
    """Interleaves `data` into one tensor: merged[indices[m][i, ...], ...] = data[m][i, ...].

    Inputs are N int32 `indices` tensors then N `data` tensors; data[m].shape must
    start with indices[m].shape and continue with the same trailing shape for every m.
    The first dimension of the result is max(index) + 1; rows no index names are
    zeros. Later inputs win where indices repeat (TF guarantees that for
    DynamicStitch only).
    """

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.count = self.attr_int("N", at_least=1)
        self.dtype = attr_type_in(self, "T", ALL_TYPES)
        if self.dtype in _compiled.DTYPES:
            _compiled.prepare()

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        indices, data = inputs[: self.count], inputs[self.count :]
        if len(data) != self.count:
            raise kernel_error(self, f"{self.op} expects {2 * self.count} inputs, got {len(inputs)}")
        trailing: tuple[int, ...] | None = None
        for m, (index, values) in enumerate(zip(indices, data, strict=True)):
            check_input_dtype(self, m, index, INT32)
            check_input_dtype(self, self.count + m, values, self.dtype)
            if values.shape[: index.ndim] != index.shape:
                raise kernel_error(
                    self,
                    f"data[{m}].shape = {shape_str(values.shape)} does not start with "
                    f"indices[{m}].shape = {shape_str(index.shape)}",
                )
            rest = values.shape[index.ndim :]
            if trailing is None:
                trailing = rest
            elif rest != trailing:
                raise kernel_error(
                    self,
                    f"Need data[0].shape[{indices[0].ndim}:] = {shape_str(trailing)} to match "
                    f"data[{m}].shape[{index.ndim}:] = {shape_str(rest)}",
                )
        assert trailing is not None
        flat_indices = [index.reshape(-1) for index in indices]
        loops = _compiled.loops() if self.dtype in _compiled.DTYPES else None
        size = 0
        for m, index in enumerate(flat_indices):
            if not index.size:
                continue
            if loops is not None and index.flags.c_contiguous:  # (one pass, not two)
                low, high = loops.bounds(index)
            else:
                low, high = int(index.min()), int(index.max())
            if low < 0:
                raise kernel_error(self, f"indices[{m}] contains a negative index {low}")
            size = max(size, high + 1)
        width = math.prod(trailing)
        if (
            loops is not None
            and size
            and width
            and sum(index.size for index in flat_indices) >= size  # (see `_stitch_compiled`)
            and all(map(_compiled.contiguous, flat_indices, data))
        ):
            return [self._stitch_compiled(loops, flat_indices, data, (size, *trailing))]
        merged = np.zeros((size, *trailing), dtype=self.dtype)
        if self.dtype == OBJECT:
            merged.fill(b"")
        for index, values in zip(flat_indices, data, strict=True):
            merged[index] = values.reshape((index.size, *trailing))
        return [merged]

    def _stitch_compiled(
        self, loops: Any, flat_indices: list[np.ndarray], data: list[np.ndarray], shape: tuple[int, ...]
    ) -> np.ndarray:
        """The rows copied by one compiled loop per input (an embedding lookup's two
        shards' rows, [1024, 32] each: 21 -> 9 us), where numpy's indexed assignment
        makes a pass of its own per input; only the rows no index names are zeroed
        afterwards (most often none: an embedding's positions name every row once),
        not the whole output first. For indices that may name every row (no more rows
        than indices): an output larger than its inputs, from an index far past the
        others, takes numpy's zeros, whose pages stay untouched where no row goes."""
        merged = np.empty(shape, self.dtype)
        size = shape[0]
        rows = merged.reshape(size, -1)
        written = np.zeros(size, np.bool_)
        for index, values in zip(flat_indices, data, strict=True):
            if index.size:
                loops.set_rows_at(rows, index, values.reshape(index.size, rows.shape[1]), written)
        if not written.all():
            rows[~written] = 0
        return merged


# --------------------------------------------------------------------------- Assert


@register_kernel("Assert")
class AssertKernel(OpKernel):
    """Fails the step with the summarised `data` tensors when `condition` is false."""

    is_stateful = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.summarize = self.attr_int("summarize", 3)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        condition, *data = inputs
        check_input_dtype(self, 0, condition, BOOL)
        if condition.size != 1 or condition.ndim > 1:  # TF's "legacy scalar": [] or [1]
            raise kernel_error(self, f"In[0] should be a scalar: {shape_str(condition.shape)}")
        if bool(condition.reshape(-1)[0]):
            return []
        summary = " ".join(f"[{summarize(value, self.summarize)}]" for value in data)
        raise kernel_error(self, f"assertion failed: {summary}")


__all__ = [
    "AssertKernel",
    "BroadcastGradientArgsKernel",
    "BroadcastToKernel",
    "ConcatV2Kernel",
    "ConstKernel",
    "DynamicStitchKernel",
    "ExpandDimsKernel",
    "FillKernel",
    "FillLikeKernel",
    "GatherKernel",
    "IdentityKernel",
    "IdentityNKernel",
    "InvertPermutationKernel",
    "ListDiffKernel",
    "NoOpKernel",
    "OneHotKernel",
    "PackKernel",
    "PlaceholderKernel",
    "RangeKernel",
    "RankKernel",
    "ReshapeKernel",
    "ScatterNdKernel",
    "SelectKernel",
    "SelectV2Kernel",
    "ShapeKernel",
    "SizeKernel",
    "SliceKernel",
    "SqueezeKernel",
    "StridedSliceGradKernel",
    "StridedSliceKernel",
    "TileKernel",
    "TransposeKernel",
    "UnpackKernel",
    "WhereKernel",
]
