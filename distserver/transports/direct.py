"""Direct connections: calls and tensors between distserver tasks over plain TCP, beside gRPC.

Why: a message through grpc.aio passes grpcio's poller thread and a completion queue
before the event loop sees it; on this 2-CPU machine a call-stream round trip costs
178-217 µs and a unary call ~500 µs, against ~45 µs for a round trip over an asyncio
TCP connection. A distributed step makes several calls in a row (master -> workers,
worker -> worker receives), so that difference is on every step's critical path.
Large tensors gain too: a receiver reads the bytes straight into the buffer that
becomes the array.

How: every server of a gRPC-based transport also listens on a second TCP port
(`DirectServer`, same host, a free port bound on first use), announced over gRPC by
`/distserver.Direct/Endpoint` (so it needs the cluster's token and TLS like any call).
A channel's first call to a distserver peer asks for it in the background (`DirectLink`)
and, once connected, sends its MasterService/WorkerService/EagerService calls and
RecvTensor requests there; until then, and for good with TensorFlow peers (they answer
UNIMPLEMENTED), calls take the call stream or unary gRPC as before. A peer whose
direct port cannot be reached (a firewall) is retried every `RETRY_SECONDS`, logged
once. `DISTSERVER_DIRECT=0` turns the path off in the process that sets it.

Frames (both directions): a head (`kind` u8, `call id` u64, body length u64), then the body.

    HELLO    client -> server: magic "DSDC", version u16, the token's metadata value (UTF-8)
    WELCOME  server -> client: empty (the client may call)
    REFUSED  server -> client: why (UTF-8); the server closes
    CALL     timeout f64 (seconds; < 0: none), path length u16, path, serialized request
    CANCEL   empty: the caller gave up on that call
    RESULT   status code i32, serialized response or UTF-8 error message
    PING     empty (client, while calls wait); PONG: the answer

Checks, before anything is allocated: a server reads nothing but a HELLO of at most
`MAX_HELLO_BYTES` until it has admitted the token (within `HANDSHAKE_TIMEOUT`), then only
CALLs of at most `MAX_REQUEST_BYTES` (larger calls go by unary gRPC), CANCELs and PINGs;
anything else closes the connection. At most `MAX_CALLS_PER_STREAM` calls run per
connection. A server whose client does not read its answers stops reading that
client's calls until they drain. A client accepts answers of at most
`MAX_RESULT_BYTES` (TensorFlow's own message limit).

Failures: a connection that breaks fails the calls waiting on it with UnavailableError
naming the peer and method. While calls wait, the client pings after `KEEPALIVE_MS` of
silence and fails them all if nothing arrives within `KEEPALIVE_TIMEOUT_MS` (the same
bounds as the gRPC keepalive: a SIGSTOPped peer or a cut cable fails in ~10 s, never
hangs). A deadline sends CANCEL and raises DeadlineExceededError; the server sees the
caller's timeout too (`call_deadline`). A stopping server refuses new calls
(UnavailableError), lets running ones answer within the grace, then closes.

With TLS, the direct port serves TLS with the same certificates (client certificates
required when `require_client_cert`), and clients verify it as gRPC does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc
import grpc.aio

from distserver import call_deadline, errors
from distserver._cpus import heard_from_peer, sent_to_peer
from distserver.security import TOKEN_METADATA_KEY, Security
from distserver.transports.base import wait_for_answer

logger = logging.getLogger(__name__)

ENDPOINT_SERVICE = "distserver.Direct"
ENDPOINT_METHOD = "Endpoint"
ENV = "DISTSERVER_DIRECT"
MAGIC = b"DSDC"
VERSION = 1

HELLO, WELCOME, REFUSED, CALL, CANCEL, RESULT, PING, PONG = range(1, 9)
_HEAD = struct.Struct("<BQQ")  # kind, call id, body length
_HELLO = struct.Struct("<4sH")  # magic, version
_CALL = struct.Struct("<dH")  # timeout, path length
_RESULT = struct.Struct("<i")  # status code

MAX_HELLO_BYTES = 4096
MAX_REQUEST_BYTES = 4 << 20
MAX_RESULT_BYTES = (1 << 31) - 1
MAX_CALLS_PER_STREAM = 4096
MAX_HANDSHAKES = 256  # connections of one server not yet admitted
HANDSHAKE_TIMEOUT = 10.0
SETUP_TIMEOUT = 5.0
RETRY_SECONDS = 5.0
# A server stops reading a client's calls while this much of its answers is unsent.
_UNSENT_LIMIT = 64 << 20
# Bodies up to this size are copied into the frame; larger ones are written in
# slices of `_WRITE_SLICE`, each waiting for the socket to take the previous one, so
# the event loop never copies a large tensor in one go.
_JOIN_BYTES = 64 << 10
_WRITE_SLICE = 1 << 20
_SCRATCH_BYTES = 256 << 10
_CLOSE_WAIT = 1.0  # seconds a stopping server waits for its listening sockets to close


def enabled() -> bool:
    """Whether this process uses and serves the direct path (`DISTSERVER_DIRECT`, default on)."""
    return os.environ.get(ENV, "1") != "0"


class ProtocolError(Exception):
    """The peer sent a frame it may not send, or one over its budget."""


# ----------------------------------------------------------------------------- framing


class _FrameReader:
    """Cuts a byte stream into frames (`on_frame(kind, call_id, body)`), for a BufferedProtocol.

    Small frames are read in batches into a scratch buffer; a frame too large for it
    is read straight into its own bytearray (the body the handler gets). `budget(kind)`
    is the largest body the peer may send with that kind; anything above, or a kind
    it may not send (budget < 0), raises ProtocolError before a byte is allocated.
    """

    def __init__(
        self,
        on_frame: Callable[[int, int, bytes | bytearray], None],
        budget: Callable[[int], int],
        scratch_bytes: int,
    ) -> None:
        self._on_frame = on_frame
        self._budget = budget
        self._scratch = bytearray(scratch_bytes)
        self.scratch_bytes = scratch_bytes  # raise it to grow the scratch buffer
        self._start = 0
        self._end = 0
        self._body: bytearray | None = None  # a large frame's body being filled
        self._filled = 0
        self._large_head = (0, 0)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return memoryview(self._body)[self._filled :]
        if len(self._scratch) < self.scratch_bytes:
            grown = bytearray(self.scratch_bytes)
            grown[: self._end - self._start] = self._scratch[self._start : self._end]
            self._scratch, self._start, self._end = grown, 0, self._end - self._start
        elif self._end == len(self._scratch):  # only a partial frame is left: move it to the front
            pending = self._end - self._start
            self._scratch[:pending] = self._scratch[self._start : self._end]
            self._start, self._end = 0, pending
        return memoryview(self._scratch)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._body is not None:
            self._filled += nbytes
            if self._filled == len(self._body):
                body, self._body = self._body, None
                self._on_frame(*self._large_head, body)
            return
        self._end += nbytes
        scratch = self._scratch
        while self._end - self._start >= _HEAD.size:
            kind, call_id, length = _HEAD.unpack_from(scratch, self._start)
            budget = self._budget(kind)
            if length > budget:
                raise ProtocolError(
                    f"frame kind {kind} may not be sent here"
                    if budget < 0
                    else f"a frame of kind {kind} carries {length} bytes, more than the {budget} allowed"
                )
            body_start = self._start + _HEAD.size
            available = self._end - body_start
            if available >= length:
                self._start = body_start + length
                self._on_frame(kind, call_id, bytes(memoryview(scratch)[body_start : self._start]))
                continue
            if _HEAD.size + length > len(scratch):  # read the rest straight into its own buffer
                body = bytearray(length)
                body[:available] = scratch[body_start : self._end]
                self._body, self._filled, self._large_head = body, available, (kind, call_id)
                self._start = self._end = 0
                return
            break
        if self._start == self._end:
            self._start = self._end = 0


class _Connection(asyncio.BufferedProtocol):
    """What both ends share: frame reading, writing with flow control, closing."""

    def __init__(self, scratch_bytes: int = _SCRATCH_BYTES) -> None:
        self._transport: asyncio.Transport | None = None
        self._reader = _FrameReader(self._frame, self._budget, scratch_bytes)
        self._writable = asyncio.Event()
        self._writable.set()
        # While a large frame goes out a slice at a time, other frames wait here (in order).
        self._large_lock = asyncio.Lock()
        self._held: list[bytes] | None = None
        self._loop = asyncio.get_running_loop()
        self.closed = self._loop.create_future()  # result: the reason (str)

    # -- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        _keep_alive(transport.get_extra_info("socket"))
        if transport.get_extra_info("sslcontext") is None:
            # Pause on any unsent byte: each slice of a large body then goes from its own
            # memory to the socket, copied only in part. (TLS transports keep their defaults.)
            self._transport.set_write_buffer_limits(high=0)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        heard_from_peer(self._loop)
        self._heard()
        try:
            self._reader.buffer_updated(nbytes)
        except ProtocolError as exc:
            self.abort(f"the peer broke the protocol: {exc}")
        except ConnectionError:
            pass  # an answer to a peer that is gone: connection_lost follows

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def eof_received(self) -> bool:
        return False  # close: a peer that stops sending is done

    def connection_lost(self, exc: Exception | None) -> None:
        self._writable.set()
        if not self.closed.done():
            reason = "the connection closed" if exc is None else f"the connection failed: {exc}"
            self.closed.set_result(reason)
        self._lost()

    # -- to implement
    def _heard(self) -> None:
        """Bytes arrived (of any frame, complete or not)."""

    def _budget(self, kind: int) -> int:
        raise NotImplementedError

    def _frame(self, kind: int, call_id: int, body: bytes | bytearray) -> None:
        raise NotImplementedError

    def _lost(self) -> None:
        raise NotImplementedError

    # -- for both ends
    @property
    def is_closed(self) -> bool:
        return self.closed.done()

    def send(self, kind: int, call_id: int, *parts: bytes | memoryview) -> None:
        """Send a small frame now (the parts are copied into it)."""
        if self._transport is None or self._transport.is_closing():
            raise ConnectionError("the connection closed")
        size = sum(len(part) if isinstance(part, bytes) else part.nbytes for part in parts)
        frame = b"".join((_HEAD.pack(kind, call_id, size), *parts))
        if self._held is not None:
            self._held.append(frame)  # after the large frame being written
        else:
            self._transport.write(frame)
        sent_to_peer(self._loop)

    async def send_large(self, kind: int, call_id: int, parts: list[bytes | memoryview]) -> None:
        """Send a frame whose parts may be large, a slice at a time (see `_WRITE_SLICE`)."""
        size = sum(len(part) if isinstance(part, bytes) else part.nbytes for part in parts)
        if size <= _JOIN_BYTES:
            self.send(kind, call_id, *parts)
            return
        async with self._large_lock:
            transport = self._transport
            if transport is None or transport.is_closing():
                raise ConnectionError("the connection closed")
            transport.write(_HEAD.pack(kind, call_id, size))
            self._held = []
            try:
                for part in parts:
                    view = memoryview(part).cast("B")
                    for offset in range(0, view.nbytes, _WRITE_SLICE):
                        await self._writable.wait()
                        if transport.is_closing():
                            raise ConnectionError("the connection closed")
                        transport.write(view[offset : offset + _WRITE_SLICE])
            finally:
                held, self._held = self._held, None
                if held and not transport.is_closing():
                    transport.write(b"".join(held))
            sent_to_peer(self._loop)

    def abort(self, reason: str) -> None:
        if not self.closed.done():
            self.closed.set_result(reason)
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _keep_alive(sock: Any) -> None:
    """TCP keepalive (probes after a minute of silence): a peer whose host vanished
    without a FIN does not hold its connection forever."""
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 6)


# ----------------------------------------------------------------------------- server

# Serves one call: (path, serialized request) -> the response's parts (joined, they are
# the serialized response). Raises an OpError to answer with its status.
CallServer = Callable[[str, memoryview], Awaitable[list[bytes | memoryview]]]


class _ServerConnection(_Connection):
    def __init__(self, server: DirectServer) -> None:
        # Until it is admitted, a connection holds a buffer the size of a HELLO.
        super().__init__(scratch_bytes=_HEAD.size + MAX_HELLO_BYTES)
        self._server = server
        self.admitted = False
        self._running: dict[int, asyncio.Task[None]] = {}
        self._cancelled: set[int] = set()
        self._handshake: asyncio.TimerHandle | None = None
        self._resuming: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._server.connections.add(self)
        if sum(not c.admitted for c in self._server.connections) > MAX_HANDSHAKES:
            self.abort(f"more than {MAX_HANDSHAKES} connections are shaking hands")
            return
        self._handshake = asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT, self.abort, "no HELLO within the handshake timeout"
        )

    def _budget(self, kind: int) -> int:
        if not self.admitted:
            return MAX_HELLO_BYTES if kind == HELLO else -1
        if kind == CALL:
            return MAX_REQUEST_BYTES + _CALL.size + 0xFFFF
        return 0 if kind in (CANCEL, PING) else -1

    def _frame(self, kind: int, call_id: int, body: bytes | bytearray) -> None:
        if kind == HELLO:
            self._hello(body)
        elif kind == PING:
            self.send(PONG, call_id)
        elif kind == CANCEL:
            task = self._running.get(call_id)
            if task is not None:
                self._cancelled.add(call_id)
                task.cancel()
        else:
            self._call(call_id, body)

    def _hello(self, body: bytes | bytearray) -> None:
        if self._handshake is not None:
            self._handshake.cancel()
        if len(body) < _HELLO.size or _HELLO.unpack_from(body)[0] != MAGIC:
            self.abort("not a distserver direct client")
            return
        _, version = _HELLO.unpack_from(body)
        token = bytes(body[_HELLO.size :])
        if version != VERSION:
            self._refuse(f"direct path version {version} is not served here (this task speaks {VERSION})")
        elif not self._server.admits(token):
            self._refuse("the direct path needs the cluster's token")
        else:
            self.admitted = True
            self._reader.scratch_bytes = _SCRATCH_BYTES
            self.send(WELCOME, 0)

    def _refuse(self, why: str) -> None:
        self.send(REFUSED, 0, why.encode())
        self.close()

    def _call(self, call_id: int, body: bytes | bytearray) -> None:
        if self._server.draining:
            self._answer_error(call_id, errors.UNAVAILABLE, "the server is stopping")
            return
        if call_id in self._running or len(self._running) >= MAX_CALLS_PER_STREAM:
            self._answer_error(
                call_id,
                errors.RESOURCE_EXHAUSTED,
                f"call {call_id} is running already, or {MAX_CALLS_PER_STREAM} calls are",
            )
            return
        try:
            timeout, path_len = _CALL.unpack_from(body)
            path = bytes(body[_CALL.size : _CALL.size + path_len]).decode()
        except (struct.error, UnicodeDecodeError):
            self.abort("the peer sent a malformed CALL")
            return
        payload = memoryview(body)[_CALL.size + path_len :]
        self._running[call_id] = asyncio.ensure_future(
            self._run(call_id, path, payload, None if timeout < 0 else timeout)
        )
        assert self._transport is not None
        if self._transport.get_write_buffer_size() > _UNSENT_LIMIT:
            self._transport.pause_reading()  # resumed once the answers have drained
            self._resuming = asyncio.ensure_future(self._resume_reading_when_drained())

    async def _resume_reading_when_drained(self) -> None:
        await self._writable.wait()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    async def _run(self, call_id: int, path: str, payload: memoryview, timeout: float | None) -> None:
        call_deadline.set_from_timeout(timeout)
        try:
            parts = await self._server.serve_call(path, payload)
            code = errors.OK
        except asyncio.CancelledError:
            if call_id not in self._cancelled:
                self._running.pop(call_id, None)
                raise  # the connection is gone or the server closes it
            parts, code = [b"the call was cancelled"], errors.CANCELLED
        except Exception as exc:
            code, message = errors.to_status(exc)
            parts = [message.encode()]
        finally:
            self._cancelled.discard(call_id)
        try:
            await self.send_large(RESULT, call_id, [_RESULT.pack(code), *parts])
        except ConnectionError:
            pass  # the caller is gone: nobody to tell
        finally:
            self._running.pop(call_id, None)
            if self._server.draining and not self._running:
                self.close()

    def _answer_error(self, call_id: int, code: int, message: str) -> None:
        self.send(RESULT, call_id, _RESULT.pack(code), message.encode())

    def _lost(self) -> None:
        if self._handshake is not None:
            self._handshake.cancel()
        self._server.connections.discard(self)
        for task in self._running.values():
            task.cancel()

    def drain(self) -> None:
        if not self._running:
            self.close()

    async def cancel_running(self) -> None:
        running = list(self._running.values())
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        self.abort("the server stopped")  # not close(): a peer that does not read would hold it


class DirectServer:
    """The direct port of one task: accepts connections and serves their calls with `serve_call`.

    The port is bound when a peer first asks for it (`announcement`), on a free port of
    `address`'s host ("localhost": every loopback address): a task holds no second port
    until a peer wants one, and cannot take a port that was picked for a task started
    after it (a cluster's ports are often chosen up front, from the free ones).
    """

    def __init__(self, address: str, serve_call: CallServer, security: Security | None) -> None:
        self.serve_call = serve_call
        self._address = address
        self._security = security
        self._servers: list[asyncio.AbstractServer] = []
        self._binding: asyncio.Lock | None = None
        self._bind_failed = False
        self.connections: set[_ServerConnection] = set()
        self.draining = False
        self.port = 0

    async def _listen(self) -> None:
        """Bind and serve the port; on any failure, a cancelled caller included, close
        whatever was bound (closing a socket a server took over is harmless)."""
        context = _server_ssl_context(self._security)
        loop = asyncio.get_running_loop()
        sockets = _listening_sockets(self._address)
        try:
            for sock in sockets:
                self.port = sock.getsockname()[1]
                self._servers.append(
                    await loop.create_server(lambda: _ServerConnection(self), sock=sock, ssl=context)
                )
        except BaseException:
            for server in self._servers:
                server.close()
            self._servers.clear()
            for sock in sockets:
                sock.close()
            raise

    def admits(self, token_value: bytes) -> bool:
        if self._security is None:
            return True
        return self._security.admits(((TOKEN_METADATA_KEY, token_value),))

    async def announcement(self) -> bytes | None:
        """What `/distserver.Direct/Endpoint` answers (the port, bound now if it is not
        yet); None when the port cannot be bound or the server is stopping."""
        if self._binding is None:
            self._binding = asyncio.Lock()
        async with self._binding:
            if not self._servers and not self._bind_failed and not self.draining:
                try:
                    await self._listen()
                except OSError as exc:
                    self._bind_failed = True
                    logger.warning("no direct path for %s (%s): peers use gRPC alone", self._address, exc)
        if not self._servers or self.draining:
            return None
        return json.dumps({"port": self.port, "version": VERSION}).encode()

    def drain(self) -> None:
        """Refuse new calls; close each connection once its running calls have answered."""
        self.draining = True
        for server in self._servers:
            server.close()
        for connection in list(self.connections):
            connection.drain()

    async def close(self, grace: float | None) -> None:
        """Drain, wait up to `grace` seconds (None: no wait) for running calls, then cancel them."""
        self.drain()
        if grace and self.connections:
            closing = [asyncio.ensure_future(asyncio.shield(c.closed)) for c in self.connections]
            await asyncio.wait(closing, timeout=grace)
            for future in closing:
                future.cancel()
        await asyncio.gather(*(c.cancel_running() for c in list(self.connections)), return_exceptions=True)
        for server in self._servers:
            server.close()
            # Bounded: some event loops wait for every connection here, and two tasks
            # stopping together each hold a connection to the other.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), _CLOSE_WAIT)


def _listening_sockets(address: str) -> list[socket.socket]:
    """Bound, listening sockets on `address`'s host, all on one free port."""
    host = address.rpartition(":")[0].strip("[]") or "0.0.0.0"
    hosts = ["127.0.0.1", "::1"] if host == "localhost" else [host]
    sockets: list[socket.socket] = []
    port = 0
    try:
        for name in hosts:
            try:
                infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            except socket.gaierror:
                if sockets:
                    continue  # e.g. no IPv6 here
                raise
            family, kind, proto, _, sockaddr = infos[0]
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(sockaddr)
            except OSError:
                sock.close()
                if sockets:
                    continue  # another loopback address we cannot bind: the first one serves
                raise
            sock.listen(1024)
            sock.setblocking(False)
            sockets.append(sock)
            port = sock.getsockname()[1]
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _server_ssl_context(security: Security | None) -> ssl.SSLContext | None:
    if security is None or not security.tls or security.cert_file is None or security.key_file is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(security.cert_file, security.key_file)
    if security.require_client_cert:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(security.ca_file)
    return context


def _client_ssl_context(security: Security | None) -> ssl.SSLContext | None:
    if security is None or not security.tls:
        return None
    context = ssl.create_default_context(cafile=security.ca_file)
    if security.cert_file is not None and security.key_file is not None:
        context.load_cert_chain(security.cert_file, security.key_file)
    return context


def endpoint_handler(server: Callable[[], DirectServer | None]) -> Any:
    """The gRPC handler of `/distserver.Direct/Endpoint`: the direct port, or UNIMPLEMENTED."""

    async def endpoint(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        direct = server()
        announcement = None if direct is None else await direct.announcement()
        if announcement is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this task serves no direct path")
        assert announcement is not None
        return announcement

    return grpc.method_handlers_generic_handler(
        ENDPOINT_SERVICE,
        {ENDPOINT_METHOD: grpc.unary_unary_rpc_method_handler(endpoint, lambda b: b, lambda b: b)},
    )


# ----------------------------------------------------------------------------- client


class _ClientConnection(_Connection):
    def __init__(self, target: str, keepalive: tuple[float, float]) -> None:
        super().__init__()
        self._target = target
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[bytes | bytearray]] = {}
        self.welcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._keepalive, self._keepalive_timeout = keepalive
        self._last_heard = 0.0
        self._ping_sent: float | None = None
        self._watch: asyncio.TimerHandle | None = None

    def _budget(self, kind: int) -> int:
        if kind == RESULT:
            return MAX_RESULT_BYTES
        if kind in (WELCOME, REFUSED):
            return MAX_HELLO_BYTES
        return 0 if kind == PONG else -1

    def _heard(self) -> None:
        self._last_heard = asyncio.get_running_loop().time()
        self._ping_sent = None

    def _frame(self, kind: int, call_id: int, body: bytes | bytearray) -> None:
        if kind == RESULT:
            future = self._waiting.get(call_id)
            if future is not None and not future.done():
                future.set_result(body)
        elif kind == WELCOME:
            if not self.welcome.done():
                self.welcome.set_result(None)
        elif kind == REFUSED:
            reason = bytes(body).decode("utf-8", "replace")
            if not self.welcome.done():
                self.welcome.set_exception(errors.UnauthenticatedError(f"{self._target} refused: {reason}"))
            self.abort(reason)

    def _lost(self) -> None:
        reason = self.closed.result()
        if not self.welcome.done():
            self.welcome.set_exception(errors.UnavailableError(f"{self._target}: {reason}"))
        if self._watch is not None:
            self._watch.cancel()
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ConnectionError(reason))

    async def call(self, path: str, payload: bytes, timeout: float | None, method: str) -> bytes | bytearray:
        """The raw RESULT body of `path` (status code first); see the module docstring."""
        if self.is_closed:
            raise ConnectionError(self.closed.result())
        call_id = next(self._ids)
        future: asyncio.Future[bytes | bytearray] = asyncio.get_running_loop().create_future()
        if not self._waiting:
            self._last_heard = asyncio.get_running_loop().time()
            self._schedule_watch()
        self._waiting[call_id] = future
        encoded_path = path.encode()
        try:
            self.send(
                CALL,
                call_id,
                _CALL.pack(-1.0 if timeout is None else timeout, len(encoded_path)),
                encoded_path,
                payload,
            )
            return await wait_for_answer(
                future,
                timeout,
                lambda: self._cancel(call_id),
                f"{method} to {self._target} failed: Deadline Exceeded",
            )
        finally:
            self._waiting.pop(call_id, None)

    def _cancel(self, call_id: int) -> None:
        with contextlib.suppress(ConnectionError):
            self.send(CANCEL, call_id)

    def _schedule_watch(self) -> None:
        if self._watch is None and not self.is_closed:
            period = min(self._keepalive, self._keepalive_timeout) / 2
            self._watch = asyncio.get_running_loop().call_later(period, self._check_alive)

    def _check_alive(self) -> None:
        """While calls wait: ping after `keepalive` of silence; give up `keepalive_timeout` after."""
        self._watch = None
        if not self._waiting or self.is_closed:
            return
        now = asyncio.get_running_loop().time()
        if self._ping_sent is not None and now - self._ping_sent >= self._keepalive_timeout:
            self.abort(f"no answer to a keepalive ping within {self._keepalive_timeout:g} s")
            return
        if self._ping_sent is None and now - self._last_heard >= self._keepalive:
            self._ping_sent = now
            with contextlib.suppress(ConnectionError):
                self.send(PING, 0)
        self._schedule_watch()


def _split_host(target: str) -> str:
    return target.rpartition(":")[0].strip("[]")


class DirectLink:
    """A channel's direct connection to one peer, set up in the background on first use.

    `call` returns the serialized response, or None when the link is not (yet) up
    and the channel should use gRPC. Errors are the remote handler's OpError, or
    UnavailableError/DeadlineExceededError naming the peer and method.
    """

    def __init__(
        self,
        endpoint: Callable[[bytes, float], Awaitable[bytes]],
        target: str,
        security: Security | None,
        keepalive: tuple[float, float],
    ) -> None:
        self._endpoint = endpoint
        self._target = target
        self._security = security
        self._keepalive = keepalive
        self._connection: _ClientConnection | None = None
        self._setup: asyncio.Task[None] | None = None
        self._retry_at = 0.0
        self._warned = False
        self._closed = False
        self.unsupported: str | None = None if enabled() else f"{ENV}=0"
        self.calls_made = 0

    @property
    def connected(self) -> bool:
        return self._connection is not None and not self._connection.is_closed

    def _ready(self) -> _ClientConnection | None:
        connection = self._connection
        if connection is not None and not connection.is_closed:
            return connection
        if (
            self.unsupported is None
            and self._setup is None
            and asyncio.get_running_loop().time() >= self._retry_at
        ):
            self._setup = asyncio.ensure_future(self._set_up())
        return None

    async def _set_up(self) -> None:
        loop = asyncio.get_running_loop()
        connection: _ClientConnection | None = None
        try:
            reply = json.loads(await self._endpoint(b"", SETUP_TIMEOUT))
            port = int(reply["port"])
            async with asyncio.timeout(SETUP_TIMEOUT):
                host = _split_host(self._target)
                _, connection = await loop.create_connection(
                    lambda: _ClientConnection(self._target, self._keepalive),
                    host,
                    port,
                    ssl=_client_ssl_context(self._security),
                    server_hostname=host if self._security is not None and self._security.tls else None,
                )
                token = b""
                if self._security is not None and self._security.token_metadata:
                    token = self._security.token_metadata[0][1].encode()
                connection.send(HELLO, 0, _HELLO.pack(MAGIC, VERSION), token)
                await connection.welcome
            self._connection = connection
            connection = None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.unsupported = "the peer serves no direct path"  # TensorFlow, or direct path off
            else:  # the peer is down or busy: its gRPC calls say so; retry quietly
                self._failed(f"asking for its endpoint failed: {exc.code().name}", warn=False)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
        finally:
            if connection is not None:
                connection.abort("set-up failed")
            self._setup = None

    def _failed(self, reason: str, *, warn: bool = True) -> None:
        self._retry_at = asyncio.get_running_loop().time() + RETRY_SECONDS
        if not warn:
            logger.debug("direct path to %s: %s", self._target, reason)
        elif not self._warned:
            self._warned = True
            logger.warning(
                "direct path to %s: %s; calls use gRPC meanwhile (retried every %g s)",
                self._target,
                reason,
                RETRY_SECONDS,
            )

    async def call(
        self, service: str, method: str, payload: bytes, timeout: float | None
    ) -> bytes | memoryview | None:
        if len(payload) > MAX_REQUEST_BYTES:
            return None
        connection = self._ready()
        if connection is None:
            return None
        self.calls_made += 1
        try:
            body = await connection.call(f"/{service}/{method}", payload, timeout, method)
        except ConnectionError as exc:
            if self._closed:
                raise errors.CancelledError(
                    f"{method} to {self._target} was cancelled: the channel was closed"
                ) from None
            raise errors.UnavailableError(
                f"{method} to {self._target} failed: the direct connection broke ({exc})"
            ) from None
        if len(body) < _RESULT.size:
            raise errors.InternalError(f"{method} to {self._target}: a malformed answer on the direct path")
        (code,) = _RESULT.unpack_from(body)
        if code != errors.OK:
            raise errors.from_status(code, bytes(body[_RESULT.size :]).decode("utf-8", "replace"))
        return memoryview(body)[_RESULT.size :]

    async def close(self) -> None:
        """Close the connection: calls still waiting fail with CancelledError."""
        self._closed = True
        self.unsupported = "the channel is closed"
        if self._setup is not None:
            self._setup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._setup
        if self._connection is not None:
            self._connection.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._connection.closed), 1.0)


def call_server(
    dispatch: Callable[[str, memoryview], Awaitable[bytes]],
    recv_tensor: Callable[[memoryview], Awaitable[list[bytes | memoryview]]] | None,
    recv_tensor_path: str,
) -> CallServer:
    """A `CallServer` from the call stream's dispatch plus a RecvTensor server."""

    async def serve(path: str, payload: memoryview) -> list[bytes | memoryview]:
        if path == recv_tensor_path:
            if recv_tensor is None:
                raise errors.UnimplementedError("this task serves no tensors")
            return await recv_tensor(payload)
        return [await dispatch(path, payload)]

    return serve
