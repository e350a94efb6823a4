"""Runs one registered graph partition as a dataflow graph.

`Executor(graph_def)` is built once, at RegisterGraph: it creates every node's
kernel (so unknown ops and bad attrs fail at registration, naming the node),
resolves inputs, and rejects cycles. `run(ctx)` then executes one step:

* Ready-queue scheduling: a node runs once all its data and control inputs have.
* Per-step work that does not depend on the data is done once, at registration or
  at the first step: how each node runs (`_Node.mode`), and the outputs of nodes
  without inputs whose kernel says they are fixed (`OpKernel.outputs_fixed`: Const,
  VarHandleOp), which later steps start from (a traced step still runs every node).
* Small synchronous kernels run inline on the event loop (a task per node would
  cost more than the node). Kernels whose inputs are large, or whose output will
  be (`OpKernel.output_nbytes`: Fill, Tile, Range, random tensors), run in the
  worker's thread pool, and asynchronous kernels (`_Recv`, queues) run as tasks, so
  independent branches proceed concurrently and the loop never blocks on numpy.
* A node's outputs are dropped as soon as its last consumer has taken them (as
  TensorFlow frees a tensor when its last consumer has run), so a long chain over a
  large tensor holds a few of them at a time, not one per node.
* Dead tensors (`kernels.registry.DEAD`, on the port a Switch did not take): a node
  with a dead input is not computed, and everything downstream is dead until a
  Merge picks the live branch (`OpKernel.dead_inputs` says how each kernel treats
  them). A dead node's control edges make their targets dead too.
* The first failing node stops the step: the other nodes in flight are cancelled
  and the error names the node.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distserver import errors
from distserver.kernels.registry import (
    CARRIES_DEADNESS,
    DEAD,
    SKIP_WHEN_DEAD,
    FunctionFrame,
    KernelContext,
    OpKernel,
    create_kernel,
)
from distserver.kernels.resources import ResourceManager
from distserver.protos.attr_value_pb2 import NameAttrList
from distserver.protos.debug_pb2 import DeviceStepStats
from distserver.protos.function_pb2 import FunctionDef
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.runtime.concurrency import first_error
from distserver.runtime.functions import index_library, inline_functions, instantiate
from distserver.runtime.names import parse_input
from distserver.runtime.rendezvous import StepRendezvous

# Kernels whose inputs add up to at least this many bytes run in the thread pool.
OFFLOAD_BYTES = 256 * 1024


@dataclass
class StepContext:
    """What kernels see while one step runs on one device."""

    step_id: int
    device: str
    device_incarnation: int
    rendezvous: StepRendezvous
    resources: ResourceManager
    pool: concurrent.futures.Executor | None = None
    # Where checkpoint kernels may touch files (resolved); None refuses them.
    checkpoint_root: str | None = None
    # The graph's functions (functional ops call them), and the call this context runs.
    functions: FunctionLibraryRuntime | None = None
    frame: FunctionFrame | None = None
    call_depth: int = 0

    async def call_function(self, function: NameAttrList, args: list[Any]) -> list[Any]:
        """Run `function` of the graph's library on `args` in this step (`KernelContext`)."""
        if self.functions is None:
            raise errors.NotFoundError(
                f"Function '{function.name}' is called, but the graph has no function library"
            )
        return await self.functions.call(self, function, args)


class FunctionLibraryRuntime:
    """The functions of one registered graph, instantiated (and inlined) on first call.

    Each (function, attrs) gets one `Executor` over its body, shared by every call; a
    call runs it with a `FunctionFrame` of its own in a copy of the caller's context,
    so it belongs to the caller's step (rendezvous, resources, cancellation).
    """

    def __init__(self, library: Mapping[str, FunctionDef]) -> None:
        self._library = library
        self._executors: dict[bytes, tuple[Executor, int]] = {}

    def _executor(self, function: NameAttrList) -> tuple[Executor, int]:
        key = function.SerializeToString(deterministic=True)
        found = self._executors.get(key)
        if found is None:
            body = instantiate(self._library, function.name, function.attr)
            graph = GraphDef()
            graph.node.extend(inline_functions(body.graph_def.node, self._library))
            found = (Executor(graph), len(body.retvals))
            self._executors[key] = found
        return found

    async def call(self, ctx: StepContext, function: NameAttrList, args: list[Any]) -> list[Any]:
        if ctx.call_depth >= MAX_CALL_DEPTH:
            raise errors.InvalidArgumentError(
                f"Function calls nest deeper than {MAX_CALL_DEPTH} (calling '{function.name}'): "
                "a loop body that runs a loop over itself?"
            )
        executor, num_results = self._executor(function)
        frame = FunctionFrame(args=list(args), retvals=[_NO_RESULT] * num_results)
        await executor.run(
            dataclasses.replace(ctx, frame=frame, functions=self, call_depth=ctx.call_depth + 1)
        )
        for index, value in enumerate(frame.retvals):
            if value is _NO_RESULT or value is DEAD:
                raise errors.InvalidArgumentError(
                    f"Function '{function.name}' did not compute its result {index}"
                )
        return frame.retvals


_NO_RESULT = object()
# Deepest chain of function calls (loops in loop bodies) one step may make.
MAX_CALL_DEPTH = 64


# How the executor runs a node's kernel (`_Node.mode`), decided once per graph.
_INLINE = 0  # synchronously on the loop, whatever its inputs
_BY_SIZE = 1  # in the thread pool when its inputs (or its estimated output) are large
_THREAD = 2  # always in the thread pool (`OpKernel.does_io`)
_TASK = 3  # as a task (`OpKernel.is_async`)


@dataclass
class _Node:
    index: int
    kernel: OpKernel
    inputs: list[tuple[int, int]]  # (producer index, output index)
    consumers: list[int]  # nodes that wait for this one (data or control), one entry per edge
    num_waits: int  # edges into this node
    control_consumers: list[int] = field(default_factory=list)  # the control edges among `consumers`
    num_reads: int = 0  # data edges out of this node: how many times its outputs are taken
    sizes_its_output: bool = False  # the kernel estimates its output (`OpKernel.output_nbytes`)
    mode: int = _INLINE
    # The producers of `inputs`, one entry per data edge (`unread` bookkeeping).
    sources: tuple[int, ...] = ()


class Executor:
    """A partition ready to run; one instance serves many concurrent steps."""

    def __init__(self, graph_def: GraphDef, stateful_kernels: dict[str, OpKernel] | None = None) -> None:
        """Build the kernels of `graph_def`.

        `stateful_kernels` (node name -> kernel), when given, is shared by the graphs of
        one session: a stateful node (a queue, a table, a random op) already built for
        another graph of the session is reused when its NodeDef is the same, so its state
        (a queue without shared_name, a random sequence) lives as long as the session,
        as TensorFlow's sessions share stateful kernels across the graphs they run.
        """
        index_of: dict[str, int] = {}
        for i, node_def in enumerate(graph_def.node):
            if node_def.name in index_of:
                raise errors.InvalidArgumentError(
                    f"Duplicate node name in graph: '{node_def.name}'", node_name=node_def.name
                )
            index_of[node_def.name] = i
        self._nodes: list[_Node] = []
        for i, node_def in enumerate(graph_def.node):
            kernel = _shared_or_new_kernel(node_def, stateful_kernels)
            sizes_output = type(kernel).output_nbytes is not OpKernel.output_nbytes
            self._nodes.append(_Node(i, kernel, [], [], 0, sizes_its_output=sizes_output))
        for i, node_def in enumerate(graph_def.node):
            node = self._nodes[i]
            for text in node_def.input:
                src_name, output, is_control = parse_input(text)
                src = index_of.get(src_name)
                if src is None:
                    raise errors.InvalidArgumentError(
                        f"Node '{node_def.name}': Unknown input node '{text}'", node_name=node_def.name
                    )
                if is_control:
                    self._nodes[src].control_consumers.append(i)
                else:
                    node.inputs.append((src, output))
                    self._nodes[src].num_reads += 1
                self._nodes[src].consumers.append(i)
                node.num_waits += 1
        for node in self._nodes:
            node.mode = _mode_of(node)
            node.sources = tuple(src for src, _ in node.inputs)
        self._roots = [n.index for n in self._nodes if n.num_waits == 0]
        self._check_acyclic()
        self._functions = (
            FunctionLibraryRuntime(index_library(graph_def.library))
            if len(graph_def.library.function)
            else None
        )
        self._plan_fixed_nodes()

    def _plan_fixed_nodes(self) -> None:
        """Where a step starts once the nodes with fixed outputs (`OpKernel.outputs_fixed`,
        no inputs) have run: they run once per device, not once per step."""
        self._fixed = [i for i in self._roots if self._nodes[i].kernel.outputs_fixed]
        self._fixed_outputs: dict[str, list[list[Any]]] = {}  # device -> outputs of each fixed node
        waits = [n.num_waits for n in self._nodes]
        ready = [i for i in self._roots if not self._nodes[i].kernel.outputs_fixed]
        for i in self._fixed:
            for c in self._nodes[i].consumers:
                waits[c] -= 1
                if waits[c] == 0:
                    ready.append(c)
        self._waits_after_fixed = waits
        self._ready_after_fixed = ready

    def _fixed_values(self, ctx: StepContext) -> list[list[Any]]:
        values = self._fixed_outputs.get(ctx.device)
        if values is None:
            values = [_compute(self._nodes[i].kernel, ctx, []) for i in self._fixed]
            self._fixed_outputs[ctx.device] = values
        return values

    def _check_acyclic(self) -> None:
        waits = [n.num_waits for n in self._nodes]
        ready = deque(self._roots)
        seen = 0
        while ready:
            i = ready.popleft()
            seen += 1
            for c in self._nodes[i].consumers:
                waits[c] -= 1
                if waits[c] == 0:
                    ready.append(c)
        if seen != len(self._nodes):
            stuck = [n.kernel.name for n, w in zip(self._nodes, waits, strict=True) if w > 0]
            raise errors.InvalidArgumentError(
                f"Graph is invalid, contains a cycle with {len(stuck)} nodes, "
                f"including: {', '.join(stuck[:5])}"
            )

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    async def run(self, ctx: StepContext, stats: DeviceStepStats | None = None) -> None:
        """Execute every node once. Raises the first node error (naming the node).

        With `stats`, each node that runs adds its timings (`NodeExecStats`: start,
        end, a timeline label; what `RunOptions(trace_level=FULL_TRACE)` returns).
        """
        if self._functions is not None and ctx.functions is None:
            ctx = dataclasses.replace(ctx, functions=self._functions)
        nodes = self._nodes
        # Outputs still to be taken by a consumer; a node's entry is dropped with its last read.
        unread = [n.num_reads for n in nodes]
        outputs: list[list[Any] | None] = [None] * len(nodes)
        dead_control = [False] * len(nodes)  # a control input of the node is dead
        if self._fixed and stats is None:  # a traced step shows every node run
            waits = list(self._waits_after_fixed)
            ready = deque(self._ready_after_fixed)
            for i, values in zip(self._fixed, self._fixed_values(ctx), strict=True):
                if unread[i]:
                    outputs[i] = values
        else:
            waits = [n.num_waits for n in nodes]
            ready = deque(self._roots)
        pool = ctx.pool
        wake = asyncio.Event()
        in_flight = 0
        # Whether a dead value exists in this step yet: until one does (most steps have no
        # conditional), no node pays for looking for them.
        saw_dead = False

        def finish(i: int, values: list[Any]) -> None:
            nonlocal saw_dead
            if unread[i]:
                outputs[i] = values
            node = nodes[i]
            if saw_dead or node.kernel.may_output_dead:
                if values is _DEAD_OUTPUTS or any(v is DEAD for v in values):
                    saw_dead = True
                dead = values is _DEAD_OUTPUTS or (values and all(v is DEAD for v in values))
                if dead:
                    for c in node.control_consumers:
                        dead_control[c] = True
            for c in node.consumers:
                waits[c] -= 1
                if waits[c] == 0:
                    ready.append(c)

        async def run_task(node: _Node, inputs: list[Any], offload: bool) -> None:
            nonlocal in_flight
            started = time.time_ns() if stats is not None else 0
            try:
                if offload:
                    loop = asyncio.get_running_loop()
                    values = await loop.run_in_executor(ctx.pool, _compute, node.kernel, ctx, inputs)
                else:
                    values = await _guard(node.kernel, node.kernel.compute_async(ctx, inputs))
                if stats is not None:
                    _record(stats, node.kernel, started, time.time_ns())
                finish(node.index, values)
            finally:
                in_flight -= 1
                wake.set()

        try:
            async with asyncio.TaskGroup() as group:
                while True:
                    while ready:
                        node = nodes[ready.popleft()]
                        if saw_dead:
                            inputs = [_output(nodes, outputs, src, k, node) for src, k in node.inputs]
                        else:
                            # No dead value yet, so no `_DEAD_OUTPUTS`: plain indexing (an
                            # output index out of range takes the checked path for its error).
                            try:
                                inputs = [outputs[src][k] for src, k in node.inputs]  # type: ignore[index]
                            except IndexError:
                                inputs = [_output(nodes, outputs, src, k, node) for src, k in node.inputs]
                        for src in node.sources:
                            left = unread[src] - 1
                            unread[src] = left
                            if not left:
                                outputs[src] = None
                        if saw_dead and (dead_control[node.index] or any(v is DEAD for v in inputs)):
                            if node.kernel.dead_inputs == SKIP_WHEN_DEAD:
                                finish(node.index, _DEAD_OUTPUTS)
                                continue
                            if node.kernel.dead_inputs == CARRIES_DEADNESS:
                                inputs = [DEAD] * len(inputs)
                        mode = node.mode
                        if mode == _TASK:
                            in_flight += 1
                            group.create_task(run_task(node, inputs, offload=False))
                        elif pool is not None and (
                            mode == _THREAD or (mode == _BY_SIZE and _large(node, inputs))
                        ):
                            in_flight += 1
                            group.create_task(run_task(node, inputs, offload=True))
                        elif stats is not None:
                            started = time.time_ns()
                            values = _compute(node.kernel, ctx, inputs)
                            _record(stats, node.kernel, started, time.time_ns())
                            finish(node.index, values)
                        else:
                            finish(node.index, _compute(node.kernel, ctx, inputs))
                        del inputs  # the kernel holds its inputs only while it runs
                    if in_flight == 0:
                        break
                    await wake.wait()
                    wake.clear()
        except BaseExceptionGroup as group_error:
            raise first_error(group_error) from None


async def run_kernel(kernel: OpKernel, ctx: StepContext, inputs: list[Any]) -> list[Any]:
    """Run one kernel outside a graph (an eager op), where the executor would run it:
    inline, as a task for asynchronous kernels, or in `ctx.pool` when it is large."""
    if kernel.is_async:
        return await _guard(kernel, kernel.compute_async(ctx, inputs))
    node = _Node(
        0, kernel, [], [], 0, sizes_its_output=type(kernel).output_nbytes is not OpKernel.output_nbytes
    )
    in_a_thread = not kernel.runs_on_loop and (kernel.does_io or _large(node, inputs))
    if ctx.pool is not None and in_a_thread:
        return await asyncio.get_running_loop().run_in_executor(ctx.pool, _compute, kernel, ctx, inputs)
    return _compute(kernel, ctx, inputs)


# The outputs of a node that was not computed because an input was dead: each is DEAD
# (an identity, not a value: the node's output count is not needed).
_DEAD_OUTPUTS: list[Any] = []


def _shared_or_new_kernel(node_def: NodeDef, stateful_kernels: dict[str, OpKernel] | None) -> OpKernel:
    if stateful_kernels is None:
        return create_kernel(node_def)
    kernel = stateful_kernels.get(node_def.name)
    if kernel is not None and kernel.node == node_def:
        return kernel
    kernel = create_kernel(node_def)
    if kernel.is_stateful:
        stateful_kernels[node_def.name] = kernel
    return kernel


def _output(nodes: list[_Node], outputs: list[list[Any] | None], src: int, k: int, consumer: _Node) -> Any:
    values = outputs[src]
    assert values is not None
    if values is _DEAD_OUTPUTS:
        return DEAD
    if k >= len(values):
        producer = nodes[src].kernel
        raise errors.InvalidArgumentError(
            f"Node '{consumer.kernel.name}' wants output {k} of '{producer.name}' ({producer.op}), "
            f"which has only {len(values)} outputs",
            node_name=consumer.kernel.name,
        )
    return values[k]


def _record(stats: DeviceStepStats, kernel: OpKernel, started_ns: int, ended_ns: int) -> None:
    """Add one node's run to `stats`, as TensorFlow's step stats describe it."""
    took = ended_ns - started_ns
    inputs = ", ".join(kernel.node.input)
    stats.node_stats.add(
        node_name=kernel.name,
        all_start_micros=started_ns // 1000,
        op_end_rel_micros=took // 1000,
        all_end_rel_micros=took // 1000,
        all_start_nanos=started_ns,
        op_end_rel_nanos=took,
        all_end_rel_nanos=took,
        timeline_label=f"{kernel.name} = {kernel.op}({inputs})",
        thread_id=threading.get_ident() & 0xFFFFFFFF,
    )


def _mode_of(node: _Node) -> int:
    """How `node` runs (see `_INLINE`...): fixed by its kernel and its graph."""
    kernel = node.kernel
    if kernel.is_async:
        return _TASK
    if kernel.runs_on_loop:
        return _INLINE
    if kernel.does_io:
        return _THREAD
    if node.inputs or node.sizes_its_output:
        return _BY_SIZE
    return _INLINE  # no inputs and no output estimate: nothing can make it large


def _large(node: _Node, inputs: list[Any]) -> bool:
    """Whether the kernel's work is large enough for a thread: large inputs, or a large output."""
    nbytes = 0
    for value in inputs:
        if isinstance(value, np.ndarray):
            nbytes += value.nbytes
    if node.sizes_its_output:
        nbytes += node.kernel.output_nbytes(inputs)
    return nbytes >= OFFLOAD_BYTES


def _compute(kernel: OpKernel, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
    try:
        return kernel.compute(ctx, inputs)
    except errors.OpError as exc:
        raise errors.with_node(exc, kernel.name) from exc
    except MemoryError as exc:
        raise errors.with_node(
            errors.ResourceExhaustedError(f"{kernel.op} ran out of memory: {exc}"), kernel.name
        ) from exc
    except (ValueError, TypeError, ArithmeticError, IndexError) as exc:
        raise errors.with_node(
            errors.InvalidArgumentError(f"{kernel.op} failed: {exc}"), kernel.name
        ) from exc


async def _guard(kernel: OpKernel, coro: Any) -> list[Any]:
    try:
        result: list[Any] = await coro
        return result
    except errors.OpError as exc:
        raise errors.with_node(exc, kernel.name) from exc
