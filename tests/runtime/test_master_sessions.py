"""The master checks a client's graph before taking it, and closes sessions nobody uses."""

from __future__ import annotations

import asyncio
import re

import pytest

from distserver import errors
from distserver.protos import master_pb2 as m
from distserver.protos.graph_pb2 import GraphDef
from distserver.runtime.clients import RemoteMaster
from distserver.server import AsyncServer
from distserver.transports import get_transport

LOCAL = {"localhost": ["localhost:0"]}


def _graph(*nodes: tuple[str, str, list[str]]) -> GraphDef:
    graph = GraphDef()
    for name, op, inputs in nodes:
        node = graph.node.add(name=name, op=op, input=inputs)
        if op == "Const":
            node.attr["dtype"].type = 1
            node.attr["value"].tensor.dtype = 1
            node.attr["value"].tensor.float_val.append(1.0)
        elif op != "NoOp":
            node.attr["T"].type = 1
    return graph


@pytest.fixture
async def master():
    async with AsyncServer(LOCAL) as server:
        channel = get_transport("grpc").connect(server.target.removeprefix("grpc://"))
        try:
            yield RemoteMaster(channel)
        finally:
            await channel.close()


async def _create(master, graph: GraphDef) -> m.CreateSessionResponse:
    return await master.call("CreateSession", m.CreateSessionRequest(graph_def=graph))


@pytest.mark.parametrize(
    ("graph", "message"),
    [
        (_graph(("a", "Const", []), ("a", "Const", [])), "Duplicate node name in graph: 'a'"),
        (_graph(("a", "Const", []), ("b", "Neg", ["nowhere"])), "Node 'b': Unknown input node 'nowhere'"),
        (_graph(("a", "Const", []), ("b", "Neg", ["^gone"])), "Unknown input node '^gone'"),
        (
            _graph(("a", "Const", []), ("b", "Add", ["a", "c"]), ("c", "Neg", ["b"])),
            "contains a cycle with 2 nodes",
        ),
    ],
    ids=["duplicate", "unknown-input", "unknown-control-input", "cycle"],
)
async def test_a_bad_graph_is_refused_at_create_session(master, graph, message):
    with pytest.raises(errors.InvalidArgumentError, match=re.escape(message)):
        await _create(master, graph)


async def test_extend_session_checks_the_new_nodes_against_the_graph_so_far(master):
    created = await _create(master, _graph(("a", "Const", [])))

    async def extend(graph: GraphDef, version: int) -> m.ExtendSessionResponse:
        request = m.ExtendSessionRequest(
            session_handle=created.session_handle, graph_def=graph, current_graph_version=version
        )
        return await master.call("ExtendSession", request)

    with pytest.raises(errors.InvalidArgumentError, match="Node 'a' is already in the graph"):
        await extend(_graph(("a", "Const", [])), created.graph_version)
    with pytest.raises(errors.InvalidArgumentError, match="Unknown input node 'x'"):
        await extend(_graph(("b", "Neg", ["x"])), created.graph_version)
    extended = await extend(_graph(("b", "Neg", ["a"])), created.graph_version)  # inputs may be old nodes
    assert extended.new_graph_version == created.graph_version + 1


async def test_a_large_graph_is_imported_without_stalling_the_task(master):
    """Checking a 100k-node graph runs off the event loop: other calls keep being answered."""
    graph = _graph(("n0", "Const", []), *((f"n{i}", "Neg", [f"n{i - 1}"]) for i in range(1, 100_000)))
    loop = asyncio.get_running_loop()
    create = asyncio.ensure_future(_create(master, graph))
    gaps = []
    while not create.done():
        started = loop.time()
        await master.call("ListDevices", m.ListDevicesRequest(), timeout=30)
        gaps.append(loop.time() - started)
    assert (await create).session_handle
    assert len(gaps) > 1  # answered while the graph was checked


async def test_idle_sessions_are_closed_and_used_ones_kept():
    async with AsyncServer(LOCAL, session_gc_seconds=0.5) as server:
        channel = get_transport("grpc").connect(server.target.removeprefix("grpc://"))
        master = RemoteMaster(channel)
        try:
            idle = (await _create(master, _graph(("a", "Const", [])))).session_handle
            used = (await _create(master, _graph(("a", "Const", [])))).session_handle
            for _ in range(15):  # 1.5 s: three GC periods, `used` busy all along
                assert await master.run_step(used, {}, ["a:0"], []) == {"a:0": 1.0}
                await asyncio.sleep(0.1)
            with pytest.raises(errors.AbortedError, match=f"Session {idle} is not found"):
                await master.run_step(idle, {}, ["a:0"], [])
            assert await master.run_step(used, {}, ["a:0"], []) == {"a:0": 1.0}
        finally:
            await channel.close()
