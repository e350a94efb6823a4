"""Numpy kernels for TensorFlow's neural-network ops and the gradients TF's graph builder emits.

Forward ops (`LogSoftmax`, `Relu6`, `LeakyRelu`, `Elu`, `Softplus`, `L2Loss`), the
losses (`SoftmaxCrossEntropyWithLogits`, `SparseSoftmaxCrossEntropyWithLogits`, which
return the loss *and* its gradient, as TF's do) and the gradient ops that
`tf.compat.v1.train.Optimizer.minimize` puts into a graph (`ReluGrad`,
`SigmoidGrad`, `TanhGrad`, `BiasAddGrad`, ...). Semantics follow TensorFlow's op
documentation; half and bfloat16 inputs are computed in float32 and rounded back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from distserver.kernels._common import (
    COMPLEX,
    FLOATS,
    INDEX_TYPES,
    REAL,
    array,
    attr_type_in,
    check_input_dtype,
    compute_dtype,
    kernel_error,
    quiet,
    shape_str,
)
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef

# float16 and bfloat16 are computed in float32 (TF's kernels accumulate in float32 too).
_WIDE = {np.dtype(np.float16): np.dtype(np.float32)}


def _work_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return _WIDE.get(dtype, compute_dtype(dtype))


# --------------------------------------------------------------------------- element-wise activations

_Unary = Callable[[np.ndarray, float], Any]
_Binary = Callable[[np.ndarray, np.ndarray, float], Any]


def _softplus(x: np.ndarray, alpha: float) -> Any:
    # log(1 + exp(x)) without overflow: max(x, 0) + log1p(exp(-|x|)).
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


_ACTIVATIONS: dict[str, tuple[frozenset[np.dtype[Any]], _Unary]] = {
    "Relu6": (REAL, lambda x, a: np.clip(x, 0, 6)),
    "LeakyRelu": (FLOATS, lambda x, a: np.where(x > 0, x, x * a)),
    "Elu": (FLOATS, lambda x, a: np.where(x > 0, x, np.expm1(np.minimum(x, 0)))),
    "Selu": (
        FLOATS,
        lambda x, a: 1.0507009873554805 * np.where(x > 0, x, 1.6732632423543772 * np.expm1(np.minimum(x, 0))),
    ),
    "Softplus": (FLOATS, _softplus),
    "Softsign": (FLOATS, lambda x, a: x / (1 + np.abs(x))),
}


@register_kernel(*_ACTIVATIONS)
class ActivationKernel(OpKernel):
    """y = f(x) element-wise for the activations of `tf.nn` (LeakyRelu reads `alpha`)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        allowed, self.fn = _ACTIVATIONS[self.op]
        self.dtype = attr_type_in(self, "T", allowed)
        self.work = _work_dtype(self.dtype)
        self.alpha = self.attr_float("alpha", 0.2)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (x,) = inputs
        check_input_dtype(self, 0, x, self.dtype)
        with np.errstate(all="ignore"):
            return [array(self.fn(x.astype(_work_dtype(self.dtype), copy=False), self.alpha), self.dtype)]


def _relu6_grad(dy: np.ndarray, x: np.ndarray, alpha: float) -> Any:
    return dy * ((x > 0) & (x < 6))


def _elu_grad(dy: np.ndarray, y: np.ndarray, alpha: float) -> Any:
    # TF's EluGrad takes the Elu *output*: dy * (y + 1) where y < 0, else dy.
    return np.where(y < 0, dy * (y + 1), dy)


def _selu_grad(dy: np.ndarray, y: np.ndarray, alpha: float) -> Any:
    scale, scale_alpha = 1.0507009873554805, 1.7580993408473766
    return np.where(y < 0, dy * (y + scale_alpha), dy * scale)


def _softplus_grad(dy: np.ndarray, x: np.ndarray, alpha: float) -> Any:
    return dy / (1 + np.exp(-x))


# op -> (allowed T, fn(gradient, second input, alpha)). The second input is the forward
# op's input (features) or output, as TF's op definitions say.
_GRADIENTS: dict[str, tuple[frozenset[np.dtype[Any]], _Binary]] = {
    # ReluGrad(gradients, features): dy where features > 0.
    "ReluGrad": (REAL, lambda dy, x, a: dy * (x > 0)),
    "Relu6Grad": (REAL, _relu6_grad),
    "LeakyReluGrad": (FLOATS, lambda dy, x, a: np.where(x > 0, dy, dy * a)),
    "EluGrad": (FLOATS, _elu_grad),
    "SeluGrad": (FLOATS, _selu_grad),
    "SoftplusGrad": (FLOATS, _softplus_grad),
    "SoftsignGrad": (FLOATS, lambda dy, x, a: dy / np.square(1 + np.abs(x))),
}

# The gradients of unary math ops, with TF's argument order (y, dy): y is the op's output.
_OUTPUT_GRADIENTS: dict[str, tuple[frozenset[np.dtype[Any]], _Binary]] = {
    "SigmoidGrad": (FLOATS | COMPLEX, lambda y, dy, a: dy * y * (1 - y)),
    "TanhGrad": (FLOATS | COMPLEX, lambda y, dy, a: dy * (1 - y * y)),
    "SqrtGrad": (FLOATS | COMPLEX, lambda y, dy, a: dy * 0.5 / y),
    "RsqrtGrad": (FLOATS | COMPLEX, lambda y, dy, a: dy * -0.5 * y * y * y),
    "ReciprocalGrad": (FLOATS | COMPLEX, lambda y, dy, a: -dy * y * y),
}


@register_kernel(*_GRADIENTS, *_OUTPUT_GRADIENTS)
class ActivationGradKernel(OpKernel):
    """The gradient of an element-wise op: two inputs of the same shape and dtype `T`."""

    fusable = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        allowed, self.fn = _GRADIENTS.get(self.op) or _OUTPUT_GRADIENTS[self.op]
        self._quiet_fn = quiet(self.fn)
        self.dtype = attr_type_in(self, "T", allowed)
        self.work = _work_dtype(self.dtype)
        self.alpha = self.attr_float("alpha", 0.2)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        a, b = inputs
        if a.dtype != self.dtype or b.dtype != self.dtype:
            check_input_dtype(self, 0, a, self.dtype)
            check_input_dtype(self, 1, b, self.dtype)
        if a.shape != b.shape:
            raise kernel_error(
                self,
                f"{self.op} inputs must have the same shape: {shape_str(a.shape)} vs {shape_str(b.shape)}",
            )
        if self.work is not self.dtype:
            a, b = a.astype(self.work), b.astype(self.work)
        result = self._quiet_fn(a, b, self.alpha)
        if type(result) is np.ndarray and result.dtype == self.dtype:
            return [result]
        return [array(result, self.dtype)]


# --------------------------------------------------------------------------- BiasAddGrad, L2Loss


@register_kernel("BiasAddGrad")
class BiasAddGradKernel(OpKernel):
    """The bias gradient: `out_backprop` summed over every dimension but the channel one."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", REAL | COMPLEX)
        data_format = self.attr_str("data_format", "NHWC")
        if data_format not in ("NHWC", "NCHW"):
            raise kernel_error(self, f"Invalid data format: {data_format}")
        self.channels_first = data_format == "NCHW"

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (grad,) = inputs
        check_input_dtype(self, 0, grad, self.dtype)
        if grad.ndim < 2:
            raise kernel_error(self, f"Input tensor must be at least 2D: {shape_str(grad.shape)}")
        channel = 1 if self.channels_first else grad.ndim - 1
        axes = tuple(d for d in range(grad.ndim) if d != channel)
        work = _work_dtype(self.dtype)
        return [array(np.sum(grad.astype(work, copy=False), axis=axes, dtype=work), self.dtype)]


@register_kernel("L2Loss")
class L2LossKernel(OpKernel):
    """sum(t ** 2) / 2, a scalar."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", FLOATS)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (t,) = inputs
        check_input_dtype(self, 0, t, self.dtype)
        x = t.astype(_work_dtype(self.dtype), copy=False)
        with np.errstate(all="ignore"):
            return [array(np.sum(x * x) / 2, self.dtype)]


# --------------------------------------------------------------------------- softmax family


# Rows of at most this many values have their largest taken column by column
# (`_row_max`).
_COLUMN_MAX_VALUES = 32


def _row_max(x: np.ndarray) -> np.ndarray:
    """np.max(x, axis=-1, keepdims=True), for x of at least one dimension whose rows
    are not empty.

    numpy's reduction runs a short inner loop per row: a classifier's 256 x 10 logits
    take ~17 us. Rows of at most `_COLUMN_MAX_VALUES` values are reduced column by
    column over the transposed array instead (~3 us): `np.maximum` of the columns in
    order, each value exact, so the same maxima (and nan where a row has one; of a row
    whose largest values are 0.0 and -0.0, either may come out, as from numpy's own
    order).
    """
    columns = x.shape[-1]
    if x.ndim < 2 or not 2 <= columns <= _COLUMN_MAX_VALUES:
        largest: np.ndarray = np.max(x, axis=-1, keepdims=True)
        return largest
    by_column = np.ascontiguousarray(x.reshape(-1, columns).T)
    largest = np.maximum.reduce(by_column, axis=0).reshape(*x.shape[:-1], 1)
    return largest


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """log(softmax(x)) over the last axis, computed stably."""
    shifted = x - _row_max(x)
    result: np.ndarray = shifted - np.log(np.add.reduce(np.exp(shifted), axis=-1, keepdims=True))
    return result


class _SoftmaxFamilyKernel(OpKernel):
    """Softmax / LogSoftmax: a numerically stable normalisation over the last dimension."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", FLOATS)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (logits,) = inputs
        check_input_dtype(self, 0, logits, self.dtype)
        if logits.ndim < 1:
            raise kernel_error(self, f"logits must have >= 1 dimension, got {shape_str(logits.shape)}")
        if logits.size == 0:
            return [np.array(logits, copy=True)]
        with np.errstate(all="ignore"):
            return [array(self.normalize(logits.astype(_work_dtype(self.dtype), copy=False)), self.dtype)]

    def normalize(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError


@register_kernel("Softmax")
class SoftmaxKernel(_SoftmaxFamilyKernel):
    """exp(x) / sum(exp(x)) over the last dimension."""

    def normalize(self, x: np.ndarray) -> np.ndarray:
        shifted = np.exp(x - _row_max(x))
        result: np.ndarray = shifted / np.sum(shifted, axis=-1, keepdims=True)
        return result


@register_kernel("LogSoftmax")
class LogSoftmaxKernel(_SoftmaxFamilyKernel):
    """logits - log(sum(exp(logits))) over the last dimension."""

    def normalize(self, x: np.ndarray) -> np.ndarray:
        return _log_softmax(x)


@register_kernel("SoftmaxCrossEntropyWithLogits")
class SoftmaxCrossEntropyWithLogitsKernel(OpKernel):
    """(loss, backprop) for `features` [batch, classes] and a label distribution.

    loss[i] = -sum_j labels[i, j] * log_softmax(features)[i, j]
    backprop = softmax(features) - labels

    `labels` broadcasts against `features` (TF 2.x); both must be 2-D after
    broadcasting.
    """

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", FLOATS)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        features, labels = inputs
        check_input_dtype(self, 0, features, self.dtype)
        check_input_dtype(self, 1, labels, self.dtype)
        try:
            shape = np.broadcast_shapes(features.shape, labels.shape)
        except ValueError:
            raise kernel_error(
                self,
                "logits and labels must be broadcastable: logits_size="
                f"{shape_str(features.shape)} labels_size={shape_str(labels.shape)}",
            ) from None
        if len(shape) != 2:
            raise kernel_error(
                self,
                "logits and labels must be either 2-dimensional, or broadcasted to be 2-dimensional: "
                f"logits_size={shape_str(features.shape)} labels_size={shape_str(labels.shape)}",
            )
        work = _work_dtype(self.dtype)
        x = np.broadcast_to(features.astype(work, copy=False), shape)
        y = np.broadcast_to(labels.astype(work, copy=False), shape)
        with np.errstate(all="ignore"):
            log_probs = _log_softmax(x) if shape[1] else np.zeros(shape, work)
            loss = -np.sum(y * log_probs, axis=1)
            backprop = np.exp(log_probs) - y
        return [array(loss, self.dtype), array(backprop, self.dtype)]


@register_kernel("SparseSoftmaxCrossEntropyWithLogits")
class SparseSoftmaxCrossEntropyWithLogitsKernel(OpKernel):
    """(loss, backprop) for `features` [batch, classes] and class indices `labels` [batch].

    loss[i] = -log_softmax(features)[i, labels[i]]
    backprop = softmax(features) - one_hot(labels)

    A label outside [0, classes) is an InvalidArgumentError, as on TF's CPU.
    """

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", FLOATS)
        self.label_type = attr_type_in(self, "Tlabels", INDEX_TYPES, default=np.dtype(np.int64))

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        features, labels = inputs
        check_input_dtype(self, 0, features, self.dtype)
        check_input_dtype(self, 1, labels, self.label_type)
        if features.ndim != 2:
            raise kernel_error(self, f"logits must be 2-D, but got shape {shape_str(features.shape)}")
        if labels.ndim != 1:
            raise kernel_error(self, f"labels must be 1-D, but got shape {shape_str(labels.shape)}")
        if features.shape[0] != labels.shape[0]:
            raise kernel_error(
                self,
                "logits and labels must have the same first dimension, got logits shape "
                f"{shape_str(features.shape)} and labels shape {shape_str(labels.shape)}",
            )
        batch, classes = features.shape
        if labels.size and (labels.min() < 0 or labels.max() >= classes):
            bad = (labels < 0) | (labels >= classes)
            first = int(labels[np.flatnonzero(bad)[0]])
            listed = " ".join(str(int(v)) for v in labels)
            raise kernel_error(
                self,
                f"Received a label value of {first} which is outside the valid range of [0, {classes}).  "
                f"Label values: {listed}",
            )
        work = _work_dtype(self.dtype)
        with np.errstate(all="ignore"):
            log_probs = _log_softmax(features.astype(work, copy=False)) if classes else np.zeros((batch, 0))
            # Each row's label, as a place in the flat array (one index, not two).
            at_labels = np.arange(0, batch * classes, classes) + labels
            loss = np.negative(log_probs.reshape(-1)[at_labels])
            backprop = np.exp(log_probs)
            backprop.reshape(-1)[at_labels] -= 1
        return [array(loss, self.dtype), array(backprop, self.dtype)]


__all__ = [
    "ActivationGradKernel",
    "ActivationKernel",
    "BiasAddGradKernel",
    "L2LossKernel",
    "LogSoftmaxKernel",
    "SoftmaxCrossEntropyWithLogitsKernel",
    "SparseSoftmaxCrossEntropyWithLogitsKernel",
]


# --------------------------------------------------------------------------- top k


@register_kernel("TopKV2")
class TopKV2Kernel(OpKernel):
    """`(input, k)` -> the k largest values along the last axis and their indices
    (largest first; equal values in index order, as TensorFlow's)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", REAL)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x, k_value = inputs
        check_input_dtype(self, 0, x, self.dtype)
        if k_value.ndim != 0:
            raise kernel_error(self, f"k must be 0-D, got shape {shape_str(k_value.shape)}")
        k = int(k_value)
        if k < 0:
            raise kernel_error(self, f"Need k >= 0, got {k}")
        if x.ndim < 1:
            raise kernel_error(self, f"input must be >= 1-D, got shape {shape_str(x.shape)}")
        if x.shape[-1] < k:
            raise kernel_error(self, f"input must have at least k columns. Had {x.shape[-1]}, needed {k}")
        # A stable sort of the negated values keeps equal values in index order.
        order = np.argsort(-x.astype(np.float64) if x.dtype.kind != "f" else -x, axis=-1, kind="stable")[
            ..., :k
        ]
        return [np.take_along_axis(x, order, axis=-1), order.astype(np.int32)]


@register_kernel("InTopKV2", "InTopK")
class InTopKKernel(OpKernel):
    """`(predictions [batch, classes], targets [batch], k)` -> whether each target's
    prediction is among the k largest (ties at the boundary count as in; a
    non-finite prediction or an out-of-range target is never in)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.k_attr = self.attr_int("k") if self.op == "InTopK" else None

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        predictions, targets = inputs[0], inputs[1]
        k = self.k_attr if self.k_attr is not None else int(inputs[2])
        if predictions.ndim != 2:
            raise kernel_error(
                self, f"predictions must be 2-dimensional, got shape {shape_str(predictions.shape)}"
            )
        if targets.ndim != 1 or targets.shape[0] != predictions.shape[0]:
            raise kernel_error(
                self,
                f"First dimension of predictions {predictions.shape[0]} must match length of targets "
                f"{targets.shape[0] if targets.ndim else 0}",
            )
        batch, classes = predictions.shape
        values = predictions.astype(np.float64)
        valid = (targets >= 0) & (targets < classes)
        safe = np.where(valid, targets, 0).astype(np.int64)
        target_values = values[np.arange(batch), safe]
        finite = np.isfinite(values).all(axis=1) & np.isfinite(target_values)
        larger = (values > target_values[:, None]).sum(axis=1)
        return [valid & finite & (larger < k)]
