"""The gRPC data plane's chunk stream (tensors over 4 MiB) keeps every byte in place.

The tensor arrives whole and in order across many chunks (the last one short), a
received array never changes afterwards, and a sender that lies about the size,
stops early or fails mid-stream gets a clear error, after which the same channel
still receives correctly.
"""

from __future__ import annotations

import grpc
import grpc.aio
import numpy as np
import pytest

from distserver import errors
from distserver.devices import RendezvousKey
from distserver.protos.services import WORKER_SERVICE
from distserver.testing import free_ports
from distserver.transports import get_transport
from distserver.transports import grpc as grpc_transport
from distserver.wire import chunk_tensor


@pytest.fixture(autouse=True)
def grpc_only(monkeypatch):
    """These tests are about gRPC's own paths: the direct connection stays off."""
    monkeypatch.setenv("DISTSERVER_DIRECT", "0")


SRC = "/job:ps/replica:0/task:0/device:CPU:0"
DST = "/job:worker/replica:0/task:0/device:CPU:0"
CHUNK = grpc_transport.CHUNK_BYTES


def key(name: str) -> RendezvousKey:
    return RendezvousKey(SRC, 1, DST, name)


def distinct(nbytes: int, seed: int) -> np.ndarray:
    """float32 values that differ from chunk to chunk and within each (a misplaced chunk shows)."""
    return np.random.default_rng(seed).standard_normal(nbytes // 4, dtype=np.float32)


async def test_a_tensor_of_many_chunks_arrives_whole_and_stays_unchanged():
    # 5 chunks and a piece, so the last chunk is short; the first receive goes through
    # the unary call's "use the stream" answer, the second straight to the stream.
    tensors = {
        "a": [distinct(5 * CHUNK + 4 * 777, seed) for seed in range(3)],
        "b": [distinct(9 * CHUNK, 10 + seed) for seed in range(3)],
    }

    async def source(step_id, k):
        return tensors[k.tensor_name][step_id], False

    address = f"localhost:{free_ports(1)[0]}"
    transport = get_transport("grpc")
    listener = await transport.listen(address, {WORKER_SERVICE: {}}, source)
    await listener.start()
    channel = transport.connect(address)
    try:
        received = []
        for step in range(3):
            for name in ("a", "b"):
                value, is_dead = await channel.recv_tensor(step, key(name))
                assert is_dead is False
                received.append((name, step, value))
        assert channel.tensor_path._streamed == {"a", "b"}  # type: ignore[attr-defined]
        # Compared only now: no later receive reused or wrote into an earlier step's array.
        for name, step, value in received:
            np.testing.assert_array_equal(value, tensors[name][step], err_msg=f"{name}, step {step}")
    finally:
        await channel.close()
        await listener.stop(None)


class HostileSender:
    """A gRPC peer whose RecvTensor says "use the stream" and whose stream sends `messages`,
    then ends the call with `status` (OK, or an error)."""

    def __init__(self, messages: list[bytes], status: grpc.StatusCode = grpc.StatusCode.OK) -> None:
        self.messages = messages
        self.status = status

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        context.set_trailing_metadata(((grpc_transport._USE_STREAM_KEY, "1"),))
        return b""

    async def stream(self, request: bytes, context: grpc.aio.ServicerContext):
        for message in self.messages:
            yield message
        if self.status != grpc.StatusCode.OK:
            await context.abort(self.status, "the sender broke down mid-stream")

    async def serve(self) -> tuple[grpc.aio.Server, str]:
        server = grpc.aio.server()
        stream_service, stream_method = grpc_transport.STREAM_METHOD.strip("/").split("/")
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    WORKER_SERVICE, {"RecvTensor": grpc.unary_unary_rpc_method_handler(self.unary)}
                ),
                grpc.method_handlers_generic_handler(
                    stream_service, {stream_method: grpc.unary_stream_rpc_method_handler(self.stream)}
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"


def chunks_of(value: np.ndarray) -> list[bytes]:
    return list(chunk_tensor(value, False, CHUNK))


@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        ("one chunk too many", errors.DataLossError, "Tensor stream sent"),
        ("last chunk missing", errors.DataLossError, "Tensor stream ended after"),
        ("failed mid-stream", errors.InternalError, "the sender broke down mid-stream"),
    ],
)
async def test_a_sender_that_lies_or_breaks_down_gets_a_clear_error(case, error, message):
    value = distinct(6 * CHUNK, seed=1)
    messages = chunks_of(value)
    status = grpc.StatusCode.OK
    if case == "one chunk too many":
        messages.append(b"\x00" * CHUNK)
    elif case == "last chunk missing":
        messages.pop()
    else:
        messages, status = messages[:3], grpc.StatusCode.INTERNAL
    sender = HostileSender(messages, status)
    server, address = await sender.serve()
    channel = get_transport("grpc").connect(address)
    try:
        with pytest.raises(error, match=message):
            await channel.recv_tensor(1, key("v"))
        # The channel still works: the same peer, now honest, is heard in full.
        honest = distinct(3 * CHUNK + 8, seed=2)
        sender.messages, sender.status = chunks_of(honest), grpc.StatusCode.OK
        got, _ = await channel.recv_tensor(2, key("v"))
        np.testing.assert_array_equal(got, honest)
    finally:
        await channel.close()
        await server.stop(None)
