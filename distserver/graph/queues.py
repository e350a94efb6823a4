"""`FIFOQueue`: a queue resource shared by steps and sessions (TF's `tf.queue.FIFOQueue`).

Queues are the classic TF 1.x way for tasks to coordinate: a parameter server
can block on `dequeue` until every worker has enqueued a "done" token. They build
TensorFlow's `FIFOQueueV2` / `QueueEnqueueV2` / `QueueDequeueV2` / ... nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from distserver import tensors
from distserver.graph.graph import Operation, Tensor, get_default_graph, name_scope
from distserver.graph.ops import convert_to_tensor
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.tensors import as_datatype


def _types_attr(datatypes: Sequence[int]) -> AttrValue:
    value = AttrValue()
    value.list.type.extend(datatypes)  # type: ignore[arg-type]
    return value


class FIFOQueue:
    """A first-in first-out queue of tuples of tensors.

    Args:
        capacity: Maximum number of elements (-1 for unbounded).
        dtypes: The dtype of each component of an element.
        shapes: Optional static shape of each component.
        shared_name: Share the queue across sessions under this name (default: the
            node name, so sessions running this graph share it).
        name: Node name of the queue.
    """

    def __init__(
        self,
        capacity: int,
        dtypes: Sequence[Any],
        shapes: Sequence[Any] | None = None,
        shared_name: str | None = None,
        name: str = "fifo_queue",
    ) -> None:
        self.dtypes = [as_datatype(d) for d in dtypes]
        self._shapes = list(shapes) if shapes is not None else None
        graph = get_default_graph()
        node_name = graph.unique_name(name)
        attrs = {
            "component_types": _types_attr(self.dtypes),
            "capacity": AttrValue(i=capacity),
            "container": AttrValue(s=b""),
            "shared_name": AttrValue(s=(shared_name or node_name).encode()),
        }
        shape_list = AttrValue()
        for shape in self._shapes or []:
            shape_list.list.shape.add().CopyFrom(tensors.shape_to_proto(shape))
        attrs["shapes"] = shape_list
        self.queue_ref = graph.create_op(
            "FIFOQueueV2", [], [tensors.as_datatype("resource")], name=node_name + "/", attrs=attrs
        ).outputs[0]
        self.name = node_name

    def enqueue(self, values: Any, name: str | None = None) -> Operation:
        """An op that adds one element (a tensor or a tuple of tensors) to the queue."""
        components = self._components(values)
        with name_scope(name, f"{self.name}_enqueue") as scope:
            attrs = {"Tcomponents": _types_attr(self.dtypes), "timeout_ms": AttrValue(i=-1)}
            return get_default_graph().create_op(
                "QueueEnqueueV2", [self.queue_ref, *components], [], name=scope, attrs=attrs
            )

    def dequeue(self, name: str | None = None) -> Any:
        """A tensor (or a list of tensors, one per component) taken from the queue; waits when empty."""
        with name_scope(name, f"{self.name}_Dequeue") as scope:
            attrs = {"component_types": _types_attr(self.dtypes), "timeout_ms": AttrValue(i=-1)}
            shapes = self._shapes or [None] * len(self.dtypes)
            op = get_default_graph().create_op(
                "QueueDequeueV2", [self.queue_ref], self.dtypes, name=scope, attrs=attrs, shapes=shapes
            )
        return op.outputs[0] if len(op.outputs) == 1 else list(op.outputs)

    def close(self, cancel_pending_enqueues: bool = False, name: str | None = None) -> Operation:
        """An op that closes the queue: later dequeues of an empty queue fail with OutOfRangeError."""
        with name_scope(name, f"{self.name}_Close") as scope:
            attrs = {"cancel_pending_enqueues": AttrValue(b=cancel_pending_enqueues)}
            return get_default_graph().create_op(
                "QueueCloseV2", [self.queue_ref], [], name=scope, attrs=attrs
            )

    def size(self, name: str | None = None) -> Tensor:
        """The number of elements in the queue."""
        with name_scope(name, f"{self.name}_Size") as scope:
            op = get_default_graph().create_op(
                "QueueSizeV2", [self.queue_ref], [as_datatype("int32")], name=scope, shapes=[()]
            )
        return op.outputs[0]

    def _components(self, values: Any) -> list[Tensor]:
        items = list(values) if isinstance(values, list | tuple) else [values]
        if len(items) != len(self.dtypes):
            raise ValueError(f"Queue {self.name} holds {len(self.dtypes)} components, got {len(items)}")
        return [convert_to_tensor(v, dtype=d) for v, d in zip(items, self.dtypes, strict=True)]
