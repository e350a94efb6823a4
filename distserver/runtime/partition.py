"""Split a placed graph into one partition per task. Pure; no I/O.

Every edge whose ends are on different devices becomes a `_Send` in the source
partition and a `_Recv` in the destination partition, with TensorFlow's attrs
(`tensor_name = "edge_<id>_<src>"`, `send_device`, `send_device_incarnation`,
`recv_device`, `client_terminated = false`). One value crosses once per
destination device however many nodes consume it there. A control edge across
devices is carried by a dummy scalar: a `Const` in the source partition that
waits on the source node is sent, and the destination node waits on its `_Recv`.
A small `Const` without inputs (an optimizer's learning rate, say) that another task
uses is copied into that task's partition instead: its value is in the graph, so
sending it would cost every step a transfer (and often a round trip of its own)
for nothing. An edge inside a loop is cut so that both tasks run their part of each
iteration (`control_loops`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from distserver.devices import task_of_device
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.types_pb2 import DT_FLOAT
from distserver.runtime.control_loops import ENTER_OPS, LOOP_FRAME_ATTR, ControlLoops, LoopFrames
from distserver.runtime.names import int64_attr, parse_input
from distserver.tensors import to_tensor_proto

# A `Const` whose value (its TensorProto) is at most this large is copied into the
# partitions that use it rather than sent to them.
COPIED_CONST_BYTES = 1024


def partition(
    nodes: Sequence[NodeDef],
    *,
    incarnation: Callable[[str], int],
) -> dict[str, GraphDef]:
    """Split placed `nodes` (every `device` a full name) by task.

    Args:
        nodes: Nodes with full device names. They are copied, not modified.
        incarnation: Device name -> its incarnation (for `send_device_incarnation`).

    Returns:
        Task name ("/job:J/replica:R/task:T") -> the partition's GraphDef.
    """
    device_of = {node.name: node.device for node in nodes}
    copied = {node.name: node for node in nodes if _copied_const(node)}
    parts: dict[str, GraphDef] = {}
    # (source tensor or "^node", destination device) -> name of the _Recv there (or of
    # the copy of a constant).
    received: dict[tuple[str, str], str] = {}
    edge_ids = iter(range(1 << 62))
    frames = LoopFrames(nodes) if any(node.op in ENTER_OPS for node in nodes) else None

    def part(device: str) -> GraphDef:
        task = task_of_device(device)
        graph = parts.get(task)
        if graph is None:
            graph = parts[task] = GraphDef()
        return graph

    def cross(src_node: str, tensor: str, is_control: bool, dst_device: str) -> str:
        key = ("^" + src_node if is_control else tensor, dst_device)
        recv_name = received.get(key)
        if recv_name is not None:
            return recv_name
        edge = next(edge_ids)
        if not is_control and src_node in copied and tensor == src_node + ":0":
            copy = part(dst_device).node.add()
            copy.CopyFrom(copied[src_node])
            copy.name = f"{src_node}/_copy_{edge}"
            copy.device = dst_device
            if "_class" in copy.attr:  # (placed already: no colocation to keep)
                del copy.attr["_class"]
            received[key] = copy.name
            return copy.name
        src_device = device_of[src_node]
        src_part = part(src_device)
        value = tensor
        if is_control:
            dummy = src_part.node.add(name=f"{src_node}/_ctrl_{edge}", op="Const", device=src_device)
            dummy.attr["dtype"].type = DT_FLOAT  # type: ignore[assignment]
            dummy.attr["value"].tensor.CopyFrom(to_tensor_proto(np.zeros((), np.float32)))
            dummy.input.append("^" + src_node)
            value = dummy.name + ":0"
        tensor_name = f"edge_{edge}_{src_node}"
        send = src_part.node.add(name=f"{src_node}/_send_{edge}", op="_Send", device=src_device)
        send.input.append(value)
        recv = part(dst_device).node.add(name=f"{src_node}/_recv_{edge}", op="_Recv", device=dst_device)
        for node in (send, recv):
            node.attr["tensor_name"].s = tensor_name.encode()
            node.attr["send_device"].s = src_device.encode()
            node.attr["send_device_incarnation"].i = int64_attr(incarnation(src_device))
            node.attr["recv_device"].s = dst_device.encode()
            node.attr["client_terminated"].b = False
        if is_control:
            recv.attr["tensor_type"].type = DT_FLOAT  # type: ignore[assignment]
        received[key] = recv.name
        frame = frames.output_frame(src_node) if frames is not None else ""
        if frame:  # the edge is inside a loop: the _Recv runs in each of its iterations
            assert control_loops is not None
            recv.input.append("^" + control_loops.anchor(src_node, frame, dst_device))
            send.attr[LOOP_FRAME_ATTR].s = recv.attr[LOOP_FRAME_ATTR].s = frame.encode()
        return recv.name

    control_loops = ControlLoops(frames, device_of, part, cross) if frames is not None else None

    for node in nodes:
        copy = part(node.device).node.add()
        copy.CopyFrom(node)
        if control_loops is not None:
            control_loops.cover(node.name, node.device)
        for i, text in enumerate(copy.input):
            src, index, is_control = parse_input(text)
            if src not in device_of or task_of_device(device_of[src]) == task_of_device(node.device):
                continue
            recv_name = cross(src, f"{src}:{index}", is_control, node.device)
            copy.input[i] = "^" + recv_name if is_control else recv_name + ":0"
    return parts


def _copied_const(node: NodeDef) -> bool:
    """Whether `node` is a constant that other tasks get a copy of (see the module)."""
    return (
        node.op == "Const"
        and not node.input
        and "value" in node.attr
        and node.attr["value"].tensor.ByteSize() <= COPIED_CONST_BYTES
    )
