"""Control calls over a queue pair (`_calls`): results, errors, deadlines, cancel, failures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from distserver import errors
from distserver.transports import verbs

MiB = 1 << 20


class Handler:
    """Serves test paths: /echo, /big (a response of several packets), /fail/<kind>, /hang."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.hanging = asyncio.Event()  # a /hang call reached the handler

    async def __call__(self, path: str, payload: bytes) -> bytes:
        if path == "/echo":
            return payload[::-1]
        if path == "/big":
            return bytes(range(256)) * (3 * MiB // 256) + b"end"
        if path == "/fail/op":
            raise errors.FailedPreconditionError("no variable named v ✓")
        if path == "/fail/bug":
            raise KeyError("oops")
        if path == "/hang":
            self.hanging.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        raise errors.UnimplementedError(f"{path} is not served")


@pytest.fixture
async def calls() -> AsyncIterator[tuple[verbs.TensorEndpoint, Handler, verbs.TensorServer]]:
    async with verbs.ProtectionDomain() as pd:
        handler = Handler()
        server = await verbs.TensorServer.start(pd, lambda header: None, call_handler=handler)
        endpoint = await verbs.TensorEndpoint.connect(pd, server.address)
        yield endpoint, handler, server
        await endpoint.close()
        await server.close()


async def test_a_call_returns_the_peers_response_even_when_it_takes_several_packets(calls):
    endpoint, _, server = calls
    assert await endpoint.calls.call("/echo", b"abc", timeout=10, name="Echo") == b"cba"
    big = await endpoint.calls.call("/big", b"", timeout=10, name="Big")
    assert len(big) == 3 * MiB + 3
    assert big.endswith(b"end")
    assert big[:256] == bytes(range(256))
    results = await asyncio.gather(
        *(endpoint.calls.call("/echo", str(i).encode(), timeout=10, name="Echo") for i in range(50))
    )
    assert results == [str(i).encode()[::-1] for i in range(50)]
    (serving,) = server.endpoints
    assert (endpoint.statistics().calls_made, serving.statistics().calls_served) == (52, 52)


async def test_the_handlers_error_arrives_as_its_class_and_message(calls):
    endpoint, _, _ = calls
    with pytest.raises(errors.FailedPreconditionError, match="no variable named v ✓"):
        await endpoint.calls.call("/fail/op", b"", timeout=10, name="F")
    with pytest.raises(errors.UnknownError, match="KeyError"):
        await endpoint.calls.call("/fail/bug", b"", timeout=10, name="F")
    with pytest.raises(errors.UnimplementedError, match="/nope is not served"):
        await endpoint.calls.call("/nope", b"", timeout=10, name="F")


async def test_a_deadline_fails_the_call_and_cancels_the_remote_handler(calls):
    endpoint, handler, _ = calls
    with pytest.raises(errors.DeadlineExceededError, match="RunGraph to x failed: Deadline Exceeded"):
        await endpoint.calls.call("/hang", b"", timeout=0.2, name="RunGraph to x")
    await asyncio.wait_for(handler.cancelled.wait(), 10)
    assert await endpoint.calls.call("/echo", b"still", timeout=10, name="Echo") == b"llits"


async def test_cancelling_the_caller_cancels_the_remote_handler(calls):
    endpoint, handler, _ = calls
    waiting = asyncio.ensure_future(endpoint.calls.call("/hang", b"", timeout=None, name="Hang"))
    await asyncio.wait_for(handler.hanging.wait(), 10)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.wait_for(handler.cancelled.wait(), 10)


async def test_a_closing_server_fails_waiting_calls_with_unavailable(calls):
    endpoint, handler, server = calls
    waiting = asyncio.ensure_future(endpoint.calls.call("/hang", b"", timeout=None, name="Hang"))
    await asyncio.wait_for(handler.hanging.wait(), 10)
    await server.close()
    with pytest.raises(errors.UnavailableError):
        await asyncio.wait_for(waiting, 10)
    with pytest.raises(errors.UnavailableError):
        await endpoint.calls.call("/echo", b"", timeout=10, name="Echo")


async def test_an_endpoint_without_a_handler_refuses_calls():
    async with verbs.ProtectionDomain() as pd:
        server = await verbs.TensorServer.start(pd, lambda header: None)
        endpoint = await verbs.TensorEndpoint.connect(pd, server.address)
        try:
            with pytest.raises(errors.UnimplementedError, match="serves no calls"):
                await endpoint.calls.call("/echo", b"", timeout=10, name="Echo")
        finally:
            await endpoint.close()
            await server.close()


async def test_closing_the_caller_fails_its_waiting_calls_at_once(calls):
    endpoint, handler, _ = calls
    waiting = asyncio.ensure_future(endpoint.calls.call("/hang", b"", timeout=None, name="Hang"))
    await asyncio.wait_for(handler.hanging.wait(), 10)
    closing = asyncio.ensure_future(endpoint.close())
    with pytest.raises(errors.UnavailableError, match="closed"):
        await asyncio.wait_for(waiting, 1)
    await closing
