"""Unary calls between distserver tasks, carried as messages on one long-lived gRPC stream.

A new unary call costs a grpc.aio server two completion-queue events, each handed
from grpcio's poller thread to the event loop; a message on an open stream costs
one. On loopback with empty handlers: 391-403 µs per unary round trip, 150-165 µs
per message round trip on a bidirectional stream. A distributed step makes two such
calls in a row (client -> master, master -> worker), so distserver channels send
MasterService and WorkerService calls to distserver peers over `METHOD`:

* request frame: call id (u64), kind (CALL or CANCEL), the method path's length
  (u16) and the path ("/tensorflow.WorkerService/RunGraph"), then the serialized
  request;
* response frame: call id, kind (OK, ERROR or BODY_FOLLOWS), a status code (i32),
  then the serialized response or the UTF-8 error message. A response above 2 MiB
  goes as its own message after a BODY_FOLLOWS frame instead, so that it is never
  copied into a frame (each message costs one more completion-queue hand-off, which
  only large responses can afford).

Calls run concurrently on the server (one task each) and are answered in any order.
A CANCEL frame cancels the server's task, as a cancelled unary call would. When the
stream breaks, every call waiting on it fails (UnavailableError) and the next call
opens a new stream. A server that stops drains its streams: new calls are refused
with UnavailableError, running ones finish, then the stream ends. A peer without the
method (TensorFlow) answers UNIMPLEMENTED; the channel then makes plain unary calls
for good, retrying the call that found out (the peer never ran it). TensorFlow
clients keep using the unary methods, which every server still serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import Message

from distserver import errors
from distserver.protos.services import SERVICES
from distserver.transports.base import parse_handler_request
from distserver.wire import content_start

METHOD = "/distserver.Calls/Stream"

_CALL, _CANCEL = 0, 1
_OK, _ERROR, _BODY_FOLLOWS = 0, 1, 2
# Calls one stream may have running at once (a peer cannot make a task start unbounded work).
MAX_CALLS_PER_STREAM = 4096
_INLINE_RESPONSE_BYTES = 2 << 20  # above the 1 MiB values a RunGraph response may carry
_REQUEST_HEAD = struct.Struct("<QBH")  # call id, kind, path length
_RESPONSE_HEAD = struct.Struct("<QBi")  # call id, kind, status code
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from the type stubs


# How long to wait for an ended stream's status once a read or write saw it end.
_FINAL_STATUS_WAIT = 1.0


class StreamUnsupported(Exception):
    """The peer does not serve `METHOD`; the call was not run there."""


class StreamUnproven(Exception):
    """The stream broke with a bare INTERNAL before the peer ever answered on it.

    That is how a peer without `METHOD` (TensorFlow) can look when its refusal races the
    first write; the call did not run there. The channel makes it as a unary call.
    """


def _raw(data: bytes) -> bytes:
    return data


# ----------------------------------------------------------------------------- server


class _ServerStream:
    """One client's stream on the server: its running calls and its outgoing frames."""

    def __init__(self) -> None:
        self.running: dict[int, asyncio.Task[None]] = {}
        self.outgoing: asyncio.Queue[tuple[bytes, ...] | None] = asyncio.Queue()

    def end_if_idle(self) -> None:
        if not self.running:
            self.outgoing.put_nowait(None)


class CallStreamServer:
    """Serves `METHOD` with `handlers` (method path -> coroutine taking the request).

    `on_unexpected(exc, path)` is told about handler errors that are not OpErrors
    (bugs); the caller gets them as UnknownError either way.
    """

    def __init__(
        self,
        handlers: Mapping[str, Callable[[Any], Awaitable[Any]]],
        on_unexpected: Callable[[Exception, str], None],
    ) -> None:
        self._handlers = dict(handlers)
        self._request_types: dict[str, type[Message]] = {
            f"/{service}/{method}": request_cls
            for service, table in SERVICES.items()
            for method, (request_cls, _) in table.items()
        }
        self._on_unexpected = on_unexpected
        self._streams: set[_ServerStream] = set()
        self._draining = False

    def serves(self, path: str) -> bool:
        """Whether `dispatch` answers calls to `path` (a unary method of the services)."""
        return path in self._handlers

    def content_start(self, path: str, head: memoryview) -> int | None:
        """Where the content of the first large tensor of a request to `path` starts,
        from the request's first bytes `head` (`wire.content_start`); None if unknown."""
        request_cls = self._request_types.get(path)
        return None if request_cls is None else content_start(head, request_cls)

    def rpc_handler(self) -> Any:
        """The generic handler to add to a `grpc.aio.Server`."""
        service, method = METHOD.strip("/").split("/")
        return grpc.method_handlers_generic_handler(
            service, {method: grpc.stream_stream_rpc_method_handler(self._serve)}
        )

    @property
    def draining(self) -> bool:
        """`drain()` was called: new calls are refused."""
        return self._draining

    def drain(self) -> None:
        """Refuse new calls; end each stream once its running calls have answered."""
        self._draining = True
        for stream in self._streams:
            stream.end_if_idle()

    async def _serve(self, requests: Any, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        stream = _ServerStream()
        self._streams.add(stream)
        reader = asyncio.ensure_future(self._read(stream, context))
        try:
            while (messages := await stream.outgoing.get()) is not None:
                for message in messages:  # a response's head and body go out back to back
                    await context.write(message)
        except Exception:  # the client went away; the reader cancels its calls
            pass
        finally:
            self._streams.discard(stream)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read(self, stream: _ServerStream, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        try:
            while (frame := await context.read()) is not _EOF:
                try:
                    call_id, kind, path_len = _REQUEST_HEAD.unpack_from(frame)
                    path = bytes(frame[_REQUEST_HEAD.size : _REQUEST_HEAD.size + path_len]).decode()
                except (struct.error, UnicodeDecodeError):
                    return  # not a distserver peer: end its stream, quietly
                if kind == _CANCEL:
                    task = stream.running.get(call_id)
                    if task is not None:
                        task.cancel()
                elif self._draining:
                    stream.outgoing.put_nowait(
                        _error_frame(call_id, errors.UNAVAILABLE, "the server is stopping")
                    )
                elif call_id in stream.running or len(stream.running) >= MAX_CALLS_PER_STREAM:
                    stream.outgoing.put_nowait(
                        _error_frame(
                            call_id,
                            errors.RESOURCE_EXHAUSTED,
                            f"call {call_id} is running already, or {MAX_CALLS_PER_STREAM} calls are",
                        )
                    )
                else:
                    payload = memoryview(frame)[_REQUEST_HEAD.size + path_len :]
                    stream.running[call_id] = asyncio.ensure_future(
                        self._answer(stream, call_id, path, payload)
                    )
        finally:
            running = list(stream.running.values())
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            stream.outgoing.put_nowait(None)

    async def dispatch(self, path: str, payload: bytes | memoryview) -> bytes:
        """Run one call: its serialized response. Raises the handler's OpError; any
        other error is reported to `on_unexpected` and raised as UnknownError."""
        fn = self._handlers.get(path)
        request_cls = self._request_types.get(path)
        if fn is None or request_cls is None:
            raise errors.UnimplementedError(f"{path} is not served by this distserver task")
        try:
            body: bytes = (await fn(parse_handler_request(request_cls, payload))).SerializeToString()
        except Exception as exc:
            if isinstance(exc, errors.OpError):
                raise
            self._on_unexpected(exc, path)
            raise errors.from_status(*errors.to_status(exc)) from exc
        return body

    async def _answer(self, stream: _ServerStream, call_id: int, path: str, payload: memoryview) -> None:
        try:
            body = await self.dispatch(path, payload)
            messages: tuple[bytes, ...] = (
                (_RESPONSE_HEAD.pack(call_id, _OK, errors.OK) + body,)
                if len(body) <= _INLINE_RESPONSE_BYTES
                else (_RESPONSE_HEAD.pack(call_id, _BODY_FOLLOWS, errors.OK), body)
            )
        except asyncio.CancelledError:
            messages = _error_frame(call_id, errors.CANCELLED, "the call was cancelled")
        except Exception as exc:
            messages = _error_frame(call_id, *errors.to_status(exc))
        stream.running.pop(call_id, None)
        stream.outgoing.put_nowait(messages)
        if self._draining:
            stream.end_if_idle()


def _error_frame(call_id: int, code: int, message: str) -> tuple[bytes]:
    return (_RESPONSE_HEAD.pack(call_id, _ERROR, code) + message.encode(),)


# ----------------------------------------------------------------------------- client


class CallStream:
    """The client side of `METHOD` on one channel; a broken stream is reopened on the next call.

    `call` returns the serialized response or raises: the remote handler's OpError;
    for a broken stream, `map_error(rpc_error, method)` (the same error a unary call
    would have raised); `StreamUnsupported` when the peer has no such method.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        target: str,
        map_error: Callable[[grpc.aio.AioRpcError, str], errors.OpError],
    ) -> None:
        self._open = channel.stream_stream(METHOD, request_serializer=_raw, response_deserializer=_raw)
        self._target = target
        self._map_error = map_error
        self._ids = itertools.count(1)
        self._stream: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, tuple[asyncio.Future[bytes | memoryview], str]] = {}
        self._write_lock = asyncio.Lock()
        self._cancels: set[asyncio.Task[None]] = set()
        # The peer has answered on a stream: it serves METHOD (see `StreamUnproven`).
        self.answered = False

    def _ensure_open(self) -> Any:
        if self._stream is None:
            self._stream = self._open(None)  # None: frames are sent with write()
            self._reader = asyncio.ensure_future(self._read(self._stream))
        return self._stream

    async def call(
        self, service: str, method: str, request: bytes, timeout: float | None
    ) -> bytes | memoryview:
        """Run `service`/`method` on the peer; its serialized response."""
        call_id = next(self._ids)
        future: asyncio.Future[bytes | memoryview] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = (future, method)
        stream = self._ensure_open()
        path = f"/{service}/{method}".encode()
        frame = _REQUEST_HEAD.pack(call_id, _CALL, len(path)) + path + request
        timer = asyncio.timeout(timeout)
        try:
            async with timer:
                async with self._write_lock:
                    try:
                        await _write_whole(stream, frame)
                    except grpc.aio.AioRpcError as exc:  # the stream has ended
                        raise self._failure(await _final_status(stream, exc), method) from exc
                return await future
        except TimeoutError:
            if not timer.expired():
                raise  # the remote handler's own DeadlineExceededError
            self._cancel(stream, call_id)
            message = f"{method} to {self._target} failed: Deadline Exceeded"
            raise errors.DeadlineExceededError(message) from None
        except asyncio.CancelledError:
            self._cancel(stream, call_id)
            raise
        except asyncio.InvalidStateError as exc:  # the stream ended before the write
            raise errors.UnavailableError(
                f"{method} to {self._target} failed: the call stream ended"
            ) from exc
        finally:
            self._pending.pop(call_id, None)
            if future.done() and not future.cancelled():
                future.exception()  # the reader failed it while this caller raised its own error

    def _cancel(self, stream: Any, call_id: int) -> None:
        """Tell the server to cancel a call its caller gave up on (in the background)."""
        if stream is not self._stream or stream.done():
            return

        async def send() -> None:
            with contextlib.suppress(Exception):  # the stream broke: the server cancels it all
                async with self._write_lock:
                    await stream.write(_REQUEST_HEAD.pack(call_id, _CANCEL, 0))

        task = asyncio.ensure_future(send())
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _read(self, stream: Any) -> None:
        failure: grpc.aio.AioRpcError | None = None
        closed = False
        try:
            while (head := await stream.read()) is not _EOF:
                call_id, kind, code = _RESPONSE_HEAD.unpack_from(head)
                body: Any = memoryview(head)[_RESPONSE_HEAD.size :]
                if kind == _BODY_FOLLOWS:
                    body = await stream.read()
                    if body is _EOF:
                        break
                self.answered = True
                entry = self._pending.get(call_id)
                if entry is None or entry[0].done():
                    continue  # answered after the caller gave up
                if kind != _ERROR:
                    entry[0].set_result(body)
                else:
                    message = head[_RESPONSE_HEAD.size :].decode(errors="replace")
                    entry[0].set_exception(errors.from_status(code, message))
        except grpc.aio.AioRpcError as exc:
            failure = await _final_status(stream, exc)
        except asyncio.CancelledError:
            closed = True
        finally:
            if self._stream is stream:
                self._stream = None
            for future, method in list(self._pending.values()):
                if future.done():
                    continue
                if failure is not None:
                    future.set_exception(self._failure(failure, method))
                elif closed:
                    future.set_exception(
                        errors.CancelledError(
                            f"{method} to {self._target} was cancelled: the channel was closed"
                        )
                    )
                else:
                    future.set_exception(
                        errors.UnavailableError(f"{method} to {self._target} failed: the call stream ended")
                    )

    def _failure(self, exc: grpc.aio.AioRpcError, method: str) -> BaseException:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return StreamUnsupported(exc.details())
        if exc.code() == grpc.StatusCode.INTERNAL and not self.answered:
            return StreamUnproven(exc.details())
        return self._map_error(exc, method)

    async def close(self) -> None:
        """End the stream; calls still waiting on it fail."""
        stream, reader = self._stream, self._reader
        self._stream = None
        if stream is not None:
            stream.cancel()
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


async def _write_whole(stream: Any, frame: bytes) -> None:
    """Write one frame even if the caller is cancelled meanwhile: grpc.aio cancels the whole
    stream when a pending write is cancelled, which would fail every other call on it
    (a failed step cancels its other partitions' RunGraph calls while they are written)."""
    write = asyncio.ensure_future(stream.write(frame))
    try:
        await asyncio.shield(write)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await write
        raise


async def _final_status(stream: Any, exc: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """The stream's own status when `exc` is the bare INTERNAL that a read or write on an
    ended stream may raise instead (the server's UNIMPLEMENTED or UNAUTHENTICATED says why)."""
    if exc.code() != grpc.StatusCode.INTERNAL:
        return exc
    try:
        async with asyncio.timeout(_FINAL_STATUS_WAIT):
            code = await stream.code()
            details = await stream.details()
            trailing = await stream.trailing_metadata()
    except (grpc.aio.AioRpcError, TimeoutError, asyncio.InvalidStateError):
        return exc
    if code in (grpc.StatusCode.OK, grpc.StatusCode.INTERNAL):
        return exc
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing or grpc.aio.Metadata(), details, None)
