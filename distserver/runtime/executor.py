"""Runs one registered graph partition as a dataflow graph.

`Executor(graph_def)` is built once, at RegisterGraph: it creates every node's
kernel (so unknown ops and bad attrs fail at registration, naming the node),
resolves inputs, and rejects cycles. `run(ctx)` then executes one step:

* Ready-queue scheduling: a node runs once all its data and control inputs have.
  A step whose receives have all arrived when it starts (a one-task step: its feeds
  are sent before it runs), or whose partition the planner marked (its receives may
  be waited for once the nodes that need none have run: `plan.mark_receives_first`),
  needs no queue: it runs as one sequence fixed at registration (`_Straight`, ~1-2
  us a node less), a large node taking the nodes after it to its pool thread (one
  hop, not one per large node).
* What another task waits for goes first: of the nodes ready, those a `_Send` to
  another task needs run before the others (in the queue and in the sequence alike),
  and once they have run, the event loop hands the sent values to the requests
  already waiting for them before any other node runs (`_sending_to_peers`). (In a
  run of nodes in a pool thread, such a `_Send` waits for the run to end: see `_AFTER`.)
* Per-step work that does not depend on the data is done once, at registration or
  at the first step: how each node runs (`_Node.mode`), and the outputs of nodes
  without inputs whose kernel says they are fixed (`OpKernel.outputs_fixed`: Const,
  VarHandleOp), which later steps start from (a traced step still runs every node).
* Nodes of pure ops (`_FOLDABLE_OPS`) whose inputs are all constants are computed once,
  at registration (`_fold_constants`, Grappler's constant folding), when small.
* Nodes that only pass a value on or only order others (Identity, NoOp) are left out
  of graphs without loops or reference variables, their consumers connected to their
  inputs (`_leave_out_pass_through`), as TensorFlow's Grappler does before a step;
  before that, a pure node whose outputs nobody reads (only control edges wait for
  it: the gradient of a layer's input) becomes a NoOp (`_skip_unread_results`).
* Small synchronous kernels run inline on the event loop (a task per node would
  cost more than the node). Kernels whose inputs are large (`OFFLOAD_BYTES`, or the
  kernel's own `OpKernel.offload_bytes`: 2 MiB for a dense optimizer update), or
  whose output or work will be (`OpKernel.output_nbytes`: Fill, Tile, Range, random
  tensors, a matrix product's multiply-adds; `OpKernel.work_nbytes` adds it up), run
  in the worker's thread pool, and asynchronous kernels (queues) run as tasks, so
  independent branches proceed concurrently and the loop never blocks on long
  numpy work. A
  `_Recv`'s value is a future the step waits on without a task (`RecvKernel.receive`:
  8.5 -> 3 us a receive; a step's receives are cancelled when it stops).
* A node's outputs are dropped as soon as its last consumer has taken them (as
  TensorFlow frees a tensor when its last consumer has run), so a long chain over a
  large tensor holds a few of them at a time, not one per node.
* Dead tensors (`kernels.registry.DEAD`, on the port a Switch did not take): a node
  with a dead input is not computed, and everything downstream is dead until a
  Merge picks the live branch (`OpKernel.dead_inputs` says how each kernel treats
  them). A dead node's control edges make their targets dead too.
* Loops of control flow v1 (a graph with `Enter` nodes; other graphs never reach this
  code): a step runs as TensorFlow's executor does, each value tagged with a frame (one
  per execution of a loop, made by its `Enter`s) and an iteration. `NextIteration`
  feeds the next iteration's `Merge`, which runs on its first live input; at most
  `parallel_iterations` iterations of a frame are alive at once (further ones wait);
  `Exit` passes a live value to the parent frame, and a loop that only saw dead values
  (a loop on a branch not taken) passes DEAD out once it is done. A loop whose body
  sends to or receives from another task is refused when the graph is registered.
* The first failing node stops the step: the other nodes in flight are cancelled
  and the error names the node.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from distserver import errors
from distserver.kernels._common import warnings_off
from distserver.kernels.control_flow import SwitchKernel
from distserver.kernels.math import (
    DENSE_STACK_OP,
    FUSED_GRADIENT_OPS,
    FUSED_MATMUL_GRAD_OP,
    FUSED_MATMUL_OP,
    FUSED_NODES_ATTR,
    GRADIENT_INPUT,
    is_dense_gradient,
)
from distserver.kernels.regions import FUSED_REGION_OP, FusedRegionKernel
from distserver.kernels.registry import (
    CARRIES_DEADNESS,
    DEAD,
    SEES_DEAD_DATA,
    SKIP_WHEN_DEAD,
    FunctionFrame,
    KernelContext,
    OpKernel,
    compute_without_dereference,
    create_kernel,
)
from distserver.kernels.resources import ResourceManager
from distserver.kernels.sendrecv import RecvKernel, SendKernel
from distserver.protos.attr_value_pb2 import NameAttrList
from distserver.protos.debug_pb2 import DeviceStepStats
from distserver.protos.function_pb2 import FunctionDef
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.runtime.concurrency import first_error
from distserver.runtime.functions import (
    index_library,
    inline_functions,
    input_count,
    instantiate,
    output_count,
)
from distserver.runtime.fusion import reached_from
from distserver.runtime.names import parse_input
from distserver.runtime.rendezvous import StepRendezvous

# Kernels whose calls weigh at least this many bytes (`OpKernel.work_nbytes`: their
# inputs and `output_nbytes`) run in the thread pool. An element-wise kernel takes ~40
# us a MiB here, and a hop to the pool and back 50-100 us: below this a thread costs
# more than the kernel's work (a 256 KiB gather of an embedding step's gradient: 10 us
# inline, ~240 us through the pool).
OFFLOAD_BYTES = 1 << 20


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
    # (frame id, iteration) of the loop iteration a `_Send`/`_Recv` runs in, for its
    # rendezvous key (`runtime.control_loops`); None outside loops.
    frame_iter: tuple[int, int] | None = None

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
_RECEIVE = 4  # a `_Recv`: its value waited for as a future, without a task (`RecvKernel.receive`)


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
    # What the ready loop calls for an inline node: `kernel.compute`, without its
    # `VariableRef` check in a graph that cannot hold one (`compute_without_dereference`).
    compute: Callable[[KernelContext, list[Any]], list[Any]] | None = None
    may_output_dead: bool = False  # `kernel.may_output_dead`
    left_out: bool = False  # never runs: its consumers were connected to its inputs


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
        control_sources: list[list[int]] = [[] for _ in graph_def.node]  # per node: its control inputs
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
                    control_sources[i].append(src)
                else:
                    node.inputs.append((src, output))
                    self._nodes[src].num_reads += 1
                self._nodes[src].consumers.append(i)
                node.num_waits += 1
        _check_signatures(graph_def, self._nodes)
        has_refs = any(n.kernel.makes_refs for n in self._nodes)
        has_loops = any(n.kernel.op in ("Enter", "RefEnter") for n in self._nodes)
        self._loop_plan = _LoopPlan(self._nodes) if has_loops else None
        self._check_acyclic()
        if not has_refs and not has_loops:
            # (A reference variable's Identity reads the variable when it runs, and a
            # loop's values are tagged by frame: both keep every node.)
            _skip_unread_results(self._nodes, control_sources)
            _leave_out_pass_through(self._nodes, control_sources)
            _fuse_dense_gradients(self._nodes, control_sources)
            _stack_dense_layers(self._nodes, control_sources)
            _fuse_regions(self._nodes, control_sources)
        for node in self._nodes:
            node.mode = _mode_of(node)
            node.sources = tuple(src for src, _ in node.inputs)
            node.compute = node.kernel.compute if has_refs else compute_without_dereference(node.kernel)
            node.may_output_dead = node.kernel.may_output_dead
        self._roots = [n.index for n in self._nodes if n.num_waits == 0 and not n.left_out]
        self._functions = (
            FunctionLibraryRuntime(index_library(graph_def.library))
            if len(graph_def.library.function)
            else None
        )
        self._plan_fixed_nodes()
        # The `_Send`s to another task, and whether each node is one or one they need:
        # those go first (`_sending_to_peers`).
        self._peer_sends, self._to_peers = _sending_to_peers(self._nodes)
        # Where the ready queue starts, in its two queues: the nodes ready once the
        # fixed ones ran, or (a traced step) every node without inputs.
        self._starts = {fixed: self._first_queues(fixed) for fixed in (True, False)}
        self._straight = None if has_refs or has_loops else _plan_straight(self)

    def _first_queues(self, after_fixed: bool) -> tuple[list[int], list[int]]:
        """The first nodes of a step's ready queue, those another task waits for and
        the others (`_sending_to_peers`)."""
        first = self._ready_after_fixed if after_fixed else self._roots
        return [i for i in first if self._to_peers[i]], [i for i in first if not self._to_peers[i]]

    def _plan_fixed_nodes(self) -> None:
        """Where a step starts once the nodes with fixed outputs (`OpKernel.outputs_fixed`,
        no inputs) have run, they once per device, and the nodes `_fold_constants` computed
        from constants, once for good: no step runs them."""
        nodes = self._nodes
        self._fixed = [i for i in self._roots if nodes[i].kernel.outputs_fixed]
        self._start_outputs: dict[str, list[list[Any] | None]] = {}  # device -> `_outputs_at_start`
        # node -> its outputs (a graph with loops runs every node, see `_LoopStep`)
        self._folded = _fold_constants(nodes, self._fixed) if self._loop_plan is None else {}
        waits = [n.num_waits for n in nodes]
        unread = [n.num_reads for n in nodes]
        ready = [i for i in self._roots if not nodes[i].kernel.outputs_fixed]
        for i in [*self._fixed, *self._folded]:  # (the folded in the order they were computed)
            for src, _ in nodes[i].inputs:
                unread[src] -= 1
            for c in nodes[i].consumers:
                waits[c] -= 1
                if waits[c] == 0 and c not in self._folded:
                    ready.append(c)
        self._waits_after_fixed = waits
        self._ready_after_fixed = ready
        self._unread_after_fixed = unread

    async def _run_straight(
        self, straight: _Straight, ctx: StepContext, receives: dict[int, asyncio.Future[tuple[Any, bool]]]
    ) -> None:
        """A step as `straight`'s sequence: at once when every receive has arrived, else
        (a partition the planner marked, `_Straight.gated`) the nodes that need no
        receive but the feeds', then, once every receive is here, the others. A receive
        that fails fails the step at once, naming its node.

        A marked partition makes its other receives after its first span: a ps's first
        span sends a worker the variables it waits for (and lets the loop hand them to
        the worker's request, `_hand_over_sent_values`), and making the ps's own
        receives first (60 small gradients: ~90 us) held that back; its own requests
        wait for the worker's computation anyway."""
        outputs = self._outputs_at_start(ctx)
        start = 0
        try:
            if straight.gated:
                for i in straight.feeds:  # (arrived: see `_run`)
                    outputs[i] = [receives[i].result()[0]]
                await straight.run(ctx, outputs, 0, straight.gate)
                for i in straight.receives:
                    if i not in receives:
                        receives[i] = self._nodes[i].kernel.receive(ctx)  # type: ignore[attr-defined]
                await _wait_for_receives(list(receives.values()))
                start = straight.gate
            # (A failed receive first: the wait ends at it, before the others are done.)
            for i, future in receives.items():
                error = _receive_error(self._nodes[i], future) if future.done() else None
                if error is not None:
                    raise error
            for i, future in receives.items():
                value, is_dead = future.result()
                if is_dead:  # (the planner marks no step with a Switch)
                    name = self._nodes[i].kernel.name
                    raise errors.InternalError(
                        f"Node '{name}' received a dead value in a step planned without any"
                    )
                outputs[i] = [value]
        except BaseException:
            for future in receives.values():
                future.cancel()
            raise
        await straight.run(ctx, outputs, start, len(straight.program))

    def _outputs_at_start(self, ctx: StepContext) -> list[list[Any] | None]:
        """A step's outputs as it starts (a node's index -> its outputs): those of the
        fixed nodes (run once per device) and of the folded ones that a node of the
        step reads. Made once per device; each step gets a copy."""
        start = self._start_outputs.get(ctx.device)
        if start is None:
            start = [None] * len(self._nodes)
            unread = self._unread_after_fixed
            for i in self._fixed:
                values = _compute(self._nodes[i].kernel, ctx, [])
                if unread[i]:
                    start[i] = values
            for i, values in self._folded.items():
                if unread[i]:
                    start[i] = values
            self._start_outputs[ctx.device] = start
        return start.copy()

    def _check_acyclic(self) -> None:
        """Refuse a cycle, except through a loop's NextIteration (its edges go to the next
        iteration)."""
        waits = [n.num_waits for n in self._nodes]
        plan = self._loop_plan
        if plan is not None:
            for i, kind in enumerate(plan.kind):
                if kind == _NEXT_ITERATION:
                    for c in self._nodes[i].consumers:
                        waits[c] -= 1
        ready = deque(i for i, w in enumerate(waits) if w == 0)
        seen = 0
        while ready:
            i = ready.popleft()
            seen += 1
            if plan is not None and plan.kind[i] == _NEXT_ITERATION:
                continue
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
        numpy's floating-point warnings are off for the whole step (`warnings_off`),
        once, rather than around each kernel's arithmetic.
        """
        with warnings_off():
            await self._run(ctx, stats)

    async def _run(self, ctx: StepContext, stats: DeviceStepStats | None) -> None:
        if self._functions is not None and ctx.functions is None:
            ctx = dataclasses.replace(ctx, functions=self._functions)
        if self._loop_plan is not None:
            await _LoopStep(self, ctx, stats).run()
            return
        straight = self._straight
        # The receives of a step that may run straight, made when it starts (a step
        # that may not takes them over); of a marked partition, only its feeds' here,
        # the others once its first span has run (`_run_straight`).
        receives: dict[int, asyncio.Future[tuple[Any, bool]]] = {}
        if straight is not None and stats is None:
            first = straight.feeds if straight.gated else straight.receives
            receives = {i: self._nodes[i].kernel.receive(ctx) for i in first}  # type: ignore[attr-defined]
            if all(_arrived(receives[i]) for i in first):
                await self._run_straight(straight, ctx, receives)
                return
        nodes = self._nodes
        dead_control = [False] * len(nodes)  # a control input of the node is dead
        if self._fixed and stats is None:  # a traced step shows every node run
            # Outputs still to be taken by a consumer; a node's entry is dropped with its last read.
            unread = list(self._unread_after_fixed)
            waits = list(self._waits_after_fixed)
            first_urgent, first_ready = self._starts[True]
            outputs = self._outputs_at_start(ctx)
        else:
            outputs = [None] * len(nodes)
            unread = [n.num_reads for n in nodes]
            waits = [n.num_waits for n in nodes]
            first_urgent, first_ready = self._starts[False]
        # Two queues: the nodes another task waits for (`_sending_to_peers`), taken first,
        # and the others; each first in, first out.
        to_peers, peer_sends = self._to_peers, self._peer_sends
        urgent, ready = deque(first_urgent), deque(first_ready)
        sent_to_peer = False  # a `_Send` to another task ran since the last hand-over
        pool = ctx.pool
        wake = asyncio.Event()
        in_flight = 0
        # Whether a dead value exists in this step yet: until one does (most steps have no
        # conditional), no node pays for looking for them.
        saw_dead = False

        def finish_deadness(node: _Node, values: list[Any]) -> None:
            nonlocal saw_dead
            if values is _DEAD_OUTPUTS or any(v is DEAD for v in values):
                saw_dead = True
            dead = values is _DEAD_OUTPUTS or (values and all(v is DEAD for v in values))
            if dead:
                for c in node.control_consumers:
                    dead_control[c] = True

        def finish(i: int, values: list[Any]) -> None:
            if unread[i]:
                outputs[i] = values
            node = nodes[i]
            if saw_dead or node.may_output_dead:
                finish_deadness(node, values)
            for c in node.consumers:
                waits[c] -= 1
                if waits[c] == 0:
                    (urgent if to_peers[c] else ready).append(c)

        async def run_task(node: _Node, inputs: list[Any], offload: bool) -> None:
            nonlocal in_flight
            started = time.time_ns() if stats is not None else 0
            try:
                thread = None
                if offload:
                    loop = asyncio.get_running_loop()
                    values, thread = await loop.run_in_executor(
                        ctx.pool, _compute_in_thread, node.kernel, ctx, inputs
                    )
                else:
                    values = await _guard(node.kernel, node.kernel.compute_async(ctx, inputs))
                if stats is not None:
                    _record(stats, node.kernel, started, time.time_ns(), thread)
                finish(node.index, values)
            finally:
                in_flight -= 1
                wake.set()

        # Receives waited for without a task (`_RECEIVE`), and the first of them to fail.
        receiving: set[asyncio.Future[tuple[Any, bool]]] = set()
        failed: list[BaseException] = []

        def received(node: _Node, future: asyncio.Future[tuple[Any, bool]]) -> None:
            nonlocal in_flight
            in_flight -= 1
            wake.set()
            receiving.discard(future)
            error = _receive_error(node, future)
            if error is not None:
                failed.append(error)
                return
            value, is_dead = future.result()
            finish(node.index, [DEAD if is_dead else value])

        try:
            async with asyncio.TaskGroup() as group:
                while True:
                    while urgent or ready:
                        if urgent:
                            node = nodes[urgent.popleft()]
                        elif sent_to_peer:
                            sent_to_peer = False
                            await _hand_over_sent_values()
                            continue
                        else:
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
                        if mode == _RECEIVE and stats is None:
                            made = receives.pop(node.index, None)  # (the step made it when it started)
                            future = made or node.kernel.receive(ctx)  # type: ignore[attr-defined]
                            in_flight += 1
                            receiving.add(future)
                            future.add_done_callback(functools.partial(received, node))
                        elif mode in (_TASK, _RECEIVE):
                            in_flight += 1
                            group.create_task(run_task(node, inputs, offload=False))
                        elif pool is not None and (
                            mode == _THREAD or (mode == _BY_SIZE and _large(node.kernel, inputs))
                        ):
                            in_flight += 1
                            group.create_task(run_task(node, inputs, offload=True))
                        elif stats is not None:
                            started = time.time_ns()
                            values = _compute(node.kernel, ctx, inputs)
                            _record(stats, node.kernel, started, time.time_ns())
                            finish(node.index, values)
                        else:
                            try:
                                values = node.compute(ctx, inputs)  # type: ignore[misc]
                            except Exception as exc:
                                error = _node_error(node.kernel, exc)
                                if error is exc:
                                    raise
                                raise error from exc
                            # `finish`, written out: this is the path of most nodes.
                            i = node.index
                            if unread[i]:
                                outputs[i] = values
                            if saw_dead or node.may_output_dead:
                                finish_deadness(node, values)
                            for c in node.consumers:
                                left = waits[c] - 1
                                waits[c] = left
                                if not left:
                                    (urgent if to_peers[c] else ready).append(c)
                            if i in peer_sends:
                                sent_to_peer = True
                            del values
                        del inputs  # the kernel holds its inputs only while it runs
                    if in_flight == 0:
                        break
                    await wake.wait()
                    wake.clear()
                    if failed:
                        raise failed[0]
        except BaseExceptionGroup as group_error:
            raise first_error(group_error) from None
        finally:
            for future in [*receiving, *receives.values()]:
                future.cancel()


class _Entry(NamedTuple):
    """One node of a `_Straight` sequence."""

    node: _Node
    sources: tuple[tuple[int, int], ...]  # its inputs' (producer, output)
    last_reads: tuple[int, ...]  # the producers whose outputs it is the last to read
    read: bool  # whether its outputs are read at all
    sized: bool  # whether it may go to the pool (`_BY_SIZE`, `_THREAD`)
    in_thread: int  # what a run of nodes in a thread does with it (`_in_thread`)
    hands_over: bool  # whether it ends a run of nodes leading to a `_Send` to another task
    # For a node of more than two inputs, some of them outputs of fixed or folded nodes
    # (the same values every step on a device: variable handles, constants): its other
    # inputs as (place, producer, output), filled into a copy of a list that holds the
    # fixed ones (`_Straight.take`); else None.
    varying: tuple[tuple[int, int, int], ...] | None


# What a run of nodes in a thread (`_Straight._run_in_thread`) does with a node: run it;
# hand it to the event loop and go on (a `_Send` to another partition of this task: the
# loop sends the value at once, so its receiver waits no longer than it did); keep it for
# the loop to run once the thread is done (a fetch, a `_Send` to the client: read when
# the step ends; a `_Send` to another task, which the loop then hands over before any
# other node: stopping before it cost a hop back to the loop, the loop's answer to the
# peer, and a hop to a thread again before the next large node -- ~0.4 ms of a cluster
# `mlp` step's critical path -- and handing it over at once would wake the loop, which
# then takes the GIL and a CPU from the thread's next nodes); stop before it (another
# node bound to the loop, `OpKernel.loop_bound`: a stack, a tensor array).
_RUN, _TO_LOOP, _AFTER, _STOP = 0, 1, 2, 3


class _Straight:
    """A partition's step as one fixed sequence of nodes (`_plan_straight`), for the
    steps whose receives have all arrived when they start, and for those of a
    partition the planner marked (`gated`): the nodes before `gate` first, then,
    once every receive is here, the rest.

    Nodes run one after the other on the event loop. A node that goes to the pool
    (large) takes the nodes after it along, `_Send`s to this task handed back to the
    loop as they come and those to the client or another task kept until the thread
    is done, up to the first node that must run on the loop (`OpKernel.loop_bound`)
    or the end of the span: one hop to a thread and back for all of them, not one per
    large node (a hop costs ~0.1-0.3 ms on a busy 2-CPU machine; a one-task `mlp`
    step has six large nodes). A value for another task so leaves when the thread's
    run ends (a span ends before the step waits for its receives: see `gated`)."""

    def __init__(self, nodes: list[_Node], receives: list[int], program: list[_Entry], gate: int) -> None:
        self.nodes = nodes
        self.receives = receives  # the `_Recv` nodes, waiting for nothing but their values
        self.program = program
        # The receives of the client's feeds, which the master sends with RunGraph,
        # and `program[:gate]`: the nodes that need no other receive.
        self.feeds = [i for i in receives if nodes[i].kernel.client_terminated]  # type: ignore[attr-defined]
        self.gate = gate
        # Whether a step may run those, wait for every other receive, then run the
        # rest: the planner found that no receive of the partition waits, through
        # other tasks, for a node after the gate (`plan.mark_receives_first`). Else
        # only a step whose receives have all arrived when it starts runs the sequence.
        late = [i for i in receives if i not in self.feeds]
        self.gated = bool(late) and all(nodes[i].kernel.may_wait_first for i in late)  # type: ignore[attr-defined]
        # device -> {position: the inputs of `program[position]` with its varying ones
        # None} (`take`): the fixed values are a device's own.
        self._with_fixed: dict[str, dict[int, list[Any]]] = {}

    def take(self, ctx: StepContext, outputs: list[list[Any] | None], position: int) -> list[Any]:
        """The inputs of `program[position]`, a node of more than two inputs (`_take_inputs`;
        from a list that holds its fixed inputs when it has some: a grouped update's
        handles and hyperparameters are most of its inputs)."""
        entry = self.program[position]
        varying = entry.varying
        if varying is None:
            return _take_inputs(self.nodes, outputs, entry.node, entry.sources, entry.last_reads)
        try:
            templates = self._with_fixed.setdefault(ctx.device, {})
            template = templates.get(position)
            if template is None:  # (the first step on the device: every fixed output is there)
                template = [outputs[src][k] for src, k in entry.sources]  # type: ignore[index]
                for place, _, _ in varying:
                    template[place] = None
                templates[position] = template
            inputs = template.copy()
            for place, src, k in varying:
                inputs[place] = outputs[src][k]  # type: ignore[index]
        except IndexError:  # (`_take_inputs` raises the error naming both nodes)
            return _take_inputs(self.nodes, outputs, entry.node, entry.sources, entry.last_reads)
        for src in entry.last_reads:
            outputs[src] = None
        return inputs

    async def run(self, ctx: StepContext, outputs: list[list[Any] | None], start: int, end: int) -> None:
        """Run `program[start:end]`; `outputs` holds those of the nodes before `start`
        (the fixed and folded ones, the receives') the nodes read."""
        program = self.program
        pool = ctx.pool
        position = start
        while position < end:
            node, sources, last_reads, read, sized, _, hands_over, _ = program[position]
            # `_take_inputs`, for one or two inputs written out: that call, and the
            # comprehension (a frame of its own until Python 3.12), cost ~3% of a step
            # of small dense layers.
            try:
                if len(sources) == 1:
                    ((src, k),) = sources
                    inputs = [outputs[src][k]]  # type: ignore[index]
                elif len(sources) == 2:
                    (first, i), (second, j) = sources
                    inputs = [outputs[first][i], outputs[second][j]]  # type: ignore[index]
                else:
                    inputs = self.take(ctx, outputs, position)
                    last_reads = ()
            except IndexError:  # (`_take_inputs` raises the error naming both nodes)
                inputs = _take_inputs(self.nodes, outputs, node, sources, last_reads)
                last_reads = ()
            for src in last_reads:
                outputs[src] = None
            if sized and pool is not None and (node.mode == _THREAD or _large(node.kernel, inputs)):
                loop = asyncio.get_running_loop()
                stop = threading.Event()
                failed: list[Exception] = []  # by the nodes the thread handed to the loop
                # The thread takes the inputs out of `held`: nothing here (this frame, the
                # pool's work item) keeps them alive while later nodes run, or a variable
                # read here could not be updated in place there.
                held = [inputs]
                del inputs
                try:
                    position, kept = await loop.run_in_executor(
                        pool, self._run_in_thread, ctx, outputs, (position, end), held, (loop, stop, failed)
                    )
                except asyncio.CancelledError:
                    stop.set()  # the thread stops before its next node
                    raise
                if failed:  # (the loop ran them before it resumed this step: first in, first out)
                    raise failed[0]
                if _send_kept(kept, ctx):
                    await _hand_over_sent_values()
                continue
            values = _run_node(node, ctx, inputs)
            del inputs
            if read:
                outputs[node.index] = values
            del values
            position += 1
            if hands_over:
                await _hand_over_sent_values()

    def _run_in_thread(
        self,
        ctx: StepContext,
        outputs: list[list[Any] | None],
        span: tuple[int, int],
        held: list[list[Any]],
        back: tuple[asyncio.AbstractEventLoop, threading.Event, list[Exception]],
    ) -> tuple[int, list[tuple[_Node, list[Any]]]]:
        """Run the node at `span`'s start (its inputs taken, in `held`) and the next ones
        before its end that may run in a thread; return where the event loop goes on,
        and the nodes (with their inputs) it runs first (`_AFTER`). `back`: the loop,
        the event that stops this run (the step was cancelled), and where the nodes
        handed to the loop put their errors."""
        program = self.program
        position, end = span
        loop, stop, failed = back
        inputs = held.pop()
        kept: list[tuple[_Node, list[Any]]] = []
        with warnings_off():
            while True:
                entry = program[position]
                values = _run_node(entry.node, ctx, inputs)
                del inputs
                if entry.read:
                    outputs[entry.node.index] = values
                del values
                position += 1
                while position < end and program[position].in_thread in (_TO_LOOP, _AFTER):
                    node = program[position].node
                    inputs = self.take(ctx, outputs, position)
                    if program[position].in_thread == _AFTER:
                        kept.append((node, inputs))
                    else:
                        loop.call_soon_threadsafe(_run_on_loop, node, ctx, inputs, failed)
                    position += 1
                if position == end or program[position].in_thread == _STOP or stop.is_set():
                    return position, kept
                inputs = self.take(ctx, outputs, position)


def _send_kept(kept: list[tuple[_Node, list[Any]]], ctx: StepContext) -> bool:
    """Run the `_Send`s a run of nodes in a thread kept (`_AFTER`), in order, emptying
    `kept`; return whether one sent to another task."""
    to_peer = False
    for node, inputs in kept:
        _run_node(node, ctx, inputs)
        to_peer = to_peer or not node.kernel.client_terminated  # type: ignore[attr-defined]
    kept.clear()
    return to_peer


def _take_inputs(
    nodes: list[_Node],
    outputs: list[list[Any] | None],
    node: _Node,
    sources: tuple[tuple[int, int], ...],
    last_reads: tuple[int, ...],
) -> list[Any]:
    """`node`'s inputs from `outputs`, dropping the outputs it is the last to read.
    (`_Straight.run` takes one or two inputs itself, the case of most nodes.)"""
    try:
        inputs = [outputs[src][k] for src, k in sources]  # type: ignore[index]
    except IndexError:  # (`_output` raises the error naming both nodes)
        inputs = [_output(nodes, outputs, src, k, node) for src, k in sources]
    for src in last_reads:
        outputs[src] = None
    return inputs


def _run_on_loop(node: _Node, ctx: StepContext, inputs: list[Any], failed: list[Exception]) -> None:
    """A node without outputs that a run in a thread handed to the event loop."""
    try:
        _run_node(node, ctx, inputs)
    except Exception as exc:
        failed.append(exc)


def _run_node(node: _Node, ctx: StepContext, inputs: list[Any]) -> list[Any]:
    """`node.compute`, its errors naming the node (`_node_error`)."""
    try:
        return node.compute(ctx, inputs)  # type: ignore[misc]
    except Exception as exc:
        error = _node_error(node.kernel, exc)
        if error is exc:
            raise
        raise error from exc


def _plan_straight(executor: Executor) -> _Straight | None:
    """The partition's step as one sequence (`_Straight`), or None when the graph has
    a node that may wait for another (an asynchronous kernel: a queue, a function
    call) or make values dead (a Switch), or a `_Recv` that waits for other nodes:
    their steps need the ready queue (~1-2 us a node of bookkeeping, which the
    sequence saves). Nodes with nothing to compute (NoOp) are left out: in one
    sequence, they order nothing."""
    nodes = executor._nodes
    waits = list(executor._waits_after_fixed)
    to_peers = executor._to_peers  # (first, as in the ready queue)
    urgent, ready = (deque(first) for first in executor._starts[True])
    receives: list[int] = []
    order: list[int] = []
    # Nodes that need a receive other than a feed's (through data or control).
    after_receive: set[int] = set()
    while urgent or ready:
        i = urgent.popleft() if urgent else ready.popleft()
        node = nodes[i]
        late = node.mode == _RECEIVE and not node.kernel.client_terminated  # type: ignore[attr-defined]
        if node.mode == _RECEIVE:  # (its value may be dead: a step checks when it starts)
            receives.append(i)
        elif node.mode == _TASK or node.may_output_dead:
            return None
        elif node.kernel.op != "NoOp":
            order.append(i)
        for c in node.consumers:
            waits[c] -= 1
            if not waits[c]:
                (urgent if to_peers[c] else ready).append(c)
            if late or i in after_receive:
                after_receive.add(c)
    if any(nodes[i].num_waits for i in receives):
        return None
    # Those that need no such receive first (the order stays topological: they need
    # none of the others).
    first = [i for i in order if i not in after_receive]
    order = first + [i for i in order if i in after_receive]
    unread = list(executor._unread_after_fixed)
    fixed = {*executor._fixed, *executor._folded}
    program = []
    for position, i in enumerate(order):
        node = nodes[i]
        last_reads = []
        for src in node.sources:
            unread[src] -= 1
            if not unread[src]:
                last_reads.append(src)
        varying = tuple((place, src, k) for place, (src, k) in enumerate(node.inputs) if src not in fixed)
        program.append(
            _Entry(
                node,
                tuple(node.inputs),
                tuple(last_reads),
                bool(executor._unread_after_fixed[i]),
                node.mode in (_BY_SIZE, _THREAD) and not node.kernel.loop_bound,
                _in_thread(node.kernel, i in executor._peer_sends),
                to_peers[i] and position + 1 < len(order) and not to_peers[order[position + 1]],
                varying if len(node.inputs) > 2 and len(varying) < len(node.inputs) else None,
            )
        )
    return _Straight(nodes, receives, program, len(first))


def _sending_to_peers(nodes: list[_Node]) -> tuple[frozenset[int], list[bool]]:
    """The `_Send`s to another task (not to the client), and for each node whether it
    is one of them or one they need.

    Of the nodes ready, a step runs those first (each kind in the order they became
    ready): another task waits for what they send (an embedding's gathered rows on its
    ps, which would otherwise wait for the ps to deduplicate the ids for its own
    update). Then, before any other node, it lets the event loop hand the sent values
    to the requests waiting for them (`_hand_over_sent_values`)."""
    sends = frozenset(
        node.index
        for node in nodes
        if isinstance(node.kernel, SendKernel)
        and not node.kernel.client_terminated
        and node.kernel.key.dst_task != node.kernel.key.src_task
    )
    producers: dict[int, list[int]] = {}
    for node in nodes:
        for c in node.consumers:
            producers.setdefault(c, []).append(node.index)
    needed = sends | reached_from(sends, producers)
    return sends, [i in needed for i in range(len(nodes))]


async def _hand_over_sent_values() -> None:
    """Let the event loop give values just sent to the requests waiting for them: a
    request waiting on a value's slot, a RecvTensor or a batched RecvTensors
    (`batched_recv.answer`), resumes two loop turns after the `_Send` (the slot's
    callback, then the request's task), with every value sent in the same pass; a
    large value's copy into a grpc+verbs peer starts in a third, after the small
    answers (`TensorEndpoint._write`)."""
    for _ in range(3):
        await asyncio.sleep(0)


def _in_thread(kernel: OpKernel, to_peer: bool) -> int:
    """What a run of nodes in a thread does with a node of `kernel` (`_RUN`...);
    `to_peer`: the node is a `_Send` to another task."""
    if not kernel.loop_bound:
        return _RUN
    if not isinstance(kernel, SendKernel):
        return _STOP
    return _AFTER if kernel.client_terminated or to_peer else _TO_LOOP


async def _wait_for_receives(futures: list[asyncio.Future[tuple[Any, bool]]]) -> None:
    """Until every receive is done, or one has failed."""
    woken = asyncio.get_running_loop().create_future()
    left = len(futures)

    def done(future: asyncio.Future[tuple[Any, bool]]) -> None:
        nonlocal left
        left -= 1
        if not woken.done() and (not left or future.cancelled() or future.exception() is not None):
            woken.set_result(None)

    for future in futures:
        future.add_done_callback(done)
    try:
        await woken
    finally:
        for future in futures:
            future.remove_done_callback(done)


def _receive_error(node: _Node, future: asyncio.Future[tuple[Any, bool]]) -> BaseException | None:
    """What a step raises for a done receive that brought no value: its error naming the
    node, or a CancelledError when someone else cancelled it (the step cancels its
    receives only once it is over)."""
    if future.cancelled():
        return errors.CancelledError(f"The receive of node '{node.kernel.name}' was cancelled")
    error = future.exception()
    if isinstance(error, errors.OpError):
        return errors.with_node(error, node.kernel.name)
    return error


def _arrived(future: asyncio.Future[tuple[Any, bool]]) -> bool:
    """Whether a receive's live value is already here."""
    return future.done() and not future.cancelled() and future.exception() is None and not future.result()[1]


async def run_kernel(kernel: OpKernel, ctx: StepContext, inputs: list[Any]) -> list[Any]:
    """Run one kernel outside a graph (an eager op), where the executor would run it:
    inline, as a task for asynchronous kernels, or in `ctx.pool` when it is large."""
    if kernel.is_async:
        return await _guard(kernel, kernel.compute_async(ctx, inputs))
    in_a_thread = not kernel.runs_on_loop and (kernel.does_io or _large(kernel, inputs))
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


def _check_signatures(graph_def: GraphDef, nodes: list[_Node]) -> None:
    """Refuse a node whose data inputs do not fit its op's signature (`op_signatures`),
    as TensorFlow's graph import does: as many inputs as its attrs say, each an output
    its source makes. A master imported its graphs so; a graph another task registers
    is checked here. Ops the table does not list (distserver's own, `_Arg`, `_Recv`),
    and counts sized by an attr the NodeDef lacks (defaults stripped), are not checked.

    Raises:
        errors.InvalidArgumentError: naming the node, with TensorFlow's text for an
            output its source does not make.
    """
    outputs: dict[int, int | None] = {}
    for node_def, node in zip(graph_def.node, nodes, strict=True):
        expected = _count_if_sized(input_count, node_def)
        if expected is not None and expected != len(node.inputs):
            raise errors.InvalidArgumentError(
                f"Node '{node_def.name}' ({node_def.op}) takes {expected} inputs with its attrs, "
                f"got {len(node.inputs)}",
                node_name=node_def.name,
            )
        for src, output in node.inputs:
            if src not in outputs:
                outputs[src] = _count_if_sized(output_count, graph_def.node[src])
            made = outputs[src]
            if made is not None and output >= made:
                raise errors.InvalidArgumentError(
                    f"Node '{node_def.name}': Connecting to invalid output {output} of source node "
                    f"{graph_def.node[src].name} which has {made} outputs",
                    node_name=node_def.name,
                )


def _count_if_sized(count: Callable[[NodeDef], int | None], node_def: NodeDef) -> int | None:
    """`count(node_def)`, or None when an attr it needs is missing."""
    try:
        return count(node_def)
    except errors.InvalidArgumentError:
        return None


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


def _record(
    stats: DeviceStepStats, kernel: OpKernel, started_ns: int, ended_ns: int, thread: int | None = None
) -> None:
    """Add one node's run to `stats`, as TensorFlow's step stats describe it; `thread`:
    the thread that ran it, when not this one (a pool thread)."""
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
        thread_id=(threading.get_ident() if thread is None else thread) & 0xFFFFFFFF,
    )


# Ops whose outputs depend only on their inputs' values (no state, no device, no
# randomness): a node of one of them whose inputs are all constants is computed once,
# when its graph is registered (`_fold_constants`), as TensorFlow's Grappler folds
# constants (a gradient's `grad_ys` Fill, a mean's Tile and RealDiv, a partitioned
# lookup's index arithmetic).
_FOLDABLE_OPS = frozenset(
    {
        "Add", "AddV2", "BroadcastGradientArgs", "Cast", "ConcatV2", "ExpandDims", "Fill",
        "FloorDiv", "FloorMod", "Maximum", "Minimum", "Mul", "Neg", "Pack", "Prod", "Range",
        "RealDiv", "Reshape", "Shape", "Size", "Squeeze", "StridedSlice", "Sub", "Sum", "Tile",
    }
)  # fmt: skip
# A folded node's outputs are kept for the graph's lifetime: only small ones are.
FOLD_LIMIT_BYTES = 64 * 1024


def _fold_constants(nodes: list[_Node], fixed: list[int]) -> dict[int, list[Any]]:
    """Node -> its outputs, for the nodes of `_FOLDABLE_OPS` computed from `Const`
    nodes alone (or from nodes folded so), in the order they were computed. Kept
    in the step: a node with control inputs (what it waits for may make it dead), one
    whose kernel fails (the step reports that, as before), one with outputs over
    `FOLD_LIMIT_BYTES`."""
    constants = {i for i in fixed if nodes[i].kernel.op == "Const"}
    values: dict[int, list[Any]] = {}  # of the constants and nodes folded so far
    folded: dict[int, list[Any]] = {}
    order = deque(c for i in constants for c in nodes[i].consumers)
    while order:
        c = order.popleft()
        node = nodes[c]
        if c in values or node.kernel.op not in _FOLDABLE_OPS:
            continue
        if node.num_waits != len(node.inputs):
            continue  # control inputs
        if not all(src in values or src in constants for src, _ in node.inputs):
            continue  # inputs not (yet) known
        for src, _ in node.inputs:
            if src not in values:
                values[src] = nodes[src].kernel.compute(None, [])  # type: ignore[arg-type]
        try:
            with warnings_off():
                outputs = node.kernel.compute(None, [values[src][k] for src, k in node.inputs])  # type: ignore[arg-type]
        except Exception:  # the step runs the node and reports its error
            continue
        if sum(v.nbytes for v in outputs if isinstance(v, np.ndarray)) > FOLD_LIMIT_BYTES:
            continue
        values[c] = folded[c] = outputs
        order.extend(node.consumers)
    return folded


# Pure kernels `_skip_unread_results` still runs (Grappler's list): a placeholder fails
# a step it is not fed in, a check fails on a bad value, and a function's arguments and
# results are its interface.
_ALWAYS_COMPUTED = frozenset({"Placeholder", "PlaceholderWithDefault", "CheckNumerics", "_Arg", "_Retval"})


def _skip_unread_results(nodes: list[_Node], control_sources: list[list[int]]) -> None:
    """Turn a node of a pure kernel whose outputs nobody reads, only waits for through
    control edges, into a NoOp over the same inputs (as control inputs), as
    TensorFlow's Grappler does before a step (its dependency optimizer): the gradient
    of a layer's input, computed by `tf.gradients` and only waited for by the
    gradient's `tuple` group, is a full matrix product a step (a third of `mlp`'s).

    Its consumers still wait for everything it waited for, with the same deadness (a
    dead input, data or control, makes the NoOp dead too; every producer but a Switch
    has outputs all dead or all live, so a control edge from it is as dead as a data
    edge). A node with no consumers at all is kept (it is what the step was asked to
    run); so is every kernel with side effects or deadness rules of its own. A
    converted node's inputs may in turn be read by nobody: they are looked at again."""
    order = deque(range(len(nodes)))
    while order:
        i = order.popleft()
        node = nodes[i]
        kernel = node.kernel
        if node.num_reads or not node.control_consumers or not _pure(kernel):
            continue
        if any(isinstance(nodes[src].kernel, SwitchKernel) for src, _ in node.inputs):
            # A control edge from a Switch is dead only when both its ports are: it
            # would not carry the deadness of the one port the node reads.
            continue
        for src, _ in node.inputs:
            nodes[src].num_reads -= 1
            nodes[src].control_consumers.append(i)
            control_sources[i].append(src)
            order.append(src)
        node.inputs = []
        node.sizes_its_output = False
        node.kernel = _shared_or_new_kernel(
            NodeDef(name=kernel.name, op="NoOp", device=kernel.node.device), None
        )


def _pure(kernel: OpKernel) -> bool:
    """Whether a node of `kernel` may be left uncomputed when nobody reads its outputs."""
    return not (
        kernel.is_stateful
        or kernel.is_async
        or kernel.does_io
        or kernel.makes_refs
        or kernel.passes_through  # (Identity and NoOp: `_leave_out_pass_through`)
        or kernel.outputs_fixed  # (computed once per device anyway)
        or kernel.may_output_dead
        or kernel.dead_inputs != SKIP_WHEN_DEAD
        or kernel.ref_inputs
        or kernel.op in _ALWAYS_COMPUTED
    )


def _leave_out_pass_through(nodes: list[_Node], control_sources: list[list[int]]) -> None:
    """Leave out the nodes that only pass a value on or only order others
    (`OpKernel.passes_through`: Identity, NoOp), as TensorFlow's Grappler removes them
    before a step: a third of the nodes of a training step (a gradient's
    `tuple/control_dependency` Identity, its `group_deps` NoOp, the train op).

    Each consumer takes the value from the node's own input and waits for the node's
    control inputs itself, so every node still runs after everything it waited for,
    and with the same deadness: a consumer is dead when the left-out node would have
    been (a dead data or control input of the node is now one of its own). Kept:
    a node feeding a Merge (which tells a dead data input from a live one whatever its
    control inputs), an Identity of an input that may be dead alone (a Switch port:
    a control edge from the Switch itself would not carry that deadness), a malformed
    node (it fails the step as it should), and a node whose consumers would gain more
    edges than its own (a NoOp joining many producers to many consumers).
    """
    waits = [n.num_waits for n in nodes]
    order = deque(n.index for n in nodes if n.num_waits == 0)
    while order:
        i = order.popleft()
        node = nodes[i]
        for c in node.consumers:
            waits[c] -= 1
            if not waits[c]:
                order.append(c)
        if node.kernel.passes_through and _may_leave_out(nodes, node, control_sources[i]):
            _leave_out(nodes, node, control_sources)


def _may_leave_out(nodes: list[_Node], node: _Node, controls: list[int]) -> bool:
    expected_inputs = 1 if node.kernel.op != "NoOp" else 0
    if len(node.inputs) != expected_inputs:
        return False
    if node.inputs:
        src, _ = node.inputs[0]
        if nodes[src].kernel.may_output_dead:
            return False
    data_edges = 0
    for c in set(node.consumers):
        consumer = nodes[c]
        if consumer.kernel.dead_inputs == SEES_DEAD_DATA:
            return False
        for src, k in consumer.inputs:
            if src == node.index:
                if k != 0 or not node.inputs:  # an output the node does not have
                    return False
                data_edges += 1
    control_edges = len(node.control_consumers)
    added = data_edges * len(controls) + control_edges * (len(controls) + len(node.inputs))
    return added <= len(node.inputs) + len(controls) + len(node.consumers)


def _leave_out(nodes: list[_Node], node: _Node, control_sources: list[list[int]]) -> None:
    i = node.index
    controls = control_sources[i]

    def add_control_edge(src: int, c: int) -> None:
        nodes[src].consumers.append(c)
        nodes[src].control_consumers.append(c)
        control_sources[c].append(src)
        nodes[c].num_waits += 1

    for src, _ in node.inputs:
        nodes[src].consumers.remove(i)
        nodes[src].num_reads -= 1
    for g in controls:
        nodes[g].consumers.remove(i)
        nodes[g].control_consumers.remove(i)
    for c in node.control_consumers:
        control_sources[c].remove(i)
        nodes[c].num_waits -= 1
        for src, _ in node.inputs:
            add_control_edge(src, c)
        for g in controls:
            add_control_edge(g, c)
    for c in set(node.consumers):
        consumer = nodes[c]
        for slot, (src, _) in enumerate(consumer.inputs):
            if src == i:
                source = node.inputs[0]
                consumer.inputs[slot] = source
                nodes[source[0]].consumers.append(c)
                nodes[source[0]].num_reads += 1
                for g in controls:
                    add_control_edge(g, c)
    node.inputs, node.consumers, node.control_consumers = [], [], []
    node.num_waits = node.num_reads = 0
    control_sources[i] = []
    node.left_out = True


def _fuse_dense_gradients(nodes: list[_Node], control_sources: list[list[int]]) -> None:
    """Run the backward pass of each dense layer as one node (`FUSED_MATMUL_GRAD_OP`,
    `kernels.math.FusedMatMulGradKernel`), as TensorFlow's remapper fuses chains of
    small kernels: a one-task step of 30 small layers runs 150 such nodes, each costing
    the executor and its kernel's checks a few microseconds over numpy's own call.

    TensorFlow's gradient of `activation(h @ w + bias)` is, once the pass-through
    nodes are left out: the activation's gradient g (`TanhGrad`, ...), `Sum` and
    `Reshape` of g for the bias, `MatMul(h, g)` for the weights and, but for a first
    layer, `MatMul(g, w)` for the layer's input. They are fused when nothing else reads
    g or the `Sum` (control edges may wait for them), all share a float dtype, and
    every other input of the parts (h, w, the axes, the shape, control inputs) comes
    before g in a topological order of the graph: the fused node, put in g's place in
    that order, keeps it topological, so the graph stays acyclic. The fused node takes
    the `Reshape`'s slot and name (output 0); the products are its outputs 1 and 2;
    whatever waited for a part waits for it.

    Not in a graph with a node that makes values dead (a Switch): a dead input of one
    part would make every output dead. (A value received from another task is dead
    only under a condition there, which makes the parts' other inputs dead with it.)
    """
    if any(n.kernel.may_output_dead and not isinstance(n.kernel, RecvKernel) for n in nodes):
        return
    position = _topological_positions(nodes)
    for g in nodes:
        if g.left_out or g.kernel.op not in FUSED_GRADIENT_OPS:
            continue
        parts = _dense_gradient_parts(nodes, g)
        if parts is None:
            continue
        inner = {part.index for part in parts}
        sources = [src for part in parts[1:] for src, _ in part.inputs]
        sources += [src for part in parts for src in control_sources[part.index]]
        if all(src in inner or position[src] < position[g.index] for src in sources):
            _fuse_parts(nodes, control_sources, parts)
            position[parts[2].index] = position[g.index]


def _topological_positions(nodes: list[_Node]) -> list[tuple[int, int]]:
    """Each node's place in a topological order: (its depth, its index), the depth one
    more than its deepest producer's (data or control)."""
    depth = [0] * len(nodes)
    waits = [n.num_waits for n in nodes]
    ready = deque(n.index for n in nodes if not n.num_waits)
    while ready:
        i = ready.popleft()
        for c in nodes[i].consumers:
            depth[c] = max(depth[c], depth[i] + 1)
            waits[c] -= 1
            if not waits[c]:
                ready.append(c)
    return [(d, i) for i, d in enumerate(depth)]


def _dense_gradient_parts(nodes: list[_Node], g: _Node) -> list[_Node] | None:
    """[g, Sum, Reshape, the weights' MatMul(, the input's MatMul)] when those alone
    read g's value (see `_fuse_dense_gradients`), else None."""
    readers = [
        nodes[c] for c in dict.fromkeys(g.consumers) if any(src == g.index for src, _ in nodes[c].inputs)
    ]
    sums = [node for node in readers if node.kernel.op == "Sum"]
    if len(sums) != 1 or sums[0].num_reads != 1:
        return None
    (sum_,) = sums
    reshapes = [nodes[c] for c in dict.fromkeys(sum_.consumers) if nodes[c].inputs[:1] == [(sum_.index, 0)]]
    weights = [node for node in readers if node.inputs[1:] == [(g.index, 0)]]
    layer_input = [node for node in readers if node.inputs[:1] == [(g.index, 0)] and node is not sum_]
    if len(reshapes) != 1 or len(weights) != 1 or len(layer_input) > 1:
        return None
    parts = [g, sum_, reshapes[0], *weights, *layer_input]
    if (
        g.num_reads != len(readers)  # (each reads it once: `is_dense_gradient` checks)
        or len(parts) != len(readers) + 2
        or any(_reads_beyond_output_0(nodes, part) for part in parts[2:])
    ):
        return None
    wired = [_wired(nodes, part) for part in parts]
    return parts if is_dense_gradient(wired, _type_attr(g.kernel.node)) else None


def _reads_beyond_output_0(nodes: list[_Node], node: _Node) -> bool:
    """Whether a node reads an output of `node` other than its first (malformed: the
    unfused node reports it)."""
    return any(src == node.index and k for c in node.consumers for src, k in nodes[c].inputs)


def _type_attr(node_def: NodeDef) -> int:
    return node_def.attr["T"].type if "T" in node_def.attr else 0


def _wired(nodes: list[_Node], node: _Node) -> NodeDef:
    """A copy of `node`'s NodeDef whose inputs name its producers as wired now (the
    pass-through nodes left out), without control inputs."""
    wired = NodeDef()
    wired.CopyFrom(node.kernel.node)
    del wired.input[:]
    for src, k in node.inputs:
        name = nodes[src].kernel.name
        wired.input.append(f"{name}:{k}" if k else name)
    return wired


def _fuse_parts(nodes: list[_Node], control_sources: list[list[int]], parts: list[_Node]) -> None:
    """Make `parts` (`_dense_gradient_parts`) one node in the `Reshape`'s slot."""
    g, sum_, reshape, weights, *rest = parts
    inputs = [*g.inputs, sum_.inputs[1], reshape.inputs[1], weights.inputs[0], *(p.inputs[1] for p in rest)]
    output_of = {(part.index, 0): k for k, part in enumerate([reshape, weights, *rest])}
    node_def = NodeDef(name=reshape.kernel.name, op=FUSED_MATMUL_GRAD_OP, device=g.kernel.node.device)
    node_def.attr["T"].CopyFrom(g.kernel.node.attr["T"])
    node_def.attr["N"].i = len(rest)
    node_def.attr[FUSED_NODES_ATTR].list.s.extend(_wired(nodes, part).SerializeToString() for part in parts)
    _merge(nodes, control_sources, parts, reshape, inputs, output_of, node_def)


def _merge(
    nodes: list[_Node],
    control_sources: list[list[int]],
    parts: list[_Node],
    slot: _Node,
    inputs: list[tuple[int, int]],
    output_of: dict[tuple[int, int], int],
    node_def: NodeDef,
    kernel: OpKernel | None = None,
) -> None:
    """Make `parts` one node computing `node_def`, in the place of `slot` (one of them):
    it reads `inputs` (outputs of other nodes), a reader of output k of a part reads its
    output `output_of[(part, k)]`, and it waits for what the parts waited for (control
    edges) and is waited for by what waited for them. `kernel`: `node_def`'s, when the
    caller built it (else built here)."""
    inner = {part.index for part in parts}
    controls = list(dict.fromkeys(src for p in parts for src in control_sources[p.index] if src not in inner))
    readers: list[int] = []  # one entry per data edge out
    waiting: list[int] = []  # the nodes waiting for a part through control edges
    for part in parts:
        for src, _ in part.inputs:
            nodes[src].consumers.remove(part.index)
            nodes[src].num_reads -= 1
        for src in control_sources[part.index]:
            nodes[src].consumers.remove(part.index)
            nodes[src].control_consumers.remove(part.index)
        for c in part.control_consumers:
            if c not in inner:
                control_sources[c].remove(part.index)
                nodes[c].num_waits -= 1
                waiting.append(c)
    # Each reader's inputs rewired once (`slot` is one of the parts).
    for c in dict.fromkeys(c for part in parts for c in part.consumers if c not in inner):
        consumer = nodes[c]
        for position, (src, k) in enumerate(consumer.inputs):
            if src in inner:
                consumer.inputs[position] = (slot.index, output_of[(src, k)])
                readers.append(c)
    for part in parts:
        part.inputs, part.consumers, part.control_consumers = [], [], []
        part.num_waits = part.num_reads = 0
        control_sources[part.index] = []
        part.left_out = True
    merged = slot
    merged.left_out = False
    merged.kernel = _shared_or_new_kernel(node_def, None) if kernel is None else kernel
    merged.sizes_its_output = True
    merged.inputs = inputs
    for src, _ in inputs:
        nodes[src].consumers.append(merged.index)
        nodes[src].num_reads += 1
    for src in controls:
        nodes[src].consumers.append(merged.index)
        nodes[src].control_consumers.append(merged.index)
    control_sources[merged.index] = controls
    merged.num_waits = len(inputs) + len(controls)
    merged.num_reads = len(readers)
    waiting = list(dict.fromkeys(waiting))
    for c in waiting:
        control_sources[c].append(merged.index)
        nodes[c].num_waits += 1
    merged.consumers = readers + waiting
    merged.control_consumers = waiting


def _stack_dense_layers(nodes: list[_Node], control_sources: list[list[int]]) -> None:
    """Run each chain of fused dense layers (`FUSED_MATMUL_OP`, each reading the one
    before's output) and each chain of their fused gradients (`FUSED_MATMUL_GRAD_OP`,
    each reading the one before's layer-input gradient, which nothing else reads) as
    one node (`DENSE_STACK_OP`, `kernels.math.DenseStackKernel`): a one-task step of 30
    small layers runs 60 such nodes, and the executor's work around each (taking its
    inputs, weighing it for the pool, the loop) costs ~1 us.

    A chain joins nodes of one device and dtype whose layers do not transpose their
    input. Every other input of its members (weights, biases, activations, control
    inputs) must come before its first member in a topological order of the graph, so
    the graph stays acyclic with the stack in its last member's place. A member whose
    value another task waits for (read by a `_Send` to it) is left out: the stack would
    hold the value back until its last member has run. Not in a graph with a node that
    makes values dead (a Switch), as for `_fuse_dense_gradients`.
    """
    if any(n.kernel.may_output_dead and not isinstance(n.kernel, RecvKernel) for n in nodes):
        return
    position = _topological_positions(nodes)
    to_peers = {
        src
        for n in nodes
        if isinstance(n.kernel, SendKernel)
        and not n.kernel.client_terminated
        and n.kernel.key.dst_task != n.kernel.key.src_task
        for src, _ in n.inputs
    }
    for op, passed in ((FUSED_MATMUL_OP, 0), (FUSED_MATMUL_GRAD_OP, 2)):
        following = _chain_links(nodes, op, passed, to_peers)
        for first in sorted(set(following) - set(following.values())):
            chain = [nodes[first]]
            while chain[-1].index in following:
                chain.append(nodes[following[chain[-1].index]])
            while len(chain) >= 2:
                run = _stackable_run(chain, control_sources, position)
                if len(run) >= 2:
                    _merge_stack(nodes, control_sources, run)
                    # A stack's place: its first member's. Every edge then still goes up
                    # the order (an edge in comes before the first member, one out leaves
                    # a member), so later runs are checked against the graph as it is.
                    position[run[-1].index] = position[run[0].index]
                chain = chain[len(run) :]


def _taken(node: _Node) -> int:
    """The input of a stacked node that the one before it in the chain gives it."""
    kernel = node.kernel
    return GRADIENT_INPUT[kernel.gradient.op] if kernel.op == FUSED_MATMUL_GRAD_OP else 0  # type: ignore[attr-defined]


def _chain_links(nodes: list[_Node], op: str, passed: int, to_peers: set[int]) -> dict[int, int]:
    """Each node of `op` that may be stacked -> the one that takes its output `passed`
    as the next in a chain (see `_stack_dense_layers`)."""

    def member(node: _Node) -> bool:
        return (
            not node.left_out
            and node.kernel.op == op
            and node.index not in to_peers
            and not getattr(node.kernel, "transpose_a", False)
        )

    following: dict[int, int] = {}
    for node in nodes:
        if not member(node):
            continue
        takers = [
            (nodes[c], slot)
            for c in dict.fromkeys(node.consumers)
            for slot, (src, k) in enumerate(nodes[c].inputs)
            if src == node.index and k == passed
        ]
        chained = [c for c, slot in takers if member(c) and slot == _taken(c)]
        # A layer's output may have other readers (its gradients); a gradient's passed
        # value may not (the stack does not return it).
        if len(chained) != 1 or (op == FUSED_MATMUL_GRAD_OP and len(takers) != 1):
            continue
        (nxt,) = chained
        if nxt.kernel.node.device == node.kernel.node.device and _type_attr(nxt.kernel.node) == _type_attr(
            node.kernel.node
        ):
            following[node.index] = nxt.index
    return following


def _stackable_run(
    chain: list[_Node], control_sources: list[list[int]], position: list[tuple[int, int]]
) -> list[_Node]:
    """The longest start of `chain` whose members' other inputs come before its first
    member: data inputs but the passed value, and control inputs but from members."""
    first = position[chain[0].index]
    run = [chain[0]]
    members = {chain[0].index}
    for node in chain[1:]:
        sources = [src for slot, (src, _) in enumerate(node.inputs) if slot != _taken(node)]
        sources += [src for src in control_sources[node.index] if src not in members]
        if not all(position[src] < first for src in sources):
            break
        run.append(node)
        members.add(node.index)
    return run


def _merge_stack(nodes: list[_Node], control_sources: list[list[int]], run: list[_Node]) -> None:
    """Make `run` (`_stackable_run`) one `DENSE_STACK_OP` node in its last member's place."""
    last = run[-1]
    forward = last.kernel.op == FUSED_MATMUL_OP
    inputs = list(run[0].inputs)
    for node in run[1:]:
        inputs += [edge for slot, edge in enumerate(node.inputs) if slot != _taken(node)]
    output_of: dict[tuple[int, int], int] = {}
    for node in run:
        for k in (0,) if forward else (0, 1):
            output_of[(node.index, k)] = len(output_of)
    if not forward and last.kernel.attr_int("N"):
        output_of[(last.index, 2)] = len(output_of)
    node_def = NodeDef(name=last.kernel.name, op=DENSE_STACK_OP, device=last.kernel.node.device)
    node_def.attr["T"].CopyFrom(last.kernel.node.attr["T"])
    node_def.attr["N"].i = len(inputs)
    node_def.attr["M"].i = len(output_of)
    node_def.attr[FUSED_NODES_ATTR].list.s.extend(node.kernel.node.SerializeToString() for node in run)
    _merge(nodes, control_sources, run, last, inputs, output_of, node_def)


# A connected group of fusable nodes is made one node from this many on: two cost
# about what one node and its parts' loop do.
REGION_MIN_NODES = 3


def _fuse_regions(nodes: list[_Node], control_sources: list[list[int]]) -> None:
    """Make each connected group of `OpKernel.fusable` nodes of one device a node of
    `FUSED_REGION_OP` (`kernels.regions.FusedRegionKernel`), which runs them one
    after the other: a one-task `embedding` step's 83 nodes become 49, each left out costing
    the executor ~1-2 us.

    Nodes join groups in a topological order: a node joins the group of one of its
    producers unless another of its producers, outside that group, comes after a
    member of it (the group would then wait for itself). A group holds back every
    value it makes until all of its inputs are there: a `_Send` to another partition
    downstream of a member then waits for every `_Recv` from another partition
    upstream of any member. A node joins only where that adds no wait: each such send
    already waited for those receives (the other side might need the value sent to
    make one awaited). Left alone: nodes `_fold_constants` may compute once (from
    constants alone), and every node of a graph that may see dead values: one with a
    node that makes them (a Switch), or a `_Recv` from another partition that may
    bring one (a dead input would make the whole group dead, not only the parts it
    reaches). The client's feeds are never dead, nor are the receives the master's
    planner marked (`RecvKernel.may_wait_first`: a step without a Switch anywhere).
    """
    for node in nodes:
        kernel = node.kernel
        if kernel.may_output_dead and not (
            isinstance(kernel, RecvKernel) and (kernel.client_terminated or kernel.may_wait_first)
        ):
            return
    producers = [[src for src, _ in n.inputs] + control_sources[n.index] for n in nodes]
    positions = _topological_positions(nodes)
    order = sorted(range(len(nodes)), key=positions.__getitem__)
    # Per node: the receives from other partitions upstream of it (a bit each), and
    # those that every send to another partition downstream of it waits for (-1: every
    # receive, when it feeds none).
    receives = [n.index for n in nodes if isinstance(n.kernel, RecvKernel) and not n.kernel.client_terminated]
    waits = [0] * len(nodes)
    for k, i in enumerate(receives):
        waits[i] = 1 << k
    for i in order:
        for src in producers[i]:
            waits[i] |= waits[src]
    allowed = [-1] * len(nodes)
    for i in reversed(order):
        kernel = nodes[i].kernel
        if isinstance(kernel, SendKernel) and not kernel.client_terminated:
            allowed[i] = waits[i]
        for c in nodes[i].consumers:
            allowed[i] &= allowed[c]
    constant = _computed_from_constants(nodes)
    region_of: list[int | None] = [None] * len(nodes)
    # For each node, the regions with a member upstream of it (bit r for region r).
    upstream = [0] * len(nodes)
    regions: list[list[_Node]] = []
    region_waits: list[int] = []  # per region: its members' `waits`, or-ed
    region_allows: list[int] = []  # and their `allowed`, and-ed
    for i in order:
        node = nodes[i]
        for src in producers[i]:
            region = region_of[src]
            upstream[i] |= upstream[src] if region is None else upstream[src] | 1 << region
        kernel = node.kernel
        if node.left_out or not kernel.fusable or i in constant or _reads_beyond_output_0(nodes, node):
            continue
        joined = None
        for src, _ in node.inputs:
            r = region_of[src]
            if (
                r is not None
                and regions[r][0].kernel.node.device == kernel.node.device
                and not (region_waits[r] | waits[i]) & ~(region_allows[r] & allowed[i])
                and all(region_of[s] == r or not upstream[s] >> r & 1 for s in producers[i])
            ):
                joined = r
                break
        if joined is None:
            joined = len(regions)
            regions.append([])
            region_waits.append(0)
            region_allows.append(-1)
        region_of[i] = joined
        regions[joined].append(node)
        region_waits[joined] |= waits[i]
        region_allows[joined] &= allowed[i]
    for members in regions:
        if len(members) >= REGION_MIN_NODES:
            _merge_region(nodes, control_sources, members)


def _computed_from_constants(nodes: list[_Node]) -> set[int]:
    """The nodes `_fold_constants` may compute once: of `_FOLDABLE_OPS`, without control
    inputs, reading `Const` nodes (without control inputs) or nodes computed so."""
    known = {n.index for n in nodes if n.kernel.op == "Const" and not n.num_waits and not n.left_out}
    order = deque(c for i in known for c in nodes[i].consumers)
    computed: set[int] = set()
    while order:
        node = nodes[order.popleft()]
        if (
            node.index in known
            or node.kernel.op not in _FOLDABLE_OPS
            or node.num_waits != len(node.inputs)
            or not all(src in known for src, _ in node.inputs)
        ):
            continue
        known.add(node.index)
        computed.add(node.index)
        order.extend(node.consumers)
    return computed


def _merge_region(nodes: list[_Node], control_sources: list[list[int]], members: list[_Node]) -> None:
    """Make `members` (`_fuse_regions`, in a topological order) one `FUSED_REGION_OP`
    node in its last member's place, with that member's name."""
    inner = {part.index: p for p, part in enumerate(members)}
    inputs: list[tuple[int, int]] = []
    place: dict[tuple[int, int], int] = {}
    wiring: list[int] = []
    for part in members:
        for edge in part.inputs:
            if edge[0] in inner:
                wiring.append(-1 - inner[edge[0]])
                continue
            if edge not in place:
                place[edge] = len(inputs)
                inputs.append(edge)
            wiring.append(place[edge])
    read_outside = [
        part
        for part in members
        if any(src == part.index for c in part.consumers if c not in inner for src, _ in nodes[c].inputs)
    ]
    last = members[-1]
    node_def = NodeDef(name=last.kernel.name, op=FUSED_REGION_OP, device=last.kernel.node.device)
    node_def.attr["N"].i = len(inputs)
    node_def.attr["wiring"].list.i.extend(wiring)
    node_def.attr["outputs"].list.i.extend(inner[part.index] for part in read_outside)
    node_def.attr["M"].i = len(read_outside)
    node_def.attr[FUSED_NODES_ATTR].list.s.extend(_wired(nodes, part).SerializeToString() for part in members)
    output_of = {(part.index, 0): k for k, part in enumerate(read_outside)}
    # (with the parts' kernels built already: rebuilding them doubled a graph's build)
    kernel = FusedRegionKernel(node_def, [part.kernel for part in members])
    _merge(nodes, control_sources, members, last, inputs, output_of, node_def, kernel)


def _mode_of(node: _Node) -> int:
    """How `node` runs (see `_INLINE`...): fixed by its kernel and its graph."""
    kernel = node.kernel
    if isinstance(kernel, RecvKernel):
        return _RECEIVE
    if kernel.is_async:
        return _TASK
    if kernel.runs_on_loop:
        return _INLINE
    if kernel.does_io:
        return _THREAD
    if node.inputs or node.sizes_its_output:
        return _BY_SIZE
    return _INLINE  # no inputs and no output estimate: nothing can make it large


def _large(kernel: OpKernel, inputs: list[Any]) -> bool:
    """Whether the kernel's work is large enough for a thread (`OpKernel.work_nbytes`)."""
    return kernel.work_nbytes(inputs) >= (kernel.offload_bytes or OFFLOAD_BYTES)


def _compute_in_thread(kernel: OpKernel, ctx: KernelContext, inputs: list[Any]) -> tuple[list[Any], int]:
    """`_compute` in a pool thread, and that thread (for step stats)."""
    return _compute(kernel, ctx, inputs), threading.get_ident()


def _compute(kernel: OpKernel, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
    try:
        return kernel.compute(ctx, inputs)
    except Exception as exc:
        error = _node_error(kernel, exc)
        if error is exc:
            raise
        raise error from exc


def _node_error(kernel: OpKernel, exc: Exception) -> Exception:
    """What the step raises for `exc` from `kernel`: an OpError naming the node, or
    `exc` itself when it is not an error of the node's data (a bug, a cancellation)."""
    if isinstance(exc, errors.OpError):
        return errors.with_node(exc, kernel.name)
    if isinstance(exc, MemoryError):
        return errors.with_node(
            errors.ResourceExhaustedError(f"{kernel.op} ran out of memory: {exc}"), kernel.name
        )
    if isinstance(exc, (ValueError, TypeError, ArithmeticError, IndexError)):
        return errors.with_node(errors.InvalidArgumentError(f"{kernel.op} failed: {exc}"), kernel.name)
    return exc


async def _guard(kernel: OpKernel, coro: Any) -> list[Any]:
    try:
        result: list[Any] = await coro
        return result
    except errors.OpError as exc:
        raise errors.with_node(exc, kernel.name) from exc


# -- Loops of control flow v1: frames and iterations ------------------------------------

# `_LoopPlan.kind` values.
_PLAIN = 0
_MERGE = 1
_ENTER = 2
_EXIT = 3
_NEXT_ITERATION = 4
_KIND_OF_OP = {
    "Merge": _MERGE,
    "RefMerge": _MERGE,
    "Enter": _ENTER,
    "RefEnter": _ENTER,
    "Exit": _EXIT,
    "RefExit": _EXIT,
    "NextIteration": _NEXT_ITERATION,
    "RefNextIteration": _NEXT_ITERATION,
}
_TRANSFER_OPS = frozenset({"_Send", "_Recv", "_HostSend", "_HostRecv"})
# A step with loops gives the event loop a turn after this many nodes run inline.
_YIELD_EVERY = 1024


class _LoopPlan:
    """What a graph with loops (`Enter` nodes) needs to run them, built once per graph."""

    def __init__(self, nodes: list[_Node]) -> None:
        self.kind = [_KIND_OF_OP.get(n.kernel.op, _PLAIN) for n in nodes]
        # Data edges out of each node: (output index, consumer, consumer's input slot).
        self.data_out: list[list[tuple[int, int, int]]] = [[] for _ in nodes]
        self.num_controls = [0] * len(nodes)
        for node in nodes:
            for slot, (src, k) in enumerate(node.inputs):
                self.data_out[src].append((k, node.index, slot))
            for c in node.control_consumers:
                self.num_controls[c] += 1
        # How many Enter nodes feed each frame: a frame's iteration 0 is complete once all have.
        self.enters_of_frame: dict[str, int] = {}
        for node in nodes:
            if self.kind[node.index] == _ENTER:
                name = node.kernel.frame_name  # type: ignore[attr-defined]
                self.enters_of_frame[name] = self.enters_of_frame.get(name, 0) + 1
        # `_Send`/`_Recv` nodes: inside a loop they name the frame and iteration in their key.
        self.transfer = [n.kernel.op in _TRANSFER_OPS for n in nodes]


class _Frame:
    """One execution of a loop (TensorFlow's FrameState): its live iterations."""

    def __init__(self, name: str, parent: _Iteration | None, pending_enters: int, parallel: int) -> None:
        self.name = name
        self.parent = parent
        # Every task running a part of this loop names this execution of it the same
        # way (the loop under its parent's name and iteration), hence the same id.
        self.path: str = f"{parent.frame.path};{parent.index};{name}" if parent is not None else ""
        self.id = _frame_id(self.path) if parent is not None else 0
        self.pending_enters = pending_enters  # Enter nodes still to arrive from the parent
        self.parallel = parallel  # most iterations alive at once (`parallel_iterations`)
        self.iterations: dict[int, _Iteration] = {}
        self.last = -1  # index of the newest iteration
        self.invariants: list[tuple[int, Any]] = []  # (Enter node, value) of `is_constant` Enters
        self.deferred: list[tuple[int, Any]] = []  # NextIteration outputs waiting for room
        self.live_exits: set[int] = set()
        self.dead_exits: set[int] = set()
        self.children: dict[tuple[str, int], _Frame] = {}

    def new_iteration(self) -> _Iteration:
        self.last += 1
        iteration = _Iteration(self, self.last)
        self.iterations[self.last] = iteration
        return iteration


class _Iteration:
    """One iteration of a frame (TensorFlow's IterationState): the nodes waiting in it."""

    def __init__(self, frame: _Frame, index: int) -> None:
        self.frame = frame
        self.index = index
        self.pending: dict[int, int] = {}  # node -> edges still to arrive (Merge: control edges)
        self.inputs: dict[int, list[Any]] = {}
        self.dead: set[int] = set()  # nodes with a dead input (Merge: dead data inputs counted)
        self.merge_dead: dict[int, int] = {}
        self.merge_live: set[int] = set()  # Merges that have a live data input
        self.fired: set[int] = set()  # Merges that ran
        self.outstanding = 0  # nodes of this iteration ready or running
        self.child_frames = 0  # frames started from this iteration still running


class _LoopStep:
    """One step of a graph with loops: values are tagged with a frame and an iteration,
    as in TensorFlow's executor. Nodes run inline on the loop, except asynchronous and
    large kernels (as in `Executor.run`)."""

    def __init__(self, executor: Executor, ctx: StepContext, stats: DeviceStepStats | None) -> None:
        assert executor._loop_plan is not None
        self.nodes = executor._nodes
        self.plan: _LoopPlan = executor._loop_plan
        self.ctx = ctx
        self.stats = stats
        self.ready: deque[tuple[int, _Iteration, list[Any], bool]] = deque()
        self.root = _Frame("", None, 0, 1)
        self.root_iteration = self.root.new_iteration()

    async def run(self) -> None:
        nodes = self.nodes
        root = self.root_iteration
        for i, node in enumerate(nodes):
            if node.num_waits == 0:
                root.outstanding += 1
                self.ready.append((i, root, [], False))
        wake = asyncio.Event()
        in_flight = 0

        async def run_task(
            i: int, iteration: _Iteration, ctx: StepContext, inputs: list[Any], offload: bool
        ) -> None:
            nonlocal in_flight
            kernel = nodes[i].kernel
            started = time.time_ns() if self.stats is not None else 0
            try:
                thread = None
                if offload:
                    loop = asyncio.get_running_loop()
                    values, thread = await loop.run_in_executor(
                        ctx.pool, _compute_in_thread, kernel, ctx, inputs
                    )
                else:
                    values = await _guard(kernel, kernel.compute_async(ctx, inputs))
                if self.stats is not None:
                    _record(self.stats, kernel, started, time.time_ns(), thread)
                self.finish(i, iteration, values, dead=False)
            finally:
                in_flight -= 1
                wake.set()

        ran = 0
        try:
            async with asyncio.TaskGroup() as group:
                while True:
                    while self.ready:
                        ran += 1
                        if not ran % _YIELD_EVERY:
                            # A loop may run for ever: let other steps, RPCs and the
                            # step's cancellation (its timeout) in now and then.
                            await asyncio.sleep(0)
                        i, iteration, inputs, dead = self.ready.popleft()
                        node = nodes[i]
                        if dead:
                            policy = node.kernel.dead_inputs
                            if policy == SKIP_WHEN_DEAD:
                                self.finish(i, iteration, [DEAD] * _num_outputs(node, self.plan), dead=True)
                                continue
                            if policy == CARRIES_DEADNESS:
                                inputs = [DEAD] * len(inputs)
                        ctx = self.ctx
                        if self.plan.transfer[i] and iteration.frame is not self.root:
                            ctx = dataclasses.replace(ctx, frame_iter=(iteration.frame.id, iteration.index))
                        mode = node.mode
                        if mode in (_TASK, _RECEIVE):
                            in_flight += 1
                            group.create_task(run_task(i, iteration, ctx, inputs, offload=False))
                        elif ctx.pool is not None and (
                            mode == _THREAD or (mode == _BY_SIZE and _large(node.kernel, inputs))
                        ):
                            in_flight += 1
                            group.create_task(run_task(i, iteration, ctx, inputs, offload=True))
                        else:
                            started = time.time_ns() if self.stats is not None else 0
                            values = _compute(node.kernel, ctx, inputs)
                            if self.stats is not None:
                                _record(self.stats, node.kernel, started, time.time_ns())
                            self.finish(i, iteration, values, dead=False)
                        del inputs
                    if in_flight == 0:
                        break
                    await wake.wait()
                    wake.clear()
        except BaseExceptionGroup as group_error:
            raise first_error(group_error) from None

    # -- propagation (TensorFlow's PropagateOutputs / ActivateNodes) --

    def finish(self, i: int, iteration: _Iteration, values: list[Any], dead: bool) -> None:
        """Deliver the outputs of node `i` run in `iteration` to their consumers."""
        plan = self.plan
        kind = plan.kind[i]
        is_dead = dead or (bool(values) and all(v is DEAD for v in values))
        frame = iteration.frame
        if kind in (_PLAIN, _MERGE):
            self.activate(i, iteration, values, is_dead)
        elif kind == _ENTER:
            kernel: Any = self.nodes[i].kernel
            child = self.child_frame(iteration, kernel)
            child.pending_enters -= 1
            if kernel.is_constant:
                child.invariants.append((i, values[0]))
                for target in list(child.iterations.values()):
                    self.activate(i, target, values, is_dead)
            else:
                first = child.iterations.get(0)
                if first is not None:
                    self.activate(i, first, values, is_dead)
            self.cleanup(child)  # its first iteration may be complete now
        elif kind == _EXIT:
            if is_dead:
                if i not in frame.live_exits:
                    frame.dead_exits.add(i)
            elif frame.parent is not None:
                frame.live_exits.add(i)
                frame.dead_exits.discard(i)
                self.activate(i, frame.parent, values, False)
            else:  # an Exit outside any loop: TensorFlow passes the value on
                self.activate(i, iteration, values, False)
        elif not is_dead:  # _NEXT_ITERATION; a dead one ends its loop: nothing to pass on
            following = frame.iterations.get(iteration.index + 1)
            if following is None and iteration.index + 1 > frame.last:
                if frame.deferred or len(frame.iterations) >= frame.parallel:
                    frame.deferred.append((i, values[0]))
                else:
                    following = self.start_iteration(frame)
            if following is not None:
                self.activate(i, following, values, False)
        iteration.outstanding -= 1
        self.cleanup(frame)

    def child_frame(self, iteration: _Iteration, enter: Any) -> _Frame:
        key = (enter.frame_name, iteration.index)
        child = iteration.frame.children.get(key)
        if child is None:
            child = _Frame(
                enter.frame_name,
                iteration,
                self.plan.enters_of_frame[enter.frame_name],
                enter.parallel_iterations,
            )
            iteration.frame.children[key] = child
            iteration.child_frames += 1
            child.new_iteration()
        return child

    def start_iteration(self, frame: _Frame) -> _Iteration:
        new = frame.new_iteration()
        for enter, value in frame.invariants:
            self.activate(enter, new, [value], value is DEAD)
        return new

    def activate(self, i: int, iteration: _Iteration, values: list[Any], is_dead: bool) -> None:
        """Hand node `i`'s outputs to its consumers in `iteration`; queue those now ready."""
        plan = self.plan
        nodes = self.nodes
        from_enter = plan.kind[i] == _ENTER
        for k, c, slot in plan.data_out[i]:
            value = DEAD if is_dead else values[k] if k < len(values) else _missing(nodes, i, k, c)
            self.deliver(c, iteration, slot, value, value is DEAD, from_enter)
        for c in nodes[i].control_consumers:
            self.deliver(c, iteration, -1, None, is_dead, False)

    def deliver(
        self, c: int, iteration: _Iteration, slot: int, value: Any, dead: bool, from_enter: bool
    ) -> None:
        node = self.nodes[c]
        plan = self.plan
        inputs = iteration.inputs.get(c)
        if inputs is None:
            inputs = iteration.inputs[c] = [None] * len(node.inputs)
            iteration.pending[c] = plan.num_controls[c] if plan.kind[c] == _MERGE else node.num_waits
        if plan.kind[c] == _MERGE:
            if c in iteration.fired:
                return
            if slot < 0:
                iteration.pending[c] -= 1
            elif dead:
                iteration.merge_dead[c] = iteration.merge_dead.get(c, 0) + 1
                if from_enter:  # a loop on a branch not taken: the loop is dead
                    iteration.merge_dead[c] = len(node.inputs)
            else:
                inputs[slot] = value
                iteration.merge_live.add(c)
            live = c in iteration.merge_live
            if iteration.pending[c] == 0 and (live or iteration.merge_dead.get(c, 0) >= len(node.inputs)):
                iteration.fired.add(c)
                if live:
                    merged = [DEAD if v is None else v for v in inputs]
                    self.enqueue(c, iteration, merged, False)
                else:
                    self.enqueue(c, iteration, [DEAD] * len(inputs), True)
            return
        if slot >= 0:
            inputs[slot] = value
        if dead:
            iteration.dead.add(c)
        left = iteration.pending[c] - 1
        iteration.pending[c] = left
        if left == 0:
            del iteration.pending[c]
            del iteration.inputs[c]
            self.enqueue(c, iteration, inputs, c in iteration.dead)

    def enqueue(self, c: int, iteration: _Iteration, inputs: list[Any], dead: bool) -> None:
        iteration.outstanding += 1
        self.ready.append((c, iteration, inputs, dead))

    # -- completion (TensorFlow's CleanupFramesIterations / DeleteFrame) --

    def cleanup(self, frame: _Frame) -> None:
        """Drop the frame's finished iterations (oldest first), start a deferred one, and
        end the frame when it is done."""
        if frame.parent is None:
            return  # the root frame ends with the step
        index = min(frame.iterations) if frame.iterations else None
        while index is not None and self.iteration_done(frame, index):
            del frame.iterations[index]
            if frame.deferred:
                deferred, frame.deferred = frame.deferred, []
                new = self.start_iteration(frame)
                for node, value in deferred:
                    self.activate(node, new, [value], False)
            index = min(frame.iterations) if frame.iterations else None
        self.maybe_frame_done(frame)

    def iteration_done(self, frame: _Frame, index: int) -> bool:
        iteration = frame.iterations[index]
        if iteration.outstanding or iteration.child_frames:
            return False
        return frame.pending_enters == 0 if index == 0 else True

    def maybe_frame_done(self, frame: _Frame) -> None:
        if frame.iterations or frame.pending_enters or frame.deferred or frame.parent is None:
            return
        parent = frame.parent
        del parent.frame.children[(frame.name, parent.index)]
        frame.parent = None  # done once
        for i in sorted(frame.dead_exits - frame.live_exits):
            self.activate(i, parent, [DEAD], True)
        parent.child_frames -= 1
        self.cleanup(parent.frame)


def _frame_id(path: str) -> int:
    """A frame's id in rendezvous keys: 64 bits of a hash of its path, never 0 (the root's)."""
    return int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "big") or 1


def _num_outputs(node: _Node, plan: _LoopPlan) -> int:
    """How many outputs a dead node has: enough for every consumer's output index."""
    return max((k + 1 for k, _, _ in plan.data_out[node.index]), default=1)


def _missing(nodes: list[_Node], src: int, k: int, consumer: int) -> Any:
    producer = nodes[src].kernel
    raise errors.InvalidArgumentError(
        f"Node '{nodes[consumer].kernel.name}' wants output {k} of '{producer.name}' ({producer.op}), "
        "which it does not have",
        node_name=nodes[consumer].kernel.name,
    )
