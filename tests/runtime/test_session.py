"""Sessions running graphs on one task, in-process and over real gRPC (same assertions)."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.protos.config_pb2 import ConfigProto, RunOptions
from distserver.runtime.master import Master


@pytest.fixture(params=["inprocess", "grpc"])
def mode(request):
    return request.param


@pytest.fixture
async def server():
    async with ds.AsyncServer({"localhost": ["localhost:0"]}) as server:
        yield server


def session_config(mode: str, **fields) -> ConfigProto:
    config = ConfigProto(**fields)
    config.rpc_options.use_rpc_for_inprocess_master = mode == "grpc"
    return config


@pytest.fixture
async def make_session(server, mode):
    sessions = []

    def make(graph, **config_fields):
        session = ds.AsyncSession(server.target, graph=graph, config=session_config(mode, **config_fields))
        sessions.append(session)
        return session

    yield make
    for session in sessions:  # tests that did not use `async with`
        await session.close()


async def test_the_shortcut_is_taken_only_in_process(server, mode):
    graph = ds.Graph()
    with graph.as_default():
        ds.constant(1.0, name="c")
    async with ds.AsyncSession(server.target, graph=graph, config=session_config(mode)) as session:
        await session.run("c:0")

        assert isinstance(session._master, Master) is (mode == "inprocess")


async def test_arithmetic_with_feeds(make_session):
    graph = ds.Graph()
    with graph.as_default():
        x = ds.placeholder(ds.float32, shape=[None, 3], name="x")
        y = ds.placeholder(ds.float32, shape=[3, 2], name="y")
        z = ds.matmul(x, y) * 2.0 - 1.0
        total = ds.reduce_sum(z, axis=1)
    async with make_session(graph) as session:
        xv = np.arange(6, dtype=np.float32).reshape(2, 3)
        yv = np.ones((3, 2), np.float32)
        zv, tv = await session.run([z, total], feed_dict={x: xv, y: yv})
        np.testing.assert_allclose(zv, xv @ yv * 2 - 1)
        np.testing.assert_allclose(tv, (xv @ yv * 2 - 1).sum(axis=1))
        assert zv.dtype == np.float32


async def test_nested_fetch_structures(make_session):
    graph = ds.Graph()
    Pair = collections.namedtuple("Pair", ["a", "b"])
    with graph.as_default():
        a = ds.constant(1, name="a")
        b = ds.constant([2, 3], name="b")
        noop = ds.no_op(name="noop")
    async with make_session(graph) as session:
        result = await session.run({"x": [a, (b, noop)], "y": Pair(a, "b:0"), "z": a})
        assert result["x"][0] == 1
        assert isinstance(result["x"][1], tuple)
        np.testing.assert_array_equal(result["x"][1][0], [2, 3])
        assert result["x"][1][1] is None
        assert isinstance(result["y"], Pair)
        assert result["y"].a == 1
        np.testing.assert_array_equal(result["y"].b, [2, 3])
        assert await session.run(noop) is None


async def test_feeding_a_non_placeholder_tensor(make_session):
    graph = ds.Graph()
    with graph.as_default():
        a = ds.constant(2.0, name="a")
        b = a * 3.0
        c = b + 1.0
    async with make_session(graph) as session:
        assert await session.run(c) == 7.0
        assert await session.run(c, feed_dict={b: 10.0}) == 11.0
        assert await session.run(c, feed_dict={"a:0": 0.0}) == 1.0
        # Fetching a fed tensor returns the fed value.
        assert await session.run(b, feed_dict={b: 5.0}) == 5.0


async def test_control_dependencies_and_group(make_session):
    graph = ds.Graph()
    with graph.as_default():
        v = ds.Variable(0.0, name="v")
        inc = v.assign_add(1.0)
        with ds.control_dependencies([inc]):
            after = ds.identity(ds.constant(5.0), name="after")
        both = ds.group(v.assign_add(10.0), v.assign_add(100.0), name="both")
        read = v.read_value()
    async with make_session(graph) as session:
        await session.run(v.initializer)
        assert await session.run(after) == 5.0
        assert await session.run(read) == 1.0
        assert await session.run(both) is None
        assert await session.run(read) == 111.0


async def test_a_control_dependency_on_a_fed_placeholder_waits_for_the_feed(make_session):
    graph = ds.Graph()
    with graph.as_default():
        p = ds.placeholder(ds.float32, shape=[], name="p")
        with ds.control_dependencies([p]):
            after = ds.identity(ds.constant(5.0), name="after")
        total = after + p
    async with make_session(graph) as session:
        assert await session.run(after, {p: 1.0}) == 5.0
        assert await session.run(total, {p: 2.0}) == 7.0
        with pytest.raises(errors.InvalidArgumentError, match="You must feed a value for placeholder"):
            await session.run(after)


async def test_full_trace_fills_step_stats_and_partition_graphs(make_session):
    graph = ds.Graph()
    with graph.as_default():
        x = ds.placeholder(ds.float32, shape=[2], name="x")
        total = ds.reduce_sum(x * 3.0, name="total")
    async with make_session(graph) as session:
        options = RunOptions(trace_level=RunOptions.FULL_TRACE, output_partition_graphs=True)
        metadata = ds.RunMetadata()
        assert await session.run(total, {x: [1, 2]}, options=options, run_metadata=metadata) == 9.0
        (device,) = metadata.step_stats.dev_stats
        assert device.device.endswith("/device:CPU:0")
        timed = {n.node_name: n for n in device.node_stats}
        assert "total" in timed
        assert timed["total"].all_start_micros > 0
        assert timed["total"].timeline_label.startswith("total = Sum(")
        assert any(n.name == "total" for g in metadata.partition_graphs for n in g.node)
        quiet = ds.RunMetadata()
        await session.run(total, {x: [1, 2]}, run_metadata=quiet)
        assert quiet == ds.RunMetadata()


async def test_variables_persist_across_runs_sessions_and_reset_clears_them(server, mode):
    graph = ds.Graph()
    with graph.as_default():
        v = ds.Variable(np.zeros(3, np.float32), name="counter")
        update = v.assign_add(np.ones(3, np.float32))
        read = v.read_value()
    config = session_config(mode)
    async with ds.AsyncSession(server.target, graph=graph, config=config) as first:
        await first.run(v.initializer)
        await first.run(update)
        await first.run(update)
        np.testing.assert_array_equal(await first.run(read), [2, 2, 2])
    async with ds.AsyncSession(server.target, graph=graph, config=config) as second:
        np.testing.assert_array_equal(await second.run(read), [2, 2, 2])
    await ds.AsyncSession.reset(server.target, config=config)
    async with ds.AsyncSession(server.target, graph=graph, config=config) as third:
        with pytest.raises(errors.FailedPreconditionError) as info:
            await third.run(read)
        assert "counter" in str(info.value)


async def test_isolate_session_state(server, mode):
    graph = ds.Graph()
    with graph.as_default():
        v = ds.Variable(7.0, name="private")
        read = v.read_value()
    async with ds.AsyncSession(
        server.target, graph=graph, config=session_config(mode, isolate_session_state=True)
    ) as isolated:
        await isolated.run(v.initializer)
        assert await isolated.run(read) == 7.0
        async with ds.AsyncSession(server.target, graph=graph, config=session_config(mode)) as shared:
            with pytest.raises(errors.FailedPreconditionError):
                await shared.run(read)


async def test_errors_name_the_failing_node(make_session):
    graph = ds.Graph()
    with graph.as_default():
        a = ds.placeholder(ds.float32, shape=[None], name="a")
        b = ds.placeholder(ds.float32, shape=[None], name="b")
        total = ds.add(a, b, name="the_sum")
        missing = ds.placeholder(ds.float32, name="never_fed")
        uses_missing = ds.identity(missing, name="uses_missing")
    async with make_session(graph) as session:
        with pytest.raises(errors.InvalidArgumentError, match="the_sum") as info:
            await session.run(total, feed_dict={a: [1.0, 2.0], b: [1.0, 2.0, 3.0]})
        assert "Incompatible shapes" in info.value.message
        with pytest.raises(errors.InvalidArgumentError, match="never_fed"):
            await session.run(uses_missing)
        with pytest.raises(ValueError, match=r"does not exist|cannot be interpreted"):
            await session.run("nope:0")


async def test_step_that_exceeds_its_timeout(make_session):
    graph = ds.Graph()
    with graph.as_default():
        queue = ds.FIFOQueue(capacity=1, dtypes=[ds.float32], name="q")
        dequeue = queue.dequeue()
    async with make_session(graph) as session:
        options = RunOptions(timeout_in_ms=200)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(errors.DeadlineExceededError):
            await session.run(dequeue, options=options)
        assert loop.time() - started < 10


async def test_session_default_operation_timeout(server, mode):
    graph = ds.Graph()
    with graph.as_default():
        queue = ds.FIFOQueue(capacity=1, dtypes=[ds.float32], name="q2")
        dequeue = queue.dequeue()
    config = session_config(mode, operation_timeout_in_ms=200)
    async with ds.AsyncSession(server.target, graph=graph, config=config) as session:
        with pytest.raises(errors.DeadlineExceededError):
            await session.run(dequeue)


async def test_100_concurrent_runs_give_correct_results(make_session):
    graph = ds.Graph()
    with graph.as_default():
        x = ds.placeholder(ds.int64, shape=[], name="x")
        y = x * x + 1
    async with make_session(graph) as session:
        results = await asyncio.gather(*(session.run(y, feed_dict={x: i}) for i in range(100)))
        assert [int(r) for r in results] == [i * i + 1 for i in range(100)]


async def test_graph_grows_between_runs(make_session):
    graph = ds.Graph()
    with graph.as_default():
        a = ds.constant(3.0, name="a")
    async with make_session(graph) as session:
        assert await session.run(a) == 3.0
        with graph.as_default():
            b = a * 2.0
        assert await session.run(b) == 6.0
        with graph.as_default():
            c = b + a
        assert await session.run([a, b, c]) == [3.0, 6.0, 9.0]


async def test_make_callable(make_session):
    graph = ds.Graph()
    with graph.as_default():
        x = ds.placeholder(ds.float32, shape=[2], name="x")
        y = ds.reduce_sum(x * x)
    async with make_session(graph) as session:
        fn = await session.make_callable(y, feed_list=[x])
        assert await fn([1.0, 2.0]) == 5.0
        assert await fn(np.array([3.0, 4.0], np.float32)) == 25.0


async def test_list_devices(make_session):
    async with make_session(ds.Graph()) as session:
        devices = await session.list_devices()
        assert [d.name for d in devices] == ["/job:localhost/replica:0/task:0/device:CPU:0"]


async def test_closed_session_refuses_runs(make_session):
    graph = ds.Graph()
    with graph.as_default():
        a = ds.constant(1.0)
    session = make_session(graph)
    await session.run(a)
    await session.close()
    with pytest.raises(RuntimeError, match="closed Session"):
        await session.run(a)


async def test_in_process_session_without_target():
    graph = ds.Graph()
    with graph.as_default():
        a = ds.constant([1, 2, 3])
        b = ds.reduce_sum(a)
    async with ds.AsyncSession(graph=graph) as session:
        assert await session.run(b) == 6
