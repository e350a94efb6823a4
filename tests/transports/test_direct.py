"""The direct path between distserver tasks (`transports/direct.py`), on real ports.

Calls and tensors ride it once it is up, with a unary call's semantics (errors,
deadlines, cancellation, draining); a peer that lies, floods or has the wrong token
is cut off before anything is allocated; a silent peer fails calls within the
keepalive bounds; an unreachable direct port leaves calls on gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import struct
import subprocess
import sys

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.devices import RendezvousKey
from distserver.protos.services import WORKER_SERVICE
from distserver.protos.worker_pb2 import GetStatusRequest, GetStatusResponse
from distserver.security import Security
from distserver.testing import LocalCluster
from distserver.testing.certs import make_cluster_certificates
from distserver.transports import direct, get_transport

SRC = "/job:ps/replica:0/task:0/device:CPU:0"
DST = "/job:worker/replica:0/task:0/device:CPU:0"
HEAD = struct.Struct("<BQQ")


def key(name: str) -> RendezvousKey:
    return RendezvousKey(SRC, 1, DST, name)


class Peer:
    """A listener serving GetStatus (answers `status_calls`, or what `behaviour` does) and tensors."""

    def __init__(self) -> None:
        self.tensors: dict[str, tuple[object, bool]] = {}
        self.behaviour = None
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.status_calls = 0

    async def get_status(self, request: GetStatusRequest) -> GetStatusResponse:
        self.status_calls += 1
        if self.behaviour is not None:
            self.started.set()
            try:
                await self.behaviour()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return GetStatusResponse()

    async def source(self, step_id: int, k: RendezvousKey) -> tuple[object, bool]:
        return self.tensors[k.tensor_name]


async def start(peer: Peer, security: Security | None = None):
    listener = await get_transport("grpc").listen(
        "localhost:0", {WORKER_SERVICE: {"GetStatus": peer.get_status}}, peer.source, security=security
    )
    await listener.start()
    return listener


async def connected(channel) -> None:
    """Make calls until the channel's direct link is up (it sets up in the background)."""
    for _ in range(200):
        await channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=10)
        if channel.direct_link.connected:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the direct link did not come up")


@contextlib.asynccontextmanager
async def served(
    peer: Peer, server_security: Security | None = None, client_security: Security | None = None
):
    """A listener for `peer` and a channel to it whose direct link is up; both closed after."""
    listener = await start(peer, server_security)
    channel = get_transport("grpc").connect(f"localhost:{listener.port}", security=client_security)
    try:
        await connected(channel)
        yield listener, channel
    finally:
        await channel.close()
        await listener.stop(1)


async def running_call(peer: Peer, channel, seconds: float) -> asyncio.Future:
    """A GetStatus call whose handler has started and takes `seconds`."""
    peer.behaviour = lambda: asyncio.sleep(seconds)
    call = asyncio.ensure_future(channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest()))
    await asyncio.wait_for(peer.started.wait(), 10)
    return call


async def direct_link_comes_up(listener, security: Security | None = None) -> None:
    channel = get_transport("grpc").connect(f"localhost:{listener.port}", security=security)
    try:
        await connected(channel)
    finally:
        await channel.close()


async def direct_port(listener) -> int:
    """The listener's direct port (bound on its first announcement)."""
    assert await listener._direct.announcement() is not None
    return listener._direct.port


async def test_calls_and_tensors_of_every_kind_ride_the_direct_path():
    peer = Peer()
    big = np.random.default_rng(1).standard_normal(3 << 20, dtype=np.float32)  # 12 MiB: many slices
    peer.tensors = {
        "big": (big, False),
        "ints": (np.arange(10, dtype=np.int64).reshape(2, 5), False),
        "strings": (np.array([b"a", b"", b"\xff" * 300], dtype=object), False),
        "scalar": (np.float64(2.5), False),
        "empty": (np.zeros((0, 3), np.float32), False),
        "dead": (np.zeros(4, np.float32), True),
        "strided": (np.arange(20, dtype=np.float32)[::2], False),
    }
    async with served(peer) as (_listener, channel):
        made = channel.direct_link.calls_made
        assert channel.statistics().data_path == "direct"
        for name, (value, is_dead) in peer.tensors.items():
            got, dead = await channel.recv_tensor(1, key(name), timeout=30)
            assert dead is is_dead
            np.testing.assert_array_equal(got, np.asarray(value))
            assert np.asarray(got).dtype == np.asarray(value).dtype
        calls = [channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=10) for _ in range(50)]
        assert len(await asyncio.gather(*calls)) == 50
        assert channel.direct_link.calls_made == made + len(peer.tensors) + 50


async def test_a_remote_error_a_deadline_and_a_cancelled_caller_behave_as_unary_calls():
    peer = Peer()
    async with served(peer) as (_listener, channel):

        async def fail():
            raise errors.NotFoundError("no such thing here")

        peer.behaviour = fail
        with pytest.raises(errors.NotFoundError, match=r"^no such thing here$"):
            await channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=10)

        peer.behaviour = lambda: asyncio.sleep(30)
        with pytest.raises(
            errors.DeadlineExceededError, match=r"GetStatus to localhost:\d+ failed: Deadline"
        ):
            await channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=0.3)
        await asyncio.wait_for(peer.cancelled.wait(), 10)  # the CANCEL reached the handler

        peer.started.clear()
        peer.cancelled.clear()
        task = asyncio.ensure_future(channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest()))
        await asyncio.wait_for(peer.started.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(peer.cancelled.wait(), 10)
        assert channel.direct_link.connected  # none of that broke the connection


async def test_a_stopping_server_finishes_running_calls_and_refuses_new_ones():
    peer = Peer()
    async with served(peer) as (listener, channel):
        running = await running_call(peer, channel, seconds=0.5)
        stopping = asyncio.ensure_future(listener.stop(10))
        await asyncio.sleep(0.05)
        assert isinstance(await running, GetStatusResponse)  # answered within the grace
        with pytest.raises(errors.UnavailableError):
            await channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=10)
        await stopping


async def test_a_peer_that_dies_fails_the_waiting_calls_unavailable():
    peer = Peer()
    async with served(peer) as (listener, channel):
        waiting = await running_call(peer, channel, seconds=30)
        await listener.stop(0)
        with pytest.raises(errors.UnavailableError, match=r"GetStatus to localhost:\d+ failed"):
            await asyncio.wait_for(waiting, 10)


async def test_a_silent_peer_fails_calls_within_the_keepalive_bounds():
    """A server that welcomes, then never answers (not even pings): calls fail, no hang."""

    writers = []

    async def silent(reader, writer):
        writers.append(writer)
        await reader.readexactly(HEAD.size)
        writer.write(HEAD.pack(direct.WELCOME, 0, 0))

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def endpoint(request: bytes, timeout: float) -> bytes:
        return b'{"port": %d}' % port

    link = direct.DirectLink(endpoint, "127.0.0.1:1", None, keepalive=(0.2, 0.3))
    try:
        assert await link.call(WORKER_SERVICE, "GetStatus", b"", None) is None  # sets up meanwhile
        for _ in range(100):
            if link.connected:
                break
            await asyncio.sleep(0.02)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(errors.UnavailableError, match="keepalive ping"):
            await asyncio.wait_for(link.call(WORKER_SERVICE, "GetStatus", b"", None), 10)
        assert loop.time() - started < 2
    finally:
        await link.close()
        for writer in writers:
            await shut(writer)
        server.close()
        await server.wait_closed()


async def test_an_unreachable_direct_port_leaves_calls_on_grpc(caplog):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there

    async def endpoint(request: bytes, timeout: float) -> bytes:
        return b'{"port": %d}' % port

    link = direct.DirectLink(endpoint, "127.0.0.1:1", None, keepalive=(5, 4))
    with caplog.at_level(logging.WARNING, logger="distserver.transports.direct"):
        for _ in range(3):
            assert await link.call(WORKER_SERVICE, "GetStatus", b"", None) is None
            await asyncio.sleep(0.1)
    assert not link.connected
    warnings = [r.getMessage() for r in caplog.records if "direct path to 127.0.0.1:1" in r.getMessage()]
    assert len(warnings) == 1
    assert "calls use gRPC meanwhile" in warnings[0]
    await link.close()


async def shut(writer) -> None:
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


async def raw_connection(port: int):
    return await asyncio.open_connection("127.0.0.1", port)


async def closed_by_peer(reader, seconds: float = 5) -> bytes:
    """What the server sent before closing the connection (fails if it stays open)."""
    return await asyncio.wait_for(reader.read(-1), seconds)


def hello(token: str = "") -> bytes:
    body = struct.pack("<4sH", direct.MAGIC, direct.VERSION) + token.encode()
    return HEAD.pack(direct.HELLO, 0, len(body)) + body


async def test_hostile_clients_are_cut_off_before_anything_is_allocated(monkeypatch):
    monkeypatch.setattr(direct, "HANDSHAKE_TIMEOUT", 0.3)
    peer = Peer()
    listener = await start(peer, Security(token="sesame"))
    port = await direct_port(listener)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        # A call before the HELLO; a 1 TiB HELLO; garbage; silence: each connection is closed.
        call_first = HEAD.pack(direct.CALL, 1, 10) + b"x" * 10
        for data in (call_first, HEAD.pack(direct.HELLO, 0, 1 << 40), b"GET / HTTP/1.1\r\n\r\n", b""):
            reader, writer = await raw_connection(port)
            writer.write(data)
            assert await closed_by_peer(reader) == b""
            await shut(writer)
        # The wrong token is refused, saying why.
        reader, writer = await raw_connection(port)
        writer.write(hello("Bearer wrong"))
        answer = await closed_by_peer(reader)
        kind, _, _length = HEAD.unpack_from(answer)
        assert kind == direct.REFUSED
        assert b"needs the cluster's token" in answer[HEAD.size :]
        await shut(writer)
        # Admitted: a CALL claiming 1 TiB, and a frame kind clients may not send, close it.
        for data in (HEAD.pack(direct.CALL, 1, 1 << 40), HEAD.pack(direct.RESULT, 1, 0)):
            reader, writer = await raw_connection(port)
            writer.write(hello("Bearer sesame") + data)
            assert await closed_by_peer(reader) == HEAD.pack(direct.WELCOME, 0, 0)
            await shut(writer)
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200_000  # KiB
        # The server still serves a proper client.
        await direct_link_comes_up(listener, Security(token="sesame"))
    finally:
        await listener.stop(1)


async def test_the_direct_path_uses_tls_with_the_clusters_certificates(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTSERVER_AUTH_TOKEN", raising=False)
    certs = make_cluster_certificates(tmp_path)
    server = Security(
        str(certs.server_cert), str(certs.server_key), str(certs.ca_cert), require_client_cert=True
    )
    client = Security(str(certs.client_cert), str(certs.client_key), str(certs.ca_cert))
    peer = Peer()
    peer.tensors = {"t": (np.arange(5, dtype=np.float32), False)}
    async with served(peer, server_security=server, client_security=client) as (listener, channel):
        got, _ = await channel.recv_tensor(1, key("t"), timeout=10)
        np.testing.assert_array_equal(got, np.arange(5, dtype=np.float32))
        # A plaintext connection to the TLS port gets nothing.
        reader, writer = await raw_connection(await direct_port(listener))
        writer.write(hello())
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(HEAD.size), 5)
        await shut(writer)


async def test_turned_off_the_channel_stays_on_grpc(monkeypatch):
    monkeypatch.setenv(direct.ENV, "0")
    peer = Peer()
    listener = await start(peer)
    channel = get_transport("grpc").connect(f"localhost:{listener.port}")
    try:
        for _ in range(5):
            await channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=10)
        assert not channel.direct_link.connected
        assert channel.direct_link.calls_made == 0
        assert listener._direct is None
    finally:
        await channel.close()
        await listener.stop(1)


@pytest.mark.slow
def test_a_session_across_task_processes_runs_its_steps_over_the_direct_path():
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        graph = ds.Graph()
        with graph.as_default():
            with ds.device("/job:ps/task:0"):
                v = ds.Variable(np.arange(1 << 20, dtype=np.float32), name="v")
            with ds.device("/job:worker/task:0"):
                total = ds.reduce_sum(v * 2.0)
            init = ds.global_variables_initializer()
        with ds.Session(cluster.target("worker"), graph=graph) as session:
            session.run(init)
            for _ in range(20):
                assert session.run(total) == pytest.approx(2.0 * (1 << 20) * ((1 << 20) - 1) / 2)
        status = subprocess.run(
            [sys.executable, "-m", "distserver", "status", cluster.target("worker"), "--stats"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        peer_line = next(line for line in status.stdout.splitlines() if "peer /job:ps" in line)
        assert "via direct:" in peer_line, status.stdout


async def test_connections_that_do_not_shake_hands_are_capped(monkeypatch):
    monkeypatch.setattr(direct, "MAX_HANDSHAKES", 3)
    listener = await start(Peer())
    writers = []
    try:
        for _ in range(3):
            reader, writer = await raw_connection(await direct_port(listener))
            writers.append(writer)
        reader, writer = await raw_connection(await direct_port(listener))
        writers.append(writer)
        assert await closed_by_peer(reader) == b""  # the fourth is cut at once
        # Admitted connections do not count: a client still gets in once the others are gone.
        for writer in writers:
            await shut(writer)
        await asyncio.sleep(0.1)
        await direct_link_comes_up(listener)
    finally:
        await listener.stop(1)


async def test_an_aborted_channel_cancels_its_waiting_direct_calls():
    peer = Peer()
    async with served(peer) as (_listener, channel):
        waiting = await running_call(peer, channel, seconds=30)
        channel.abort()
        with pytest.raises(errors.CancelledError, match="was cancelled"):
            await asyncio.wait_for(waiting, 10)
        await asyncio.wait_for(peer.cancelled.wait(), 10)  # the server let the handler go


async def test_the_direct_port_is_bound_only_when_a_peer_asks_for_it():
    # Ports a cluster picked up front stay free for the tasks started after this one.
    peer = Peer()
    listener = await start(peer)
    try:
        assert listener._direct.port == 0
        await direct_link_comes_up(listener)
        assert listener._direct.port not in (0, listener.port)
    finally:
        await listener.stop(1)


async def test_an_announcement_cancelled_while_binding_leaves_no_socket_open(monkeypatch):
    async def serve(path, payload):
        return [b""]

    bound: list[socket.socket] = []
    bind = direct._listening_sockets

    def listening_sockets(address):
        bound.extend(sockets := bind(address))
        return sockets

    monkeypatch.setattr(direct, "_listening_sockets", listening_sockets)
    server = direct.DirectServer("localhost:0", serve, None)
    announcing = asyncio.ensure_future(server.announcement())
    await asyncio.sleep(0)  # it has bound the sockets and waits for the event loop's server
    announcing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await announcing
    assert bound
    assert all(sock.fileno() == -1 for sock in bound)
    # A later announcement binds again and serves.
    assert await server.announcement() is not None
    assert server.port
    await server.close(None)
