"""Numpy kernels for TF 1.x convolutional networks: convolution, pooling, padding.

`Conv2D` and the two ops its gradient emits (`Conv2DBackpropInput`,
`Conv2DBackpropFilter`, fed by `ShapeN`), `MaxPool`/`MaxPoolGrad`,
`AvgPool`/`AvgPoolGrad`, and `Pad`/`PadV2`/`MirrorPad`/`MirrorPadGrad`. Images are
NHWC; like TensorFlow's CPU kernels these refuse NCHW. Geometry follows TensorFlow's
windowed output sizes: VALID, SAME (the odd pixel of padding goes after), and
EXPLICIT (`explicit_paddings`, for the convolutions and max pooling).

How they run: a convolution gathers every output pixel's patch into a matrix (im2col,
from a `sliding_window_view`, a chunk of the batch at a time so the matrix stays
below `_PATCH_BYTES`) and multiplies it with the filter; the input gradient and the
pooling ops loop over the window's taps (kh * kw slices of the whole batch), never
over pixels. float16/bfloat16 compute in float32 and round back, as TensorFlow's
kernels accumulate in float32. Convolutions may be grouped (input depth a multiple of
the filter's), in both directions.

Error texts are TensorFlow's, and name the node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from distserver import errors
from distserver.kernels._common import (
    ALL_TYPES,
    FLOATS,
    INDEX_TYPES,
    INT32,
    NUMBER,
    OBJECT,
    REAL,
    attr_type_in,
    check_input_dtype,
    compute_dtype,
    int_list,
    kernel_error,
    shape_str,
)
from distserver.kernels.registry import KernelContext, OpKernel, product_of, register_kernel

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef

# The most bytes of patches (im2col) one matrix product takes; larger batches go in chunks.
_PATCH_BYTES = 32 << 20

_HALF = np.dtype(np.float16)


def _work_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """float16 and bfloat16 compute in float32; everything else in its own type."""
    return np.dtype(np.float32) if dtype == _HALF else compute_dtype(dtype)


def _lowest(dtype: np.dtype[Any]) -> Any:
    """The smallest finite value of a real dtype (TensorFlow's `NumTraits<T>::lowest()`)."""
    return np.finfo(dtype).min if dtype.kind == "f" else np.iinfo(dtype).min


# --------------------------------------------------------------------------- window geometry


@dataclasses.dataclass(frozen=True)
class _Dim:
    """One spatial dimension of a sliding window over an input, padding included."""

    size: int  # of the input
    window: int
    stride: int
    dilation: int
    out: int
    before: int  # padding
    after: int

    @property
    def effective(self) -> int:
        return (self.window - 1) * self.dilation + 1

    def tap(self, i: int) -> slice:
        """The padded input's rows that tap `i` of every output position reads."""
        start = i * self.dilation
        return slice(start, start + (self.out - 1) * self.stride + 1, self.stride)

    def crop(self) -> slice:
        """The input's rows within the padded input."""
        return slice(self.before, self.before + self.size)

    def counts(self) -> np.ndarray:
        """How many input (not padding) rows each output position's window covers."""
        start = np.arange(self.out) * self.stride - self.before
        end = np.minimum(start + self.window, self.size)
        counts: np.ndarray = end - np.maximum(start, 0)
        return counts


def _windowed(
    kernel: OpKernel,
    size: int,
    window: int,
    stride: int,
    dilation: int,
    padding: str,
    explicit: tuple[int, int],
) -> _Dim:
    """TensorFlow's windowed output size and padding for one dimension."""
    effective = (window - 1) * dilation + 1
    if padding == "SAME":
        out = (size + stride - 1) // stride
        needed = max(0, (out - 1) * stride + effective - size)
        before, after = needed // 2, needed - needed // 2
    else:
        before, after = explicit if padding == "EXPLICIT" else (0, 0)
        span = size + before + after - effective + stride
        out = span // stride if span >= 0 else -(-span // stride)  # C++ division truncates
    if out < 0:
        raise kernel_error(
            kernel,
            f"Computed output size would be negative: {out} [input_size: {size}, "
            f"effective_filter_size: {effective}, stride: {stride}]",
        )
    return _Dim(size, window, stride, dilation, out, before, after)


def _pad_hw(x: np.ndarray, h: _Dim, w: _Dim, value: Any = 0) -> np.ndarray:
    """`x` (NHWC) with `h`'s and `w`'s padding around its rows and columns."""
    if not (h.before or h.after or w.before or w.after):
        return x
    padded = np.full(
        (x.shape[0], h.before + h.size + h.after, w.before + w.size + w.after, x.shape[3]), value, x.dtype
    )
    padded[:, h.crop(), w.crop(), :] = x
    return padded


def _taps(h: _Dim, w: _Dim) -> Iterator[tuple[int, slice, slice]]:
    """(tap number, rows, columns) of every tap of the window, in row-major order."""
    for i in range(h.window):
        for j in range(w.window):
            yield i * w.window + j, h.tap(i), w.tap(j)


def _patches(padded: np.ndarray, h: _Dim, w: _Dim) -> np.ndarray:
    """A view [N, OH, OW, KH, KW, C] of every output position's (dilated) window."""
    view = sliding_window_view(padded, (h.effective, w.effective), axis=(1, 2))  # N, H', W', C, eh, ew
    view = view[
        :,
        : (h.out - 1) * h.stride + 1 : h.stride,
        : (w.out - 1) * w.stride + 1 : w.stride,
        :,
        :: h.dilation,
        :: w.dilation,
    ]
    return view.transpose(0, 1, 2, 4, 5, 3)


def _batch_chunks(batch: int, bytes_per_image: int) -> Iterator[slice]:
    """Slices of the batch whose patch matrices stay below `_PATCH_BYTES` (at least one image)."""
    step = max(1, _PATCH_BYTES // max(bytes_per_image, 1))
    for start in range(0, batch, step):
        yield slice(start, min(start + step, batch))


def _four(kernel: OpKernel, attr: str, default: list[int] | None = None) -> list[int]:
    values = kernel.attr_ints(attr, default)
    if len(values) != 4:
        raise kernel_error(kernel, f"Sliding window {attr} field must specify 4 dimensions")
    return values


def _padding(kernel: OpKernel, allowed: tuple[str, ...]) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The `padding` attr and, for EXPLICIT, the (before, after) pairs of H and W."""
    padding = kernel.attr_str("padding")
    if padding not in allowed:
        names = ", ".join(f'"{name}"' for name in allowed)
        raise kernel_error(
            kernel, f"Value for attr 'padding' of \"{padding}\" is not in the list of allowed values: {names}"
        )
    explicit = kernel.attr_ints("explicit_paddings", [])
    if padding != "EXPLICIT":
        if explicit:
            raise kernel_error(
                kernel, "explicit_paddings attribute must be empty if the padding attribute is not EXPLICIT"
            )
        return padding, ((0, 0), (0, 0))
    if len(explicit) != 8:
        raise kernel_error(
            kernel, f"explicit_paddings attribute must contain 8 values, but got: {len(explicit)}"
        )
    if any(p < 0 for p in explicit):
        raise kernel_error(kernel, "All elements of explicit_paddings must be nonnegative")
    if any(explicit[i] for i in (0, 1, 6, 7)):
        raise kernel_error(
            kernel, "Nonzero explicit padding in the batch or depth dimensions is not supported"
        )
    return padding, ((explicit[2], explicit[3]), (explicit[4], explicit[5]))


def _check_rank(kernel: OpKernel, value: np.ndarray, text: str) -> None:
    if value.ndim != 4:
        raise kernel_error(kernel, text)


def _zeros(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    return np.zeros(shape, dtype)


# --------------------------------------------------------------------------- convolutions


class _ConvKernel(OpKernel):
    """Attrs and geometry shared by Conv2D and its two gradients."""

    allowed: ClassVar[frozenset[np.dtype[Any]]] = FLOATS
    label: ClassVar[str]  # TensorFlow's prefix for the gradients' shape errors
    nchw_error: ClassVar[tuple[str, type[errors.OpError]]]

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", self.allowed)
        self.work = _work_dtype(self.dtype)
        if self.attr_str("data_format", "NHWC") != "NHWC":
            text, cls = self.nchw_error
            raise kernel_error(self, text.format(self.attr_str("data_format")), cls)
        strides = _four(self, "strides")
        if strides[0] != 1 or strides[3] != 1:
            raise kernel_error(
                self,
                "Current implementation does not yet support strides in the batch and depth dimensions.",
                errors.UnimplementedError,
            )
        if strides[1] <= 0 or strides[2] <= 0:
            raise kernel_error(self, "Row and column strides should be larger than 0.")
        dilations = _four(self, "dilations", [1, 1, 1, 1])
        if dilations[0] != 1 or dilations[3] != 1:
            raise kernel_error(
                self,
                "Current implementation does not yet support dilations in the batch and depth dimensions.",
                errors.UnimplementedError,
            )
        if dilations[1] <= 0 or dilations[2] <= 0:
            raise kernel_error(self, "Dilated rates should be larger than 0.")
        self.strides = (strides[1], strides[2])
        self.dilations = (dilations[1], dilations[2])
        self.padding, self.explicit = _padding(self, ("SAME", "VALID", "EXPLICIT"))

    def _dims(self, in_hw: tuple[int, int], filter_hw: tuple[int, int]) -> tuple[_Dim, _Dim]:
        h, w = (
            _windowed(
                self,
                in_hw[d],
                filter_hw[d],
                self.strides[d],
                self.dilations[d],
                self.padding,
                self.explicit[d],
            )
            for d in range(2)
        )
        return h, w

    def _backprop_dims(
        self, input_shape: tuple[int, ...], filter_shape: tuple[int, ...], out_backprop: np.ndarray
    ) -> tuple[_Dim, _Dim, int]:
        """The gradients' shape checks (TensorFlow's ConvBackpropComputeDimensions); returns the groups."""
        label = self.label
        if len(input_shape) != 4:
            raise kernel_error(self, f"{label}: input must be 4-dimensional")
        if len(filter_shape) != 4:
            raise kernel_error(self, f"{label}: filter must be 4-dimensional")
        if out_backprop.ndim != 4:
            raise kernel_error(self, f"{label}: out_backprop must be 4-dimensional")
        if input_shape[0] != out_backprop.shape[0]:
            raise kernel_error(
                self,
                f"{label}: input and out_backprop must have the same batch size. Input batch: "
                f"{input_shape[0]}, outbackprop batch: {out_backprop.shape[0]}, batch_dim: 0",
            )
        in_depth, filter_depth, out_depth = input_shape[3], filter_shape[2], filter_shape[3]
        if filter_depth <= 0 or in_depth % filter_depth:
            raise kernel_error(self, f"{label}: input depth must be evenly divisible by filter depth")
        if out_backprop.shape[3] != out_depth:
            raise kernel_error(self, f"{label}: filter and out_backprop must have the same out_depth")
        groups = in_depth // filter_depth
        if groups and out_depth % groups:
            raise kernel_error(
                self,
                f"{label}: output depth must be evenly divisible by number of groups: "
                f"{out_depth} vs {groups}",
            )
        dims = self._dims((input_shape[1], input_shape[2]), (filter_shape[0], filter_shape[1]))
        for d, dim in enumerate(dims):
            actual = out_backprop.shape[1 + d]
            if actual != dim.out:
                raise kernel_error(
                    self,
                    f"{label}: Size of out_backprop doesn't match computed: actual = {actual}, computed = "
                    f"{dim.out} spatial_dim: {1 + d} input: {dim.size} filter: {dim.window} output: {actual} "
                    f"stride: {dim.stride} dilation: {dim.dilation}",
                )
        return dims[0], dims[1], max(groups, 1)

    def _patch_nbytes(self, batch: Any, out_hw: tuple[Any, Any], filter_shape: Any) -> int:
        """Bytes of the patch matrix for a (possibly malformed) geometry; 0 when unknown."""
        try:
            kh, kw, depth = (int(d) for d in list(filter_shape)[:3])
            return max(int(batch) * int(out_hw[0]) * int(out_hw[1]) * kh * kw * depth, 0) * self.work.itemsize
        except (TypeError, ValueError):
            return 0


def _group_filter(f: np.ndarray, groups: int) -> np.ndarray:
    """Filter [KH, KW, Cg, O] as [G, KH*KW*Cg, O/G]: each group's columns of the patch product."""
    kh, kw, cg, o = f.shape
    return (
        f.reshape(kh * kw, cg, groups, o // groups)
        .transpose(2, 0, 1, 3)
        .reshape(groups, kh * kw * cg, o // groups)
    )


def _group_patches(cols: np.ndarray, taps: int, groups: int) -> np.ndarray:
    """Patch rows [M, KH*KW*C] as [G, M, KH*KW*Cg]."""
    m = cols.shape[0]
    cg = cols.shape[1] // taps // groups
    return cols.reshape(m, taps, groups, cg).transpose(2, 0, 1, 3).reshape(groups, m, taps * cg)


@register_kernel("Conv2D")
class Conv2DKernel(_ConvKernel):
    """out[n, y, x, o] = sum over (i, j, c) of in[n, y*s + i*d, x*s + j*d, c] * filter[i, j, c, o].

    The input is padded per `padding` first. A filter of depth Cg < C convolves each
    group of Cg input channels into its own O/(C/Cg) output channels.
    """

    allowed = FLOATS | {INT32}
    nchw_error = (
        "The Conv2D op currently only supports the NHWC tensor format on the CPU. "
        "The op was given the format: {}",
        errors.UnimplementedError,
    )

    def output_nbytes(self, inputs: list[Any]) -> int:
        try:
            x, f = inputs
            out_h = -(-x.shape[1] // self.strides[0])
            out_w = -(-x.shape[2] // self.strides[1])
            out_bytes = int(x.shape[0]) * out_h * out_w * int(f.shape[3]) * self.dtype.itemsize
            return int(self._patch_nbytes(x.shape[0], (out_h, out_w), f.shape) + out_bytes)
        except (AttributeError, IndexError, TypeError, ValueError):
            return 0

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, f = inputs
        check_input_dtype(self, 0, x, self.dtype)
        check_input_dtype(self, 1, f, self.dtype)
        _check_rank(self, x, f"convolution input must be 4-dimensional: {shape_str(x.shape)}")
        _check_rank(self, f, f"convolution filter must be 4-dimensional: {shape_str(f.shape)}")
        kh, kw, filter_depth, out_depth = f.shape
        in_depth = x.shape[3]
        if filter_depth <= 0:
            raise kernel_error(self, f"filter depth must be stricly positive, got {filter_depth}")
        if f.size == 0:
            raise kernel_error(
                self, "filter must not have zero elements (i.e. all dimensions must be non-zero)"
            )
        if in_depth % filter_depth:
            raise kernel_error(
                self, f"input depth must be evenly divisible by filter depth: {in_depth} vs {filter_depth}"
            )
        groups = in_depth // filter_depth
        if groups == 0 or out_depth % groups:
            raise kernel_error(
                self, f"output depth must be evenly divisible by number of groups: {out_depth} vs {groups}"
            )
        h, w = self._dims((x.shape[1], x.shape[2]), (kh, kw))
        batch = x.shape[0]
        if batch * h.out * w.out == 0:
            return [_zeros((batch, h.out, w.out, out_depth), self.dtype)]
        padded = _pad_hw(x.astype(self.work, copy=False), h, w)
        patches = _patches(padded, h, w)
        weights = _group_filter(f.astype(self.work, copy=False), groups)
        out = np.empty((batch, h.out, w.out, out_depth), self.work)
        columns = kh * kw * in_depth
        for chunk in _batch_chunks(batch, h.out * w.out * columns * self.work.itemsize):
            cols = patches[chunk].reshape(-1, columns)
            if groups == 1:
                product = cols @ weights[0]
            else:
                product = np.matmul(_group_patches(cols, kh * kw, groups), weights)  # G, M, O/G
                product = product.transpose(1, 0, 2).reshape(-1, out_depth)
            out[chunk] = product.reshape(-1, h.out, w.out, out_depth)
        return [out.astype(self.dtype, copy=False)]


def _shape_input(kernel: OpKernel, value: np.ndarray, what: str) -> list[int]:
    """A shape given as an int32/int64 vector input, with TensorFlow's check of its sizes."""
    if value.ndim != 1:
        raise kernel_error(kernel, f"{what} input must be 1-dim, not {value.ndim}")
    sizes = int_list(kernel, value, what)
    for size in sizes:
        if size < 0:
            raise kernel_error(kernel, f"Dimension {size} must be >= 0")
    return sizes


@register_kernel("Conv2DBackpropInput")
class Conv2DBackpropInputKernel(_ConvKernel):
    """The gradient of Conv2D with respect to its input, of shape `input_sizes`.

    Every output position's gradient flows back through the filter to the input pixels
    its window read: one matrix product per tap, added into a strided slice.
    """

    label = "Conv2DCustomBackpropInput"
    nchw_error = ("Conv2DCustomBackpropInputOp only supports NHWC.", errors.InvalidArgumentError)

    def output_nbytes(self, inputs: list[Any]) -> int:
        return product_of(inputs[0]) * self.dtype.itemsize

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        sizes_value, f, dy = inputs
        check_input_dtype(self, 1, f, self.dtype)
        check_input_dtype(self, 2, dy, self.dtype)
        sizes = _shape_input(self, sizes_value, "Conv2DBackpropInput: input_sizes")
        if len(sizes) == 2:
            if dy.ndim != 4 or f.ndim != 4:
                raise kernel_error(self, f"{self.label}: out_backprop must be 4-dimensional")
            sizes = [dy.shape[0], *sizes, f.shape[2]]
        elif len(sizes) != 4:
            raise kernel_error(
                self,
                "Conv2DBackpropInput requires input_sizes to contain 4 values or 2 values, but got: "
                f"{len(sizes)}",
            )
        input_shape = tuple(sizes)
        h, w, groups = self._backprop_dims(input_shape, f.shape, dy)
        if dy.size == 0 or f.size == 0:
            return [_zeros(input_shape, self.dtype)]
        batch, _, _, in_depth = input_shape
        kh, kw, _, out_depth = f.shape
        og, cg = out_depth // groups, in_depth // groups
        # [G, M, O/G], contiguous: matmul takes BLAS's fast path only for contiguous stacks
        grads = np.ascontiguousarray(
            dy.astype(self.work, copy=False).reshape(-1, groups, og).transpose(1, 0, 2)
        )
        # filter[i, j] per group, transposed: [KH*KW, G, O/G, Cg]
        weights = f.astype(self.work, copy=False).reshape(kh * kw, cg, groups, og).transpose(0, 2, 3, 1)
        padded = np.zeros(
            (batch, h.before + h.size + h.after, w.before + w.size + w.after, in_depth), self.work
        )
        for tap, rows, columns in _taps(h, w):
            if groups == 1:
                product = grads[0] @ weights[tap, 0]  # M, C
            else:
                product = np.matmul(grads, np.ascontiguousarray(weights[tap])).transpose(1, 0, 2)  # M, G, Cg
            padded[:, rows, columns, :] += product.reshape(batch, h.out, w.out, in_depth)
        return [padded[:, h.crop(), w.crop(), :].astype(self.dtype)]


@register_kernel("Conv2DBackpropFilter")
class Conv2DBackpropFilterKernel(_ConvKernel):
    """The gradient of Conv2D with respect to its filter, shaped `filter_sizes`: patches^T @ out_backprop."""

    label = "Conv2DCustomBackpropFilter"
    nchw_error = ("Conv2DCustomBackpropFilterOp only supports NHWC.", errors.InvalidArgumentError)

    def output_nbytes(self, inputs: list[Any]) -> int:
        try:
            x, sizes, dy = inputs
            return self._patch_nbytes(
                dy.shape[0], (dy.shape[1], dy.shape[2]), [*np.asarray(sizes).tolist()[:2], x.shape[3]]
            )
        except (AttributeError, IndexError, TypeError, ValueError):
            return 0

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, sizes_value, dy = inputs
        check_input_dtype(self, 0, x, self.dtype)
        check_input_dtype(self, 2, dy, self.dtype)
        filter_shape = tuple(_shape_input(self, sizes_value, f"{self.label}: filter_sizes"))
        h, w, groups = self._backprop_dims(x.shape, filter_shape, dy)
        kh, kw, filter_depth, out_depth = filter_shape
        if x.size == 0 or dy.size == 0:
            return [_zeros(filter_shape, self.dtype)]
        batch, in_depth = x.shape[0], x.shape[3]
        padded = _pad_hw(x.astype(self.work, copy=False), h, w)
        patches = _patches(padded, h, w)
        grads = dy.astype(self.work, copy=False)
        result = np.zeros((groups, kh * kw * filter_depth, out_depth // groups), self.work)
        columns = kh * kw * in_depth
        for chunk in _batch_chunks(batch, h.out * w.out * columns * self.work.itemsize):
            cols = patches[chunk].reshape(-1, columns)
            g = grads[chunk].reshape(-1, groups, out_depth // groups).transpose(1, 0, 2)  # G, M, O/G
            if groups == 1:
                result[0] += cols.T @ g[0]
            else:
                result += np.matmul(_group_patches(cols, kh * kw, groups).transpose(0, 2, 1), g)
        # [G, KH*KW*Cg, O/G] -> [KH, KW, Cg, O]
        result = result.reshape(groups, kh * kw, filter_depth, out_depth // groups).transpose(1, 2, 0, 3)
        return [result.reshape(filter_shape).astype(self.dtype)]


# --------------------------------------------------------------------------- pooling


class _PoolKernel(OpKernel):
    """Attrs shared by the pooling ops: `ksize`, `strides`, `padding` (NHWC only)."""

    allowed: ClassVar[frozenset[np.dtype[Any]]] = FLOATS
    paddings: ClassVar[tuple[str, ...]] = ("SAME", "VALID")
    # TensorFlow's refusal of a window or stride over the depth dimension (None: allowed)
    depth_error: ClassVar[str | None] = "Non-spatial pooling is not yet supported. Volunteers? :)"
    nchw_name: ClassVar[str] = "AvgPoolingOp"

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", self.allowed)
        self.work = _work_dtype(self.dtype)
        if self.attr_str("data_format", "NHWC") != "NHWC":
            raise kernel_error(self, f"Default {self.nchw_name} only supports NHWC on device type CPU")
        ksize = _four(self, "ksize")
        strides = _four(self, "strides")
        if any(k <= 0 for k in ksize):
            raise kernel_error(
                self,
                "Sliding window ksize must be positive. The specified or inferred ksize is: "
                + ",".join(map(str, ksize)),
            )
        for stride in strides:
            if stride <= 0:
                raise kernel_error(self, f"Stride must be > 0, but got {stride}")
        if ksize[0] != 1 or strides[0] != 1:
            raise kernel_error(
                self, "Pooling is not yet supported on the batch dimension.", errors.UnimplementedError
            )
        self.depth_window = 1
        if ksize[3] != 1 or strides[3] != 1:
            self._depth_pooling(ksize, strides)
        self.ksize = (ksize[1], ksize[2])
        self.strides = (strides[1], strides[2])
        self.padding, self.explicit = _padding(self, self.paddings)
        for d, (before, after) in enumerate(self.explicit):
            for side, pad in zip(
                ("Top", "Bottom") if d == 0 else ("Left", "Right"), (before, after), strict=True
            ):
                if pad >= self.ksize[d]:
                    raise kernel_error(
                        self, f"{side} padding {pad} needs to be smaller than the window size {self.ksize[d]}"
                    )

    def _depth_pooling(self, ksize: list[int], strides: list[int]) -> None:
        if self.depth_error is None:
            if ksize[1] != 1 or ksize[2] != 1 or strides[1] != 1 or strides[2] != 1:
                raise kernel_error(
                    self,
                    "MaxPooling supports exactly one of pooling across depth or pooling across width/height.",
                    errors.UnimplementedError,
                )
            if ksize[3] != strides[3]:
                raise kernel_error(
                    self,
                    "Depthwise max pooling requires the depth window to equal the depth stride",
                    errors.UnimplementedError,
                )
            self.depth_window = ksize[3]
            return
        raise kernel_error(self, self.depth_error, errors.UnimplementedError)

    def _dims(self, shape: tuple[int, ...]) -> tuple[_Dim, _Dim]:
        h, w = (
            _windowed(self, shape[1 + d], self.ksize[d], self.strides[d], 1, self.padding, self.explicit[d])
            for d in range(2)
        )
        return h, w

    def _check_grad_shape(self, what: str, value: np.ndarray, expected: tuple[int, ...]) -> None:
        if value.shape != expected:
            raise kernel_error(
                self, f"Expected {what} shape to be {shape_str(expected)}, but got {shape_str(value.shape)}"
            )


@register_kernel("MaxPool")
class MaxPoolKernel(_PoolKernel):
    """The largest value of each window (padding never wins; NaN loses to any number).

    A window over depth alone (`ksize` [1, 1, 1, k] with equal strides) takes the
    maximum of each run of k channels, as TensorFlow's depthwise max pooling does.
    """

    allowed = REAL
    paddings = ("SAME", "VALID", "EXPLICIT")
    depth_error = None
    nchw_name = "MaxPoolingOp"

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (x,) = inputs
        check_input_dtype(self, 0, x, self.dtype)
        _check_rank(self, x, "tensor_in must be 4-dimensional")
        work = x.astype(self.work, copy=False)
        maximum = np.fmax if self.work.kind == "f" else np.maximum
        if self.depth_window > 1:
            if x.shape[3] % self.depth_window:
                raise kernel_error(
                    self,
                    "Depthwise max pooling requires the depth window to evenly divide the input depth",
                    errors.UnimplementedError,
                )
            grouped = work.reshape(*x.shape[:3], x.shape[3] // self.depth_window, self.depth_window)
            return [maximum.reduce(grouped, axis=-1).astype(self.dtype, copy=False)]
        h, w = self._dims(x.shape)
        shape = (x.shape[0], h.out, w.out, x.shape[3])
        if 0 in shape:
            return [_zeros(shape, self.dtype)]
        padded = _pad_hw(work, h, w, -np.inf if self.work.kind == "f" else _lowest(self.work))
        out: np.ndarray | None = None
        for _, rows, columns in _taps(h, w):
            window = padded[:, rows, columns, :]
            out = window.copy() if out is None else maximum(out, window, out=out)
        assert out is not None
        return [out.astype(self.dtype, copy=False)]


@register_kernel("MaxPoolGrad")
class MaxPoolGradKernel(_PoolKernel):
    """Each window's gradient goes to its maximum in `orig_input` (the first one, row-major, on ties).

    Like TensorFlow's CPU kernel, the maximum is found again in `orig_input`;
    `orig_output` is only checked for its shape.
    """

    allowed = REAL
    paddings = ("SAME", "VALID", "EXPLICIT")
    depth_error = "MaxPoolingGrad is not yet supported on the depth dimension."
    nchw_name = "MaxPoolingGradOp"

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, y, dy = inputs
        for i, value in enumerate(inputs):
            check_input_dtype(self, i, value, self.dtype)
        _check_rank(self, x, "tensor_in must be 4-dimensional")
        _check_rank(self, y, "tensor_out must be 4-dimensional")
        _check_rank(self, dy, "out_backprop must be 4-dimensional")
        h, w = self._dims(x.shape)
        shape = (x.shape[0], h.out, w.out, x.shape[3])
        self._check_grad_shape("orig_output", y, shape)
        self._check_grad_shape("grad", dy, shape)
        if 0 in shape or x.size == 0:
            return [_zeros(x.shape, self.dtype)]
        lowest = _lowest(self.work)
        padded = _pad_hw(x.astype(self.work, copy=False), h, w, lowest)
        # TensorFlow's scan: start from the lowest value, take a tap when strictly greater.
        best = np.full(shape, lowest, self.work)
        which = np.full(shape, -1, np.int32)
        for tap, rows, columns in _taps(h, w):
            window = padded[:, rows, columns, :]
            greater = np.greater(window, best)
            np.copyto(best, window, where=greater)
            np.copyto(which, tap, where=greater)
        grads = dy.astype(self.work, copy=False)
        result = np.zeros(padded.shape, self.work)
        share = np.empty(shape, self.work)
        for tap, rows, columns in _taps(h, w):
            np.multiply(grads, which == tap, out=share)
            result[:, rows, columns, :] += share
        return [result[:, h.crop(), w.crop(), :].astype(self.dtype)]


@register_kernel("AvgPool")
class AvgPoolKernel(_PoolKernel):
    """The mean of each window over the input pixels it covers (padding is not counted)."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (x,) = inputs
        check_input_dtype(self, 0, x, self.dtype)
        _check_rank(self, x, "tensor_in must be 4-dimensional")
        h, w = self._dims(x.shape)
        shape = (x.shape[0], h.out, w.out, x.shape[3])
        if 0 in shape:
            return [_zeros(shape, self.dtype)]
        padded = _pad_hw(x.astype(self.work, copy=False), h, w)
        total = np.zeros(shape, self.work)
        for _, rows, columns in _taps(h, w):
            total += padded[:, rows, columns, :]
        counts = np.multiply.outer(h.counts(), w.counts()).astype(self.work)
        return [(total / counts[None, :, :, None]).astype(self.dtype, copy=False)]


@register_kernel("AvgPoolGrad")
class AvgPoolGradKernel(_PoolKernel):
    """Each window's gradient, divided by the pixels it covers, goes to each of them."""

    def output_nbytes(self, inputs: list[Any]) -> int:
        return product_of(inputs[0]) * self.dtype.itemsize

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        shape_value, dy = inputs
        check_input_dtype(self, 1, dy, self.dtype)
        if shape_value.ndim != 1 or shape_value.size != 4:
            raise kernel_error(self, "out_backprop must be 1-dimensional and 4 elements")
        input_shape = tuple(_shape_input(self, shape_value, "orig_input_shape"))
        _check_rank(self, dy, "out_backprop must be 4-dimensional")
        h, w = self._dims(input_shape)
        shape = (input_shape[0], h.out, w.out, input_shape[3])
        self._check_grad_shape("grad", dy, shape)
        if 0 in shape or 0 in input_shape:
            return [_zeros(input_shape, self.dtype)]
        counts = np.multiply.outer(h.counts(), w.counts()).astype(self.work)
        grads = dy.astype(self.work, copy=False) / counts[None, :, :, None]
        result = np.zeros(
            (input_shape[0], h.before + h.size + h.after, w.before + w.size + w.after, input_shape[3]),
            self.work,
        )
        for _, rows, columns in _taps(h, w):
            result[:, rows, columns, :] += grads
        return [result[:, h.crop(), w.crop(), :].astype(self.dtype)]


# --------------------------------------------------------------------------- padding


class _PadKernelBase(OpKernel):
    """`paddings` ([rank, 2] int32/int64: before and after each dimension) and its checks."""

    allowed: ClassVar[frozenset[np.dtype[Any]]] = ALL_TYPES
    negative_text: ClassVar[str] = "Paddings must be non-negative: {} {}"
    rank_text: ClassVar[str] = "The first dimension of paddings must be the rank of inputs{} {}"

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", self.allowed)
        self.pad_type = attr_type_in(self, "Tpaddings", INDEX_TYPES, default=INT32)

    def _paddings(self, x: np.ndarray, paddings: np.ndarray) -> list[tuple[int, int]]:
        check_input_dtype(self, 0, x, self.dtype)
        check_input_dtype(self, 1, paddings, self.pad_type)
        if paddings.ndim != 2 or paddings.shape[1] != 2:
            raise kernel_error(self, f"paddings must be a matrix with 2 columns: {shape_str(paddings.shape)}")
        if paddings.shape[0] != x.ndim:
            raise kernel_error(self, self.rank_text.format(shape_str(paddings.shape), shape_str(x.shape)))
        pairs = [(int(before), int(after)) for before, after in paddings.tolist()]
        for before, after in pairs:
            if before < 0 or after < 0:
                raise kernel_error(self, self.negative_text.format(before, after))
        return pairs

    def output_nbytes(self, inputs: list[Any]) -> int:
        try:
            x, paddings = inputs[0], np.asarray(inputs[1])
            sizes = [n + int(paddings[d].sum()) for d, n in enumerate(x.shape)]
            return product_of(np.array(sizes)) * self.dtype.itemsize
        except (AttributeError, IndexError, TypeError, ValueError):
            return 0


@register_kernel("Pad", "PadV2")
class PadKernel(_PadKernelBase):
    """`input` surrounded by `constant_values` (PadV2) or zeros (empty strings for strings)."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, paddings = inputs[0], inputs[1]
        pairs = self._paddings(x, paddings)
        if self.op == "PadV2":
            value = inputs[2]
            check_input_dtype(self, 2, value, self.dtype)
            if value.ndim != 0:
                raise kernel_error(self, f"constant_values must be a scalar. Found: {shape_str(value.shape)}")
            fill: Any = value
        else:
            fill = b"" if self.dtype == OBJECT else 0
        if not any(before or after for before, after in pairs):
            return [x]
        shape = tuple(before + n + after for n, (before, after) in zip(x.shape, pairs, strict=True))
        out = np.full(shape, fill, self.dtype)
        out[tuple(slice(before, before + n) for n, (before, _) in zip(x.shape, pairs, strict=True))] = x
        return [out]


def _mirror_mode(kernel: OpKernel) -> str:
    mode = kernel.attr_str("mode")
    if mode not in ("REFLECT", "SYMMETRIC"):
        raise kernel_error(
            kernel,
            f"Value for attr 'mode' of \"{mode}\" is not in the list of allowed values: "
            '"REFLECT", "SYMMETRIC"',
        )
    return mode


@register_kernel("MirrorPad")
class MirrorPadKernel(_PadKernelBase):
    """`input` padded with its own mirror image: REFLECT leaves the edge out, SYMMETRIC repeats it."""

    negative_text = "paddings must be non-negative: {} {}"
    rank_text = "The first dimension of paddings must be the rank of inputs{}, {}"

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.mode = _mirror_mode(self)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, paddings = inputs
        pairs = self._paddings(x, paddings)
        for n, (before, after) in zip(x.shape, pairs, strict=True):
            if self.mode == "REFLECT" and (before >= n or after >= n) and (before or after):
                raise kernel_error(
                    self,
                    f"paddings must be less than the dimension size: {before}, {after} not less than {n}",
                )
            if self.mode == "SYMMETRIC" and (before > n or after > n):
                raise kernel_error(
                    self,
                    "paddings must be no greater than the dimension size: "
                    f"{before}, {after} greater than {n}",
                )
        if not any(before or after for before, after in pairs):
            return [x]
        return [np.pad(x, pairs, mode="reflect" if self.mode == "REFLECT" else "symmetric")]


@register_kernel("MirrorPadGrad")
class MirrorPadGradKernel(_PadKernelBase):
    """The gradient of MirrorPad: the padded border's gradients folded back onto the pixels they copy."""

    allowed = NUMBER
    negative_text = "Paddings must be non-negative: {}, {}"
    rank_text = "The first dimension of paddings must be the rank of inputs{}, {}"

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.mode = _mirror_mode(self)

    def output_nbytes(self, inputs: list[Any]) -> int:
        return 0  # smaller than its input

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        grad, paddings = inputs
        pairs = self._paddings(grad, paddings)
        offset = 1 if self.mode == "REFLECT" else 0
        result = grad.astype(_work_dtype(self.dtype), copy=False)
        for axis, (before, after) in enumerate(pairs):
            n = grad.shape[axis] - before - after
            if self.mode == "REFLECT" and (before >= n or after >= n) and (before or after):
                raise kernel_error(
                    self,
                    "paddings must be less than the output dimension size: "
                    f"{before}, {after} not less than {n}",
                )
            if self.mode == "SYMMETRIC" and (before > n or after > n):
                raise kernel_error(
                    self,
                    "paddings must be no greater than the output dimension size: "
                    f"{before}, {after} greater than {n}",
                )
            if not (before or after):
                continue
            moved = np.moveaxis(result, axis, 0)
            core = moved[before : before + n].copy()
            # padded row p < before copies row before - p - 1 + offset; padded row
            # before + n + q copies row n - 1 - q - offset.
            core[np.arange(before)[::-1] + offset] += moved[:before]
            core[n - 1 - offset - np.arange(after)] += moved[before + n :]
            result = np.moveaxis(core, 0, axis)
        return [result.astype(self.dtype)]


# --------------------------------------------------------------------------- ShapeN


@register_kernel("ShapeN")
class ShapeNKernel(OpKernel):
    """The shape of each of its N inputs (what Conv2D's gradient asks for)."""

    runs_on_loop = True  # shapes only: no thread hop

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.out_type = attr_type_in(self, "out_type", INDEX_TYPES, default=INT32)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        if self.out_type == INT32:
            for i, value in enumerate(inputs):
                for size in value.shape:
                    if size > np.iinfo(np.int32).max:
                        raise kernel_error(
                            self, f"ShapeN output type is 32-bit but shape {i} dim {size} is too large"
                        )
        return [np.array(value.shape, dtype=self.out_type) for value in inputs]


__all__ = [
    "AvgPoolGradKernel",
    "AvgPoolKernel",
    "Conv2DBackpropFilterKernel",
    "Conv2DBackpropInputKernel",
    "Conv2DKernel",
    "MaxPoolGradKernel",
    "MaxPoolKernel",
    "MirrorPadGradKernel",
    "MirrorPadKernel",
    "PadKernel",
    "ShapeNKernel",
]
