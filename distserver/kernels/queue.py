"""Kernels for TensorFlow's FIFO queue ops (`tf.queue.FIFOQueue`).

`FIFOQueueV2` creates (or finds, by `shared_name`) a `FIFOQueue` resource and outputs
its handle; the other ops take that handle. Every queue kernel is async so that all
of them run on the event loop: enqueues and dequeues wait there without holding a
thread, and cancelling a step cancels its waits, leaving the queue consistent.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

from distserver import errors
from distserver.kernels._common import (
    INT32,
    attr_type_list,
    handle_input,
    handle_output,
    int_scalar,
    kernel_error,
    shape_str,
    type_name,
)
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel
from distserver.kernels.resources import DEFAULT_CONTAINER, FIFOQueue, RandomShuffleQueue
from distserver.tensors import ResourceHandle, shape_from_proto

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef

# TensorFlow names resources by their C++ type in lookup errors; keep its text.
_QUEUE_TYPE_NAME = "N10tensorflow14QueueInterfaceE"

# A queue without a shared_name is private to its kernel, as in TF's ResourceOpKernel;
# the executor shares a stateful kernel among the graphs of a session, so the queue
# lives as long as the session.
_anonymous_ids = itertools.count()


class _QueueKernel(OpKernel):
    """Runs `run` on the event loop and names the node in every error it raises."""

    is_async = True
    is_stateful = True

    async def compute_async(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        try:
            return await self.run(ctx, inputs)
        except errors.OpError as exc:
            raise errors.with_node(exc, self.name) from None

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        raise RuntimeError(f"{self.op} is an async kernel: call compute_async")

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        raise NotImplementedError

    def _queue(self, ctx: KernelContext, value: Any) -> FIFOQueue:
        handle = handle_input(self, value)
        try:
            queue = ctx.resources.lookup(handle.container, handle.name)
        except errors.NotFoundError:
            queue = None
        if not isinstance(queue, FIFOQueue):
            container = handle.container or DEFAULT_CONTAINER
            raise errors.NotFoundError(
                f"Resource {container}/{handle.name}/{_QUEUE_TYPE_NAME} does not exist."
            )
        return queue

    def _timeout(self) -> float | None:
        """The `timeout_ms` attr in seconds; None (wait forever) when negative or absent."""
        timeout_ms = self.attr_int("timeout_ms", -1)
        return None if timeout_ms < 0 else timeout_ms / 1000

    def _check_types(self, queue: FIFOQueue, attr: str) -> None:
        expected = tuple(attr_type_list(self, attr))
        if expected != queue.component_types:
            raise errors.InvalidArgumentError(
                f"Queue '{queue.name}' holds components of types "
                f"[{', '.join(type_name(t) for t in queue.component_types)}] but {self.op} expects "
                f"[{', '.join(type_name(t) for t in expected)}]"
            )


@register_kernel("FIFOQueueV2")
class FIFOQueueV2Kernel(_QueueKernel):
    """Creates the queue on its first run (or joins the one sharing its name)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.component_types = attr_type_list(self, "component_types")
        if not self.component_types:
            raise kernel_error(self, "FIFOQueue needs at least one component type")
        self.shapes: list[tuple[int, ...]] = []
        for i, proto in enumerate(self._attr("shapes").list.shape if self.has_attr("shapes") else []):
            shape = shape_from_proto(proto)
            if shape is None or None in shape:
                raise kernel_error(
                    self,
                    f"FIFOQueue needs fully defined shapes, but component {i} has shape {shape_str(shape)}",
                )
            self.shapes.append(tuple(d for d in shape if d is not None))
        if self.shapes and len(self.shapes) != len(self.component_types):
            raise kernel_error(
                self,
                f"FIFOQueue has {len(self.component_types)} component types but {len(self.shapes)} shapes",
            )
        self.capacity = self.attr_int("capacity", -1)
        self.container = self.attr_str("container", "") or DEFAULT_CONTAINER
        self.queue_name = self.attr_str("shared_name", "") or f"_{next(_anonymous_ids)}_{self.name}"

    queue_class: type[FIFOQueue] = FIFOQueue

    def new_queue(self) -> FIFOQueue:
        return FIFOQueue(self.queue_name, self.component_types, self.shapes, self.capacity)

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        queue = ctx.resources.lookup_or_create(self.container, self.queue_name, self.new_queue)
        if type(queue) is not self.queue_class:
            raise errors.InvalidArgumentError(
                f"Resource {self.container}/{self.queue_name} exists and is not a {self.op[:-2]}"
            )
        queue.matches(self.component_types, self.shapes, self.capacity)
        return [handle_output(ResourceHandle(ctx.device, self.container, self.queue_name))]


@register_kernel("RandomShuffleQueueV2")
class RandomShuffleQueueV2Kernel(FIFOQueueV2Kernel):
    """A queue dequeued in random order, keeping `min_after_dequeue` elements while open."""

    queue_class = RandomShuffleQueue

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.min_after_dequeue = self.attr_int("min_after_dequeue", 0)
        self.seeds = (self.attr_int("seed", 0), self.attr_int("seed2", 0))
        if self.capacity >= 0 and self.min_after_dequeue >= self.capacity:
            raise kernel_error(
                self,
                f"min_after_dequeue {self.min_after_dequeue} must be < capacity {self.capacity}",
            )

    def new_queue(self) -> FIFOQueue:
        seed, seed2 = self.seeds
        return RandomShuffleQueue(
            self.queue_name,
            self.component_types,
            self.shapes,
            self.capacity,
            min_after_dequeue=self.min_after_dequeue,
            seed=seed,
            seed2=seed2,
        )


@register_kernel("QueueEnqueueV2")
class QueueEnqueueV2Kernel(_QueueKernel):
    """Adds one element (one value per component), waiting while the queue is full."""

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        queue = self._queue(ctx, inputs[0])
        # Copies: the queue keeps the values beyond this step.
        element = queue.validate_element([np.array(v, copy=True) for v in inputs[1:]])
        await queue.enqueue([element], self._timeout())
        return []


@register_kernel("QueueEnqueueManyV2")
class QueueEnqueueManyV2Kernel(_QueueKernel):
    """Adds the elements of a batch (components stacked along dimension 0), in order."""

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        queue = self._queue(ctx, inputs[0])
        elements = queue.validate_batch([np.array(v, copy=True) for v in inputs[1:]])
        await queue.enqueue(elements, self._timeout())
        return []


@register_kernel("QueueDequeueV2")
class QueueDequeueV2Kernel(_QueueKernel):
    """Removes the first element, waiting (up to `timeout_ms`) until there is one."""

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        queue = self._queue(ctx, inputs[0])
        self._check_types(queue, "component_types")
        (element,) = await queue.dequeue(1, self._timeout())
        return list(element)


@register_kernel("QueueDequeueManyV2", "QueueDequeueUpToV2")
class QueueDequeueManyV2Kernel(_QueueKernel):
    """Removes `n` elements at once and stacks each component along a new dimension 0.

    DequeueUpTo: once the queue is closed, fewer (at least one) will do.
    """

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        queue = self._queue(ctx, inputs[0])
        self._check_types(queue, "component_types")
        count = int_scalar(self, inputs[1], "n")
        if count < 0:
            raise errors.InvalidArgumentError(f"DequeueManyOp requested {count} < 0 elements")
        if not queue.shapes:
            raise errors.InvalidArgumentError(
                "FIFOQueue's DequeueMany and DequeueUpTo require the components to have specified shapes."
            )
        elements = await queue.dequeue(count, self._timeout(), allow_fewer=self.op == "QueueDequeueUpToV2")
        return [
            np.stack([element[i] for element in elements])
            if elements
            else np.empty((0, *queue.shapes[i]), dtype=dtype)
            for i, dtype in enumerate(queue.component_types)
        ]


@register_kernel("QueueCloseV2")
class QueueCloseV2Kernel(_QueueKernel):
    """Closes the queue; `cancel_pending_enqueues` also fails the enqueues still waiting."""

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        queue = self._queue(ctx, inputs[0])
        await queue.close(self.attr_bool("cancel_pending_enqueues", False))
        return []


@register_kernel("QueueSizeV2")
class QueueSizeV2Kernel(_QueueKernel):
    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [np.array(self._queue(ctx, inputs[0]).size(), dtype=INT32)]


__all__ = [
    "FIFOQueueV2Kernel",
    "QueueCloseV2Kernel",
    "QueueDequeueManyV2Kernel",
    "QueueDequeueV2Kernel",
    "QueueEnqueueManyV2Kernel",
    "QueueEnqueueV2Kernel",
    "QueueSizeV2Kernel",
]
