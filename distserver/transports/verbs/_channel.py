"""A connected `AF_UNIX`/`SOCK_SEQPACKET` socket on the event loop: whole packets plus fds.

SEQPACKET keeps message boundaries and delivers the fds (`SCM_RIGHTS`) of a message
together with it, so there is no framing layer and no fd/byte alignment problem.
Everything is non-blocking: reads happen in a `loop.add_reader` callback (draining
whatever is ready, a bounded number of packets per wake-up), writes go straight out
when the socket has room and are otherwise queued behind a `loop.add_writer`
callback, in order.

EOF (the peer closed the socket, or its process died and the kernel closed it) is
the peer-death signal: it reaches `on_closed` at once.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from distserver import errors
from distserver._cpus import heard_from_peer, sent_to_peer
from distserver.transports.verbs._wire import MAX_PACKET_BYTES

MAX_FDS_PER_PACKET = 4
_FD_BYTES = array.array("i").itemsize
_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_PACKET * _FD_BYTES)
_PACKETS_PER_WAKEUP = 64  # stay fair to other callbacks when a peer floods us
_SOCKET_BUFFER_BYTES = 1 << 20


Buffer = bytes | bytearray | memoryview
"""A packet's bytes, or one of its parts (a memoryview of bytes, one byte an item)."""


@dataclass
class _Outgoing:
    parts: Sequence[Buffer]
    fds: list[int]  # our own duplicates, closed once sent
    done: asyncio.Future[None]


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel recorded at connect."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def seqpacket_socket() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.setblocking(False)
    return sock


class PacketChannel:
    """Packets with fds over one connected SEQPACKET socket (see the module docstring).

    Contract:
        * `on_packet(data, fds)` runs on the loop for every packet; it owns `fds` (must
          close or keep them). If it raises, the channel closes with that error
          (an `OpError`) or an `InternalError`.
        * `on_closed(error)` runs once, when the peer hung up (`error` None) or the
          channel failed. It does not run for a local `close()`.
        * `send_nowait(payload, fds)` queues a packet (fds are duplicated, so the
          caller may close its own at once) and returns a future resolved when the
          kernel took it; packets leave in call order. `payload` may be a sequence of
          parts, sent as one packet without joining them (`sendmsg`'s gather).
        * `stop()` stops reading and writing and fails unsent packets; `close()` also
          closes the socket. Both are idempotent.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        on_packet: Callable[[bytes, list[int]], None],
        on_closed: Callable[[errors.OpError | None], None],
    ) -> None:
        sock.setblocking(False)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)
        self._sock = sock
        self._fileno = sock.fileno()
        self._on_packet = on_packet
        self._on_closed = on_closed
        self._loop = asyncio.get_running_loop()
        self._outgoing: deque[_Outgoing] = deque()
        self._writer_armed = False
        self._reading = False
        self._stopped = False
        self._closed = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def socket(self) -> socket.socket:
        return self._sock

    def peer_credentials(self) -> tuple[int, int, int]:
        return peer_credentials(self._sock)

    def start(self) -> None:
        if not self._reading and not self._stopped:
            self._reading = True
            self._loop.add_reader(self._fileno, self._on_readable)

    def send_nowait(
        self, payload: Buffer | Sequence[Buffer], fds: Sequence[int] = ()
    ) -> asyncio.Future[None]:
        if self._stopped:
            raise errors.UnavailableError("the queue pair's socket is closed")
        parts = (payload,) if isinstance(payload, bytes | bytearray | memoryview) else payload
        nbytes = sum(map(len, parts))
        if nbytes > MAX_PACKET_BYTES:
            raise ValueError(f"packet of {nbytes} bytes exceeds {MAX_PACKET_BYTES}")
        duplicates: list[int] = []
        try:
            for fd in fds:
                duplicates.append(os.dup(fd))
        except BaseException:
            for fd in duplicates:
                os.close(fd)
            raise
        item = _Outgoing(parts, duplicates, self._loop.create_future())
        self._outgoing.append(item)
        if not self._writer_armed:
            self._flush()
        sent_to_peer(self._loop)
        return item.done

    async def send(self, payload: Buffer | Sequence[Buffer], fds: Sequence[int] = ()) -> None:
        # Shielded: once queued, a packet goes out whole even if this caller is cancelled.
        await asyncio.shield(self.send_nowait(payload, fds))

    def _flush(self) -> None:
        while self._outgoing:
            item = self._outgoing[0]
            ancillary = []
            if item.fds:
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", item.fds).tobytes())]
            try:
                self._sock.sendmsg(item.parts, ancillary)
            except (BlockingIOError, InterruptedError):
                if not self._writer_armed:
                    self._writer_armed = True
                    self._loop.add_writer(self._fileno, self._flush)
                return
            except OSError as exc:
                self._lose(errors.UnavailableError(f"the queue pair's peer is gone ({exc})"))
                return
            self._outgoing.popleft()
            self._finish(item, None)
        if self._writer_armed:
            self._writer_armed = False
            self._loop.remove_writer(self._fileno)

    @staticmethod
    def _finish(item: _Outgoing, error: errors.OpError | None) -> None:
        for fd in item.fds:
            os.close(fd)
        item.fds.clear()
        if not item.done.done():
            if error is None:
                item.done.set_result(None)
            else:
                item.done.set_exception(error)
                item.done.exception()  # nobody may be waiting; mark it retrieved

    def _on_readable(self) -> None:
        heard_from_peer(self._loop)
        for _ in range(_PACKETS_PER_WAKEUP):
            if self._stopped:
                return
            try:
                # A new bytes object of the packet's size, the kernel's copy the only one
                # (`recvmsg` shrinks its buffer in place).
                data, ancillary, flags, _ = self._sock.recvmsg(
                    MAX_PACKET_BYTES, _ANCILLARY_BYTES, socket.MSG_CMSG_CLOEXEC
                )
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._lose(errors.UnavailableError(f"the queue pair's peer is gone ({exc})"))
                return
            fds = _take_fds(ancillary)
            if not data and not fds:
                self._lose(None)  # EOF: we never send empty packets
                return
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                for fd in fds:
                    os.close(fd)
                self._lose(errors.InternalError("the queue pair's peer sent an oversized packet"))
                return
            try:
                self._on_packet(data, fds)
            except errors.OpError as exc:
                self._lose(exc)
                return
            except Exception as exc:
                self._lose(errors.InternalError(f"cannot handle a packet from the peer: {exc!r}"))
                return

    def _lose(self, error: errors.OpError | None) -> None:
        if self._stopped:
            return
        self.stop(error or errors.UnavailableError("the queue pair's peer closed the connection"))
        self._on_closed(error)

    def stop(self, error: errors.OpError | None = None) -> None:
        """Stop reading and writing and fail unsent packets, but keep the socket open.

        The peer sees EOF only at `close()`: a queue pair closes its socket after its
        own copies into the peer's memory are over, so EOF always means "this side
        will never write into your memory again".
        """
        if self._stopped:
            return
        self._stopped = True
        if not self._loop.is_closed():
            if self._reading:
                self._loop.remove_reader(self._fileno)
            if self._writer_armed:
                self._loop.remove_writer(self._fileno)
        self._reading = self._writer_armed = False
        failure = error or errors.UnavailableError("the queue pair is closed")
        while self._outgoing:
            self._finish(self._outgoing.popleft(), failure)

    def close(self, error: errors.OpError | None = None) -> None:
        """`stop`, then close the socket (the peer sees EOF). Idempotent."""
        self.stop(error)
        if not self._closed:
            self._closed = True
            self._sock.close()


def _take_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % _FD_BYTES
            fds.extend(array.array("i", data[:usable]))
    return fds
