"""Conditional accumulators: the gradient aggregation of `SyncReplicasOptimizer`.

TensorFlow's `ConditionalAccumulator` (dense gradients) and
`SparseConditionalAccumulator` (`IndexedSlices` gradients), their ops in both the
TF 1.x reference-handle form (`ConditionalAccumulator`, `AccumulatorApplyGradient`,
...; the handle is a 2-element string tensor `[container, name]`) and the resource
form (`ResourceConditionalAccumulator`, `ResourceAccumulatorApplyGradient`, ...).

Semantics, as TensorFlow's:

* An accumulator has a global step (0 at creation). `ApplyGradient(local_step, g)`
  adds `g` when `local_step >= global_step` and silently drops it otherwise (a stale
  gradient is not even checked).
* `TakeGradient(num_required)` waits until `num_required` gradients have been added,
  then returns their mean (`reduction_type` "MEAN"; "SUM" returns the sum), resets
  the count and increments the global step. Takes are served in arrival order.
  A sparse mean divides each row by the number of gradients that had that index.
* `SetGlobalStep(step)` sets the global step (lowering it is allowed, as in TF).

A waiting take holds no thread: it waits on the event loop and is withdrawn when its
step is cancelled (the step's timeout, a failure elsewhere, the session closing).
Accumulators live in the task's `ResourceManager` under their `shared_name`; without
one, under a name private to the kernel, which the session's graphs share.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from distserver import errors
from distserver.kernels._common import (
    INT32,
    INT64,
    OBJECT,
    attr_shape,
    attr_type_in,
    handle_output,
    kernel_error,
    shape_str,
    type_name,
)
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel
from distserver.kernels.resources import DEFAULT_CONTAINER, wake_waiters
from distserver.tensors import ResourceHandle

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef

# The types TensorFlow registers accumulator kernels for on the CPU.
_GRADIENT_TYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))
_REDUCTIONS = ("MEAN", "SUM")
# TensorFlow names resources by their C++ type in lookup errors; keep its text.
_ACCUMULATOR_TYPE_NAME = "N10tensorflow26ConditionalAccumulatorBaseE"

_anonymous_ids = itertools.count()

PartialShape = tuple[int | None, ...] | None


@dataclasses.dataclass(eq=False)
class _Take:
    """One TakeGradient waiting its turn."""

    required: int
    future: asyncio.Future[None]
    result: Any = None
    done: bool = False


class GradientAccumulator:
    """The state both accumulator kinds share: count, global step, the line of takes.

    Thread-safe: applies may run in the executor's threads, takes wait on the event
    loop; a finished take is woken on its own loop.
    """

    kind = "ConditionalAccumulator"

    def __init__(self, name: str, dtype: np.dtype[Any], shape: PartialShape, reduction_type: str) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)
        self.shape = shape
        self.reduction_type = reduction_type
        self._lock = threading.Lock()
        self._counter = 0
        self._global_step = 0
        self._takes: collections.deque[_Take] = collections.deque()

    def num_accumulated(self) -> int:
        with self._lock:
            return self._counter

    @property
    def global_step(self) -> int:
        with self._lock:
            return self._global_step

    def set_global_step(self, step: int) -> None:
        with self._lock:
            self._global_step = step

    def apply(self, local_step: int, gradient: Any) -> bool:
        """Add `gradient` unless it is stale; returns whether it was added.

        Raises:
            InvalidArgumentError: a gradient that is not stale does not fit the accumulator.
        """
        with self._lock:
            if local_step < self._global_step:
                return False
            self._validate_locked(gradient)
            self._add_locked(gradient)
            self._counter += 1
            finished = self._serve_locked()
        wake_waiters(finished)
        return True

    async def take(self, required: int) -> Any:
        """Wait until `required` gradients are in, then return their reduction and reset."""
        attempt = _Take(required, asyncio.get_running_loop().create_future())
        with self._lock:
            self._takes.append(attempt)
            finished = self._serve_locked()
        wake_waiters(finished)
        if not attempt.done:
            try:
                await attempt.future
            except BaseException:
                with self._lock:
                    if not attempt.done:  # withdrawn; a completed take's result is lost, as in TF
                        self._takes.remove(attempt)
                        attempt.done = True
                raise
        return attempt.result

    def _serve_locked(self) -> list[_Take]:
        finished = []
        while self._takes and self._counter >= self._takes[0].required:
            attempt = self._takes.popleft()
            attempt.result = self._reduce_locked()
            attempt.done = True
            self._counter = 0
            self._global_step += 1
            finished.append(attempt)
        return finished

    # Subclasses: the gradient's representation.

    def _validate_locked(self, gradient: Any) -> None:
        raise NotImplementedError

    def _add_locked(self, gradient: Any) -> None:
        raise NotImplementedError

    def _reduce_locked(self) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name!r} dtype={self.dtype} count={self.num_accumulated()}>"


class DenseAccumulator(GradientAccumulator):
    """Accumulates dense gradients of one shape."""

    def __init__(self, name: str, dtype: np.dtype[Any], shape: PartialShape, reduction_type: str) -> None:
        super().__init__(name, dtype, shape, reduction_type)
        self._sum: np.ndarray | None = None

    def _validate_locked(self, gradient: np.ndarray) -> None:
        if self._counter > 0 and self._sum is not None and self._sum.shape != gradient.shape:
            raise errors.InvalidArgumentError(
                f"Shape mismatch: expected {shape_str(self._sum.shape)}, got {shape_str(gradient.shape)}"
            )
        if not _compatible(self.shape, gradient.shape):
            raise errors.InvalidArgumentError(
                f"Shape mismatch: expected {shape_str(self.shape)}, got {shape_str(gradient.shape)}"
            )

    def _add_locked(self, gradient: np.ndarray) -> None:
        if self._counter == 0 or self._sum is None:
            self._sum = np.array(gradient, dtype=self.dtype, copy=True)
        else:
            np.add(self._sum, gradient, out=self._sum)

    def _reduce_locked(self) -> np.ndarray:
        assert self._sum is not None
        total, self._sum = self._sum, None
        if self.reduction_type == "MEAN":
            np.divide(total, np.asarray(self._counter, dtype=self.dtype), out=total)
        return total


@dataclasses.dataclass
class SparseGradient:
    indices: np.ndarray  # int64 [nnz]
    values: np.ndarray  # [nnz, ...]
    shape: np.ndarray | None  # int64 dense shape, when the op has it


class SparseAccumulator(GradientAccumulator):
    """Accumulates `IndexedSlices` gradients, counting the gradients each index had.

    Merging follows TensorFlow's: a walk over both index lists in step, which sums
    rows with equal indices and assumes each list ascends (what TensorFlow's sparse
    gradients give); rows of unsorted lists are kept as that walk meets them, as in
    TensorFlow.
    """

    kind = "SparseConditionalAccumulator"

    def __init__(self, name: str, dtype: np.dtype[Any], shape: PartialShape, reduction_type: str) -> None:
        super().__init__(name, dtype, shape, reduction_type)
        self._indices: list[int] = []
        self._values: np.ndarray | None = None
        self._counts: list[int] = []

    def _validate_locked(self, gradient: SparseGradient) -> None:
        declared = self.shape or ()
        if gradient.shape is not None:
            dense_shape = [int(d) for d in gradient.shape.reshape(-1)]
            if len(declared) > len(dense_shape):
                raise errors.InvalidArgumentError(
                    f"Shape mismatch: expected shape rank at least {len(declared)}, got {len(dense_shape)}"
                )
            for i, size in enumerate(declared):
                if size is not None and size != dense_shape[i]:
                    raise errors.InvalidArgumentError(
                        f"Shape mismatch: expected shape dim {i} to be {size}, got {dense_shape[i]}"
                    )
        if declared and declared[0] is not None and gradient.indices.size:
            too_large = np.flatnonzero(gradient.indices >= declared[0])
            if too_large.size:
                i = int(too_large[0])
                raise errors.InvalidArgumentError(
                    f"Shape mismatch: index of slice {i} exceeded limits of shape; index is "
                    f"{int(gradient.indices[i])} exceeded {declared[0]}"
                )
        values = gradient.values
        if self._counter > 0 and self._values is not None:
            if self._values.ndim != values.ndim:
                raise errors.InvalidArgumentError(
                    f"Shape mismatch: expected values rank {self._values.ndim}, got {values.ndim}"
                )
            for i in range(1, values.ndim):
                if self._values.shape[i] != values.shape[i]:
                    raise errors.InvalidArgumentError(
                        f"Shape mismatch: expected values dim {i} to be {self._values.shape[i]}, "
                        f"got {values.shape[i]}"
                    )
        else:
            if len(declared) > values.ndim:
                raise errors.InvalidArgumentError(
                    f"Shape mismatch: expected values rank at least {len(declared)}, got {values.ndim}"
                )
            for i in range(1, len(declared)):
                size = declared[i]
                if size is not None and size != values.shape[i]:
                    raise errors.InvalidArgumentError(
                        f"Shape mismatch: expected values dim {i} to be {size}, got {values.shape[i]}"
                    )

    def _add_locked(self, gradient: SparseGradient) -> None:
        if self._counter == 0 or self._values is None:
            self._indices = gradient.indices.tolist()
            self._values = np.array(gradient.values, dtype=self.dtype, copy=True)
            self._counts = [1] * len(self._indices)
            return
        old, new = self._indices, gradient.indices.tolist()
        # Where each row of the sum comes from: (index, row of the sum so far or -1,
        # row of the new gradient or -1, count).
        indices: list[int] = []
        from_old: list[int] = []
        from_new: list[int] = []
        counts: list[int] = []
        i = j = 0
        while i < len(old) or j < len(new):
            if j == len(new) or (i < len(old) and old[i] < new[j]):
                indices.append(old[i])
                from_old.append(i)
                from_new.append(-1)
                counts.append(self._counts[i])
                i += 1
            elif i == len(old) or old[i] > new[j]:
                indices.append(new[j])
                from_old.append(-1)
                from_new.append(j)
                counts.append(1)
                j += 1
            else:
                indices.append(old[i])
                from_old.append(i)
                from_new.append(j)
                counts.append(self._counts[i] + 1)
                i += 1
                j += 1
        old_rows, new_rows = np.array(from_old, dtype=np.int64), np.array(from_new, dtype=np.int64)
        has_old, has_new = old_rows >= 0, new_rows >= 0
        total = np.empty((len(indices), *gradient.values.shape[1:]), dtype=self.dtype)
        total[has_old] = self._values[old_rows[has_old]]
        only_new = has_new & ~has_old
        total[only_new] = gradient.values[new_rows[only_new]]
        both = has_new & has_old
        total[both] += gradient.values[new_rows[both]]
        self._indices, self._values, self._counts = indices, total, counts

    def _reduce_locked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        assert self._values is not None
        values, self._values = self._values, None
        if self.reduction_type == "MEAN" and values.shape[0]:
            counts = np.array(self._counts, dtype=self.dtype).reshape((-1,) + (1,) * (values.ndim - 1))
            np.divide(values, counts, out=values)
        dense_shape = [-1 if not self.shape or self.shape[0] is None else self.shape[0], *values.shape[1:]]
        return np.array(self._indices, dtype=np.int64), values, np.array(dense_shape, dtype=np.int64)


def _compatible(declared: PartialShape, shape: tuple[int, ...]) -> bool:
    if declared is None:
        return True
    return len(declared) == len(shape) and all(
        d is None or d == s for d, s in zip(declared, shape, strict=True)
    )


# --------------------------------------------------------------------------- kernels


class _CreateAccumulator(OpKernel):
    """Creates the accumulator on its first run (or joins the one sharing its name)."""

    is_stateful = True
    accumulator_class: type[GradientAccumulator] = DenseAccumulator
    outputs_resource = False

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "dtype", _GRADIENT_TYPES)
        self.shape = attr_shape(self, "shape")
        self.reduction_type = self.attr_str("reduction_type", "MEAN")
        if self.reduction_type not in _REDUCTIONS:
            raise kernel_error(
                self, f"reduction_type must be one of {list(_REDUCTIONS)}, got '{self.reduction_type}'"
            )
        self.container = self.attr_str("container", "") or DEFAULT_CONTAINER
        self.accumulator_name = self.attr_str("shared_name", "") or f"_{next(_anonymous_ids)}_{self.name}"

    def new_accumulator(self) -> GradientAccumulator:
        return self.accumulator_class(self.accumulator_name, self.dtype, self.shape, self.reduction_type)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        accumulator = ctx.resources.lookup_or_create(
            self.container, self.accumulator_name, self.new_accumulator
        )
        if type(accumulator) is not self.accumulator_class:
            raise kernel_error(
                self,
                f"Resource {self.container}/{self.accumulator_name} exists and is not a "
                f"{self.accumulator_class.kind}",
            )
        if accumulator.dtype != self.dtype:
            raise kernel_error(
                self,
                f"Shared accumulator '{self.accumulator_name}' accumulates {type_name(accumulator.dtype)} "
                f"but {self.op} requests {type_name(self.dtype)}",
            )
        if self.outputs_resource:
            return [handle_output(ResourceHandle(ctx.device, self.container, self.accumulator_name))]
        return [np.array([self.container.encode(), self.accumulator_name.encode()], dtype=OBJECT)]


@register_kernel("ConditionalAccumulator")
class ConditionalAccumulatorKernel(_CreateAccumulator):
    pass


@register_kernel("ResourceConditionalAccumulator")
class ResourceConditionalAccumulatorKernel(_CreateAccumulator):
    outputs_resource = True


@register_kernel("SparseConditionalAccumulator")
class SparseConditionalAccumulatorKernel(_CreateAccumulator):
    accumulator_class = SparseAccumulator


class _AccumulatorOp(OpKernel):
    """An op on the accumulator its input 0 names (a resource handle or a `[container, name]` ref)."""

    is_stateful = True
    sparse = False

    def accumulator(self, ctx: KernelContext, value: Any) -> GradientAccumulator:
        container, name = self._address(value)
        try:
            accumulator = ctx.resources.lookup(container, name)
        except errors.NotFoundError:
            accumulator = None
        wanted = SparseAccumulator if self.sparse else GradientAccumulator
        if not isinstance(accumulator, wanted):
            raise kernel_error(
                self,
                f"Resource {container or DEFAULT_CONTAINER}/{name}/{_ACCUMULATOR_TYPE_NAME} does not exist.",
                errors.NotFoundError,
            )
        return accumulator

    def _address(self, value: Any) -> tuple[str, str]:
        item = value[()] if isinstance(value, np.ndarray) and value.ndim == 0 else value
        if isinstance(item, ResourceHandle):
            return item.container, item.name
        if isinstance(value, np.ndarray) and value.shape == (2,) and value.dtype == OBJECT:
            container, name = (v.decode() if isinstance(v, bytes) else str(v) for v in value)
            return container, name
        raise kernel_error(
            self,
            f"{self.op} expects an accumulator handle as input 0, got {type(item).__name__} {item!r:.80}",
        )

    def check_dtype(self, accumulator: GradientAccumulator, dtype: np.dtype[Any], what: str) -> None:
        if dtype != accumulator.dtype:
            raise kernel_error(
                self,
                f"{self.op}: {what} has type {type_name(dtype)} but accumulator '{accumulator.name}' "
                f"accumulates {type_name(accumulator.dtype)}",
            )

    def scalar(self, value: Any, dtype: np.dtype[Any], what: str) -> int:
        value = np.asarray(value)
        if value.ndim != 0:
            raise kernel_error(
                self, f"Argument {what} must be scalar, but had bad shape {shape_str(value.shape)}"
            )
        if value.dtype != dtype:
            raise kernel_error(
                self, f"Argument {what} must be {type_name(dtype)}, got {type_name(value.dtype)}"
            )
        return int(value)


@register_kernel("AccumulatorApplyGradient", "ResourceAccumulatorApplyGradient")
class AccumulatorApplyGradientKernel(_AccumulatorOp):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        accumulator = self.accumulator(ctx, inputs[0])
        local_step = self.scalar(inputs[1], INT64, "local_step")
        gradient = np.asarray(inputs[2])
        self.check_dtype(accumulator, gradient.dtype, "gradient")
        try:
            accumulator.apply(local_step, gradient)
        except errors.OpError as exc:
            raise errors.with_node(exc, self.name) from None
        return []


@register_kernel("SparseAccumulatorApplyGradient")
class SparseAccumulatorApplyGradientKernel(_AccumulatorOp):
    sparse = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.has_known_shape = self.attr_bool("has_known_shape")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        accumulator = self.accumulator(ctx, inputs[0])
        local_step = self.scalar(inputs[1], INT64, "local_step")
        indices, values = np.asarray(inputs[2]), np.asarray(inputs[3])
        self.check_dtype(accumulator, values.dtype, "gradient_values")
        if indices.dtype != INT64:
            raise kernel_error(self, f"gradient_indices must be int64, got {type_name(indices.dtype)}")
        if indices.ndim != 1:
            raise kernel_error(
                self, f"Input indices should be vector but received shape: {shape_str(indices.shape)}"
            )
        if values.ndim == 0:
            raise kernel_error(self, "Values cannot be 0-dimensional.")
        if values.shape[0] != indices.shape[0]:
            raise kernel_error(
                self, f"Expected {indices.shape[0]} non-empty input values, got {values.shape[0]}"
            )
        shape = None
        if self.has_known_shape:
            shape = np.asarray(inputs[4])
            if shape.dtype != INT64 or shape.ndim != 1:
                raise kernel_error(
                    self,
                    f"gradient_shape must be an int64 vector, got {type_name(shape.dtype)} "
                    f"{shape_str(shape.shape)}",
                )
        try:
            accumulator.apply(local_step, SparseGradient(indices, values, shape))
        except errors.OpError as exc:
            raise errors.with_node(exc, self.name) from None
        return []


@register_kernel(
    "AccumulatorTakeGradient", "ResourceAccumulatorTakeGradient", "SparseAccumulatorTakeGradient"
)
class AccumulatorTakeGradientKernel(_AccumulatorOp):
    """Waits on the event loop until enough gradients are in; cancelling the step withdraws it."""

    is_async = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.sparse = node.op == "SparseAccumulatorTakeGradient"
        self.dtype = attr_type_in(self, "dtype", _GRADIENT_TYPES)

    async def compute_async(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        accumulator = self.accumulator(ctx, inputs[0])
        self.check_dtype(accumulator, self.dtype, "the dtype attr")
        required = self.scalar(inputs[1], INT32, "num_required")
        if required <= 0:
            raise kernel_error(self, f"Argument num_required must be positive, but was {required}")
        result = await accumulator.take(required)
        return list(result) if self.sparse else [result]


@register_kernel("AccumulatorNumAccumulated", "ResourceAccumulatorNumAccumulated")
class AccumulatorNumAccumulatedKernel(_AccumulatorOp):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [np.array(self.accumulator(ctx, inputs[0]).num_accumulated(), dtype=INT32)]


@register_kernel("AccumulatorSetGlobalStep", "ResourceAccumulatorSetGlobalStep")
class AccumulatorSetGlobalStepKernel(_AccumulatorOp):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        accumulator = self.accumulator(ctx, inputs[0])
        accumulator.set_global_step(self.scalar(inputs[1], INT64, "new_global_step"))
        return []


__all__ = [
    "AccumulatorApplyGradientKernel",
    "AccumulatorNumAccumulatedKernel",
    "AccumulatorSetGlobalStepKernel",
    "AccumulatorTakeGradientKernel",
    "ConditionalAccumulatorKernel",
    "DenseAccumulator",
    "GradientAccumulator",
    "ResourceConditionalAccumulatorKernel",
    "SparseAccumulator",
    "SparseAccumulatorApplyGradientKernel",
    "SparseConditionalAccumulatorKernel",
]
