"""AsyncServer lifecycle: TF's observable behaviour plus clean stop, join(timeout), port release."""

from __future__ import annotations

import asyncio
import socket

import pytest

import distserver as ds
from distserver import errors
from distserver.protos.master_pb2 import ListDevicesRequest
from distserver.runtime.clients import RemoteMaster
from distserver.server import AsyncServer, ServerState
from distserver.testing import free_ports
from distserver.transports import get_transport

LOCAL = {"localhost": ["localhost:0"]}


async def list_devices(target: str, timeout: float = 10.0) -> list[str]:
    channel = get_transport("grpc").connect(target.removeprefix("grpc://"))
    try:
        response = await RemoteMaster(channel).call("ListDevices", ListDevicesRequest(), timeout=timeout)
    finally:
        await channel.close()
    return [d.name for d in [*response.local_device, *response.remote_device]]


async def test_port_zero_picks_a_free_port_and_target_shows_it():
    async with AsyncServer(LOCAL) as server:
        host, port = server.target.removeprefix("grpc://").rsplit(":", 1)
        assert host == "localhost"
        assert int(port) > 0
        # The ServerDef is not rewritten with the bound port, as in TF.
        assert server.server_def.cluster.job[0].tasks[0] == "localhost:0"
        assert await list_devices(server.target) == ["/job:localhost/replica:0/task:0/device:CPU:0"]


async def test_start_is_idempotent_and_stop_releases_the_port():
    server = AsyncServer(LOCAL)
    await server.start()
    await server.start()
    port = server.target.rsplit(":", 1)[1]
    await server.stop()
    await server.stop()
    assert server.state is ServerState.STOPPED
    again = AsyncServer({"localhost": [f"localhost:{port}"]})
    await again.start()
    try:
        assert again.target.endswith(f":{port}")
        assert await list_devices(again.target)
    finally:
        await again.stop()


async def test_port_in_use_is_an_unknown_error_naming_the_address():
    async with AsyncServer(LOCAL) as server:
        port = server.target.rsplit(":", 1)[1]
        clash = AsyncServer({"localhost": [f"localhost:{port}"]})
        with pytest.raises(errors.UnknownError, match=f"Could not start gRPC server.*localhost:{port}"):
            await clash.bind()


@pytest.mark.parametrize("held", ["127.0.0.1", "::1"])
async def test_localhost_with_one_loopback_address_taken_is_refused(held):
    """ "localhost:P" must serve every loopback address peers may dial, or not start."""
    family = socket.AF_INET6 if ":" in held else socket.AF_INET
    try:
        other = socket.socket(family, socket.SOCK_STREAM)
        other.bind((held, 0))
    except OSError:
        pytest.skip(f"{held} is not configured here")
    with other:
        other.listen()
        port = other.getsockname()[1]
        clash = AsyncServer({"localhost": [f"localhost:{port}"]})
        with pytest.raises(errors.UnknownError, match=rf"cannot bind .*{port} \(for localhost:{port}\)"):
            await clash.bind()
        assert clash.state is not ServerState.STARTED


async def test_join_on_a_never_started_server_returns_and_forbids_start():
    server = AsyncServer(LOCAL)
    await server.bind()
    assert await server.join() is True
    assert server.state is ServerState.STOPPED
    with pytest.raises(errors.FailedPreconditionError, match=r"^Server has stopped\.$"):
        await server.start()


async def test_join_times_out_then_returns_after_stop():
    async with AsyncServer(LOCAL) as server:
        assert await server.join(timeout=0.05) is False
        joiner = asyncio.create_task(server.join())
        await asyncio.sleep(0)
        assert not joiner.done()
        await server.stop()
        assert await asyncio.wait_for(joiner, 5) is True


async def test_stop_with_grace_cancels_a_call_in_flight():
    from distserver.protos.config_pb2 import ConfigProto

    server = AsyncServer(LOCAL)
    await server.start()
    port = server.target.rsplit(":", 1)[1]
    graph = ds.Graph()
    with graph.as_default():
        blocked = ds.FIFOQueue(capacity=1, dtypes=[ds.float32], name="never_fed").dequeue()
    config = ConfigProto()
    config.rpc_options.use_rpc_for_inprocess_master = True  # a real RPC is in flight
    session = ds.AsyncSession(server.target, graph=graph, config=config)
    step = asyncio.create_task(session.run(blocked))
    for _ in range(500):  # wait until the step is running on the server
        if server.master is not None and any(s.steps for s in server.master._sessions.values()):
            break
        await asyncio.sleep(0.01)
    assert not step.done()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await server.stop(grace=0.2)
    with pytest.raises(errors.OpError):
        await asyncio.wait_for(step, 10)
    assert loop.time() - started < 10
    await session.close()
    # The port is free again at once.
    async with AsyncServer({"localhost": [f"localhost:{port}"]}) as again:
        assert again.target.endswith(f":{port}")


async def test_three_tasks_list_every_device_from_any_task():
    ports = free_ports(3)
    cluster = {"ps": [f"localhost:{ports[0]}"], "worker": [f"localhost:{p}" for p in ports[1:]]}
    servers = [
        AsyncServer(cluster, "ps", 0),
        AsyncServer(cluster, "worker", 0),
        AsyncServer(cluster, "worker", 1),
    ]
    for server in servers:
        await server.start()
    try:
        expected = {
            "/job:ps/replica:0/task:0/device:CPU:0",
            "/job:worker/replica:0/task:0/device:CPU:0",
            "/job:worker/replica:0/task:1/device:CPU:0",
        }
        for server in servers:
            names = await list_devices(server.target)
            assert set(names) == expected
            assert names[0].startswith(server.task)  # own device first (local_device)
    finally:
        for server in servers:
            await server.stop()


async def test_list_devices_names_a_task_that_is_down():
    ports = free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    config_ms = 300
    from distserver.protos.config_pb2 import ConfigProto

    async with AsyncServer(
        cluster, "worker", 0, config=ConfigProto(operation_timeout_in_ms=config_ms)
    ) as server:
        with pytest.raises(errors.UnavailableError, match=r"/job:worker/replica:0/task:1 did not answer"):
            await list_devices(server.target)


@pytest.mark.parametrize(
    ("cluster", "job", "task", "error", "message"),
    [
        (
            {"worker": ["localhost:0"]},
            "worker",
            3,
            errors.InternalError,
            'Task 3 was not defined in job "worker"',
        ),
        ({"worker": ["localhost:0"]}, "ps", 0, errors.InternalError, 'Job "ps" was not defined in cluster'),
        (
            {"worker": ["localhost:http"]},
            "worker",
            0,
            errors.InvalidArgumentError,
            'Could not parse port for local server from "localhost:http".',
        ),
    ],
)
def test_task_validation_errors(cluster, job, task, error, message):
    with pytest.raises(error) as info:
        AsyncServer(cluster, job, task)
    assert info.value.message == message


def test_unknown_protocol_lists_the_available_ones():
    with pytest.raises(errors.NotFoundError, match=r"'carrier-pigeon'.*\[ .*grpc.* \]"):
        AsyncServer(LOCAL, protocol="carrier-pigeon")


def test_missing_job_and_task_use_tf_messages():
    with pytest.raises(ValueError, match=r"^Must specify an explicit `job_name`\.$"):
        AsyncServer({"a": ["localhost:0"], "b": ["localhost:0"]})
    with pytest.raises(ValueError, match=r"^Must specify an explicit `task_index`\.$"):
        AsyncServer({"a": ["localhost:0", "localhost:0"]})


async def test_unimplemented_rpc_answers_unimplemented():
    async with AsyncServer(LOCAL) as server:
        channel = get_transport("grpc").connect(server.target.removeprefix("grpc://"))
        try:
            from distserver.protos.worker_pb2 import LoggingRequest

            with pytest.raises(errors.UnimplementedError, match="Logging is not implemented"):
                await channel.call("tensorflow.WorkerService", "Logging", LoggingRequest(), timeout=5)
        finally:
            await channel.close()


async def test_call_to_a_stopped_server_fails_fast_with_unavailable():
    server = AsyncServer(LOCAL)
    await server.start()
    target = server.target
    await server.stop()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(errors.UnavailableError, match=r"ListDevices to localhost:\d+ failed"):
        await list_devices(target, timeout=30)
    assert loop.time() - started < 10


@pytest.mark.parametrize("everywhere", [False, True])
async def test_binds_only_the_task_host_unless_asked_for_every_interface(everywhere):
    (port,) = free_ports(1)
    server = AsyncServer({"w": [f"127.0.0.1:{port}"]}, listen_on_all_interfaces=everywhere)
    async with server:
        assert await list_devices(f"127.0.0.1:{port}")
        # 127.0.0.2 is another loopback address: reachable only on a wildcard bind.
        if everywhere:
            assert await list_devices(f"127.0.0.2:{port}")
        else:
            with pytest.raises(errors.UnavailableError):
                await list_devices(f"127.0.0.2:{port}", timeout=5)
