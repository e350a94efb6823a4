"""Calls between distserver tasks ride one gRPC stream; other peers get unary calls."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from distserver import errors
from distserver.protos.master_pb2 import ListDevicesRequest, ListDevicesResponse
from distserver.protos.services import MASTER_SERVICE
from distserver.testing import free_ports
from distserver.transports import call_stream, get_transport


@pytest.fixture(autouse=True)
def grpc_only(monkeypatch):
    """These tests are about gRPC's own paths: the direct connection stays off."""
    monkeypatch.setenv("DISTSERVER_DIRECT", "0")


async def serve(handler):
    """A "grpc" listener whose MasterService.ListDevices is `handler`, on a free port."""
    address = f"localhost:{free_ports(1)[0]}"
    listener = await get_transport("grpc").listen(address, {MASTER_SERVICE: {"ListDevices": handler}})
    await listener.start()
    return listener, address


def echo_name(request):
    response = ListDevicesResponse()
    response.local_device.add(name=request.session_handle)
    return response


async def test_concurrent_calls_share_the_stream_and_each_gets_its_own_answer():
    async def list_devices(request):
        # This sleep is the test's point: answers come back out of order.
        await asyncio.sleep(int(request.session_handle) % 5 * 0.01)
        return echo_name(request)

    listener, address = await serve(list_devices)
    channel = get_transport("grpc").connect(address)
    try:
        names = [str(i) for i in range(40)]
        answers = await asyncio.gather(
            *(
                channel.call(MASTER_SERVICE, "ListDevices", ListDevicesRequest(session_handle=n))
                for n in names
            )
        )
        assert [a.local_device[0].name for a in answers] == names
        assert channel._calls is not None
        assert channel._calls._stream is not None  # they went over the stream
    finally:
        await channel.close()
        await listener.stop(None)


async def test_a_caller_that_gives_up_cancels_the_remote_handler():
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def list_devices(request):
        if request.session_handle == "block":
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return echo_name(request)

    listener, address = await serve(list_devices)
    channel = get_transport("grpc").connect(address)
    try:
        blocked = ListDevicesRequest(session_handle="block")
        with pytest.raises(errors.DeadlineExceededError, match=r"ListDevices to .* failed: Deadline"):
            await channel.call(MASTER_SERVICE, "ListDevices", blocked, timeout=1.0)
        assert started.is_set()
        async with asyncio.timeout(5):
            await cancelled.wait()
        # The stream still serves the next call.
        answer = await channel.call(MASTER_SERVICE, "ListDevices", ListDevicesRequest(session_handle="next"))
        assert answer.local_device[0].name == "next"
    finally:
        await channel.close()
        await listener.stop(None)


async def test_a_remote_deadline_error_keeps_its_own_message():
    async def list_devices(request):
        raise errors.DeadlineExceededError("the handler's own deadline")

    listener, address = await serve(list_devices)
    channel = get_transport("grpc").connect(address)
    try:
        with pytest.raises(errors.DeadlineExceededError, match=r"^the handler's own deadline$"):
            await channel.call(MASTER_SERVICE, "ListDevices", ListDevicesRequest(), timeout=5)
    finally:
        await channel.close()
        await listener.stop(None)


async def test_a_peer_without_the_stream_gets_unary_calls():
    """A server like TensorFlow's: only the unary method. The first call finds out and is retried."""
    server = grpc.aio.server()
    calls = []

    async def list_devices(request: bytes, context):
        calls.append(request)
        response = ListDevicesResponse()
        response.local_device.add(name="unary")
        return response.SerializeToString()

    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                MASTER_SERVICE, {"ListDevices": grpc.unary_unary_rpc_method_handler(list_devices)}
            ),
        )
    )
    port = server.add_insecure_port("localhost:0")
    await server.start()
    channel = get_transport("grpc").connect(f"localhost:{port}")
    try:
        for _ in range(3):
            answer = await channel.call(MASTER_SERVICE, "ListDevices", ListDevicesRequest(), timeout=5)
            assert answer.local_device[0].name == "unary"
        assert len(calls) == 3  # each call ran once
        assert channel._calls is None  # and the channel stopped trying the stream
    finally:
        await channel.close()
        await server.stop(None)


async def test_a_stopping_server_ends_its_streams_after_their_calls():
    running, release = asyncio.Event(), asyncio.Event()

    async def list_devices(request):
        if request.session_handle == "slow":
            running.set()
            await release.wait()
        return echo_name(request)

    listener, address = await serve(list_devices)
    channel = get_transport("grpc").connect(address)
    try:
        await channel.call(MASTER_SERVICE, "ListDevices", ListDevicesRequest(session_handle="warm"))
        slow = asyncio.ensure_future(
            channel.call(MASTER_SERVICE, "ListDevices", ListDevicesRequest(session_handle="slow"))
        )
        async with asyncio.timeout(5):
            await running.wait()
        stopping = asyncio.ensure_future(listener.stop(grace=30))
        async with asyncio.timeout(5):  # the stop has begun: the stream is draining
            while not listener.calls.draining:  # noqa: ASYNC110 - a flag, no event to wait on
                await asyncio.sleep(0)
        release.set()
        assert (await slow).local_device[0].name == "slow"  # the running call finished
        async with asyncio.timeout(5):  # the open stream does not hold the stop for the grace
            await stopping
        with pytest.raises(errors.UnavailableError):
            await channel.call(MASTER_SERVICE, "ListDevices", ListDevicesRequest(), timeout=5)
    finally:
        await channel.close()
        await listener.stop(None)


async def test_a_large_response_arrives_whole():
    """Responses above 2 MiB travel as their own message after a short frame."""

    async def list_devices(request):
        response = ListDevicesResponse()
        for i in range(int(request.session_handle)):
            response.local_device.add(name=f"device-{i:08d}-" + "x" * 200)
        return response

    listener, address = await serve(list_devices)
    channel = get_transport("grpc").connect(address)
    try:
        for count in (3, 20_000):  # ~5 KiB and ~4.5 MiB
            request = ListDevicesRequest(session_handle=str(count))
            answer = await channel.call(MASTER_SERVICE, "ListDevices", request, timeout=30)
            assert len(answer.local_device) == count
            assert answer.local_device[-1].name.startswith(f"device-{count - 1:08d}-")
    finally:
        await channel.close()
        await listener.stop(None)


async def test_a_bare_internal_before_any_answer_is_not_taken_for_the_peers_error():
    """A refusal that races the first write surfaces as INTERNAL: the call must go unary,
    not fail; once the peer has answered on a stream, INTERNAL is an ordinary failure."""
    async with grpc.aio.insecure_channel("localhost:1") as channel:
        stream = call_stream.CallStream(
            channel, "localhost:1", lambda exc, method: errors.UnavailableError(method)
        )
        internal = grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            "Internal error from Core",
            None,
        )
        assert isinstance(stream._failure(internal, "RunStep"), call_stream.StreamUnproven)
        stream.answered = True
        assert isinstance(stream._failure(internal, "RunStep"), errors.UnavailableError)


async def test_callers_cancelled_while_writing_leave_the_other_calls_on_the_stream_alone():
    # grpc.aio cancels a whole stream when a write in progress is cancelled; a failed step
    # cancels its other RunGraph calls, which must not fail the calls of concurrent steps.
    async def list_devices(request):
        return echo_name(request)

    listener, address = await serve(list_devices)
    channel = get_transport("grpc").connect(address)
    padding = "x" * 200_000  # writes that take a while
    try:
        await channel.call(MASTER_SERVICE, "ListDevices", ListDevicesRequest(session_handle="open"))
        assert channel._calls is not None
        stream = channel._calls._stream
        for _ in range(10):
            names = [f"{i}{padding}" for i in range(16)]
            calls = [
                asyncio.ensure_future(
                    channel.call(MASTER_SERVICE, "ListDevices", ListDevicesRequest(session_handle=n))
                )
                for n in names
            ]
            await asyncio.sleep(0)  # every call is writing or waiting to write
            for call in calls[::2]:
                call.cancel()
            results = await asyncio.gather(*calls, return_exceptions=True)
            for name, result in list(zip(names, results, strict=True))[1::2]:
                assert not isinstance(result, BaseException), result
                assert result.local_device[0].name == name
        assert channel._calls._stream is stream  # the stream was never cancelled
    finally:
        await channel.close()
        await listener.stop(None)
