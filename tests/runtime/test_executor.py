"""The executor, on its own: what a step keeps alive while it runs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import threading
import tracemalloc
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.kernels.resources import ResourceManager
from distserver.protos import types_pb2
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.protos.debug_pb2 import DeviceStepStats
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.tensor_shape_pb2 import TensorShapeProto
from distserver.runtime import batched_recv
from distserver.runtime.executor import OFFLOAD_BYTES, Executor, StepContext
from distserver.runtime.rendezvous import StepRendezvous
from distserver.tensors import to_tensor_proto

TASK = "/job:localhost/replica:0/task:0"
DEVICE = f"{TASK}/device:CPU:0"
MiB = 1 << 20


def _step_context(pool: concurrent.futures.Executor | None) -> StepContext:
    return StepContext(
        step_id=1,
        device=DEVICE,
        device_incarnation=1,
        rendezvous=StepRendezvous(1, TASK, None),
        resources=ResourceManager(),
        pool=pool,
    )


def _chain(length: int, elements: int) -> ds.Graph:
    """fill -> negative x length -> a reduction, the tensor `elements` float32 long."""
    with ds.Graph().as_default() as graph:
        x = ds.fill([elements], np.float32(1.0))
        for _ in range(length):
            x = ds.negative(x)
        ds.reduce_sum(x, name="total")
    return graph


@pytest.mark.parametrize("offload", [True, False], ids=["thread-pool", "inline"])
async def test_a_chain_holds_a_few_intermediates_not_one_per_node(offload):
    nbytes = 4 * MiB
    executor = Executor(_chain(40, nbytes // 4).as_graph_def())
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ctx = _step_context(pool if offload else None)
        tracemalloc.start()
        try:
            await executor.run(ctx)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    # Kept: the node running, its input and perhaps the one just produced. Keeping
    # every output until the step ends would be 41 tensors.
    assert peak < 6 * nbytes, f"peak {peak / MiB:.0f} MiB for a chain of 4 MiB tensors"


def _random_uniform(shape: list[int], name: str) -> None:
    """A RandomUniform node (the graph API has no random ops; TensorFlow clients send them)."""
    graph = ds.get_default_graph()
    dims = ds.constant(np.array(shape, np.int32))
    attrs = {"dtype": AttrValue(type=types_pb2.DT_FLOAT), "T": AttrValue(type=types_pb2.DT_INT32)}
    graph.create_op("RandomUniform", [dims], [np.float32], name=name, attrs=attrs)


class _CountingPool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that records which kernels ran in its threads (`counting_pool`)."""

    def __init__(self) -> None:
        super().__init__(2, thread_name_prefix="counting-pool")
        self.kernels: list[str] = []


@pytest.fixture
def counting_pool(monkeypatch):
    from distserver.runtime import executor as executor_module

    pool = _CountingPool()

    def recording(run):
        def record(kernel_or_node, ctx, inputs):
            if threading.current_thread().name.startswith("counting-pool"):
                pool.kernels.append(getattr(kernel_or_node, "kernel", kernel_or_node).name)
            return run(kernel_or_node, ctx, inputs)

        return record

    # Every kernel the executor computes goes through one of these.
    monkeypatch.setattr(executor_module, "_compute", recording(executor_module._compute))
    monkeypatch.setattr(executor_module, "_run_node", recording(executor_module._run_node))
    with pool:
        yield pool


@pytest.mark.parametrize(
    ("build", "large"),
    [
        (lambda n: ds.fill([n], np.float32(1.0), name="out"), True),
        (lambda n: _random_uniform([n], name="out"), True),
        (lambda n: ds.tile(ds.constant([1.0, 2.0]), [n // 2], name="out"), True),
        (lambda n: ds.range(0, n, name="out"), True),
        (lambda n: ds.fill([16], np.float32(1.0), name="out"), False),
    ],
    ids=["fill", "random_uniform", "tile", "range", "small-fill"],
)
async def test_kernels_with_small_inputs_and_a_large_output_leave_the_event_loop(build, large, counting_pool):
    with ds.Graph().as_default() as graph:
        build(4 * MiB)
    executor = Executor(graph.as_graph_def())
    await executor.run(_step_context(counting_pool))
    assert ("out" in counting_pool.kernels) is large, counting_pool.kernels


async def test_the_graphs_of_a_session_share_its_stateful_kernels():
    """Two graphs with the same unshared queue node (two fetch sets of one session) use one queue."""
    queue = AttrValue()
    queue.list.type.append(types_pb2.DT_FLOAT)
    with ds.Graph().as_default() as graph:
        attrs = {"component_types": queue}
        graph.create_op("FIFOQueueV2", [], [types_pb2.DT_RESOURCE], name="q", attrs=attrs)
    session_kernels: dict = {}
    first = Executor(graph.as_graph_def(), session_kernels)
    second = Executor(graph.as_graph_def(), session_kernels)
    other_session = Executor(graph.as_graph_def(), {})
    assert first._nodes[0].kernel is second._nodes[0].kernel
    assert other_session._nodes[0].kernel is not first._nodes[0].kernel


@pytest.mark.parametrize(("elements", "offloaded"), [(16, set()), (MiB, {"filled", "negated"})])
async def test_the_way_each_node_runs_is_decided_once_and_still_follows_input_sizes(
    elements, offloaded, counting_pool
):
    # The executor fixes at registration which nodes may leave the loop (`_Node.mode`: a
    # node without inputs or an output estimate never does); whether one of the others
    # does is still decided per step, from the size of its inputs.
    with ds.Graph().as_default() as graph:
        big = ds.fill([elements], np.float32(1.0), name="filled")
        ds.negative(big, name="negated")
        ds.constant(np.ones(elements, np.float32), name="const")
    executor = Executor(graph.as_graph_def())
    await executor.run(_step_context(counting_pool))
    assert set(counting_pool.kernels) == offloaded, counting_pool.kernels


async def test_nodes_with_fixed_outputs_run_once_per_device_unless_the_step_is_traced(monkeypatch):
    from distserver.kernels.array import ConstKernel
    from distserver.protos.debug_pb2 import DeviceStepStats

    runs: list[str] = []
    original = ConstKernel.compute

    def counting(self, ctx, inputs):
        runs.append(self.name)
        return original(self, ctx, inputs)

    monkeypatch.setattr(ConstKernel, "compute", counting)
    with ds.Graph().as_default() as graph:
        a = ds.constant(np.float32(2.0), name="a")
        # (Pow: not an op whose node is folded when its inputs are constants.)
        ds.pow(a, ds.constant(np.float32(3.0), name="b"), name="total")
    executor = Executor(graph.as_graph_def())
    for _ in range(3):
        await executor.run(_step_context(None))
    assert sorted(runs) == ["a", "b"]  # the first step computed them; later steps reused them
    stats = DeviceStepStats()
    await executor.run(_step_context(None), stats)
    assert sorted(runs) == ["a", "a", "b", "b"]  # a traced step shows every node
    assert {s.node_name for s in stats.node_stats} == {"a", "b", "total"}


async def test_only_a_graph_that_can_hold_a_reference_variable_checks_inputs_for_one():
    # VariableV2 is the one kernel that outputs a VariableRef; in a graph without it no
    # input can be one, and the executor calls the kernels without the check.
    from distserver.kernels.resources import VariableRef
    from distserver.protos.graph_pb2 import GraphDef
    from distserver.protos.node_def_pb2 import NodeDef
    from distserver.tensors import to_tensor_proto

    def graph(with_variable: bool) -> GraphDef:
        value = NodeDef(name="value", op="Const")
        value.attr["dtype"].type = types_pb2.DT_FLOAT
        value.attr["value"].tensor.CopyFrom(to_tensor_proto(np.float32([1.0, 2.0])))
        nodes = [value]
        if with_variable:
            variable = NodeDef(name="v", op="VariableV2")
            variable.attr["dtype"].type = types_pb2.DT_FLOAT
            assign = NodeDef(name="assign", op="Assign", input=["v", "value"])
            nodes += [variable, assign]
        # (Square: not an op whose node is folded when its input is a constant.)
        read = NodeDef(name="read", op="Square", input=["assign" if with_variable else "value"])
        for node in [*nodes[1:], read]:
            node.attr["T"].type = types_pb2.DT_FLOAT
        result = GraphDef()
        result.node.extend([*nodes, read])
        return result

    for with_variable in (False, True):
        executor = Executor(graph(with_variable))
        neg = executor._nodes[-1]
        checks = neg.compute.__func__ is type(neg.kernel).compute  # the wrapped compute
        assert checks == with_variable
        seen: list = []
        original = neg.compute
        neg.compute = lambda ctx, inputs, seen=seen, original=original: (
            seen.append(inputs[0]) or original(ctx, inputs)
        )
        await executor.run(_step_context(None))
        # Assign outputs the reference, which the wrapped compute dereferences (Square on a
        # VariableRef would have failed the step).
        if with_variable:
            assert type(seen[0]) is VariableRef
        else:
            assert isinstance(seen[0], np.ndarray)


async def test_a_kernel_goes_to_the_pool_for_large_work_not_for_a_quarter_mib():
    # A hop to the pool costs more than element-wise work on 256 KiB; a product of small
    # matrices can still be long work (300x300 @ 300x300: 720 KB in, 27M multiply-adds).
    quarter = np.ones(64 * 1024, np.float32)
    small_square = np.ones((300, 300), np.float32)
    with ds.Graph().as_default() as graph:
        ds.negative(ds.constant(quarter), name="negated")
        ds.matmul(ds.constant(small_square), ds.constant(small_square), name="product")
        ds.negative(ds.constant(np.ones(OFFLOAD_BYTES // 4, np.float32)), name="large")
    stats = DeviceStepStats()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        await Executor(graph.as_graph_def()).run(_step_context(pool), stats)
    here = threading.get_ident() & 0xFFFFFFFF
    threads = {node.node_name: node.thread_id for node in stats.node_stats}
    assert threads["negated"] == here
    assert threads["product"] != here
    assert threads["large"] != here


def test_the_size_of_a_nodes_work_counts_its_array_inputs_and_skips_other_values():
    from distserver.kernels.registry import create_kernel
    from distserver.runtime import executor

    kernel = create_kernel(_node("n", "AddN", T=_F32, N=2))  # (counts as `OpKernel.work_nbytes` does)
    half = np.ones(OFFLOAD_BYTES // 8, np.float32)
    assert executor._large(kernel, [half, half])
    assert not executor._large(kernel, [half])
    # A value without `nbytes` (a VariableRef, a dataset) counts for nothing.
    assert executor._large(kernel, [half, object(), half])
    assert not executor._large(kernel, [half, object()])


def test_a_dense_optimizer_update_stays_on_the_loop_up_to_a_2_mib_gradient():
    # It streams its arrays once (~0.3 ms for 1.6 MiB), where a hop to the pool and
    # back costs 0.1-0.2 ms in a step; other kernels go at 1 MiB.
    from distserver.kernels.registry import create_kernel
    from distserver.runtime import executor

    def node(op: str, **attrs: Any) -> Any:
        return create_kernel(_node("n", op, T=_F32, **attrs))

    adam, negation = node("ResourceApplyAdam"), node("Neg")
    sparse = node("ResourceSparseApplyAdagrad", Tindices=types_pb2.DT_INT64)
    scalars = [np.float32(0.1)] * 6  # the powers, rate, betas and epsilon
    handles = [object()] * 3  # var, m, v: resource handles, no bytes of their own
    gradient = np.ones(3 * OFFLOAD_BYTES // 8, np.float32)  # 1.5 MiB
    assert not executor._large(adam, [*handles, *scalars, gradient])
    assert executor._large(negation, [gradient])
    assert executor._large(adam, [*handles, *scalars, np.ones(2 * OFFLOAD_BYTES // 4, np.float32)])
    # A sparse update's rows lie at random places: it goes at 1 MiB, as other kernels.
    assert executor._large(sparse, [*handles[:2], scalars[0], gradient, np.arange(4, dtype=np.int64)])


@pytest.mark.parametrize("offload", [True, False], ids=["thread-pool", "inline"])
async def test_a_step_computes_inf_and_nan_silently_and_leaves_the_callers_error_state(offload):
    # numpy's warnings are turned off once per step (`warnings_off`), not around each
    # kernel: inline kernels see that, pool threads (no context of the step) still quiet
    # their own arithmetic. pytest turns any warning into an error here.
    from distserver.kernels import _common

    elements = (OFFLOAD_BYTES // 4) if offload else 4
    with ds.Graph().as_default() as graph:
        big = ds.fill([elements], np.float32(3e38))
        ds.multiply(big, big, name="overflow")  # inf
        zero = ds.fill([elements], np.float32(0.0))
        ratio = ds.truediv(zero, zero, name="nan")
        ds.reduce_sum(ds.exp(ratio), name="total")
    executor = Executor(graph.as_graph_def())
    before = np.geterr()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        await executor.run(_step_context(pool))
    assert np.geterr() == before
    assert not _common._WARNINGS_OFF.get()


def _node(name: str, op: str, inputs: Sequence[str] = (), **attrs: Any) -> NodeDef:
    node = NodeDef(name=name, op=op, input=list(inputs))
    for key, value in attrs.items():
        if isinstance(value, np.ndarray):
            node.attr[key].tensor.CopyFrom(to_tensor_proto(value))
        elif key == "N":
            node.attr[key].i = value
        elif isinstance(value, list):
            node.attr[key].shape.CopyFrom(TensorShapeProto(dim=[TensorShapeProto.Dim(size=d) for d in value]))
        else:
            node.attr[key].type = value
    return node


def _graph(*nodes: NodeDef) -> GraphDef:
    graph = GraphDef()
    graph.node.extend(nodes)
    return graph


_F32 = types_pb2.DT_FLOAT


def _variable(name: str) -> NodeDef:
    return _node(name, "VarHandleOp", dtype=_F32, shape=[])


def _const(name: str, value: float, inputs: Sequence[str] = ()) -> NodeDef:
    return _node(name, "Const", inputs, dtype=_F32, value=np.array(value, np.float32))


def _left_out(executor: Executor) -> set[str]:
    return {n.kernel.name for n in executor._nodes if n.left_out}


async def test_identity_and_noop_nodes_are_left_out_and_their_consumers_still_wait_for_their_inputs():
    # A gradient's shape: add -> NoOp group -> Identity(value, ^group) -> reader. Left
    # out, the reader waits for the add itself: it reads 1 + 2. (Without that edge the
    # reader would run first: it is ready as soon as `passed_on` is, before `add` is.)
    ctx = _step_context(None)
    init = _node("init", "AssignVariableOp", ["v", "one"], dtype=_F32)
    await Executor(_graph(_variable("v"), _const("one", 1.0), init)).run(ctx)
    step = Executor(
        _graph(
            _node("read", "ReadVariableOp", ["v", "^after"], dtype=_F32),
            _variable("v"),
            _variable("result"),
            _node("keep", "AssignVariableOp", ["result", "read"], dtype=_F32),
            _const("passed_on", 0.0),
            _const("two", 2.0),
            _node("add", "AssignAddVariableOp", ["v", "two"], dtype=_F32),
            _node("group", "NoOp", ["^add"]),
            _node("after", "Identity", ["passed_on", "^group"], T=_F32),
            _node("train", "NoOp", ["^keep", "^after"]),
        )
    )
    assert _left_out(step) == {"group", "after", "train"}
    await step.run(ctx)
    assert ctx.resources.lookup("", "result").value == np.float32(3.0)


def _branch_not_taken() -> list[NodeDef]:
    """A variable `v`, and cond's Switch on a false predicate with its pivot (dead)."""
    return [
        _variable("v"),
        _node("pred", "Const", dtype=types_pb2.DT_BOOL, value=np.array(False)),
        _const("x", 1.0),
        _node("switch", "Switch", ["x", "pred"], T=_F32),
        _node("pivot", "Identity", ["switch:1"], T=_F32),
    ]


async def test_an_identity_that_carries_one_dead_switch_port_to_a_control_edge_is_kept():
    # TensorFlow's cond pivot: Identity(switch:1) is dead when the predicate is false,
    # and makes what it controls dead. A control edge from the Switch itself would not:
    # the Switch has a live output too.
    ctx = _step_context(None)
    executor = Executor(
        _graph(
            *_branch_not_taken(),
            _const("five", 5.0, ["^pivot"]),
            _node("assign", "AssignVariableOp", ["v", "five"], dtype=_F32),
        )
    )
    assert _left_out(executor) == set()
    await executor.run(ctx)
    with pytest.raises(errors.NotFoundError):
        ctx.resources.lookup("", "v")  # the branch not taken assigned nothing


async def test_pass_through_nodes_feeding_a_merge_or_joining_many_to_many_are_kept():
    controls = [f"^c{i}" for i in range(5)]
    executor = Executor(
        _graph(
            _node("pred", "Const", dtype=types_pb2.DT_BOOL, value=np.array(True)),
            _const("x", 1.0),
            _node("switch", "Switch", ["x", "pred"], T=_F32),
            _node("through", "Identity", ["x"], T=_F32),
            _node("merge", "Merge", ["switch:0", "through"], T=_F32, N=2),
            *[_const(f"c{i}", float(i)) for i in range(5)],
            _node("join", "NoOp", controls),
            *[_const(f"d{i}", float(i), ["^join"]) for i in range(5)],
        )
    )
    # A Merge tells a dead input from a live one whatever its control inputs; the NoOp
    # would give its 5 consumers 25 edges instead of its own 10.
    assert _left_out(executor) == set()


def _noops(executor: Executor) -> set[str]:
    return {n.kernel.name for n in executor._nodes if n.kernel.op == "NoOp"}


async def test_a_pure_node_nobody_reads_is_not_computed_and_what_waits_for_it_waits_for_its_inputs():
    # The gradient of a layer's input: a product only the gradient's group waits for.
    # Its shapes do not match, so computing it would fail the step: it is not computed,
    # nor are its inputs, which nobody else reads. `reader` (first in the graph) waits
    # for it, so for the add as well: it reads 3, not 1.
    ctx = _step_context(None)
    init = _node("init", "AssignVariableOp", ["v", "one"], dtype=_F32)
    await Executor(_graph(_variable("v"), _const("one", 1.0), init)).run(ctx)
    graph = _graph(
        _node("reader", "ReadVariableOp", ["v", "^unread"], dtype=_F32),
        _node("keep", "AssignVariableOp", ["result", "reader"], dtype=_F32),
        _variable("v"),
        _variable("result"),
        _const("two", 2.0),
        _node("add", "AssignAddVariableOp", ["v", "two"], dtype=_F32),
        _node("bumped", "ReadVariableOp", ["v", "^add"], dtype=_F32),
        _node("shaped", "Reshape", ["bumped", "row"], T=_F32, Tshape=types_pb2.DT_INT32),
        _node("row", "Const", dtype=types_pb2.DT_INT32, value=np.array([1, 1], np.int32)),
        _node("wide", "Const", dtype=_F32, value=np.ones((3, 4), np.float32)),
        _node("unread", "MatMul", ["shaped", "wide"], T=_F32),
    )
    step = Executor(graph)
    assert _noops(step) == {"unread", "shaped", "bumped"}
    await step.run(ctx)
    assert ctx.resources.lookup("", "result").value == np.float32(3.0)
    # Asked for (no consumer: the node the step was asked to run), it is computed, and fails.
    ctx = _step_context(None)
    await Executor(_graph(_variable("v"), _const("one", 1.0), init)).run(ctx)
    alone = _graph(*[node for node in graph.node if node.name not in ("reader", "keep")])
    with pytest.raises(errors.InvalidArgumentError, match="unread"):
        await Executor(alone).run(ctx)


async def test_a_node_nobody_reads_is_computed_when_it_has_effects_or_reads_a_switch_port():
    executor = Executor(
        _graph(
            _node("pred", "Const", dtype=types_pb2.DT_BOOL, value=np.array(False)),
            _const("x", 1.0),
            _node("switch", "Switch", ["x", "pred"], T=_F32),
            _node("on_port", "Neg", ["switch:1"], T=_F32),
            _node("feed", "Placeholder", dtype=_F32),
            _node("random", "RandomUniform", ["shape"], T=types_pb2.DT_INT32, dtype=_F32),
            _node("shape", "Const", dtype=types_pb2.DT_INT32, value=np.array([2], np.int32)),
            _node("after", "NoOp", ["^on_port", "^feed", "^random"]),
            _const("last", 0.0, ["^after"]),
        )
    )
    # A control edge from the Switch is live when one port is: `on_port` stays to carry
    # the dead port. A placeholder must fail when not fed, and a random op's sequence
    # moves on.
    assert _noops(executor) == {"after"}


async def test_a_node_nobody_reads_downstream_of_a_dead_port_makes_what_waits_for_it_dead():
    # cond's branch not taken: `negated` reads the pivot (dead), is not computed, and
    # the assignment waiting for it must not run either; nor the one waiting for a
    # node reading the dead port itself.
    ctx = _step_context(None)
    executor = Executor(
        _graph(
            *_branch_not_taken(),
            _node("negated", "Neg", ["pivot"], T=_F32),
            _const("five", 5.0, ["^negated"]),
            _node("assign", "AssignVariableOp", ["v", "five"], dtype=_F32),
            _variable("w"),
            _node("on_port", "Neg", ["switch:1"], T=_F32),  # computed (dead), not a NoOp
            _const("six", 6.0, ["^on_port"]),
            _node("assign_w", "AssignVariableOp", ["w", "six"], dtype=_F32),
        )
    )
    assert _noops(executor) == {"negated"}
    await executor.run(ctx)
    for name in ("v", "w"):
        with pytest.raises(errors.NotFoundError):
            ctx.resources.lookup("", name)


def _recv(name: str, src_task: str = TASK) -> NodeDef:
    node = _node(name, "_Recv", tensor_type=_F32)
    node.attr["send_device"].s = f"{src_task}/device:CPU:0".encode()
    node.attr["recv_device"].s = DEVICE.encode()
    node.attr["send_device_incarnation"].i = 1
    node.attr["tensor_name"].s = name.encode()
    return node


PS = "/job:ps/replica:0/task:0"


def _record_runs(executor: Executor, names: tuple[str, ...], request: asyncio.Future[Any]) -> list[Any]:
    """As each node of `names` runs: its name, its thread's name, and whether `request`
    (another task's, waiting for a value) has its answer."""
    ran = []
    for node in executor._nodes:
        if node.kernel.name in names:

            def recording(ctx, inputs, compute=node.compute, name=node.kernel.name):
                ran.append((name, threading.current_thread().name, request.done()))
                return compute(ctx, inputs)

            node.compute = recording
    return ran


@pytest.mark.parametrize("late", [False, True], ids=["sequence", "ready-queue"])
@pytest.mark.parametrize("batched", [False, True], ids=["recv-tensor", "recv-tensors"])
async def test_what_another_task_waits_for_is_sent_and_handed_over_before_the_rest(late, batched):
    # A ps's embedding step: the ids arrive, the rows gathered from them go to the
    # worker, which waits; the ps's own work on the ids (its deduplication for the
    # update, here `local`) waits until the rows are handed to the worker's request.
    # Ids that arrive after the step started make it run its ready queue; ids already
    # there, one fixed sequence. The worker asks with a RecvTensor, or with a batched
    # RecvTensors (a distserver peer's small values).
    graph = _graph(
        _recv("ids", src_task=PS),
        _node("local", "Neg", ["ids"], T=_F32),  # first in the graph: FIFO would run it first
        _node("rows", "Square", ["ids"], T=_F32),
        _send("to_ps", "rows", PS),
        _node("more_local", "Neg", ["local"], T=_F32),
        _send("fetch", "more_local"),
    )
    executor = Executor(graph)
    assert executor._straight is not None
    ids, sent = (executor._nodes[i].kernel.key for i in (0, 3))  # type: ignore[attr-defined]
    ctx = _step_context(None)
    worker_request = asyncio.ensure_future(  # waiting already
        batched_recv.answer(ctx.rendezvous, [sent]) if batched else ctx.rendezvous.recv_local(sent)
    )
    ran = _record_runs(executor, ("local", "rows", "to_ps", "more_local"), worker_request)
    if not late:
        ctx.rendezvous.send(ids, np.float32(3.0))
    step = asyncio.ensure_future(executor.run(ctx))
    if late:
        await asyncio.sleep(0)
        assert not step.done()
        ctx.rendezvous.send(ids, np.float32(3.0))
    await step
    assert [(name, done) for name, _, done in ran] == [
        ("rows", False),
        ("to_ps", False),
        ("local", True),
        ("more_local", True),
    ]
    assert await worker_request == ({sent.text: np.float32(9.0)} if batched else (np.float32(9.0), False))


async def test_a_send_to_another_task_in_a_run_in_a_thread_goes_when_the_run_ends():
    # A worker's gradient (`rows`, large: computed in a pool thread) goes to the ps,
    # whose request waits; `local` (small, the loss for the client) comes after it. The
    # thread keeps the send and goes on with `local` (stopping would cost a hop to the
    # loop and back, and the loop's answer to the ps before the thread's next node);
    # the loop sends both values once the run ends, and hands the ps its value before
    # the step ends.
    graph = _graph(
        _recv("grads", src_task=PS),
        _recv("loss", src_task=PS),
        _node("rows", "Square", ["grads"], T=_F32),
        _send("to_ps", "rows", PS),
        _node("local", "Neg", ["loss"], T=_F32),
        _send("fetch", "local"),
    )
    graph.node[-1].attr["client_terminated"].b = True
    executor = Executor(graph)
    assert executor._straight is not None
    grads, loss, sent = (executor._nodes[i].kernel.key for i in (0, 1, 3))  # type: ignore[attr-defined]
    with _HopCountingPool() as pool:
        ctx = _step_context(pool)
        ps_request = asyncio.ensure_future(ctx.rendezvous.recv_local(sent))  # waiting already
        ran = _record_runs(executor, ("rows", "to_ps", "local", "fetch"), ps_request)
        ctx.rendezvous.send(grads, np.full(OFFLOAD_BYTES // 4, 3.0, np.float32))
        ctx.rendezvous.send(loss, np.float32(2.0))
        await executor.run(ctx)
        assert ps_request.done()
    assert pool.hops == 1
    here = threading.current_thread().name
    in_thread = [(name, thread != here, done) for name, thread, done in ran]
    assert in_thread == [
        ("rows", True, False),
        ("local", True, False),
        ("to_ps", False, False),
        ("fetch", False, False),
    ]
    value, is_dead = await ps_request
    assert not is_dead
    np.testing.assert_array_equal(value, np.full(OFFLOAD_BYTES // 4, 9.0, np.float32))


async def test_a_receive_is_waited_for_without_a_task_and_given_up_when_the_step_stops():
    # `_Recv` values are futures the step waits on (no task per receive); a step that
    # stops (here: its timeout) cancels its own receives, never the rendezvous' slot,
    # so a value sent later is still delivered to whoever receives it.
    executor = Executor(
        _graph(_recv("early"), _recv("never"), _node("sum", "AddV2", ["early", "never"], T=_F32))
    )
    ctx = _step_context(None)
    ctx.rendezvous.send(executor._nodes[0].kernel.key, np.float32(1.0))  # type: ignore[attr-defined]
    tasks_before = len(asyncio.all_tasks())
    stepping = asyncio.ensure_future(executor.run(ctx))
    await asyncio.sleep(0.01)
    assert len(asyncio.all_tasks()) == tasks_before + 1  # the step's own task only
    stepping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stepping
    never = executor._nodes[1].kernel.key  # type: ignore[attr-defined]
    ctx.rendezvous.send(never, np.float32(2.0))
    assert await ctx.rendezvous.recv_local(never) == (np.float32(2.0), False)


async def test_a_failed_or_cancelled_receive_fails_the_step_naming_the_node():
    fetches: list[asyncio.Future[tuple[Any, bool]]] = []

    def fetch_remote(step_id: int, key: Any, together: bool) -> asyncio.Future[tuple[Any, bool]]:
        fetches.append(asyncio.get_running_loop().create_future())
        return fetches[-1]

    peer = "/job:ps/replica:0/task:0"
    executor = Executor(_graph(_recv("w", peer)))
    for outcome in ("error", "cancelled"):
        fetches.clear()
        ctx = _step_context(None)
        ctx.rendezvous = StepRendezvous(1, TASK, fetch_remote)
        stepping = asyncio.ensure_future(executor.run(ctx))
        await asyncio.sleep(0.01)
        if outcome == "error":
            fetches[0].set_exception(errors.UnavailableError("ps is gone"))
            with pytest.raises(errors.UnavailableError, match="ps is gone") as raised:
                await asyncio.wait_for(stepping, 10)
            assert raised.value.node_name == "w"
        else:
            # Cancelled by someone else: the step must fail, not end as if it had run.
            fetches[0].cancel()
            with pytest.raises(errors.CancelledError, match="'w'"):
                await asyncio.wait_for(stepping, 10)


async def test_nodes_computed_from_constants_alone_are_folded_once_and_not_run_by_steps(monkeypatch):
    from distserver.kernels.array import FillKernel
    from distserver.kernels.registry import FunctionFrame
    from distserver.runtime import executor as executor_module

    runs: list[str] = []
    original = FillKernel.compute

    def counting(self, ctx, inputs):
        runs.append(self.name)
        return original(self, ctx, inputs)

    monkeypatch.setattr(FillKernel, "compute", counting)
    monkeypatch.setattr(executor_module, "FOLD_LIMIT_BYTES", 1024)
    with ds.Graph().as_default() as graph:
        ones = ds.fill([4], np.float32(1.0), name="ones")  # folded
        big = ds.fill([1024], np.float32(1.0), name="big")  # over the limit: runs every step
        held = ds.square(ds.constant(np.float32(2.0)), name="held")  # Square: not folded
        scaled = ds.multiply(ones, held, name="scaled")  # an input that is not a constant
        ds.add(ds.reduce_sum(scaled), ds.reduce_sum(big), name="total")
    graph_def = graph.as_graph_def()
    graph_def.node.append(_node("result", "_Retval", ["total"], T=_F32))
    graph_def.node[-1].attr["index"].i = 0
    executor = Executor(graph_def)
    folded = {executor._nodes[i].kernel.name for i in executor._folded}
    assert "ones" in folded
    assert not folded & {"big", "scaled", "total"}
    assert "ones" in runs  # computed when the graph was registered (big too, then dropped)
    runs.clear()
    for _ in range(2):
        ctx = dataclasses.replace(_step_context(None), frame=FunctionFrame(args=[], retvals=[None]))
        await executor.run(ctx)
        assert ctx.frame.retvals == [np.float32(16.0 + 1024.0)]
    assert runs == ["big", "big"]


async def test_a_foldable_node_that_fails_is_left_to_the_step_which_reports_it():
    values = _node("values", "Const", dtype=_F32, value=np.float32([1.0, 2.0, 3.0]))
    shape = _node("shape", "Const", dtype=types_pb2.DT_INT32, value=np.int32([2]))
    executor = Executor(_graph(values, shape, _node("bad", "Reshape", ["values", "shape"], T=_F32)))
    assert not executor._folded
    with pytest.raises(errors.InvalidArgumentError) as raised:
        await executor.run(_step_context(None))
    assert raised.value.node_name == "bad"


def _send(name: str, input_name: str, dst_task: str = TASK) -> NodeDef:
    node = _node(name, "_Send", [input_name], T=_F32)
    node.attr["send_device"].s = DEVICE.encode()
    node.attr["recv_device"].s = f"{dst_task}/device:CPU:0".encode()
    node.attr["send_device_incarnation"].i = 1
    node.attr["tensor_name"].s = name.encode()
    return node


def _fed_sum() -> GraphDef:
    """x, y received -> (x * y + x) sent to this task (a fetch)."""
    return _graph(
        _recv("x"),
        _recv("y"),
        _node("product", "Mul", ["x", "y"], T=_F32),
        _node("total", "AddV2", ["product", "x"], T=_F32),
        _send("fetch", "total"),
    )


async def _fed_step(executor: Executor, x: Any, y: Any, *, late: bool = False) -> tuple[Any, bool]:
    ctx = _step_context(None)
    keys = [executor._nodes[i].kernel.key for i in (0, 1)]  # type: ignore[attr-defined]
    ctx.rendezvous.send(keys[0], x)
    if late:  # the second value arrives while the step runs
        asyncio.get_running_loop().call_later(0.01, ctx.rendezvous.send, keys[1], y)
    else:
        ctx.rendezvous.send(keys[1], y)
    await executor.run(ctx)
    return await ctx.rendezvous.recv_local(executor._nodes[4].kernel.key)  # type: ignore[attr-defined]


async def test_a_step_whose_receives_have_arrived_runs_as_one_sequence_with_the_same_results(monkeypatch):
    from distserver.runtime import executor as executor_module

    straight_runs = []
    original = executor_module._Straight.run

    async def counting(self, ctx, outputs, start, end):
        straight_runs.append(ctx.step_id)
        await original(self, ctx, outputs, start, end)

    monkeypatch.setattr(executor_module._Straight, "run", counting)
    executor = Executor(_fed_sum())
    assert executor._straight is not None
    x, y = np.float32([1.5, -2.0]), np.float32([3.0, 0.25])
    value, is_dead = await _fed_step(executor, x, y)
    assert len(straight_runs) == 1
    assert not is_dead
    # The ready queue (a receive still on its way) gives the same bits.
    late_value, _ = await _fed_step(executor, x, y, late=True)
    assert len(straight_runs) == 1
    np.testing.assert_array_equal(value, late_value)
    np.testing.assert_array_equal(value, x * y + x)
    # A dead value received: the ready queue, which knows deadness, runs the step.
    dead = _step_context(None)
    dead.rendezvous.send(executor._nodes[0].kernel.key, None, is_dead=True)  # type: ignore[attr-defined]
    dead.rendezvous.send(executor._nodes[1].kernel.key, y)  # type: ignore[attr-defined]
    await executor.run(dead)
    assert len(straight_runs) == 1
    assert (await dead.rendezvous.recv_local(executor._nodes[4].kernel.key))[1] is True  # type: ignore[attr-defined]


async def test_a_node_of_many_inputs_takes_its_fixed_ones_from_a_list_made_once():
    # A grouped update's handles and hyperparameters are the same every step: they are
    # kept in a list made at the first step, and only the others are taken per step.
    # That list must hold no step's own values.
    graph = _graph(
        _recv("x"),
        _recv("y"),
        _const("c", 2.0),
        _const("d", 3.0),
        _node("total", "AddN", ["x", "c", "y", "d"], T=_F32, N=4),
        _send("fetch", "total"),
    )
    executor = Executor(graph)
    straight = executor._straight
    assert straight is not None
    (entry,) = [e for e in straight.program if e.node.kernel.name == "total"]
    assert entry.varying is not None
    assert [place for place, _, _ in entry.varying] == [0, 2]
    fed = []
    for x, y in [(1.0, 10.0), (100.0, 1000.0), (-7.0, 0.5)]:
        ctx = _step_context(None)
        values = [np.array(x, np.float32), np.array(y, np.float32)]
        for i, value in enumerate(values):
            ctx.rendezvous.send(executor._nodes[i].kernel.key, value)  # type: ignore[attr-defined]
        await executor.run(ctx)
        total, _ = await ctx.rendezvous.recv_local(executor._nodes[5].kernel.key)  # type: ignore[attr-defined]
        assert total == np.float32(x + y + 5.0)
        fed += [weakref.ref(value) for value in values]
        del ctx, values, value, total
    gc.collect()
    assert all(value() is None for value in fed)  # (no step's feed outlives its step)
    (kept,) = straight._with_fixed[DEVICE].values()
    assert kept[0] is None
    assert kept[2] is None
    assert (kept[1], kept[3]) == (np.float32(2.0), np.float32(3.0))


async def test_graphs_that_need_the_ready_queue_have_no_sequence():
    queue = AttrValue()
    queue.list.type.append(types_pb2.DT_FLOAT)
    with ds.Graph().as_default() as graph:  # an asynchronous kernel
        attrs = {"component_types": queue}
        graph.create_op("FIFOQueueV2", [], [types_pb2.DT_RESOURCE], name="q", attrs=attrs)
    assert Executor(graph.as_graph_def())._straight is None
    pred = _node("pred", "Const", dtype=types_pb2.DT_BOOL, value=np.array(True))
    switch = _graph(_const("x", 1.0), pred, _node("switch", "Switch", ["x", "pred"], T=_F32))
    assert Executor(switch)._straight is None
    waiting = _recv("w")
    waiting.input.append("^x")  # a receive that waits for another node
    assert Executor(_graph(_const("x", 1.0), waiting))._straight is None


class _HopCountingPool(_CountingPool):
    def __init__(self) -> None:
        super().__init__()
        self.hops = 0

    def submit(self, fn, /, *args, **kwargs):
        self.hops += 1
        return super().submit(fn, *args, **kwargs)


async def test_a_large_node_takes_the_nodes_after_it_to_its_thread_sends_going_back_to_the_loop(monkeypatch):
    from distserver.kernels.array import FillLikeKernel
    from distserver.runtime import executor as executor_module

    where: dict[str, str] = {}
    original = executor_module._run_node

    def recording(node, ctx, inputs):
        where[node.kernel.name] = threading.current_thread().name
        return original(node, ctx, inputs)

    monkeypatch.setattr(executor_module, "_run_node", recording)
    # ZerosLike stands for a kernel bound to the loop other than `_Send` (a stack, a
    # tensor array): a run in a thread stops before it.
    monkeypatch.setattr(FillLikeKernel, "runs_on_loop", True)
    monkeypatch.setattr(FillLikeKernel, "loop_bound", True)
    elements = OFFLOAD_BYTES // 4
    graph = _graph(
        _node("shape", "Const", dtype=types_pb2.DT_INT32, value=np.int32([elements])),
        _const("one", 1.0),
        _node("zero", "Const", dtype=types_pb2.DT_INT32, value=np.array(0, np.int32)),
        _node("big", "Fill", ["shape", "one"], T=_F32),  # large: to a thread
        _node("a", "Neg", ["big"], T=_F32),
        _node("b", "Sum", ["a", "zero"], T=_F32),
        _node("z", "ZerosLike", ["a"], T=_F32),  # the run ends before it
        _node("c", "Neg", ["a"], T=_F32),  # large again: a second hop
        _send("to_ps", "b", "/job:ps/replica:0/task:0"),  # sent by the loop, the run goes on
        _node("d", "Square", ["c"], T=_F32),
        _send("fetch_d", "d"),
    )
    graph.node[5].attr["Tidx"].type = types_pb2.DT_INT32
    executor = Executor(graph)
    program = [entry.node.kernel.name for entry in executor._straight.program]  # type: ignore[union-attr]
    # (What another task waits for first: the send to the ps right after its value.)
    assert program == ["big", "a", "b", "to_ps", "z", "c", "d", "fetch_d"]
    with _HopCountingPool() as pool:
        ctx = _step_context(pool)
        await executor.run(ctx)
    assert pool.hops == 2
    here = threading.current_thread().name
    assert [name for name in program if where[name] == here] == ["to_ps", "z", "fetch_d"]
    sent = {executor._nodes[i].kernel.name: executor._nodes[i].kernel.key for i in (8, 10)}  # type: ignore[attr-defined]
    assert await ctx.rendezvous.recv_local(sent["to_ps"]) == (np.float32(-elements), False)
    value, _ = await ctx.rendezvous.recv_local(sent["fetch_d"])
    np.testing.assert_array_equal(value, np.ones(elements, np.float32))


async def test_a_fetch_sent_during_a_run_in_a_thread_waits_for_the_run_to_end(monkeypatch):
    # A fetch (a `_Send` to the client) is read when the step ends: the loop sends it
    # once the thread is done, rather than waking up in the middle of the thread's
    # nodes. A `_Send` to another partition of this task still goes at once.
    from distserver.runtime import executor as executor_module

    events: list[tuple[str, str]] = []
    handed: list[str] = []  # by the thread to the loop, as it goes
    original, original_on_loop = executor_module._run_node, executor_module._run_on_loop

    def recording(node, ctx, inputs):
        events.append((node.kernel.name, threading.current_thread().name))
        return original(node, ctx, inputs)

    def recording_handed(node, ctx, inputs, failed):
        handed.append(node.kernel.name)
        return original_on_loop(node, ctx, inputs, failed)

    monkeypatch.setattr(executor_module, "_run_node", recording)
    monkeypatch.setattr(executor_module, "_run_on_loop", recording_handed)
    elements = OFFLOAD_BYTES // 4
    fetch = _send("fetch_a", "a")
    fetch.attr["client_terminated"].b = True
    graph = _graph(
        _node("shape", "Const", dtype=types_pb2.DT_INT32, value=np.int32([elements])),
        _const("one", 1.0),
        _node("big", "Fill", ["shape", "one"], T=_F32),  # large: to a thread
        _node("a", "Neg", ["big"], T=_F32),
        fetch,
        _send("to_partition", "a"),  # to this task, not the client: handed over at once
        _node("b", "Square", ["a"], T=_F32),
        _node("c", "Neg", ["b"], T=_F32),
        _send("fetch_c", "c"),
    )
    graph.node[-1].attr["client_terminated"].b = True
    executor = Executor(graph)
    program = [entry.node.kernel.name for entry in executor._straight.program]  # type: ignore[union-attr]
    assert program == ["big", "a", "fetch_a", "to_partition", "b", "c", "fetch_c"]
    with _HopCountingPool() as pool:
        ctx = _step_context(pool)
        await executor.run(ctx)
    assert pool.hops == 1
    assert handed == ["to_partition"]
    here = threading.current_thread().name
    assert [name for name, thread in events if thread == here] == ["to_partition", "fetch_a", "fetch_c"]
    order = [name for name, _ in events]
    assert order.index("c") < order.index("fetch_a") < order.index("fetch_c")
    value, _ = await ctx.rendezvous.recv_local(executor._nodes[4].kernel.key)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(value, -np.ones(elements, np.float32))
    value, _ = await ctx.rendezvous.recv_local(executor._nodes[8].kernel.key)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(value, -np.ones(elements, np.float32))


async def test_a_send_that_fails_after_a_thread_handed_it_to_the_loop_fails_the_step():
    elements = OFFLOAD_BYTES // 4
    graph = _graph(
        _node("shape", "Const", dtype=types_pb2.DT_INT32, value=np.int32([elements])),
        _const("one", 1.0),
        _node("big", "Fill", ["shape", "one"], T=_F32),
        _send("fetch", "big"),
    )
    executor = Executor(graph)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ctx = _step_context(pool)
        ctx.rendezvous.send(executor._nodes[3].kernel.key, np.float32(0.0))  # type: ignore[attr-defined]
        with pytest.raises(errors.InternalError, match="already sent") as raised:
            await executor.run(ctx)
    assert raised.value.node_name == "fetch"


async def test_a_cancelled_step_stops_its_thread_before_the_next_node(monkeypatch):
    from distserver.runtime import executor as executor_module

    ran: list[str] = []
    entered, release = threading.Event(), threading.Event()
    original = executor_module._run_node

    def blocking(node, ctx, inputs):
        ran.append(node.kernel.name)
        if node.kernel.name == "big":
            entered.set()
            release.wait(10)
        return original(node, ctx, inputs)

    monkeypatch.setattr(executor_module, "_run_node", blocking)
    with ds.Graph().as_default() as graph:
        big = ds.fill([OFFLOAD_BYTES // 4], np.float32(1.0), name="big")
        ds.negative(ds.negative(big, name="a"), name="b")
    executor = Executor(graph.as_graph_def())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stepping = asyncio.ensure_future(executor.run(_step_context(pool)))
        assert await asyncio.to_thread(entered.wait, 10)
        stepping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stepping
        release.set()
    assert ran == ["big"]


def _marked_partition() -> Executor:
    """A partition the planner marked to wait for its receives at once: w and v from
    the ps, their sum fetched, and `early` (needing no receive) sent to the ps first."""
    peer = "/job:ps/replica:0/task:0"
    receives = [_recv("w", peer), _recv("v", peer)]
    for receive in receives:
        receive.attr["_receives_first"].b = True  # (`plan.mark_receives_first`)
    return Executor(
        _graph(
            *receives,
            _node("sum", "AddV2", ["w", "v"], T=_F32),
            _send("fetch", "sum"),
            _const("c", 4.0),
            _node("early", "Square", ["c"], T=_F32),  # needs no receive: runs before the wait
            _send("to_ps", "early", peer),
        )
    )


async def test_a_marked_partition_runs_what_needs_no_receive_then_waits_for_them_all(monkeypatch):
    from distserver.runtime import executor as executor_module

    straight_runs = []
    original = executor_module._Straight.run

    async def counting(self, ctx, outputs, start, end):
        straight_runs.append((ctx.step_id, start, end))
        await original(self, ctx, outputs, start, end)

    monkeypatch.setattr(executor_module._Straight, "run", counting)
    fetches: dict[str, asyncio.Future[tuple[Any, bool]]] = {}

    def fetch_remote(step_id: int, key: Any, together: bool) -> asyncio.Future[tuple[Any, bool]]:
        fetches[key.tensor_name] = asyncio.get_running_loop().create_future()
        return fetches[key.tensor_name]

    executor = _marked_partition()
    straight = executor._straight
    assert straight is not None
    assert straight.gated
    assert [e.node.kernel.name for e in straight.program[: straight.gate]] == ["early", "to_ps"]
    ctx = _step_context(None)
    ctx.rendezvous = StepRendezvous(1, TASK, fetch_remote)
    stepping = asyncio.ensure_future(executor.run(ctx))
    await asyncio.sleep(0.01)
    # Sent before the step waits (the ps may need it to send w and v).
    assert await ctx.rendezvous.recv_local(executor._nodes[6].kernel.key) == (np.float32(16.0), False)  # type: ignore[attr-defined]
    fetches["w"].set_result((np.float32(1.0), False))
    await asyncio.sleep(0.01)
    assert not stepping.done()  # v is still on its way
    fetches["v"].set_result((np.float32(2.0), False))
    await asyncio.wait_for(stepping, 10)
    assert straight_runs == [(1, 0, 2), (1, 2, 4)]
    assert await ctx.rendezvous.recv_local(executor._nodes[3].kernel.key) == (np.float32(3.0), False)  # type: ignore[attr-defined]
    # One receive fails: the step fails at once, naming it, without waiting for the other.
    ctx = dataclasses.replace(_step_context(None), step_id=2)
    ctx.rendezvous = StepRendezvous(2, TASK, fetch_remote)
    stepping = asyncio.ensure_future(executor.run(ctx))
    await asyncio.sleep(0.01)
    fetches["v"].set_exception(errors.UnavailableError("ps is gone"))
    with pytest.raises(errors.UnavailableError) as raised:
        await asyncio.wait_for(stepping, 10)
    assert raised.value.node_name == "v"
    assert fetches["w"].cancelled()
    assert straight_runs[2:] == [(2, 0, 2)]


async def test_a_marked_partition_asks_for_its_receives_after_its_first_span_has_handed_over_its_sends():
    """A ps's first span sends the worker what it waits for: the step's other receives
    are made only after that span has sent its values and the loop has handed them to
    the peer waiting for them, never before."""
    loop = asyncio.get_running_loop()
    executor = _marked_partition()
    assert executor._straight is not None
    assert executor._straight.gated
    early_key = executor._nodes[6].kernel.key  # type: ignore[attr-defined]
    fetches: dict[str, asyncio.Future[tuple[Any, bool]]] = {}
    answered: list[bool] = []
    made_after: list[tuple[bool, bool]] = []  # (the early value sent, its waiter answered)

    def fetch_remote(step_id: int, key: Any, together: bool) -> asyncio.Future[tuple[Any, bool]]:
        made_after.append((slot.done(), bool(answered)))
        fetches[key.tensor_name] = loop.create_future()
        return fetches[key.tensor_name]

    ctx = _step_context(None)
    ctx.rendezvous = StepRendezvous(1, TASK, fetch_remote)
    (slot,) = ctx.rendezvous.slots([early_key])

    async def peer_waiting() -> None:  # (as a RecvTensors answer waits on the slot)
        await slot
        answered.append(True)

    waiting = asyncio.ensure_future(peer_waiting())
    await asyncio.sleep(0)
    stepping = asyncio.ensure_future(executor.run(ctx))
    await asyncio.sleep(0.01)
    assert made_after == [(True, True), (True, True)]
    fetches["w"].set_result((np.float32(1.0), False))
    fetches["v"].set_result((np.float32(2.0), False))
    await asyncio.wait_for(stepping, 10)
    await waiting
    assert await ctx.rendezvous.recv_local(executor._nodes[3].kernel.key) == (np.float32(3.0), False)  # type: ignore[attr-defined]


def test_a_variable_read_by_the_node_that_starts_a_run_in_a_thread_is_still_updated_in_place():
    # The run's first node (a product with the variable, large) reads the variable; once
    # that node has run, nothing (the loop's frame, the pool's work item) may keep its
    # inputs, or the update the same run makes later would find the variable shared
    # and copy it.
    from distserver.kernels.state import OPTIMIZER_UPDATES

    side = 512  # a 1 MiB variable
    server = ds.Server.create_local_server()
    try:
        with ds.Graph().as_default() as graph:
            v = ds.Variable(np.full((side, side), 0.5, np.float32), name="v")
            loss = ds.reduce_sum(ds.matmul(ds.constant(np.ones((1, side), np.float32)), v.read_value()))
            train = ds.train.GradientDescentOptimizer(0.25).minimize(loss)
            init = ds.global_variables_initializer()
        with ds.Session(server.target, graph=graph) as session:
            session.run(init)
            before = (OPTIMIZER_UPDATES.in_place, OPTIMIZER_UPDATES.copied)
            losses = [session.run([loss, train])[0] for _ in range(3)]
            after = (OPTIMIZER_UPDATES.in_place, OPTIMIZER_UPDATES.copied)
            value = session.run(v.read_value())
    finally:
        server.stop()
    assert (after[0] - before[0], after[1] - before[1]) == (3, 0)
    assert losses == [side * side * 0.5, side * side * 0.25, 0.0]
    np.testing.assert_array_equal(value, np.full((side, side), -0.25, np.float32))


def test_kernels_asked_before_every_layer_weigh_their_calls_as_the_executor_would(monkeypatch):
    # A fused dense layer and a fused layer gradient count, in one call, what
    # `OpKernel.work_nbytes` counts (their inputs' bytes and `output_nbytes`), for the
    # inputs of a real step and for inputs their fast path does not take; a grouped
    # update counts its gradients (the rest are handles and scalars).
    from distserver.kernels.math import FUSED_MATMUL_GRAD_OP, FUSED_MATMUL_OP
    from distserver.kernels.registry import OpKernel
    from distserver.kernels.state import GROUPED_UPDATES_OP
    from distserver.runtime import executor

    asked: dict[str, list[tuple[Any, list[Any]]]] = {}
    large = executor._large

    def recording(kernel: Any, inputs: list[Any]) -> bool:
        asked.setdefault(kernel.op, []).append((kernel, list(inputs)))
        return large(kernel, inputs)

    monkeypatch.setattr(executor, "_large", recording)
    # The layers one by one (a stack weighs its members: `test_dense_stacks.py`).
    monkeypatch.setattr(executor, "_stack_dense_layers", lambda nodes, control_sources: None)
    rng = np.random.default_rng(3)
    server = ds.Server.create_local_server()
    try:
        with ds.Graph().as_default() as graph:
            x = ds.placeholder(ds.float32, [16, 8], name="x")
            w1 = ds.Variable(rng.standard_normal((8, 12)).astype(np.float32), name="w1")
            b1 = ds.Variable(np.zeros(12, np.float32), name="b1")
            w2 = ds.Variable(rng.standard_normal((12, 4)).astype(np.float32), name="w2")
            b2 = ds.Variable(np.zeros(4, np.float32), name="b2")
            hidden = ds.relu(ds.matmul(x, w1) + b1)
            loss = ds.reduce_sum(ds.square(ds.tanh(ds.matmul(hidden, w2) + b2)))
            train = ds.train.MomentumOptimizer(0.01, 0.9).minimize(loss)
            init = ds.global_variables_initializer()
        with ds.Session(server.target, graph=graph) as session:
            session.run(init)
            session.run(train, {x: rng.standard_normal((16, 8)).astype(np.float32)})
    finally:
        server.stop()
    assert len(asked[FUSED_MATMUL_OP]) == 2
    assert sorted(len(inputs) for _, inputs in asked[FUSED_MATMUL_GRAD_OP]) == [
        5,
        6,
    ]  # (w1's: no input gradient)
    (grouped,) = asked[GROUPED_UPDATES_OP]
    for kernel, inputs in asked[FUSED_MATMUL_OP] + asked[FUSED_MATMUL_GRAD_OP]:
        assert kernel.work_nbytes(inputs) == OpKernel.work_nbytes(kernel, inputs) > 0
        for odd in (
            [inputs[0].ravel(), *inputs[1:]],  # a vector: no product to count
            [inputs[0].tolist(), *inputs[1:]],  # not an array
            [inputs[0][None], *inputs[1:]],  # three dimensions
        ):
            assert kernel.work_nbytes(odd) == OpKernel.work_nbytes(kernel, odd)
    kernel, inputs = grouped
    gradients = [
        value
        for value in inputs
        if isinstance(value, np.ndarray) and value.dtype == np.float32 and value.ndim
    ]
    assert len(gradients) == 4
    assert kernel.work_nbytes(inputs) == sum(g.nbytes for g in gradients) == (8 * 12 + 12 + 12 * 4 + 4) * 4


@pytest.mark.parametrize("inputs", [["c:1"], ["c", "c:1"]], ids=["one-input", "two-inputs"])
def test_a_node_reading_an_output_its_producer_lacks_gets_an_error_naming_both(inputs):
    # Refused when the graph is registered, as TensorFlow's import refuses it (before,
    # the step's straight sequence, which takes one or two inputs itself, found it).
    c = _node("c", "Const", dtype=_F32, value=np.array(2.0, np.float32))
    op = "Neg" if len(inputs) == 1 else "AddV2"
    missing = r"'n': Connecting to invalid output 1 of source node c which has 1 outputs"
    with pytest.raises(errors.InvalidArgumentError, match=missing):
        Executor(_graph(c, _node("n", op, inputs, T=_F32)))


def test_a_graph_whose_nodes_do_not_fit_their_ops_signatures_is_refused_when_registered():
    # A master imports and checks its graphs; a graph another task registers is checked
    # here (an ad-hoc fuzz of RegisterGraph found both as IndexError and TypeError).
    x = _node("x", "Const", value=np.ones((2, 3), np.float32), dtype=_F32)
    tile = _node("tile", "Tile", ["x"], T=_F32, Tmultiples=types_pb2.DT_INT32)
    with pytest.raises(
        errors.InvalidArgumentError, match=r"'tile' \(Tile\) takes 2 inputs with its attrs, got 1"
    ):
        Executor(_graph(x, tile))
    nothing = _node("nothing", "NoOp")
    reads = _node("reads", "Identity", ["nothing"], T=_F32)
    with pytest.raises(
        errors.InvalidArgumentError,
        match="'reads': Connecting to invalid output 0 of source node nothing which has 0",
    ):
        Executor(_graph(nothing, reads))
    with pytest.raises(
        errors.InvalidArgumentError, match="Connecting to invalid output 1 of source node x which has 1"
    ):
        Executor(_graph(x, _node("second", "Identity", ["x:1"], T=_F32)))
    # A count an attr the NodeDef lacks would size (defaults stripped) is not checked.
    add = _node("add", "AddN", ["x", "x"], T=_F32)
    assert "N" not in add.attr
    Executor(_graph(x, add))
