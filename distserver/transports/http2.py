"""A task's public gRPC port served by asyncio itself: HTTP/2 framing here, grpc.aio behind it.

Why: a unary call through grpc.aio's server passes its completion-queue poller thread
and two or three wake-ups of the event loop; on this 2-CPU machine that is ~0.4 ms of
CPU per call on the loop thread and ~0.08 ms on the poller, and TensorFlow's clients
pay it on every step (their RunStep is a unary call). Read and answered here, on the
loop, the same call costs a frame parse and a write (measured in docs/benchmarks.md,
round 15).

What: `Http2Front` listens on the task's address. It answers the unary methods of the
task's services itself (`serves(path)`, the same handlers the call stream and direct
connections use). Every other call a handler of the task's grpc.aio server takes
(RecvTensor, streams, the direct-path endpoint, handlers other transports add) is
relayed, one grpc.aio call per HTTP/2 stream, to that server, which listens on a
loopback port of its own: metadata, deadline, messages in both directions, status and
trailing metadata go across as they are. A call of a path no handler takes is
answered UNIMPLEMENTED here. Not used with TLS: then grpc.aio serves the address
itself.

A request's large DATA frame (TensorFlow's client sends a RunStep's 784 KiB feed in
one) is read from the socket straight into the call's body, placed so that its first
large tensor's content is aligned (`Http2Front.content_start`): the handler reads the
feed where it lies, with no copy to join the reads and none to align it (a copy each,
~0.1 ms of a training step's critical path; docs/benchmarks.md, round 42).

HTTP/2 (RFC 9113) as a gRPC server needs it: the connection preface and SETTINGS, HEADERS
and CONTINUATION (HPACK, `distserver.transports.hpack`), DATA with flow control both
ways, RST_STREAM, PING, WINDOW_UPDATE, GOAWAY. No server push, no priorities (PRIORITY
frames are read and ignored), no compressed messages (UNIMPLEMENTED).

Checks, before anything is allocated: a frame larger than `MAX_FRAME_BYTES`, a header
block larger than `MAX_HEADER_BYTES`, a message larger than `MAX_MESSAGE_BYTES` (its
length prefix is read first), more than `MAX_STREAMS` streams at once, a peer that
sends more than it was allowed (flow control) or breaks the protocol: each ends the
stream or the connection with the HTTP/2 error code that names it. A connection that
has not sent the preface and its SETTINGS within `HANDSHAKE_SECONDS` is closed. A
relayed stream's client is granted more bytes only as the relay forwards them, so a
peer cannot queue unbounded data behind a slow call. A client that stops reading its
answers is written to no further than asyncio's write buffer (the answer waits for it
to drain); one that keeps sending frames the server must answer (PING, SETTINGS,
requests refused at once) but reads none of the answers is cut off once
`MAX_UNREAD_ANSWER_BYTES` of them wait.

Stopping: `close(grace)` refuses new connections and streams (GOAWAY), lets running
calls answer within the grace, then cancels what is left and closes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
import numpy as np

from distserver import call_deadline, errors
from distserver.security import Security
from distserver.transports.hpack import Decoder, HpackError, encode

logger = logging.getLogger(__name__)

ENV = "DISTSERVER_HTTP2_FRONT"

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Error codes (RFC 9113, 7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
# SETTINGS identifiers.
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE = 0x1, 0x2, 0x3, 0x4
MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x5, 0x6

MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65535
DEFAULT_FRAME_BYTES = 16384
# What we allow a client (announced in our SETTINGS).
MAX_FRAME_BYTES = 1 << 20
MAX_HEADER_BYTES = 64 << 10
MAX_STREAMS = 1000
# TensorFlow's own message limit (INT32_MAX).
MAX_MESSAGE_BYTES = (1 << 31) - 1
# The window each stream starts with, and the connection's.
STREAM_WINDOW = 4 << 20
CONNECTION_WINDOW = 64 << 20
# A served call's DATA frame at least this large becomes its body without a copy: read
# straight into it from the socket when it is its request's first (`_Connection._read_large`),
# else the buffer it was read into when little was read after it (`_Connection._read_frames`).
KEPT_DATA_BYTES = 64 << 10
# How much one read of the socket takes in (other than into such a body).
READ_BYTES = 64 << 10
# A request read straight into its body is placed so that its first large tensor's
# content starts at a multiple of this (a cache line): its decoder then takes it as it
# is, where content at an offset its dtype does not divide is copied first.
ALIGNMENT = 64
# A relayed stream's client may be this many bytes of whole messages ahead of the relay.
RELAY_QUEUE_BYTES = 4 << 20
HANDSHAKE_SECONDS = 10.0
# Answers to the client's own frames (PING and SETTINGS acknowledgements, resets, error
# trailers, window updates) queued while it reads nothing: a client that keeps asking
# and never reads is cut off once this many bytes of answers wait for it.
MAX_UNREAD_ANSWER_BYTES = 1 << 20
# grpc.aio makes a timeout an absolute deadline in int64 nanoseconds since the epoch: one
# past ~2262 wraps, and the call fails at once (grpc-timeout allows 99999999 hours).
MAX_RELAY_TIMEOUT = 1e9

_HEAD = struct.Struct(">BHBBI")  # length (24 bits: high byte + low 16), type, flags, stream id
_MESSAGE_HEAD = struct.Struct(">BI")  # gRPC: compressed flag, length
_SETTING = struct.Struct(">HI")
_WINDOW = struct.Struct(">I")
_GOAWAY = struct.Struct(">II")

_RESPONSE_HEADERS = encode([(b":status", b"200"), (b"content-type", b"application/grpc")])
# Request headers that are HTTP/2's or gRPC's own, not call metadata.
_NOT_METADATA = frozenset({b"te", b"content-type", b"user-agent", b"grpc-timeout", b"grpc-encoding"})
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
# Trailing metadata that marks an error raised by a distserver handler (see `grpc.error_from_rpc`).
HANDLER_ERROR_KEY = "distserver-handler-error"
_FROM_HANDLER = ((HANDLER_ERROR_KEY, "1"),)

Dispatch = Callable[[str, memoryview], Awaitable[bytes]]


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def frame(kind: int, flags: int, stream_id: int, payload: bytes | memoryview = b"") -> bytes:
    size = len(payload)
    return _HEAD.pack(size >> 16, size & 0xFFFF, kind, flags, stream_id) + bytes(payload)


def _percent_encode(message: str) -> bytes:
    """grpc-message's encoding: bytes outside printable ASCII, and '%', as %XX."""
    out = bytearray()
    for byte in message.encode():
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def _timeout(value: bytes) -> float | None:
    """Seconds from a grpc-timeout header ("100m"); None when malformed."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


def _metadata_value(key: bytes, value: bytes) -> str | bytes:
    if key.endswith(b"-bin"):
        with contextlib.suppress(binascii.Error):
            return base64.b64decode(value + b"=" * (-len(value) % 4))
        return value
    return value.decode("latin-1")


def _header_value(key: str, value: str | bytes) -> bytes:
    if key.endswith("-bin"):
        raw = value if isinstance(value, bytes) else value.encode()
        return base64.b64encode(raw).rstrip(b"=")
    return value.encode("latin-1") if isinstance(value, str) else value


class _StreamClosed(Exception):
    """The stream being answered was reset, or its connection lost: nothing more to write."""


class _ConnectionError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class _Stream:
    """One call: its request as it arrives, its send window, the task answering it."""

    def __init__(
        self, stream_id: int, path: str, headers: list[tuple[bytes, bytes]], send_window: int
    ) -> None:
        self.id = stream_id
        self.path = path
        self.headers = headers
        self.send_window = send_window
        # Bytes of messages not yet complete (relayed) or all of them (served): a view of
        # a buffer the connection read them into when they came in one large DATA frame
        # with little read after it (`_Connection._read_frames`).
        self.body: bytearray | memoryview = bytearray()
        self.relayed = False
        self.messages: asyncio.Queue[bytes | None] | None = None  # relayed: whole messages for the call
        self.queued_bytes = 0  # relayed: bytes in `messages`
        self.withheld = 0  # relayed: received bytes not yet granted back to the client
        self.owed = 0  # bytes granted back but not yet written in a WINDOW_UPDATE
        self.ended = False  # the client has sent END_STREAM
        self.reset = False  # the stream was reset: write nothing more
        self.task: asyncio.Task[None] | None = None


class _LargeData:
    """A large DATA frame read straight into its stream's body (`_Connection.get_buffer`):
    the first frame of a served call's request, placed so that the content of its
    first large tensor is aligned (`Http2Front.content_start`)."""

    def __init__(self, stream_id: int, flags: int, body: memoryview, filled: int) -> None:
        self.stream_id = stream_id
        self.flags = flags
        self.body = body
        self.filled = filled  # bytes of `body` read so far


class _Connection(asyncio.BufferedProtocol):
    def __init__(self, front: Http2Front) -> None:
        self._front = front
        self._transport: Any = None  # asyncio's or uvloop's stream transport
        self._buffer = bytearray()  # bytes read and not yet taken as whole frames
        self._read_area = memoryview(bytearray(READ_BYTES))  # where a read lands, but:
        self._large: _LargeData | None = None  # the frame a read lands in instead
        self._preface_seen = False
        self._settings_seen = False
        self._decoder = Decoder(MAX_HEADER_BYTES)
        self._streams: dict[int, _Stream] = {}
        self._last_stream_id = 0
        self._pending_headers: tuple[int, int, bytearray] | None = None  # stream id, flags, block so far
        self._send_window = DEFAULT_WINDOW
        self._owed = 0  # received bytes not yet given back to the connection's window
        self._withheld = 0  # received bytes of relayed streams not yet granted (their `withheld`)
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_frame_bytes = DEFAULT_FRAME_BYTES
        self._window_waiters: list[asyncio.Future[None]] = []
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._paused = False
        self._unread = 0  # bytes of `_write` answers queued since writing paused
        self._closed = False
        self._going_away = False
        self._handshake: asyncio.TimerHandle | None = None

    # ----------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._front.connections.add(self)
        settings = b"".join(
            _SETTING.pack(key, value)
            for key, value in (
                (MAX_CONCURRENT_STREAMS, MAX_STREAMS),
                (INITIAL_WINDOW_SIZE, STREAM_WINDOW),
                (MAX_FRAME_SIZE, MAX_FRAME_BYTES),
                (MAX_HEADER_LIST_SIZE, MAX_HEADER_BYTES),
                (ENABLE_PUSH, 0),
            )
        )
        self._transport.write(
            frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, _WINDOW.pack(CONNECTION_WINDOW - DEFAULT_WINDOW))
        )
        self._handshake = asyncio.get_running_loop().call_later(HANDSHAKE_SECONDS, self._handshake_late)
        if self._front.draining:
            self.go_away()

    def _handshake_late(self) -> None:
        if not self._settings_seen:
            self._close()

    def get_buffer(self, sizehint: int) -> memoryview:
        large = self._large
        if large is not None:
            return large.body[large.filled :]
        return self._read_area

    def buffer_updated(self, nbytes: int) -> None:
        if self._closed:
            return
        try:
            large = self._large
            if large is None:
                self._buffer += self._read_area[:nbytes]
                self._read_frames()
            else:
                large.filled += nbytes
                if large.filled == len(large.body):
                    self._large = None
                    self._on_frame(DATA, large.flags, large.stream_id, large.body, True)
        except _ConnectionError as exc:
            self._fail(exc.code, str(exc))
        except HpackError as exc:
            self._fail(COMPRESSION_ERROR, str(exc))
        if self._closed:
            self._buffer = bytearray()
            self._large = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._large = None
        self._front.connections.discard(self)
        if self._handshake is not None:
            self._handshake.cancel()
        for stream in self._streams.values():
            stream.reset = True
            if stream.task is not None:
                stream.task.cancel()
        self._wake(self._window_waiters)
        self._wake(self._drain_waiters)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._unread = 0
        self._wake(self._drain_waiters)

    # ----------------------------------------------------------------- reading

    def _read_frames(self) -> None:
        buffer = self._buffer
        pos = 0
        if not self._preface_seen:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 client (bad connection preface)")
                return
            if bytes(buffer[: len(PREFACE)]) != PREFACE:
                raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 client (bad connection preface)")
            self._preface_seen = True
            pos = len(PREFACE)
        # Frames are read as views of the buffer (a DATA payload is copied once, into its
        # stream's body); on an error the connection ends and the buffer is dropped whole.
        with memoryview(buffer) as view:
            while len(buffer) - pos >= 9:
                high, low, kind, flags, stream_id = _HEAD.unpack_from(buffer, pos)
                size = (high << 16) | low
                if size > MAX_FRAME_BYTES:
                    raise _ConnectionError(
                        FRAME_SIZE_ERROR, f"a frame of {size} bytes, over {MAX_FRAME_BYTES}"
                    )
                if len(buffer) - pos < 9 + size:
                    if kind == DATA and size >= KEPT_DATA_BYTES:
                        with view[pos + 9 :] as partial:
                            self._large = self._read_large(flags, stream_id & 0x7FFFFFFF, partial, size)
                        if self._large is not None:
                            pos = len(buffer)  # (its bytes so far are in its body)
                    break
                end = pos + 9 + size
                if kind == DATA and size >= KEPT_DATA_BYTES and len(buffer) - end < KEPT_DATA_BYTES:
                    # A large frame with little read after it (a unary call's request,
                    # most often, its bytes the last to come: on the call's path): its
                    # stream may keep this buffer as its body instead of a copy, and the
                    # connection reads on in a new one, from what followed the frame.
                    self._buffer = buffer[end:]
                    self._on_frame(
                        kind, flags, stream_id & 0x7FFFFFFF, memoryview(buffer)[pos + 9 : end], True
                    )
                    if not self._closed:
                        self._read_frames()  # (nothing it holds is large enough to be kept)
                    return
                with view[pos + 9 : pos + 9 + size] as payload:
                    pos += 9 + size
                    self._on_frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
                if self._closed:
                    return
        del buffer[:pos]

    def _read_large(self, flags: int, stream_id: int, partial: memoryview, size: int) -> _LargeData | None:
        """Where the rest of a DATA frame of `size` bytes, `partial` read so far, goes
        straight from the socket: a body of its own, when it is the first frame of a
        served call's request and within the windows (else None: it is read into the
        buffer as any frame is). The body is placed so that the content of the request's
        first large tensor, if `partial` shows where it starts, is `ALIGNMENT`-aligned."""
        stream = self._streams.get(stream_id)
        if (
            stream is None
            or stream.relayed
            or stream.ended
            or stream.body
            or flags & PADDED
            or self._owed + self._withheld + size > CONNECTION_WINDOW
            or stream.owed + stream.withheld + size > STREAM_WINDOW
        ):
            return None
        start = self._front.content_start(stream.path, partial[_MESSAGE_HEAD.size :])
        area = np.empty(size + ALIGNMENT, np.uint8)
        shift = 0
        if start is not None:
            shift = -(area.ctypes.data + _MESSAGE_HEAD.size + start) % ALIGNMENT
        body = memoryview(area.data)[shift : shift + size]
        body[: len(partial)] = partial
        return _LargeData(stream_id, flags, body, len(partial))

    def _on_frame(
        self, kind: int, flags: int, stream_id: int, payload: memoryview, keep: bool = False
    ) -> None:
        """One frame; `keep`: a DATA `payload` the stream may keep as its body (`_on_data`)."""
        if not self._settings_seen and kind != SETTINGS:
            raise _ConnectionError(PROTOCOL_ERROR, "the client's first frame is not SETTINGS")
        if self._pending_headers is not None and (
            kind != CONTINUATION or stream_id != self._pending_headers[0]
        ):
            raise _ConnectionError(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self._on_data(flags, stream_id, payload, keep)
        elif kind == HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == PING:
            if len(payload) != 8:
                raise _ConnectionError(FRAME_SIZE_ERROR, "a PING of a length other than 8")
            if stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, "a PING on a stream")
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if not stream_id or len(payload) != 4:
                raise _ConnectionError(PROTOCOL_ERROR, "a bad RST_STREAM")
            self._on_reset(stream_id)
        elif kind == GOAWAY:
            self._going_away = True
            self._close_if_done()
        elif kind == PRIORITY:
            if not stream_id or len(payload) != 5:
                raise _ConnectionError(PROTOCOL_ERROR, "a bad PRIORITY")
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "a client may not push")
        # Other frame types are extensions: ignored (RFC 9113, 5.5).

    def _on_settings(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise _ConnectionError(FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS of a length not a multiple of 6")
        initial_window = self._peer_initial_window
        for offset in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, f"an initial window of {value} bytes")
                initial_window = value  # applied once, below: a frame may repeat it many times
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_BYTES <= value <= (1 << 24) - 1:
                    raise _ConnectionError(PROTOCOL_ERROR, f"a maximum frame size of {value}")
                self._peer_frame_bytes = value
            elif key == ENABLE_PUSH and value > 1:
                raise _ConnectionError(PROTOCOL_ERROR, f"ENABLE_PUSH of {value}")
            # Other settings do not bind a server that never pushes or indexes.
        if initial_window != self._peer_initial_window:
            delta = initial_window - self._peer_initial_window
            self._peer_initial_window = initial_window
            for stream in self._streams.values():
                stream.send_window += delta
                if stream.send_window > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "a stream's window overflowed")
            self._wake(self._window_waiters)
        self._settings_seen = True
        if self._handshake is not None:
            self._handshake.cancel()
            self._handshake = None
        self._write(frame(SETTINGS, ACK, 0))

    def _on_window_update(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "a WINDOW_UPDATE of a length other than 4")
        increment = _WINDOW.unpack(payload)[0] & 0x7FFFFFFF
        if not stream_id:
            if not increment:
                raise _ConnectionError(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "the connection's window overflowed")
        else:
            stream = self._streams.get(stream_id)
            if stream is None:
                if stream_id > self._last_stream_id:
                    raise _ConnectionError(PROTOCOL_ERROR, f"a WINDOW_UPDATE on idle stream {stream_id}")
                return  # a stream we finished
            if not increment:
                self._reset(stream, PROTOCOL_ERROR)
                return
            stream.send_window += increment
            if stream.send_window > MAX_WINDOW:
                self._reset(stream, FLOW_CONTROL_ERROR)
                return
        self._wake(self._window_waiters)

    def _on_headers(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if not stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
        block = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise _ConnectionError(PROTOCOL_ERROR, "HEADERS too short for their priority")
            block = block[5:]
        if len(block) > MAX_HEADER_BYTES:
            raise _ConnectionError(PROTOCOL_ERROR, f"a header block over {MAX_HEADER_BYTES} bytes")
        if flags & END_HEADERS:
            self._on_header_block(stream_id, flags, bytes(block))
        else:
            self._pending_headers = (stream_id, flags, bytearray(block))

    def _on_continuation(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if self._pending_headers is None:
            raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        _, first_flags, block = self._pending_headers
        if len(block) + len(payload) > MAX_HEADER_BYTES:
            raise _ConnectionError(PROTOCOL_ERROR, f"a header block over {MAX_HEADER_BYTES} bytes")
        block += payload
        if flags & END_HEADERS:
            self._pending_headers = None
            self._on_header_block(stream_id, first_flags, bytes(block))

    def _on_header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        headers = self._decoder.decode(block)  # always: the table must stay in step
        stream = self._streams.get(stream_id)
        if stream is not None and stream.ended:  # the client's side is closed: nothing more on it
            self._reset(stream, STREAM_CLOSED)
            return
        if stream is not None:  # trailers from the client: they end its side
            if not flags & END_STREAM:
                raise _ConnectionError(PROTOCOL_ERROR, f"a second header block, not the last, on {stream_id}")
            self._end_of_request(stream)
            return
        if stream_id <= self._last_stream_id or not stream_id & 1:
            raise _ConnectionError(PROTOCOL_ERROR, f"HEADERS open stream {stream_id} out of order")
        self._last_stream_id = stream_id
        if self._going_away or self._front.draining or len(self._streams) >= MAX_STREAMS:
            self._write(frame(RST_STREAM, 0, stream_id, _WINDOW.pack(REFUSED_STREAM)))
            return
        fields = dict(headers)
        path = fields.get(b":path", b"").decode("latin-1")
        stream = _Stream(stream_id, path, headers, self._peer_initial_window)
        self._streams[stream_id] = stream
        if fields.get(b":method") != b"POST" or not fields.get(b"content-type", b"").startswith(
            b"application/grpc"
        ):
            # Not a gRPC call: answered with HTTP's own status, as gRPC servers do.
            status = b"405" if fields.get(b":method") != b"POST" else b"415"
            self._write(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, encode([(b":status", status)])))
            self._forget(stream, reset_if_open=not flags & END_STREAM)
            return
        if not self._front.serves(path):
            if not self._front.relays(path):
                # No handler of the task takes it: answered here as grpc.aio answers it,
                # token or not (relayed, a client that reset it meanwhile made grpc.aio
                # log an error).
                stream.ended = bool(flags & END_STREAM)
                self._answer_error(stream, errors.UNIMPLEMENTED, f"Method not found: {path}")
                return
            stream.relayed = True
            stream.messages = asyncio.Queue()
            stream.task = asyncio.get_running_loop().create_task(self._front.relay(self, stream))
        if flags & END_STREAM:
            self._end_of_request(stream)

    def _on_data(self, flags: int, stream_id: int, payload: memoryview, keep: bool = False) -> None:
        """A DATA frame; `keep`: `payload` is a view no one else writes to, which may
        become the stream's body, when it has none yet, instead of a copy."""
        if not stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)  # all of it counts against the windows, padding included
        # What the client may send: the windows we announced, less what it sent since.
        if self._owed + self._withheld + size > CONNECTION_WINDOW:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "DATA past the connection's window")
        stream = self._streams.get(stream_id)
        if stream is not None and stream.owed + stream.withheld + size > STREAM_WINDOW:
            raise _ConnectionError(FLOW_CONTROL_ERROR, f"DATA past the window of stream {stream_id}")
        if stream is None or stream.ended:
            if stream_id > self._last_stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            self._give_back(None, size)  # the connection's window still counts them
            if stream is not None:
                self._reset(stream, STREAM_CLOSED)
            return
        data = self._unpad(flags, payload)
        if stream.relayed:
            self._relay_data(stream, size, data)
        elif len(stream.body) + len(data) > MAX_MESSAGE_BYTES + _MESSAGE_HEAD.size:
            self._give_back(None, size)
            self._refuse_large(stream)
            return
        else:
            if keep and not stream.body:
                stream.body = data
            else:
                if not isinstance(stream.body, bytearray):  # (a frame after one it kept)
                    stream.body = bytearray(stream.body)
                stream.body += data
            if _claims_too_much(stream.body):  # answered from the prefix, not after the body
                self._give_back(None, size)
                self._refuse_large(stream)
                return
            self._give_back(None if flags & END_STREAM else stream, size)
        if flags & END_STREAM:
            self._end_of_request(stream)

    def _relay_data(self, stream: _Stream, size: int, data: memoryview) -> None:
        # Withheld until granted; a refusal below gives them back with the stream (`_release`).
        stream.withheld += size
        self._withheld += size
        body = stream.body
        assert isinstance(body, bytearray)  # (`_on_data` keeps no view for a relayed stream)
        body += data
        assert stream.messages is not None
        while len(body) >= _MESSAGE_HEAD.size:
            if _claims_too_much(body):
                self._refuse_large(stream)
                return
            compressed, length = _MESSAGE_HEAD.unpack_from(body)
            if len(body) < _MESSAGE_HEAD.size + length:
                break
            if compressed:
                self._refuse_compressed(stream)
                return
            message = bytes(body[_MESSAGE_HEAD.size : _MESSAGE_HEAD.size + length])
            del body[: _MESSAGE_HEAD.size + length]
            stream.messages.put_nowait(message)
            stream.queued_bytes += len(message)
        # Bytes of a message still arriving are always granted (a message may be larger
        # than the window); whole messages waiting for the call only up to a bound.
        self.grant(stream)

    def grant(self, stream: _Stream) -> None:
        """Give a relayed stream's client back the bytes it sent, unless too many wait for the call."""
        if stream.withheld and stream.queued_bytes <= RELAY_QUEUE_BYTES:
            size, stream.withheld = stream.withheld, 0
            self._withheld -= size
            self._give_back(stream, size)

    def _give_back(self, stream: _Stream | None, size: int) -> None:
        """Return `size` received bytes to the client's windows: the connection's, and
        `stream`'s unless None. Each is written once half of it is owed, so a small
        call costs no WINDOW_UPDATE (nor the client a wake-up to read one)."""
        updates = b""
        self._owed += size
        if self._owed >= CONNECTION_WINDOW // 2:
            updates += frame(WINDOW_UPDATE, 0, 0, _WINDOW.pack(self._owed))
            self._owed = 0
        if stream is not None:
            stream.owed += size
            if stream.owed >= STREAM_WINDOW // 2:
                updates += frame(WINDOW_UPDATE, 0, stream.id, _WINDOW.pack(stream.owed))
                stream.owed = 0
        if updates:
            self._write(updates)

    def _end_of_request(self, stream: _Stream) -> None:
        stream.ended = True
        if stream.relayed:
            assert stream.messages is not None
            if stream.body:
                self._refuse_incomplete(stream)
                return
            stream.messages.put_nowait(None)
            return
        stream.task = asyncio.get_running_loop().create_task(self._front.serve(self, stream))

    def _on_reset(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            if stream_id > self._last_stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
            return
        self._release(stream)
        stream.reset = True
        if stream.task is not None:
            stream.task.cancel()
        self._wake(self._window_waiters)
        self._close_if_done()

    @staticmethod
    def _unpad(flags: int, payload: memoryview) -> memoryview:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise _ConnectionError(PROTOCOL_ERROR, "padding longer than its frame")
        return payload[1 : len(payload) - payload[0]]

    # ----------------------------------------------------------------- refusals

    def _refuse_large(self, stream: _Stream) -> None:
        self._answer_error(
            stream,
            errors.RESOURCE_EXHAUSTED,
            f"a request message larger than {MAX_MESSAGE_BYTES} bytes: split the data or send it in parts",
        )

    def _refuse_compressed(self, stream: _Stream) -> None:
        self._answer_error(
            stream, errors.UNIMPLEMENTED, "compressed messages are not supported: send them uncompressed"
        )

    def _refuse_incomplete(self, stream: _Stream) -> None:
        self._answer_error(stream, errors.INTERNAL, "the request ended inside a message")

    def _answer_error(self, stream: _Stream, code: int, message: str) -> None:
        """End `stream` with a gRPC error now, whatever it was doing."""
        if stream.task is not None:
            stream.task.cancel()
        if not stream.reset:
            self._write(
                frame(HEADERS, END_HEADERS, stream.id, _RESPONSE_HEADERS)
                + _trailers(stream.id, code, message)
            )
        self._forget(stream, reset_if_open=not stream.ended)

    # ----------------------------------------------------------------- writing

    def _write(self, data: bytes) -> None:
        if self._closed or self._transport is None:
            return
        if self._paused:
            self._unread += len(data)
            if self._unread > MAX_UNREAD_ANSWER_BYTES:
                logger.debug("ending an HTTP/2 connection: its client reads none of its answers")
                self._closed = True
                self._transport.abort()  # (a GOAWAY would wait behind what it does not read)
                return
        self._transport.write(data)

    def headers_frame(self, stream: _Stream, metadata: tuple[tuple[str, Any], ...] = ()) -> bytes:
        """The response's HEADERS frame for `stream` (its initial metadata, if any)."""
        block = _RESPONSE_HEADERS
        if metadata:
            block += encode([(key.encode(), _header_value(key, value)) for key, value in metadata])
        return frame(HEADERS, END_HEADERS, stream.id, block)

    async def send_message(
        self, stream: _Stream, message: bytes | memoryview, before: bytes = b"", after: bytes = b""
    ) -> None:
        """One gRPC message on `stream`, in DATA frames as the windows allow, with the
        frames `before` and `after` written in the same batch as its first and last
        bytes (a small answer goes out in one write)."""
        assert self._transport is not None
        rest = [memoryview(_MESSAGE_HEAD.pack(0, len(message))), memoryview(message).cast("B")]
        left = len(rest[0]) + len(rest[1])
        batch: list[bytes | memoryview] = [before] if before else []
        while left:
            self._check_open(stream)
            allowed = min(left, stream.send_window, self._send_window)
            if allowed <= 0:
                if batch:
                    self._transport.writelines(batch)
                    batch = []
                await self._wait(self._window_waiters)
                continue
            stream.send_window -= allowed
            self._send_window -= allowed
            left -= allowed
            while allowed:
                size = min(allowed, self._peer_frame_bytes)
                allowed -= size
                batch.append(_HEAD.pack(size >> 16, size & 0xFFFF, DATA, 0, stream.id))
                while size:  # the frame's bytes: the rest of the message's prefix, then of its body
                    piece = rest[0][:size]
                    batch.append(piece)
                    size -= len(piece)
                    rest[0] = rest[0][len(piece) :]
                    if not rest[0]:
                        rest.pop(0)
            if (left and len(batch) >= 64) or self._paused:
                self._transport.writelines(batch)
                batch = []
                if self._paused:
                    await self._wait(self._drain_waiters)
        self._check_open(stream)
        if after:
            batch.append(after)
        self._transport.writelines(batch)

    def send_trailers(
        self,
        stream: _Stream,
        code: int,
        message: str,
        metadata: tuple[tuple[str, Any], ...] = (),
        headers: bytes | None = None,
    ) -> None:
        """End `stream` with a status (after the response's `headers`, when they are
        not written yet: by default the plain ones)."""
        if not stream.reset:
            first = self.headers_frame(stream) if headers is None else headers
            self._write(first + _trailers(stream.id, code, message, metadata))
        self.finish(stream)

    def finish(self, stream: _Stream) -> None:
        """`stream` is answered."""
        self._forget(stream, reset_if_open=not stream.ended)

    def _check_open(self, stream: _Stream) -> None:
        if stream.reset or self._closed:
            raise _StreamClosed

    async def _wait(self, waiters: list[asyncio.Future[None]]) -> None:
        future = asyncio.get_running_loop().create_future()
        waiters.append(future)
        await future

    @staticmethod
    def _wake(waiters: list[asyncio.Future[None]]) -> None:
        for future in waiters:
            if not future.done():
                future.set_result(None)
        waiters.clear()

    # ----------------------------------------------------------------- stream and connection ends

    def _forget(self, stream: _Stream, *, reset_if_open: bool) -> None:
        """`stream` is answered: drop it; a client still sending is told to stop."""
        if self._streams.pop(stream.id, None) is None:
            return
        self._release(stream)
        if reset_if_open and not stream.reset:
            self._write(frame(RST_STREAM, 0, stream.id, _WINDOW.pack(NO_ERROR)))
        stream.reset = True
        self._close_if_done()

    def _release(self, stream: _Stream) -> None:
        """`stream` is dropped: the bytes it withheld go back to the connection's window, and
        its relay's request iterator ends (grpc.aio's task reading it would wait forever once
        the call has ended; "Task was destroyed but it is pending" when collected)."""
        if stream.withheld:
            self._withheld -= stream.withheld
            self._give_back(None, stream.withheld)
            stream.withheld = 0
        if stream.messages is not None:
            stream.messages.put_nowait(None)

    def _reset(self, stream: _Stream, code: int) -> None:
        self._write(frame(RST_STREAM, 0, stream.id, _WINDOW.pack(code)))
        self._on_reset(stream.id)

    def done(self, stream: _Stream) -> None:
        """The task of `stream` ended without answering (it was cancelled)."""
        self._forget(stream, reset_if_open=True)

    def go_away(self) -> None:
        """Refuse new streams; close once the running ones have answered."""
        if not self._going_away:
            self._going_away = True
            self._write(frame(GOAWAY, 0, 0, _GOAWAY.pack(self._last_stream_id, NO_ERROR)))
        self._close_if_done()

    def _close_if_done(self) -> None:
        if self._going_away and not self._streams:
            self._close()

    def _fail(self, code: int, reason: str) -> None:
        logger.debug("ending an HTTP/2 connection: %s", reason)
        self._write(frame(GOAWAY, 0, 0, _GOAWAY.pack(self._last_stream_id, code) + reason.encode()[:256]))
        self._close()

    def _close(self) -> None:
        if not self._closed and self._transport is not None:
            self._closed = True
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    @property
    def streams(self) -> int:
        return len(self._streams)


def _trailers(stream_id: int, code: int, message: str, metadata: tuple[tuple[str, Any], ...] = ()) -> bytes:
    fields = [(b"grpc-status", str(code).encode())]
    if message:
        fields.append((b"grpc-message", _percent_encode(message)))
    fields += [(key.encode(), _header_value(key, value)) for key, value in metadata]
    return frame(HEADERS, END_HEADERS | END_STREAM, stream_id, encode(fields))


def _raw(data: bytes) -> bytes:
    return data


class Http2Front:
    """The public port of a task (see the module's docstring).

    `dispatch(path, request)` answers the unary calls `serves(path)` accepts (it raises
    OpErrors only); `relay_channel` reaches the task's grpc.aio server, for the calls
    `relays(path)` accepts (its handlers'); any other call is answered UNIMPLEMENTED.
    `content_start(path, head)`: where the content of the first large tensor of a
    request to `path` starts, from its first bytes `head` (`wire.content_start`), or None.
    """

    def __init__(
        self,
        dispatch: Dispatch,
        serves: Callable[[str], bool],
        relays: Callable[[str], bool],
        relay_channel: grpc.aio.Channel,
        security: Security | None,
        content_start: Callable[[str, memoryview], int | None],
    ) -> None:
        self._dispatch = dispatch
        self.serves = serves
        self.content_start = content_start
        self.relays = relays
        self._security = security
        self._relay_channel = relay_channel
        self._servers: list[asyncio.AbstractServer] = []
        self.connections: set[_Connection] = set()
        self.draining = False

    async def listen(self, sockets: list[socket.socket]) -> None:
        loop = asyncio.get_running_loop()
        for sock in sockets:
            self._servers.append(
                await loop.create_server(lambda: _Connection(self), sock=sock, start_serving=False)
            )

    async def start(self) -> None:
        for server in self._servers:
            await server.start_serving()

    async def close(self, grace: float | None) -> None:
        self.draining = True
        for server in self._servers:
            server.close()
        for connection in list(self.connections):
            connection.go_away()
        deadline = None if grace is None else asyncio.get_running_loop().time() + grace
        while any(c.streams for c in self.connections):
            if deadline is not None and asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.01)
        for connection in list(self.connections):
            connection.abort()
        await self._relay_channel.close(None)

    # ----------------------------------------------------------------- served calls

    async def serve(self, connection: _Connection, stream: _Stream) -> None:
        """Answer a unary call from the task's own handlers."""
        try:
            body = stream.body
            message = _one_message(body)
            if isinstance(message, tuple):
                connection.send_trailers(stream, *message)
                return
            fields = dict(stream.headers)
            timeout = fields.get(b"grpc-timeout")
            if timeout is not None:
                call_deadline.set_from_timeout(_timeout(timeout))
            if self._security is not None and not self._security.admits(_metadata(stream.headers)):
                connection.send_trailers(
                    stream,
                    errors.UNAUTHENTICATED,
                    f"{stream.path} needs the cluster's token: set it with Security(token=...) "
                    "or the DISTSERVER_AUTH_TOKEN environment variable",
                )
                return
            try:
                response = await self._dispatch(stream.path, message)
            except errors.OpError as exc:
                code, text = errors.to_status(exc)
                connection.send_trailers(stream, code, text, _FROM_HANDLER)
                return
            await connection.send_message(
                stream,
                response,
                before=connection.headers_frame(stream),
                after=_trailers(stream.id, errors.OK, ""),
            )
            connection.finish(stream)
        except (asyncio.CancelledError, _StreamClosed):
            connection.done(stream)
        except Exception as exc:  # a bug here: the caller still gets an answer
            logger.exception("answering %s", stream.path)
            connection.send_trailers(
                stream, errors.INTERNAL, f"distserver failed to answer {stream.path}: {exc!r}"
            )

    # ----------------------------------------------------------------- relayed calls

    async def relay(self, connection: _Connection, stream: _Stream) -> None:
        """Carry a call to the task's grpc.aio server and its answer back."""
        fields = dict(stream.headers)
        timeout_header = fields.get(b"grpc-timeout")
        timeout = None if timeout_header is None else _timeout(timeout_header)
        if timeout is not None:
            timeout = min(timeout, MAX_RELAY_TIMEOUT)
        try:
            call = self._relay_channel.stream_stream(
                stream.path, request_serializer=_raw, response_deserializer=_raw
            )(self._requests(connection, stream), timeout=timeout, metadata=_metadata(stream.headers))
        except Exception as exc:  # metadata gRPC will not take
            connection.send_trailers(stream, errors.INTERNAL, f"cannot relay {stream.path}: {exc}")
            return
        headers: bytes | None = None  # the response's HEADERS frame while not written yet
        try:
            initial: Any = await call.initial_metadata()
            headers = connection.headers_frame(stream, tuple(initial or ()))
            async for message in call:
                await connection.send_message(stream, message, before=headers or b"")
                headers = b""
            code = (await call.code()).value[0]
            details = await call.details() or ""
            trailing: Any = await call.trailing_metadata()
        except grpc.aio.AioRpcError as exc:
            code, details, trailing = exc.code().value[0], exc.details() or "", exc.trailing_metadata()
        except (asyncio.CancelledError, _StreamClosed):
            call.cancel()
            connection.done(stream)
            return
        connection.send_trailers(stream, code, details, tuple(trailing or ()), headers=headers)

    async def _requests(self, connection: _Connection, stream: _Stream) -> AsyncIterator[bytes]:
        assert stream.messages is not None
        while (message := await stream.messages.get()) is not None:
            stream.queued_bytes -= len(message)
            connection.grant(stream)
            yield message


def _metadata(headers: list[tuple[bytes, bytes]]) -> tuple[tuple[str, str | bytes], ...]:
    """A call's metadata from its request headers (HTTP/2's and gRPC's own left out)."""
    return tuple(
        (key.decode("latin-1"), _metadata_value(key, value))
        for key, value in headers
        if not key.startswith(b":") and key not in _NOT_METADATA and not key.startswith(b"grpc-")
    )


def _claims_too_much(body: bytearray | memoryview) -> bool:
    """Whether the message starting `body` says it is larger than `MAX_MESSAGE_BYTES`."""
    return len(body) >= _MESSAGE_HEAD.size and _MESSAGE_HEAD.unpack_from(body)[1] > MAX_MESSAGE_BYTES


def _one_message(body: bytearray | memoryview) -> memoryview | tuple[int, str]:
    """A unary call's request, or (status code, message) saying why there is none."""
    if len(body) < _MESSAGE_HEAD.size:
        return errors.INTERNAL, "a unary call needs one request message, got none"
    compressed, length = _MESSAGE_HEAD.unpack_from(body)
    if compressed:
        return errors.UNIMPLEMENTED, "compressed messages are not supported: send them uncompressed"
    if len(body) != _MESSAGE_HEAD.size + length:
        return errors.INTERNAL, "a unary call needs exactly one request message"
    return memoryview(body)[_MESSAGE_HEAD.size :]
