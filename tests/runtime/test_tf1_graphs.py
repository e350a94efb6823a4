"""The master's handling of graphs TF 1.x clients send: unsupported ops, reference variables."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.protos import master_pb2 as m
from distserver.protos.config_pb2 import RunOptions
from distserver.protos.node_def_pb2 import NodeDef
from distserver.runtime.plan import check_kernels, read_refs_late
from distserver.tensors import to_tensor_proto

PS = "/job:ps/replica:0/task:0/device:CPU:0"
WORKER = "/job:worker/replica:0/task:0/device:CPU:0"


def node(name, op, inputs=(), device="", **attrs):
    n = NodeDef(name=name, op=op, input=list(inputs), device=device)
    for key, value in attrs.items():
        if not isinstance(value, int):
            n.attr[key].tensor.CopyFrom(to_tensor_proto(np.asarray(value)))
        else:
            n.attr[key].type = value
    return n


def graph_def(*nodes):
    from distserver.protos.graph_pb2 import GraphDef

    graph = GraphDef()
    graph.node.extend(nodes)
    return graph


@pytest.fixture
async def master():
    async with ds.AsyncServer({"localhost": ["localhost:0"]}) as server:
        yield server.master


def test_check_kernels_names_every_unsupported_op_and_a_node():
    graph = graph_def(
        node("a", "Const", dtype=1, value=np.float32(1)),
        node("s1", "Svd", ["a"]),
        node("s2", "Svd", ["a"]),
        node("w", "WriteFile", ["a"]),
    )
    with pytest.raises(errors.UnimplementedError) as info:
        check_kernels(graph)
    message = info.value.message
    assert "'Svd' (node 's1' and 1 more)" in message
    assert "'WriteFile' (node 'w')" in message
    assert "docs/tf-compat.md" in message
    assert info.value.node_name == "s1"


def test_check_kernels_explains_control_flow():
    hint = "SymbolicGradient and RemoteCall are not supported"
    with pytest.raises(errors.UnimplementedError, match=re.escape(hint)):
        check_kernels(graph_def(node("c", "SymbolicGradient")))


async def test_create_session_refuses_unsupported_ops_before_contacting_workers(master):
    request = m.CreateSessionRequest(graph_def=graph_def(node("s", "Svd")))
    with pytest.raises(errors.UnimplementedError, match="'Svd' \\(node 's'\\)"):
        await master.create_session(request)
    assert master._sessions == {}


async def test_extend_session_refuses_unsupported_ops_and_keeps_the_graph(master):
    created = await master.create_session(
        m.CreateSessionRequest(graph_def=graph_def(node("a", "Const", dtype=1, value=np.float32(2))))
    )
    handle = created.session_handle
    with pytest.raises(errors.UnimplementedError, match="Svd"):
        await master.extend_session(
            m.ExtendSessionRequest(session_handle=handle, graph_def=graph_def(node("s", "Svd", ["a"])))
        )
    assert "s" not in master._sessions[handle].nodes
    assert (await master.run_step(handle, {}, ["a:0"], []))["a:0"] == 2.0


async def test_partial_run_setup_is_refused(master):
    created = await master.create_session(m.CreateSessionRequest())
    with pytest.raises(errors.UnimplementedError, match="Partial runs"):
        await master.partial_run_setup(m.PartialRunSetupRequest(session_handle=created.session_handle))


async def test_reference_variables_end_to_end(master):
    value = np.array([1.0, 2.0], np.float32)
    nodes = [
        node("v", "VariableV2", dtype=1),
        node("init_value", "Const", dtype=1, value=value),
        node("init", "Assign", ["v", "init_value"], T=1),
        node("step", "Const", dtype=1, value=np.full(2, 10, np.float32)),
        node("bump", "AssignAdd", ["v", "step"], T=1),
        node("read_after", "Identity", ["v", "^bump"], T=1),
        node("is_init", "IsVariableInitialized", ["v"], dtype=1),
    ]
    handle = (await master.create_session(m.CreateSessionRequest(graph_def=graph_def(*nodes)))).session_handle
    assert not (await master.run_step(handle, {}, ["is_init:0"], []))["is_init:0"]
    with pytest.raises(errors.FailedPreconditionError, match="Attempting to use uninitialized value v"):
        await master.run_step(handle, {}, ["v:0"], [])
    await master.run_step(handle, {}, [], ["init"])
    np.testing.assert_array_equal((await master.run_step(handle, {}, ["v:0"], []))["v:0"], value)
    after = await master.run_step(handle, {}, ["read_after:0", "bump:0"], [])
    np.testing.assert_array_equal(after["read_after:0"], value + 10)
    np.testing.assert_array_equal(after["bump:0"], value + 10)


def test_a_cross_task_read_of_a_reference_waits_for_the_consumers_control_inputs():
    variable = node("v", "VariableV2", device=PS)
    update = node("bump", "AssignAdd", ["v", "one"], device=PS)
    read = node("read", "Identity", ["v", "^bump"], device=WORKER)
    plain = node("plain", "Identity", ["v"], device=WORKER)
    nodes = [variable, update, read, plain]
    read_refs_late(nodes)
    late = nodes[-1]
    assert (late.op, late.device, list(late.input)) == ("Identity", PS, ["v", "^bump"])
    assert list(nodes[2].input) == [late.name, "^bump"]
    assert nodes[2] is not read  # the session's NodeDef is left alone
    assert list(read.input) == ["v", "^bump"]
    assert list(nodes[3].input) == ["v"]  # no control inputs: nothing to wait for
    assert len(nodes) == 5


def test_a_snapshot_read_after_an_in_place_update_reads_the_variable_again():
    # SyncReplicasOptimizer's tokens: fill(n, global_step/read) ordered after the
    # update that increments the global step (through `dims`' control input).
    nodes = [
        node("gs", "VariableV2", device=PS),
        node("gs/read", "Identity", ["gs"], device=PS),
        node("bump", "AssignAdd", ["gs", "one"], device=PS),
        node("dims", "Const", ["^bump"], device=PS),
        node("tokens", "Fill", ["dims", "gs/read"], device=PS),
        node("before", "Mul", ["gs/read", "two"], device=WORKER),  # does not follow the update
    ]
    original = nodes[4]
    read_refs_late(nodes)
    late = nodes[-1]
    assert (late.op, late.device, list(late.input)) == ("Identity", PS, ["gs", "^bump"])
    assert list(nodes[4].input) == ["dims", late.name]
    assert list(original.input) == ["dims", "gs/read"]  # the session's NodeDef is left alone
    assert list(nodes[5].input) == ["gs/read", "two"]
    assert len(nodes) == 7


async def test_a_snapshot_consumer_after_an_update_sees_the_update(master):
    one = np.array(1, np.int64)
    nodes = [
        node("gs", "VariableV2", dtype=9),
        node("zero", "Const", dtype=9, value=np.array(0, np.int64)),
        node("init", "Assign", ["gs", "zero"], T=9),
        node("gs/read", "Identity", ["gs"], T=9),
        node("one", "Const", dtype=9, value=one),
        node("bump", "AssignAdd", ["gs", "one"], T=9),
        node("dims", "Const", ["^bump"], dtype=3, value=np.array([2], np.int32)),
        node("tokens", "Fill", ["dims", "gs/read"], T=9),
    ]
    handle = (await master.create_session(m.CreateSessionRequest(graph_def=graph_def(*nodes)))).session_handle
    await master.run_step(handle, {}, [], ["init"])
    tokens = (await master.run_step(handle, {}, ["tokens:0"], []))["tokens:0"]
    np.testing.assert_array_equal(tokens, [1, 1])


def _accumulator_graph():
    graph = graph_def(
        node("acc", "ResourceConditionalAccumulator", dtype=1),
        node("two", "Const", dtype=3, value=np.int32(2)),
        node("take", "ResourceAccumulatorTakeGradient", ["acc", "two"], dtype=1),
        node("step", "Const", dtype=9, value=np.int64(0)),
        node("grad", "Const", dtype=1, value=np.array([1.0, 3.0], np.float32)),
        node("apply", "ResourceAccumulatorApplyGradient", ["acc", "step", "grad"], dtype=1),
    )
    accumulator = graph.node[0]
    accumulator.attr["shape"].shape.dim.add(size=2)
    accumulator.attr["reduction_type"].s = b"MEAN"
    accumulator.attr["shared_name"].s = b"acc"
    return graph


async def test_a_waiting_take_gradient_is_withdrawn_by_a_timeout_and_by_closing_the_session(master):
    graph = _accumulator_graph()
    handle = (await master.create_session(m.CreateSessionRequest(graph_def=graph))).session_handle
    with pytest.raises(errors.DeadlineExceededError):
        await master.run_step(handle, {}, ["take:0"], [], options=RunOptions(timeout_in_ms=300))
    waiting = asyncio.create_task(master.run_step(handle, {}, ["take:0"], []))
    await master.run_step(handle, {}, [], ["apply"])
    await asyncio.sleep(0.2)  # the take waits for a second gradient: nothing to poll for
    assert not waiting.done()
    await master.close_session(m.CloseSessionRequest(session_handle=handle))
    with pytest.raises(errors.OpError):
        await asyncio.wait_for(waiting, 30)
    # Neither withdrawn take took anything: a new session finds one gradient and adds one.
    handle = (await master.create_session(m.CreateSessionRequest(graph_def=graph))).session_handle
    await master.run_step(handle, {}, [], ["apply"])
    result = await asyncio.wait_for(master.run_step(handle, {}, ["take:0"], []), 30)
    np.testing.assert_array_equal(result["take:0"], [1.0, 3.0])
