"""Loops that span tasks: every task runs its part of each iteration. Pure; no I/O.

A control flow v1 loop (`Enter`, `Merge`, `Switch`, `LoopCond`, `NextIteration`,
`Exit`) runs in a *frame*: each value inside it belongs to one iteration of one
execution of the loop. When the partitioner cuts an edge inside a loop (a body that
reads a variable on the ps each iteration), both tasks must agree on which iteration
a value belongs to:

* the `_Send` and the `_Recv` of such an edge put the frame and the iteration in the
  rendezvous key (the executor gives them at run time, `StepContext.frame_iter`); both
  tasks name a frame the same way (its loop's name under its parent frame's name and
  iteration), so they make the same key;
* the receiving task needs the frame even when none of the loop's own `Enter` nodes is
  there, so that its `_Recv` runs once in each iteration. For each (frame, receiving
  device) `ControlLoops` adds a *control loop* there, as TensorFlow's partitioner does:

      Const (or the parent frame's control loop) -> Enter -> Merge <- NextIteration
      Switch(Merge, the loop's LoopCond, sent from its task) -> :1 -> NextIteration

  It iterates exactly as the loop does, since the loop's predicate decides each of its
  iterations, and every `_Recv` of the frame on that device waits on its `Merge` (on
  its `Enter` for the value of a non-constant `Enter`, which exists in the first
  iteration only). A `_Recv` runs even when what it waits on is dead (TensorFlow's
  rule for transfers), so the dead values of the loop's last iteration are received
  too and nothing is left behind in the rendezvous.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from distserver import errors
from distserver.devices import task_of_device
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.types_pb2 import DT_FLOAT
from distserver.runtime.names import parse_input
from distserver.tensors import to_tensor_proto

ENTER_OPS = frozenset({"Enter", "RefEnter"})
EXIT_OPS = frozenset({"Exit", "RefExit"})
NEXT_ITERATION_OPS = frozenset({"NextIteration", "RefNextIteration"})

# The attr the partitioner puts on a `_Send` and a `_Recv` inside a loop (the frame's
# name): their keys change every iteration, so the push protocol leaves them alone.
LOOP_FRAME_ATTR = "_loop_frame"


@dataclass
class LoopFrame:
    """One loop of the graph (its `Enter` nodes' `frame_name`)."""

    name: str
    parent: str  # "" for a loop at the top level
    parallel_iterations: int
    loop_cond: str | None = None  # its LoopCond node


class LoopFrames:
    """Which frame every node of a placed graph runs in, found as TensorFlow's
    `BuildControlFlowInfo` does: a node's outputs are in its own frame, except that an
    `Enter`'s are in its loop's frame and an `Exit`'s in the parent of its own."""

    def __init__(self, nodes: Sequence[NodeDef]) -> None:
        by_name = {node.name: node for node in nodes}
        consumers: dict[str, list[str]] = {name: [] for name in by_name}
        starts = []
        for node in nodes:
            sources = [parse_input(text)[0] for text in node.input]
            sources = [s for s in sources if s in by_name]
            if not sources:
                starts.append(node.name)
            for source in sources:
                consumers[source].append(node.name)
        self.frames: dict[str, LoopFrame] = {}
        self.frame_of: dict[str, str] = {name: "" for name in starts}
        self._exits: dict[str, list[str]] = {}  # frame -> its Exit nodes
        self.nodes = by_name  # name -> NodeDef
        todo = deque(starts)
        while todo:
            name = todo.popleft()
            node = by_name[name]
            frame = self.frame_of[name]
            if node.op in ENTER_OPS:
                loop = node.attr["frame_name"].s.decode()
                self.frames.setdefault(
                    loop, LoopFrame(loop, frame, max(1, node.attr["parallel_iterations"].i))
                )
            elif node.op == "LoopCond" and frame:
                self.frames[frame].loop_cond = name
            elif node.op in EXIT_OPS and frame:
                self._exits.setdefault(frame, []).append(name)
            out = self.output_frame(name)
            for consumer in consumers[name]:
                if consumer not in self.frame_of:
                    self.frame_of[consumer] = out
                    todo.append(consumer)

    def after_loops(self, name: str) -> list[str]:
        """Nodes outside every loop that finish after node `name` has run for the last
        time: `name` itself when its outputs are outside loops, else the Exit nodes of
        the outermost loop it is in (a control edge may not leave a loop)."""
        frame = self.output_frame(name)
        if not frame:
            return [name]
        while self.frames[frame].parent:
            frame = self.frames[frame].parent
        return self._exits.get(frame, [])

    def output_frame(self, name: str) -> str:
        """The frame of the values node `name` outputs ("" outside loops)."""
        node = self.nodes[name]
        frame = self.frame_of.get(name, "")
        if node.op in ENTER_OPS:
            return node.attr["frame_name"].s.decode()
        if node.op in EXIT_OPS and frame:
            return self.frames[frame].parent
        return frame


@dataclass
class _ControlLoop:
    enter: str
    merge: str


class ControlLoops:
    """The control loops of one partitioning, made on demand (`anchor`)."""

    def __init__(
        self,
        frames: LoopFrames,
        device_of: Mapping[str, str],
        part: Callable[[str], GraphDef],
        cross: Callable[[str, str, bool, str], str],
    ) -> None:
        """`device_of` is the device of every node of the graph, `part(device)` the
        partition of a device; `cross(src, tensor, is_control, dst_device)` carries a
        tensor to another device and names its `_Recv` there."""
        self._frames = frames
        self._device_of = device_of
        self._part = part
        self._cross = cross
        self._loops: dict[tuple[str, str], _ControlLoop] = {}
        self._names = itertools.count()

    def cover(self, name: str, device: str) -> None:
        """Give the loops node `name` (placed on `device`) runs in or outputs to a
        control loop there, unless the loop's LoopCond is on that task: the node must run
        in every iteration even when nothing it receives makes it (a variable read of
        a constant `Enter` on the ps)."""
        for frame in {self._frames.frame_of.get(name, ""), self._frames.output_frame(name)}:
            if not frame:
                continue
            loop_cond = self._frames.frames[frame].loop_cond
            if loop_cond is None or task_of_device(self._device_of[loop_cond]) != task_of_device(device):
                self._control_loop(frame, device)

    def anchor(self, src: str, frame: str, device: str) -> str:
        """The node on `device` a `_Recv` of `src`'s output in `frame` waits on."""
        node = self._frames.nodes[src]
        if node.op in NEXT_ITERATION_OPS:
            raise errors.UnimplementedError(
                f"The NextIteration node '{src}' of the loop '{frame}' and its Merge are on "
                "different tasks: place a loop's Merge and NextIteration nodes together",
                node_name=src,
            )
        loop = self._control_loop(frame, device)
        if node.op in ENTER_OPS and not node.attr["is_constant"].b:
            return loop.enter  # the value exists in the first iteration only
        return loop.merge

    def _control_loop(self, frame: str, device: str) -> _ControlLoop:
        found = self._loops.get((frame, device))
        if found is not None:
            return found
        info = self._frames.frames[frame]
        if info.loop_cond is None:
            raise errors.InvalidArgumentError(
                f"The loop '{frame}' has no LoopCond node, but its body spans tasks"
            )
        graph = self._part(device)
        prefix = f"_control_loop_{next(self._names)}"
        start = _node(graph, f"{prefix}/start", "Const", device)
        start.attr["dtype"].type = DT_FLOAT  # type: ignore[assignment]
        start.attr["value"].tensor.CopyFrom(to_tensor_proto(np.zeros((), np.float32)))
        if info.parent:  # once per iteration of the parent loop
            start.input.append("^" + self._control_loop(info.parent, device).merge)
        enter = _node(graph, f"{prefix}/enter", "Enter", device, start.name)
        enter.attr["frame_name"].s = frame.encode()
        enter.attr["is_constant"].b = False
        enter.attr["parallel_iterations"].i = info.parallel_iterations
        merge = _node(graph, f"{prefix}/merge", "Merge", device, enter.name, f"{prefix}/next")
        merge.attr["N"].i = 2
        loop = self._loops[(frame, device)] = _ControlLoop(enter.name, merge.name)
        if task_of_device(self._device_of[info.loop_cond]) == task_of_device(device):
            predicate = info.loop_cond + ":0"
        else:
            predicate = self._cross(info.loop_cond, info.loop_cond + ":0", False, device) + ":0"
        _node(graph, f"{prefix}/switch", "Switch", device, merge.name, predicate)
        _node(graph, f"{prefix}/next", "NextIteration", device, f"{prefix}/switch:1")
        return loop


def _node(graph: GraphDef, name: str, op: str, device: str, *inputs: str) -> NodeDef:
    node = graph.node.add(name=name, op=op, device=device)
    node.input.extend(inputs)
    if op != "Const":
        node.attr["T"].type = DT_FLOAT  # type: ignore[assignment]
    return node
