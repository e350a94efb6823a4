"""The "grpc" transport: everything over grpc.aio, at TensorFlow's method paths.

Message-size limits are lifted on both ends (TensorFlow uses INT32_MAX; we use
unlimited), `SO_REUSEPORT` is off so a port in use is an error rather than a silent
second listener, and proxies from the environment are ignored (cluster traffic is
always direct).

Between distserver tasks, calls and RecvTensor ride a direct TCP connection beside
gRPC once it is up (`distserver.transports.direct`); until then MasterService and
WorkerService calls ride one long-lived stream per channel
(`distserver.transports.call_stream`). TensorFlow peers, and calls that must wait for
the peer or carry more than 4 MiB, use the unary methods.

A channel is a gRPC control connection plus a pluggable `TensorPath`, its data plane
(the split tensorpipe makes between a pipe's control connection and its data
channels). `GrpcTensorPath` is the default; other transports pass their own
(grpc+verbs: shared memory, with `GrpcTensorPath` as its fallback) and reuse the rest
as is. A tensor path may also carry control calls (`TensorPath.carry_call`).

On the serving side, `serve` builds the grpc.aio server every gRPC-based transport
uses; the data plane serves from the task's tensor source through a `TensorHandOver`.

The gRPC data plane (RecvTensor) skips protobuf for tensor bytes (`distserver.wire`):

* `/tensorflow.WorkerService/RecvTensor` (unary) answers with a valid
  `RecvTensorResponse` built by hand, read back as a numpy view over the received
  bytes. Any TensorFlow peer can call it.
* Tensors larger than `STREAM_THRESHOLD` go through
  `/distserver.WorkerService/RecvTensorChunks` (server streaming, `CHUNK_BYTES` per
  message), which measured ~1.4x faster than one unary message at 16-64 MiB and has
  no 2 GiB limit. A distserver receiver announces it can stream (request metadata);
  the sender then answers a large tensor's unary call with only a trailing
  "use the stream" flag, and the receiver remembers that tensor name so later steps
  go straight to the stream.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple

import grpc
import grpc.aio
from google.protobuf.message import Message

from distserver import call_deadline, errors
from distserver.devices import RendezvousKey, parse_rendezvous_key
from distserver.protos.services import SERVICES, STREAMING_METHODS, WORKER_SERVICE
from distserver.protos.worker_pb2 import RecvTensorRequest
from distserver.security import Security
from distserver.tensors import tensor_nbytes
from distserver.transports import call_stream, direct, http2
from distserver.transports.base import (
    Channel,
    ChannelStatistics,
    Listener,
    ServiceHandler,
    TensorSource,
    Transport,
    parse_handler_request,
    parse_request,
)
from distserver.wire import (
    EncodedMessage,
    TensorAssembler,
    chunk_tensor,
    decode_plain_recv_tensor_response,
    decode_recv_tensor_response,
    encode_recv_tensor_response,
    is_plain,
    recv_tensor_response_parts,
)

logger = logging.getLogger(__name__)

_MESSAGE_LIMITS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]
# A peer that stops answering (hung, SIGSTOPped, its network cut) is noticed by HTTP/2
# keepalive: while calls are in flight a channel pings every KEEPALIVE_MS, and a ping
# not answered within KEEPALIVE_TIMEOUT_MS fails those calls with UNAVAILABLE. So a
# step waiting on a hung task fails within ~10 s instead of never. Our servers accept
# pings that often. TensorFlow's servers do not (with gRPC's defaults they end the
# connection, in-flight calls included, at the third ping of a call that runs silently:
# "too many pings"), so a channel that finds a TensorFlow peer drops keepalive
# (`GrpcChannel._to_foreign_peer`).
# Both can be set through the environment of every process of the cluster.
# How long calls in flight on a connection a channel replaced may take to finish.
_RETIRED_CHANNEL_GRACE = 60.0
KEEPALIVE_ENV = "DISTSERVER_KEEPALIVE_MS"
KEEPALIVE_TIMEOUT_ENV = "DISTSERVER_KEEPALIVE_TIMEOUT_MS"


def _milliseconds_from_env(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{name} must be a whole number of milliseconds above 0, got {text!r}")
    return value


KEEPALIVE_MS = _milliseconds_from_env(KEEPALIVE_ENV, 5000)
KEEPALIVE_TIMEOUT_MS = _milliseconds_from_env(KEEPALIVE_TIMEOUT_ENV, 4000)
CONNECT_TIMEOUT_MS = KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS
SERVER_OPTIONS = [
    *_MESSAGE_LIMITS,
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
_QUIET_CHANNEL_OPTIONS = [
    *_MESSAGE_LIMITS,
    ("grpc.enable_http_proxy", 0),
    # Reconnect quickly to a task that was down or restarted: a caller otherwise keeps
    # getting "connection refused" for up to the backoff after the task is back.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
    # gRPC core shares a connection attempt's state among a process's channels to the
    # same address: a new channel to a task that has just started (or restarted) got
    # the old channels' "connection refused" at once. Each channel connects for itself.
    ("grpc.use_local_subchannel_pool", 1),
    # gRPC core gives a connection attempt this long to finish its handshake (the
    # peer's HTTP/2 SETTINGS). At 100 ms a peer that was up but busy for a moment
    # (a loaded host, a pause) failed its callers with UNAVAILABLE at once; a silent
    # peer is given the time keepalive gives one on an open connection.
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
]
CHANNEL_OPTIONS = [
    *_QUIET_CHANNEL_OPTIONS,
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # gRPC core also times out every ping after its own limit (60 s by default),
    # which newer releases apply to keepalive pings too.
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]

# Trailing metadata that marks an error raised by a distserver handler, as opposed
# to one made by gRPC itself (peer unreachable, deadline, cancelled connection).
_HANDLER_ERROR_KEY = http2.HANDLER_ERROR_KEY

_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}

STREAM_METHOD = "/distserver.WorkerService/RecvTensorChunks"
STREAM_THRESHOLD = 4 << 20
CHUNK_BYTES = 1 << 20
_STREAM_ABOVE_KEY = "distserver-stream-above"
_USE_STREAM_KEY = "distserver-use-stream"
# Tensors encoded or decoded in a thread rather than on the event loop.
_OFFLOAD_BYTES = 1 << 20
# Calls whose request is larger than this go as their own unary call rather than
# on the shared call stream (`call_stream`), so they do not hold the stream up.
_STREAMED_CALL_BYTES = 4 << 20
# How many streamed tensor names a channel remembers.
_STREAMED_NAMES_LIMIT = 4096


def grpc_status(code: int) -> grpc.StatusCode:
    """The gRPC status for a TensorFlow status code (they share numbers)."""
    return _STATUS_BY_CODE.get(code, grpc.StatusCode.UNKNOWN)


# What gRPC says when the connection broke under a call (the peer died or restarted).
_CONNECTION_LOST = frozenset(
    {(errors.UNKNOWN, "Stream removed"), (errors.INTERNAL, "Internal error from Core")}
)


def error_from_rpc(exc: grpc.aio.AioRpcError, *, target: str, method: str) -> errors.OpError:
    """The OpError a failed call stands for.

    Errors raised by the remote handler keep their class and message. Errors that
    gRPC made itself also say which task and method the call was for, so that
    "failed to connect" names the peer.
    """
    code = exc.code().value[0]
    message = exc.details() or ""
    trailing: Any = exc.trailing_metadata() or ()
    from_handler = any(key == _HANDLER_ERROR_KEY for key, _ in trailing)
    if not from_handler:
        if (code, message) in _CONNECTION_LOST or (
            code == errors.INTERNAL and message.startswith("Received RST_STREAM")
        ):
            code = errors.UNAVAILABLE  # the peer went away mid-call
        message = f"{method} to {target} failed: {message}"
    return errors.from_status(code, message)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: Exception, where: Any) -> None:
    if not isinstance(exc, errors.OpError):
        _log_unexpected(exc, getattr(where, "__name__", str(where)))
    code, message = errors.to_status(exc)
    await context.abort(grpc_status(code), message, trailing_metadata=((_HANDLER_ERROR_KEY, "1"),))


def _wrap(
    fn: Callable[[Any], Awaitable[Any]], request_cls: type[Message]
) -> Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Any]:
    # The request arrives as bytes and is parsed here, so that malformed bytes are
    # INVALID_ARGUMENT rather than grpc's UNKNOWN with a logged traceback.
    async def handle(data: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        call_deadline.set_from_timeout(context.time_remaining())
        try:
            return await fn(parse_handler_request(request_cls, data))
        except Exception as exc:
            await _abort(context, exc, fn)
        raise AssertionError("unreachable: context.abort raises")

    return handle


def _wrap_stream(
    fn: Callable[[Any], Awaitable[Any]], request_cls: type[Message]
) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]:
    # A bidirectional stream of calls to one unary handler: each request message is
    # answered in order; the first error ends the stream with its status.
    async def handle(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        try:
            async for data in requests:
                yield await fn(parse_handler_request(request_cls, data))
        except Exception as exc:
            await _abort(context, exc, fn)

    return handle


async def _in_thread_if_large(nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
    if nbytes < _OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class TensorHandOver:
    """A task's tensor source, plus values parked for a second call of the same receiver.

    The worker hands each value over once (and may drop the step right after). When
    the serving side fetched a value but will send it through another path the
    receiver calls next (the chunk stream for a large tensor; gRPC for a string that
    shared memory cannot carry), it `park`s the value; the next `fetch` of that step
    and key takes it from here. A parked value that nobody asks for within
    `PARKED_SECONDS` is dropped (its receiver is gone).
    """

    PARKED_SECONDS = 60.0

    def __init__(self, source: TensorSource) -> None:
        self._source = source
        self._parked: dict[tuple[int, str], tuple[Any, bool]] = {}

    async def fetch(self, step_id: int, key: RendezvousKey) -> tuple[Any, bool]:
        """`(value, is_dead)` of `key` in step `step_id`."""
        found = self._parked.pop((step_id, key.text), None)
        if found is not None:
            return found
        return await self._source(step_id, key)

    def park(self, step_id: int, key: RendezvousKey, value: Any, is_dead: bool) -> None:
        slot = (step_id, key.text)
        self._parked[slot] = (value, is_dead)
        asyncio.get_running_loop().call_later(self.PARKED_SECONDS, self._parked.pop, slot, None)


def _recv_tensor_handlers(hand_over: TensorHandOver) -> tuple[Any, Any]:
    """The unary (TF-compatible) and streaming RecvTensor handlers.

    A value the unary call redirects to the stream is parked for the stream call.
    """

    async def unary(data: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        try:
            request = parse_request(RecvTensorRequest, data)
            key = parse_rendezvous_key(request.rendezvous_key)
            value, is_dead = await hand_over.fetch(request.step_id, key)
            stream_above = dict(context.invocation_metadata() or ()).get(_STREAM_ABOVE_KEY)
            nbytes = tensor_nbytes(value)
            if stream_above is not None and is_plain(value) and nbytes > int(stream_above):
                hand_over.park(request.step_id, key, value, is_dead)
                context.set_trailing_metadata(((_USE_STREAM_KEY, "1"),))
                return b""
            encoded: bytes = await _in_thread_if_large(nbytes, encode_recv_tensor_response, value, is_dead)
            return encoded
        except Exception as exc:
            await _abort(context, exc, "RecvTensor")
        raise AssertionError("unreachable: context.abort raises")

    async def stream(data: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
        try:
            request = parse_request(RecvTensorRequest, data)
            key = parse_rendezvous_key(request.rendezvous_key)
            value, is_dead = await hand_over.fetch(request.step_id, key)
        except Exception as exc:
            await _abort(context, exc, "RecvTensorChunks")
            return
        for chunk in chunk_tensor(value, is_dead, CHUNK_BYTES):
            yield chunk

    return (
        grpc.unary_unary_rpc_method_handler(unary, request_deserializer=_raw, response_serializer=_raw),
        grpc.unary_stream_rpc_method_handler(stream, request_deserializer=_raw, response_serializer=_raw),
    )


def _unimplemented(service: str, method: str) -> Callable[[Any], Awaitable[Message]]:
    async def handle(request: Any) -> Message:
        raise errors.UnimplementedError(f"{service}/{method} is not implemented by distserver")

    return handle


class GrpcListener(Listener):
    def __init__(
        self,
        server: grpc.aio.Server,
        port: int,
        calls: call_stream.CallStreamServer,
        direct_server: direct.DirectServer | None,
        front: http2.Http2Front | None = None,
    ) -> None:
        self._server = server
        self._port = port
        self._calls = calls
        self._direct = direct_server
        self._front = front
        self._started = False
        self._stopped = False

    @property
    def port(self) -> int:
        return self._port

    @property
    def calls(self) -> call_stream.CallStreamServer:
        """What serves this listener's call streams (transports reuse its dispatch)."""
        return self._calls

    async def start(self) -> None:
        if not self._started:
            self._started = True
            await self._server.start()
            if self._front is not None:
                await self._front.start()

    async def stop(self, grace: float | None) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._calls.drain()  # call streams never end by themselves: the grace would always run out
        closing = [self._server.stop(grace)]
        if self._front is not None:
            closing.append(self._front.close(grace))
        if self._direct is not None:
            closing.append(self._direct.close(grace))
        await asyncio.gather(*closing)


class TensorPath(abc.ABC):
    """How a `GrpcChannel` moves tensors: its data plane, pluggable.

    Contract:
        * `recv_tensor(step_id, key, timeout)` is `Channel.recv_tensor` minus the
          channel's bookkeeping (closed check, statistics, gRPC error mapping: an
          `AioRpcError` it lets escape becomes the right OpError).
        * `carry_call(service, method, payload, timeout)` may carry a control call
          (serialized request in, serialized response out) that the channel's direct
          connection does not (it is not up, or off); None leaves the call to the
          channel's gRPC connection. The default carries nothing.
        * `data_path` names the path for `ChannelStatistics.data_path`.
        * `close()` releases what the path holds; the channel calls it once, before
          closing its gRPC connection.
    """

    @abc.abstractmethod
    async def recv_tensor(
        self, step_id: int, key: RendezvousKey, timeout: float | None
    ) -> tuple[Any, bool]: ...

    async def carry_call(
        self, service: str, method: str, payload: bytes, timeout: float | None
    ) -> bytes | memoryview | None:
        return None

    @property
    def data_path(self) -> str:
        return "grpc"

    async def close(self) -> None:
        return None


class GrpcTensorPath(TensorPath):
    """RecvTensor over gRPC: unary (TensorFlow's method) or, for large tensors, chunks.

    The receiver announces it can stream; the sender answers a tensor above the
    threshold with a "use the stream" flag, and the receiver remembers that tensor
    name so later steps go straight to the stream.
    """

    def __init__(self, channel: grpc.aio.Channel, direct_link: direct.DirectLink | None = None) -> None:
        self._direct = direct_link
        self._unary = channel.unary_unary(
            f"/{WORKER_SERVICE}/RecvTensor", request_serializer=_serialize, response_deserializer=_raw
        )
        self._chunks = channel.unary_stream(
            STREAM_METHOD, request_serializer=_serialize, response_deserializer=_raw
        )
        self._streamed: set[str] = set()

    async def recv_tensor(self, step_id: int, key: RendezvousKey, timeout: float | None) -> tuple[Any, bool]:
        request = RecvTensorRequest(step_id=step_id, rendezvous_key=key.text)
        if self._direct is not None:
            data = await self._direct.call(WORKER_SERVICE, "RecvTensor", request.SerializeToString(), timeout)
            if data is not None:
                return await _decode_recv_tensor_response(data)
        if key.tensor_name in self._streamed:
            return await self._recv_stream(request, timeout)
        call = self._unary(request, timeout=timeout, metadata=((_STREAM_ABOVE_KEY, str(STREAM_THRESHOLD)),))
        data = await call
        trailing: Any = await call.trailing_metadata()
        if any(k == _USE_STREAM_KEY for k, _ in trailing or ()):
            if len(self._streamed) >= _STREAMED_NAMES_LIMIT:
                self._streamed.clear()
            self._streamed.add(key.tensor_name)
            return await self._recv_stream(request, timeout)
        return await _decode_recv_tensor_response(data)

    @property
    def data_path(self) -> str:
        return "direct" if self._direct is not None and self._direct.connected else "grpc"

    async def _recv_stream(self, request: RecvTensorRequest, timeout: float | None) -> tuple[Any, bool]:
        assembler = TensorAssembler()
        async for message in self._chunks(request, timeout=timeout):
            assembler.add(message)
        return assembler.result()


async def _decode_recv_tensor_response(data: bytes | memoryview) -> tuple[Any, bool]:
    decoded = decode_plain_recv_tensor_response(data)  # a view: no thread needed
    if decoded is not None:
        return decoded
    result: tuple[Any, bool] = await _in_thread_if_large(len(data), decode_recv_tensor_response, data)
    return result


def open_channel(
    address: str, security: Security | None = None, *, keepalive: bool = True
) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` with our options, TLS and token as `security` says.

    `keepalive=False` leaves out the keepalive pings (for TensorFlow peers, see KEEPALIVE_MS).
    """
    interceptors = _token_interceptors(security.token_metadata) if security is not None else []
    options = CHANNEL_OPTIONS if keepalive else _QUIET_CHANNEL_OPTIONS
    if security is None or not security.tls:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    pem = security.credentials()
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pem.root_certificates,
        private_key=pem.private_key,
        certificate_chain=pem.certificate_chain,
    )
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def _token_interceptors(metadata: tuple[tuple[str, str], ...]) -> list[Any]:
    """Client interceptors adding `metadata` (the token) to every call; none without it."""
    if not metadata:
        return []

    def with_token(details: Any) -> Any:
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *metadata))

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
        async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(with_token(details), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[type-arg]
        async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(with_token(details), request)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[type-arg]
        async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
            return await continuation(with_token(details), requests)

    return [UnaryUnary(), UnaryStream(), StreamStream()]


# Makes a channel's tensor path from its gRPC connection, target address and direct link.
TensorPathFactory = Callable[[grpc.aio.Channel, str, direct.DirectLink], TensorPath]


def _grpc_tensor_path(channel: grpc.aio.Channel, target: str, direct_link: direct.DirectLink) -> TensorPath:
    return GrpcTensorPath(channel, direct_link)


class GrpcChannel(Channel):
    """A gRPC control connection to one task plus a tensor path (`GrpcTensorPath` by default).

    A control call goes, in order of preference, over the tensor path (when it
    carries calls), the direct connection or the call stream (distserver peers), or
    a unary call.
    """

    def __init__(
        self,
        address: str,
        tensor_path: TensorPathFactory = _grpc_tensor_path,
        security: Security | None = None,
    ) -> None:
        self.target = address
        self._security = security
        self._channel = open_channel(address, security)
        self._callables: dict[tuple[str, str], Any] = {}
        self._tensor_path_factory = tensor_path
        self._direct = direct.DirectLink(
            self._direct_endpoint, address, security, (KEEPALIVE_MS / 1000, KEEPALIVE_TIMEOUT_MS / 1000)
        )
        self._tensors = tensor_path(self._channel, address, self._direct)
        self._retired: list[asyncio.Future[None]] = []  # closing: what `_to_foreign_peer` replaced
        self._unproven_streams = 0  # call streams that broke before the peer ever answered
        self._calls: call_stream.CallStream | None = call_stream.CallStream(
            self._channel, address, lambda exc, method: error_from_rpc(exc, target=address, method=method)
        )
        self._closed = False
        self._aborted = False
        self._closing: asyncio.Future[None] | None = None
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._calls_started = 0
        self._calls_failed = 0
        self._tensors_received = 0
        self._tensor_bytes_received = 0
        self._call_bytes_received = 0

    @property
    def tensor_path(self) -> TensorPath:
        """This channel's data plane."""
        return self._tensors

    @property
    def direct_link(self) -> direct.DirectLink:
        """This channel's direct connection to a distserver peer (`direct`)."""
        return self._direct

    async def _direct_endpoint(self, request: bytes, timeout: float) -> bytes:
        path = f"/{direct.ENDPOINT_SERVICE}/{direct.ENDPOINT_METHOD}"
        endpoint = self._channel.unary_unary(path, request_serializer=_raw, response_deserializer=_raw)
        reply: bytes = await endpoint(request, timeout=timeout)
        return reply

    def _callable(self, service: str, method: str) -> Any:
        key = (service, method)
        mc = self._callables.get(key)
        if mc is None:
            _, response_cls = SERVICES[service][method]
            mc = self._channel.unary_unary(
                f"/{service}/{method}",
                request_serializer=_serialize,
                response_deserializer=response_cls.FromString,
            )
            self._callables[key] = mc
        return mc

    @contextlib.asynccontextmanager
    async def _tracked(self, method: str) -> AsyncIterator[None]:
        """Count one call, map its errors, and let `close()` wait for it."""
        if self._closed:
            raise errors.UnavailableError(f"{method} to {self.target} failed: the channel is closed")
        self._calls_started += 1
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        except grpc.aio.AioRpcError as exc:
            self._calls_failed += 1
            raise error_from_rpc(exc, target=self.target, method=method) from exc
        except errors.OpError:
            self._calls_failed += 1
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._aborted and task is not None and not task.cancelling():
                # Our abort() cancelled the RPC, not the caller: report it as an OpError.
                self._calls_failed += 1
                raise errors.CancelledError(
                    f"{method} to {self.target} was cancelled: the channel was aborted"
                ) from None
            raise
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def call(
        self,
        service: str,
        method: str,
        request: Message,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> Message:
        async with self._tracked(method):
            if not wait_for_ready:
                data = await self._call_framed(service, method, request.SerializeToString(), timeout)
                if data is not None:
                    self._call_bytes_received += len(data)
                    response_cls: Any = SERVICES[service][method][1]
                    framed: Message = response_cls.FromString(data)
                    return framed
            response: Message = await self._callable(service, method)(
                request, timeout=timeout, wait_for_ready=wait_for_ready
            )
        self._call_bytes_received += response.ByteSize()
        return response

    async def call_serialized(
        self, service: str, method: str, request: Message | EncodedMessage, *, timeout: float | None = None
    ) -> bytes | memoryview:
        async with self._tracked(method):
            payload = request.SerializeToString()
            data = await self._call_framed(service, method, payload, timeout)
            if data is None:
                path = f"/{service}/{method}"
                unary = self._channel.unary_unary(path, request_serializer=_raw, response_deserializer=_raw)
                data = await unary(payload, timeout=timeout)
        self._call_bytes_received += len(data)
        return data

    async def _call_framed(
        self, service: str, method: str, payload: bytes, timeout: float | None
    ) -> bytes | memoryview | None:
        """The serialized response over the direct connection, the tensor path or the call
        stream; None: make a unary call."""
        data = await self._direct.call(service, method, payload, timeout)
        if data is None:
            data = await self._tensors.carry_call(service, method, payload, timeout)
        if data is not None or self._calls is None or len(payload) > _STREAMED_CALL_BYTES:
            return data
        try:
            return await self._calls.call(service, method, payload, timeout)
        except call_stream.StreamUnsupported:
            self._stream_is_unsupported()
            return None
        except call_stream.StreamUnproven:
            # Perhaps a refusal that raced the first write: this call goes unary; a second
            # such failure before any answer settles it.
            self._unproven_streams += 1
            if self._unproven_streams >= 2:
                self._stream_is_unsupported()
            return None

    def _stream_is_unsupported(self) -> None:
        if self._calls is not None:  # the first call to learn it (others may be in flight)
            self._calls = None  # not a distserver peer: unary calls from now on
            self._direct.unsupported = "a TensorFlow peer"
            self._to_foreign_peer()

    def _to_foreign_peer(self) -> None:
        """Reopen without keepalive pings, which TensorFlow servers punish (see KEEPALIVE_MS).

        Calls in flight finish on the old connection, closed in the background; the
        tensor path is made again on the new one.
        """
        old_channel, old_path = self._channel, self._tensors
        self._channel = open_channel(self.target, self._security, keepalive=False)
        self._callables.clear()
        self._tensors = self._tensor_path_factory(self._channel, self.target, self._direct)

        async def retire() -> None:
            try:
                await old_path.close()
            finally:
                # grace: a RecvTensor still waiting there finishes (None would cancel it).
                await old_channel.close(grace=_RETIRED_CHANNEL_GRACE)

        self._retired.append(asyncio.ensure_future(retire()))

    async def recv_tensor(
        self, step_id: int, key: RendezvousKey, *, timeout: float | None = None
    ) -> tuple[Any, bool]:
        async with self._tracked("RecvTensor"):
            value, is_dead = await self._tensors.recv_tensor(step_id, key, timeout)
        self._tensors_received += 1
        self._tensor_bytes_received += tensor_nbytes(value)
        return value, is_dead

    async def close(self) -> None:
        """Refuse new calls, let those in flight finish, then release the connection."""
        self._closed = True
        await self._idle.wait()
        await self._start_release()

    def abort(self) -> None:
        """Refuse new calls and cancel those in flight at once (they raise CancelledError)."""
        self._closed = True
        self._aborted = True
        self._start_release()

    def _start_release(self) -> asyncio.Future[None]:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._release())
        return self._closing

    async def _release(self) -> None:
        try:
            await self._tensors.close()
        finally:
            await self._direct.close()
            if self._calls is not None:
                await self._calls.close()
            await self._channel.close(grace=None)
            if self._retired:
                await asyncio.gather(*self._retired, return_exceptions=True)

    def statistics(self) -> ChannelStatistics:
        return ChannelStatistics(
            target=self.target,
            calls_started=self._calls_started,
            calls_failed=self._calls_failed,
            tensors_received=self._tensors_received,
            tensor_bytes_received=self._tensor_bytes_received,
            data_path=self._tensors.data_path,
            call_bytes_received=self._call_bytes_received,
        )


# (where, exception type) pairs whose traceback was logged: a peer that triggers the
# same bug in a loop must not flood the log.
_LOGGED_UNEXPECTED: set[tuple[str, type[BaseException]]] = set()
_LOGGED_UNEXPECTED_LIMIT = 256


def _log_unexpected(exc: Exception, where: str) -> None:
    """Log a handler's non-OpError (a bug): with its traceback the first time per place and type."""
    seen = (where, type(exc))
    if seen in _LOGGED_UNEXPECTED:
        logger.debug("unexpected error in %s again: %r", where, exc)
        return
    if len(_LOGGED_UNEXPECTED) < _LOGGED_UNEXPECTED_LIMIT:
        _LOGGED_UNEXPECTED.add(seen)
    logger.error("unexpected error in %s (later ones like it are logged at debug level)", where, exc_info=exc)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def _raw(data: bytes) -> bytes:
    return data


async def serve(
    address: str,
    services: Mapping[str, ServiceHandler],
    tensors: TensorHandOver | None,
    extra_handlers: Sequence[Any] = (),
    security: Security | None = None,
) -> GrpcListener:
    """A grpc.aio server bound to `address`, not started yet, serving:

    * every method of `services` at TensorFlow's unary paths and, for distserver
      peers, on the call stream (`call_stream`); a method a handler lacks answers
      UNIMPLEMENTED;
    * the bidirectional streams of `STREAMING_METHODS` whose unary method a
      service of `services` has (EagerService/StreamingEnqueue);
    * RecvTensor (unary, and the chunk stream) from `tensors`;
    * `extra_handlers` (generic RPC handlers), for transports built on this one.

    With `security`: TLS when it has a certificate (clients' certificates required
    with `require_client_cert`), and every call checked for its token.

    Without TLS, `address` is served by an `http2.Http2Front` (unary calls of the
    services answered on the event loop, the rest relayed to the grpc.aio server,
    which then listens on a loopback port of its own); `DISTSERVER_HTTP2_FRONT=0`
    leaves `address` to grpc.aio.
    """
    interceptors = [_TokenCheck(security)] if security is not None and security.token else []
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    handlers: list[Any] = []  # every generic handler `server` has, for the front's routing

    def add_handlers(*generic: Any) -> None:
        server.add_generic_rpc_handlers(generic)
        handlers.extend(generic)

    if extra_handlers:
        add_handlers(*extra_handlers)
    calls = call_stream.CallStreamServer(
        {
            f"/{service}/{method}": handler.get(method) or _unimplemented(service, method)
            for service, handler in services.items()
            for method in SERVICES[service]
            if method != "RecvTensor"  # the data plane has its own paths
        },
        _log_unexpected,
    )
    add_handlers(calls.rpc_handler())
    direct_server = _direct_server(address, calls, tensors, security)
    add_handlers(direct.endpoint_handler(lambda: direct_server))
    for service, handler in services.items():
        rpc_handlers = {}
        for method, (request_cls, _) in SERVICES[service].items():
            fn = handler.get(method) or _unimplemented(service, method)
            rpc_handlers[method] = grpc.unary_unary_rpc_method_handler(
                _wrap(fn, request_cls), request_deserializer=_raw, response_serializer=_serialize
            )
        for (stream_service, stream_method), unary_method in STREAMING_METHODS.items():
            unary_fn = handler.get(unary_method)
            if stream_service == service and unary_fn is not None:
                rpc_handlers[stream_method] = grpc.stream_stream_rpc_method_handler(
                    _wrap_stream(unary_fn, SERVICES[service][unary_method][0]),
                    request_deserializer=_raw,
                    response_serializer=_serialize,
                )
        if service == WORKER_SERVICE and tensors is not None:
            unary, stream = _recv_tensor_handlers(tensors)
            rpc_handlers["RecvTensor"] = unary
            service_name, method_name = STREAM_METHOD.strip("/").split("/")
            add_handlers(grpc.method_handlers_generic_handler(service_name, {method_name: stream}))
        add_handlers(grpc.method_handlers_generic_handler(service, rpc_handlers))
    credentials = _server_credentials(security)
    use_front = credentials is None and http2.enabled()
    front = None
    try:
        if use_front:
            sockets = _listening_sockets(address)
            port = sockets[0].getsockname()[1]
            relay_port = _bind(server, "127.0.0.1:0", None)
            relay = grpc.aio.insecure_channel(f"127.0.0.1:{relay_port}", options=_QUIET_CHANNEL_OPTIONS)
            front = http2.Http2Front(
                calls.dispatch, calls.serves, _handled_by(handlers), relay, security, calls.content_start
            )
            await front.listen(sockets)
        else:
            port = _bind(server, address, credentials)
    except errors.UnknownError:
        await server.stop(None)
        if direct_server is not None:
            await direct_server.close(None)
        raise
    return GrpcListener(server, port, calls, direct_server, front)


class _CallDetails(NamedTuple):
    """What grpc.aio asks a generic handler about a call (`grpc.HandlerCallDetails`)."""

    method: str
    invocation_metadata: tuple[Any, ...]


def _handled_by(handlers: list[Any]) -> Callable[[str], bool]:
    """Whether one of `handlers` (generic RPC handlers) takes calls of a path."""

    def handles(path: str) -> bool:
        details = _CallDetails(path, ())
        return any(handler.service(details) is not None for handler in handlers)

    return handles


def _direct_server(
    address: str,
    calls: call_stream.CallStreamServer,
    tensors: TensorHandOver | None,
    security: Security | None,
) -> direct.DirectServer | None:
    """The direct port beside the gRPC one (`direct`, bound on first use); None when off."""
    if not direct.enabled():
        return None
    recv_tensor = None if tensors is None else _direct_recv_tensor(tensors)
    serve_call = direct.call_server(calls.dispatch, recv_tensor, f"/{WORKER_SERVICE}/RecvTensor")
    return direct.DirectServer(address, serve_call, security)


def _direct_recv_tensor(hand_over: TensorHandOver) -> Callable[[memoryview], Awaitable[list[Any]]]:
    async def recv_tensor(payload: memoryview) -> list[Any]:
        request = parse_request(RecvTensorRequest, payload)
        key = parse_rendezvous_key(request.rendezvous_key)
        value, is_dead = await hand_over.fetch(request.step_id, key)
        # Plain arrays are sent from their own memory; anything else is serialized first.
        nbytes = 0 if is_plain(value) and value.flags.c_contiguous else tensor_nbytes(value)
        parts: list[Any] = await _in_thread_if_large(nbytes, recv_tensor_response_parts, value, is_dead)
        return parts

    return recv_tensor


def _bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind `address`; "localhost" binds every loopback address it names, or fails.

    gRPC binds "localhost:P" on whichever of 127.0.0.1 and [::1] it can: with
    127.0.0.1:P held by another process it would serve on [::1] alone, and peers
    dialing 127.0.0.1:P would reach that other process. Each loopback address is bound
    on its own instead (the port the first one got, for port 0).
    """
    host, _, port_text = address.rpartition(":")
    targets = [address]
    if host == "localhost":
        targets = [f"{loopback}:{port_text}" for loopback in _loopback_addresses()]
    port = 0
    for target in targets:
        if port:
            target = f"{target.rpartition(':')[0]}:{port}"
        named = target if target == address else f"{target} (for {address})"
        try:
            if credentials is None:
                port = server.add_insecure_port(target)
            else:
                port = server.add_secure_port(target, credentials)
        except RuntimeError as exc:
            port, reason = 0, f" ({exc})"
        else:
            reason = ""
        if port == 0:
            raise _bind_error(named, reason)
    return port


def _listening_sockets(address: str) -> list[socket.socket]:
    """Listening sockets for `address`, by `_bind`'s rules: every address its host names
    ("localhost": every loopback address), all on one port (the first one's, for port 0)."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    hosts = [a.strip("[]") for a in _loopback_addresses()] if host == "localhost" else [host]
    sockets: list[socket.socket] = []
    port = int(port_text)
    try:
        for name in hosts:
            named = f"{name}:{port_text}" if name == host else f"{name}:{port_text} (for {address})"
            try:
                infos = socket.getaddrinfo(
                    name or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
                )
            except socket.gaierror as exc:
                raise _bind_error(named, f" ({exc})") from None
            families = {info[0] for info in infos}
            for family, kind, proto, _, sockaddr in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                sockets.append(sock)
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    if family == socket.AF_INET6 and socket.AF_INET in families:
                        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # both bound
                    if port:
                        sockaddr = (sockaddr[0], port, *sockaddr[2:])
                    sock.bind(sockaddr)
                    sock.listen(1024)
                except OSError as exc:
                    raise _bind_error(named, f" ({exc.strerror})") from None
                sock.setblocking(False)
                port = sock.getsockname()[1]
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _bind_error(named: str, reason: str) -> errors.UnknownError:
    return errors.UnknownError(
        f"Could not start gRPC server: cannot bind {named}{reason}. "
        "Is another process using that port? Pick a free port or use port 0."
    )


def _server_credentials(security: Security | None) -> grpc.ServerCredentials | None:
    """TLS credentials for a server port; None: plaintext."""
    if security is None or not security.tls:
        return None
    pem = security.credentials()
    if pem.certificate_chain is None or pem.private_key is None:
        raise errors.InvalidArgumentError(
            "A server with TLS needs its own certificate: give Security(cert_file=..., key_file=...) "
            "(ca_file alone configures clients)"
        )
    return grpc.ssl_server_credentials(
        [(pem.private_key, pem.certificate_chain)],
        root_certificates=pem.root_certificates,
        require_client_auth=security.require_client_cert,
    )


class _TokenCheck(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses, with UNAUTHENTICATED, every call that does not carry the security's token."""

    def __init__(self, security: Security) -> None:
        self._security = security

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or self._security.admits(details.invocation_metadata):
            return handler
        return _refusal(handler, f"{details.method} needs the cluster's token")


def _refusal(handler: Any, message: str) -> Any:
    """A handler of `handler`'s kind that answers UNAUTHENTICATED without reading a request."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if handler.request_streaming:
            # Take the first message before answering: a client still writing when the
            # call ends would see a bare "Internal error" instead of this status.
            async for _ in request:
                break
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{message}: set it with Security(token=...) or the DISTSERVER_AUTH_TOKEN environment variable",
        )

    kind = (handler.request_streaming, handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kind]
    return make(refuse, request_deserializer=_raw, response_serializer=_raw)


def _loopback_addresses() -> list[str]:
    """The loopback addresses "localhost" stands for here: 127.0.0.1, and [::1] when it exists."""
    addresses = ["127.0.0.1"]
    if socket.has_ipv6:
        try:
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
                probe.bind(("::1", 0))
            addresses.append("[::1]")
        except OSError:
            pass  # IPv6 is off here: 127.0.0.1 is all "localhost" can reach
    return addresses


class GrpcTransport(Transport):
    name = "grpc"

    async def listen(
        self,
        address: str,
        services: Mapping[str, ServiceHandler],
        tensors: TensorSource | None = None,
        *,
        security: Security | None = None,
    ) -> Listener:
        hand_over = None if tensors is None else TensorHandOver(tensors)
        return await serve(address, services, hand_over, security=security)

    def connect(self, address: str, *, security: Security | None = None) -> Channel:
        return GrpcChannel(address, security=security)
