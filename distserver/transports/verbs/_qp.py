"""Queue pairs: a connection between two processes with one-sided writes and reads.

Setup (`connect` / `QueuePairAcceptor.accept`), over a Unix `SOCK_SEQPACKET` socket:

1. The listener binds an abstract-namespace address (`@distserver-verbs-<pid>-<random>`:
   nothing on disk to leak, and a 128-bit random name) or a path the caller chose.
2. Both ends check the other's credentials with `SO_PEERCRED`: a peer of another uid
   is refused (`PermissionDeniedError`). This is the access control the abstract
   namespace lacks.
3. Both send HELLO carrying their completion queue's ring memfd and eventfd; each
   maps the other's ring and keeps its eventfd to post completions. The connecting
   side speaks first; its HELLO carries the listener's ticket, and the listener
   answers only a HELLO with the right one. The ticket is 128 random bits, part of the
   address `connect` takes ("<socket>#<ticket hex>"), given out only over the
   (authenticated) control plane. The socket's name alone, which any local process
   can list, does not get a peer in.
4. Later, `expose(region)` sends a region's memfd once (REG_MR); the peer maps it.

After setup the socket carries only small frames (REG_MR/UNREG_MR, SEND, CREDIT,
BYE). Tensor bytes never touch it: `write` copies straight into the peer's mapping.
The socket's EOF is the peer-death signal; everything pending fails with
`UnavailableError` as soon as it is seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import mmap
import os
import secrets
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from distserver import errors
from distserver.transports.verbs import _wire as wire
from distserver.transports.verbs._channel import Buffer, PacketChannel, peer_credentials, seqpacket_socket
from distserver.transports.verbs._cq import CQE, CompletionQueue, CqProducer, Opcode, WcStatus, WorkCompletion
from distserver.transports.verbs._identity import HostIdentity, host_identity
from distserver.transports.verbs._memory import (
    INLINE_COPY_BYTES,
    OFFLOAD_BYTES,
    SHARED_COPY_BYTES,
    MemoryRegion,
    ProtectionDomain,
    SharedCopy,
    as_byte_view,
    check_access,
    copy_bytes,
    map_peer_fd,
    nbytes_of,
    wait_offloaded,
)

__all__ = [
    "DEFAULT_CQ_DEPTH",
    "ListenerStatistics",
    "QueuePair",
    "QueuePairAcceptor",
    "QueuePairStatistics",
    "connect",
    "listen",
]

logger = logging.getLogger(__name__)

DEFAULT_CQ_DEPTH = 1024
HANDSHAKE_TIMEOUT = 10.0
_CLOSE_FLUSH_TIMEOUT = 1.0
_ABSTRACT_PREFIX = "@"


def _sockaddr(address: str) -> str:
    if address.startswith(_ABSTRACT_PREFIX):
        return "\0" + address[1:]
    return address


def check_peer_uid(sock: socket.socket, expected_uid: int) -> tuple[int, int]:
    """(pid, uid) of the peer; raises PermissionDeniedError when its uid is not `expected_uid`."""
    pid, uid, _ = peer_credentials(sock)
    if uid != expected_uid:
        raise errors.PermissionDeniedError(
            f"refusing a verbs queue pair with process {pid}: it runs as uid {uid}, "
            f"we run as uid {expected_uid}"
        )
    return pid, uid


@dataclass(frozen=True)
class QueuePairStatistics:
    """A snapshot of one queue pair's activity."""

    writes: int
    bytes_written: int
    reads: int
    bytes_read: int
    sends: int
    receives: int
    completions_posted: int
    completions_received: int
    cq_wakeups: int
    regions_exposed: int
    remote_regions: int


class _RemoteRegion:
    """A region the peer exposed to us, mapped into this process."""

    def __init__(
        self, pd: ProtectionDomain, region_id: int, nbytes: int, key: bytes, ready: asyncio.Future[None]
    ) -> None:
        self._pd = pd
        self.id = region_id
        self.nbytes = nbytes
        self.key = key
        self.mapping: mmap.mmap | None = None
        self.ready = ready
        self.in_flight = 0
        self.retired = False

    def release_if_idle(self) -> None:
        if self.retired and self.in_flight == 0 and self.mapping is not None:
            mapping, self.mapping = self.mapping, None
            self._pd._release_mapping(mapping)


class QueuePair:
    """A connected pair of endpoints in two processes of the same host and user.

    Create one with `await connect(pd, address)` or `await listener.accept()`.

    Contract:
        * `await expose(region)` lets the peer write into and read from one of our
          regions (its fd is sent once; idempotent). Closing the region withdraws it.
        * `await write(region_id, key, offset, data, wr_id=, imm_data=)` copies `data`
          (bytes-like, or a numpy array of any layout) straight into the peer's region
          -- one copy, shared with the executor's threads when larger than
          `SHARED_COPY_BYTES` -- then posts a
          `RECV_RDMA_WITH_IMM` completion (`wr_id`, `byte_len`, `imm_data`) to the
          peer's completion queue, like `IBV_WR_RDMA_WRITE_WITH_IMM`. It returns the
          local `RDMA_WRITE` completion. A write that started copying is never
          abandoned half-way: cancelling it takes effect after the copy.
        * `await read(region_id, key, offset, length, into)` copies from the peer's
          region into `into` (one-sided: the peer is not notified).
        * Both check the key and bounds first: `PermissionDeniedError` (wrong key),
          `OutOfRangeError` (outside the region), `NotFoundError` (region not exposed
          or withdrawn) -- all `IBV_WC_REM_ACCESS_ERR` in verbs terms.
        * `await send(data)` (or `send_nowait`) / `await recv()` carry small messages
          (at most `MAX_SEND_BYTES`) in order over the socket. Received messages queue without
          bound until `recv()` takes them -- or, after `deliver_to(handler)`, go to
          `handler(data)` on the event loop as each packet is read (no task switch;
          `recv()` then only raises when the queue pair fails; an OpError from the
          handler fails the queue pair).
        * `cq` receives the completions the peer posts.
        * When the peer closes or dies (socket EOF), every pending and later
          operation fails with `UnavailableError`, and the peer's mappings and fds
          are released as soon as no copy uses them.
        * `await close()` refuses new operations, waits for copies in flight (so
          the peer never sees memory written after we said goodbye), then releases
          everything. Idempotent; also `async with`.
    """

    def __init__(self, pd: ProtectionDomain, sock: socket.socket, *, cq_depth: int) -> None:
        pd._check_open()
        self.pd = pd
        self._loop = asyncio.get_running_loop()
        self._executor = pd.executor
        self.cq = CompletionQueue(cq_depth, on_consumed=self._on_cq_consumed)
        try:
            self._channel = PacketChannel(sock, on_packet=self._on_packet, on_closed=self._on_channel_closed)
        except BaseException:
            self.cq.close()
            raise
        self.peer_pid = 0
        self.peer_identity: HostIdentity | None = None
        self._hello: asyncio.Future[wire.Hello] = self._loop.create_future()
        self._expected_ticket: bytes | None = None  # set by the acceptor: what a peer must present
        self._producer: CqProducer | None = None
        self._remote: dict[int, _RemoteRegion] = {}
        self._exposed: dict[int, asyncio.Future[None]] = {}
        self._exposed_regions: dict[int, MemoryRegion] = {}
        self._messages: deque[bytes] = deque()
        self._on_message: Callable[[bytes | memoryview], None] | None = None
        self._message_waiters: deque[asyncio.Future[None]] = deque()
        self._uncredited = 0
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._error: errors.OpError | None = None
        self._released = False
        self._closed_event = asyncio.Event()
        self._peer_farewell: str | None = None
        self._peer_gone = False
        self._mapping_jobs: set[asyncio.Future[mmap.mmap]] = set()
        self._stats = {
            "writes": 0,
            "bytes_written": 0,
            "reads": 0,
            "bytes_read": 0,
            "sends": 0,
            "receives": 0,
        }
        pd._attach(self)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<QueuePair peer_pid={self.peer_pid} {state}>"

    @property
    def closed(self) -> bool:
        """True once the queue pair cannot be used any more (closed, or the peer is gone)."""
        return self._closing or self._error is not None

    @property
    def peer_gone(self) -> bool:
        """True once the peer's socket closed: it will never write into our memory again.

        A queue pair closes its socket only after its own copies into the peer's
        memory ended (or its process died), so memory it could write may be reused
        from then on.
        """
        return self._peer_gone

    # -- setup -----------------------------------------------------------------------

    async def _handshake(self, timeout: float, ticket: bytes = bytes(wire.TICKET_BYTES)) -> None:
        try:
            self.peer_pid, _ = check_peer_uid(self._channel.socket, os.getuid())
            self._channel.start()
            hello = wire.Hello(
                wire.VERSION, os.getpid(), self.cq.depth, self.cq.ring_bytes, host_identity().encode(), ticket
            )
            # The connecting side speaks first; the listener answers only a HELLO that
            # carries its ticket, so a refused peer never sees a HELLO.
            accepting = self._expected_ticket is not None
            if not accepting:
                self._send_hello(hello)
            timer = asyncio.timeout(timeout)
            try:
                async with timer:
                    await asyncio.shield(self._hello)
            except TimeoutError as exc:
                if not timer.expired():
                    raise
                raise errors.DeadlineExceededError(
                    f"verbs queue pair setup with process {self.peer_pid} timed out after {timeout} s"
                ) from exc
            if accepting:
                self._send_hello(hello)
        except BaseException as exc:
            # Tell the peer why (BYE before HELLO reads as a refusal), then let go.
            if self._error is None:
                with contextlib.suppress(errors.OpError):
                    self._channel.send_nowait(wire.encode_bye(str(exc)))
                self._fail(errors.UnavailableError(f"verbs queue pair setup failed: {exc}"))
            await self.close()
            raise
        self.cq._start(self._loop)

    def _send_hello(self, hello: wire.Hello) -> None:
        self._channel.send_nowait(wire.encode_hello(hello), [self.cq.ring_fd, self.cq.eventfd])

    def _check_ticket(self, hello_frame: bytes) -> None:
        expected = self._expected_ticket
        if expected is not None and not hmac.compare_digest(wire.decode_hello(hello_frame).ticket, expected):
            raise errors.PermissionDeniedError(
                "the peer did not present this listener's ticket (learn the address over the control plane)"
            )

    def _on_hello(self, data: bytes, fds: list[int]) -> None:
        hello = wire.decode_hello(data)
        if hello.version != wire.VERSION:
            raise wire.ProtocolError(
                f"the peer speaks verbs protocol {hello.version}, we speak {wire.VERSION}"
            )
        if len(fds) != 2 or not 1 <= hello.cq_depth <= 1 << 20:
            raise wire.ProtocolError("malformed HELLO from the peer")
        ring_fd, eventfd = fds
        try:
            if hello.cq_ring_bytes < hello.cq_depth * CQE.size:
                raise wire.ProtocolError("the peer's completion ring is smaller than its depth")
            ring = map_peer_fd(ring_fd, hello.cq_ring_bytes, what="the peer's completion ring")
        except BaseException:
            os.close(eventfd)
            raise
        finally:
            os.close(ring_fd)
        self._producer = CqProducer(ring, eventfd, hello.cq_depth)
        with contextlib.suppress(ValueError):
            self.peer_identity = HostIdentity.decode(hello.identity)
        if not self._hello.done():
            self._hello.set_result(hello)

    # -- incoming frames -------------------------------------------------------------

    def _on_packet(self, data: bytes, fds: list[int]) -> None:
        try:
            kind = data[0]
            if not self._hello.done():
                if kind == wire.FrameType.BYE:
                    raise errors.UnavailableError(
                        "the verbs peer refused the queue pair: " + data[1:].decode("utf-8", "replace")
                    )
                if kind != wire.FrameType.HELLO:
                    raise wire.ProtocolError(f"expected HELLO from the peer, got frame type {kind}")
                self._check_ticket(data)
                taken, fds = fds, []
                self._on_hello(data, taken)
            elif kind == wire.FrameType.SEND:
                self._stats["receives"] += 1
                if self._on_message is not None:
                    self._on_message(memoryview(data)[1:])  # (a view: no copy of a large answer)
                else:
                    self._messages.append(data[1:])
                    self._wake_receivers()
            elif kind == wire.FrameType.CREDIT:
                if self._producer is not None:
                    self._producer.add_credits(wire.decode_credit(data))
            elif kind == wire.FrameType.REG_MR:
                if len(fds) != 1:
                    raise wire.ProtocolError("REG_MR without exactly one fd")
                (fd,), fds = fds, []
                self._on_reg_mr(wire.decode_reg_mr(data), fd)
            elif kind == wire.FrameType.UNREG_MR:
                self._on_unreg_mr(wire.decode_unreg_mr(data))
            elif kind == wire.FrameType.BYE:
                self._peer_farewell = data[1:].decode("utf-8", "replace")
            else:
                raise wire.ProtocolError(f"unknown frame type {kind} from the peer")
        finally:
            for fd in fds:
                os.close(fd)

    def _on_reg_mr(self, reg: wire.RegMr, fd: int) -> None:
        if reg.region_id in self._remote or reg.nbytes <= 0:
            os.close(fd)
            raise wire.ProtocolError(f"bad REG_MR for region {reg.region_id}")
        ready: asyncio.Future[None] = self._loop.create_future()
        remote = _RemoteRegion(self.pd, reg.region_id, reg.nbytes, reg.key, ready)
        self._remote[reg.region_id] = remote
        what = f"the peer's memory region {reg.region_id}"
        if reg.nbytes <= OFFLOAD_BYTES:
            try:
                remote.mapping = map_peer_fd(fd, reg.nbytes, what=what)
                ready.set_result(None)
            except (OSError, errors.OpError) as exc:
                _set_exception(ready, _as_op_error(exc, what))
            finally:
                os.close(fd)
            return
        # Pre-faulting a large mapping takes tens of milliseconds: off the loop.
        job = self._loop.run_in_executor(self._executor, map_peer_fd, fd, reg.nbytes, what)

        def mapped(job: asyncio.Future[mmap.mmap]) -> None:
            os.close(fd)
            if job.cancelled():
                _set_exception(ready, errors.UnavailableError(f"{what}: mapping was cancelled"))
            elif (exc := job.exception()) is not None:
                _set_exception(ready, _as_op_error(exc, what))
            elif remote.retired:
                self.pd._release_mapping(job.result())
                _set_exception(ready, errors.NotFoundError(f"{what} was withdrawn"))
            else:
                remote.mapping = job.result()
                ready.set_result(None)

        job.add_done_callback(mapped)
        self._mapping_jobs.add(job)
        job.add_done_callback(self._mapping_jobs.discard)

    def _on_unreg_mr(self, region_id: int) -> None:
        remote = self._remote.pop(region_id, None)
        if remote is not None:
            remote.retired = True
            remote.release_if_idle()

    def _on_cq_consumed(self, count: int) -> None:
        # Return credits in batches: one CREDIT frame per quarter ring, not per entry.
        self._uncredited += count
        if self._uncredited >= max(1, self.cq.depth // 4) and not self.closed:
            with contextlib.suppress(errors.OpError):
                self._channel.send_nowait(wire.encode_credit(self._uncredited))
            self._uncredited = 0

    def _wake_receivers(self) -> None:
        ready = len(self._messages)
        while self._message_waiters and ready:
            waiter = self._message_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                ready -= 1

    def _on_channel_closed(self, error: errors.OpError | None) -> None:
        # EOF or a socket error: the peer's socket is closed (see `peer_gone`).
        # An InternalError is our own verdict on a bad packet: the peer may live on.
        self._peer_gone = error is None or isinstance(error, errors.UnavailableError)
        if error is None:
            if self._peer_farewell is not None:
                error = errors.UnavailableError(
                    f"the verbs peer (pid {self.peer_pid}) closed the queue pair: {self._peer_farewell}"
                )
            else:
                error = errors.UnavailableError(
                    f"the verbs peer (pid {self.peer_pid}) went away without closing the queue pair "
                    "(the process died or was killed)"
                )
        self._fail(error)

    # -- failure and release ---------------------------------------------------------

    def _fail(self, error: errors.OpError) -> None:
        """Stop everything now; release what no copy in flight still uses."""
        if self._error is not None:
            return
        self._error = error
        if not self._hello.done():
            _set_exception(self._hello, error)
        while self._message_waiters:
            waiter = self._message_waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)
        if self._producer is not None:
            self._producer.fail(error)
        self.cq.close(error)
        # Stop, but keep the socket open until our copies are over (see `peer_gone`).
        self._channel.stop(error)
        for remote in self._remote.values():
            remote.retired = True
        for region_id in list(self._exposed_regions):
            self._exposed_regions.pop(region_id)._unobserve(self)
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        if self._error is None or self._in_flight or self._released:
            return
        self._released = True
        for remote in self._remote.values():
            remote.release_if_idle()
        self._remote.clear()
        if self._producer is not None:
            self._producer.close(self._error)
        self._channel.close()
        self.pd._detach(self)
        self._closed_event.set()

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closing:
            raise errors.UnavailableError("the verbs queue pair is closed")

    async def close(self) -> None:
        """Close the queue pair (see the class docstring)."""
        if self._closing:
            await self._closed_event.wait()
            return
        self._closing = True
        # Mappings still being set up in the executor: let them finish, so their fds
        # and mappings are released by their callbacks rather than leaked.
        await asyncio.gather(*self._mapping_jobs, return_exceptions=True)
        if self._error is None:
            with contextlib.suppress(errors.OpError, TimeoutError):
                bye = self._channel.send_nowait(wire.encode_bye("closed by its owner"))
                async with asyncio.timeout(_CLOSE_FLUSH_TIMEOUT):
                    await asyncio.shield(bye)
        # Copies in flight finish first: after we hang up, the peer may reuse its memory.
        await self._idle.wait()
        self._fail(errors.UnavailableError("the verbs queue pair is closed"))
        await self._closed_event.wait()
        await self.pd.wait_unmapped()

    async def __aenter__(self) -> QueuePair:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _local_region_closed(self, region_id: int) -> None:
        # May run on any thread (a pool slice freed by the garbage collector).
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to tell
            self._loop.call_soon_threadsafe(self._withdraw, region_id)

    def _withdraw(self, region_id: int) -> None:
        self._exposed_regions.pop(region_id, None)
        if self._exposed.pop(region_id, None) is not None and not self.closed:
            with contextlib.suppress(errors.OpError):
                self._channel.send_nowait(wire.encode_unreg_mr(region_id))

    # -- operations ------------------------------------------------------------------

    async def expose(self, region: MemoryRegion) -> None:
        """Let the peer access `region` (sends its fd once; idempotent)."""
        self._check_usable()
        if region._pd is not self.pd:
            raise ValueError("the region belongs to another protection domain")
        sent = self._exposed.get(region.id)
        if sent is None:
            sent = self._channel.send_nowait(
                wire.encode_reg_mr(region.id, region.nbytes, region.key), [region.fd]
            )
            self._exposed[region.id] = sent
            self._exposed_regions[region.id] = region
            region._observe(self)
        await asyncio.shield(sent)

    async def _usable_remote(self, region_id: int, key: bytes, offset: int, length: int) -> _RemoteRegion:
        self._check_usable()
        remote = self._remote.get(region_id)
        if remote is None:
            raise errors.NotFoundError(
                f"the peer has not exposed memory region {region_id} (or withdrew it) (IBV_WC_REM_ACCESS_ERR)"
            )
        await asyncio.shield(remote.ready)
        self._check_usable()
        if remote.retired or remote.mapping is None:
            raise errors.NotFoundError(f"the peer withdrew memory region {region_id} (IBV_WC_REM_ACCESS_ERR)")
        check_access(
            what=f"the peer's memory region {region_id}",
            nbytes=remote.nbytes,
            expected_key=remote.key,
            key=key,
            offset=offset,
            length=length,
        )
        return remote

    def _begin(self, remote: _RemoteRegion) -> None:
        self._in_flight += 1
        remote.in_flight += 1
        self._idle.clear()

    def _end(self, remote: _RemoteRegion) -> None:
        remote.in_flight -= 1
        remote.release_if_idle()
        self._in_flight -= 1
        if not self._in_flight:
            self._idle.set()
            self._release_if_idle()

    async def _copy(
        self, dst: memoryview, src: Any, nbytes: int, then: Callable[[], None] | None = None
    ) -> bool:
        """Copy (large copies shared by the executor's threads and, for a bounded
        part, the loop), calling `then` in whichever thread copies the last byte;
        returns whether the caller was cancelled meanwhile."""
        try:
            if nbytes <= SHARED_COPY_BYTES:
                copy_bytes(dst, src)
                if then is not None:
                    then()
                return False
            work = SharedCopy(dst, src, nbytes, then=then)
            jobs = [self._loop.run_in_executor(self._executor, work.run) for _ in range(work.threads_wanted)]
            try:
                work.run(limit=INLINE_COPY_BYTES)
            finally:
                cancelled = await wait_offloaded(jobs)
            return cancelled
        finally:
            with contextlib.suppress(BufferError):
                dst.release()

    async def write(
        self,
        remote_region_id: int,
        key: bytes,
        offset: int,
        data: Any,
        *,
        wr_id: int = 0,
        imm_data: int = 0,
    ) -> WorkCompletion:
        """One-sided write into the peer's region (see the class docstring)."""
        if isinstance(data, np.ndarray) and data.dtype.hasobject:
            raise TypeError(
                f"arrays of dtype {data.dtype} hold Python objects and cannot be written as bytes"
            )
        nbytes = nbytes_of(data)
        remote = await self._usable_remote(remote_region_id, key, offset, nbytes)
        producer = self._producer
        assert producer is not None
        await producer.reserve()  # a ring slot for the peer's completion
        if self.closed or remote.retired or remote.mapping is None:
            producer.unreserve()
            self._check_usable()
            raise errors.NotFoundError(f"the peer withdrew memory region {remote_region_id}")
        self._begin(remote)
        posted = False

        def post() -> None:
            # Runs in the thread that copied the last byte: the peer hears at once,
            # even if our caller gave up meanwhile (a started copy is finished).
            nonlocal posted
            self._check_usable()
            producer.post(
                WorkCompletion(wr_id, Opcode.RECV_RDMA_WITH_IMM, WcStatus.SUCCESS, nbytes, imm_data)
            )
            posted = True

        try:
            dst = memoryview(remote.mapping)[offset : offset + nbytes]
            cancelled = await self._copy(dst, data, nbytes, then=post)
        finally:
            if not posted:
                with contextlib.suppress(errors.OpError):
                    producer.unreserve()
            self._end(remote)
        self._stats["writes"] += 1
        self._stats["bytes_written"] += nbytes
        if cancelled:
            raise asyncio.CancelledError
        return WorkCompletion(wr_id, Opcode.RDMA_WRITE, WcStatus.SUCCESS, nbytes, imm_data)

    async def read(
        self,
        remote_region_id: int,
        key: bytes,
        offset: int,
        length: int,
        into: Any,
        *,
        wr_id: int = 0,
    ) -> WorkCompletion:
        """One-sided read from the peer's region into the writable buffer `into`."""
        target = as_byte_view(into)
        if target.readonly:
            raise TypeError("read() needs a writable buffer to read into")
        if target.nbytes < length:
            raise errors.InvalidArgumentError(
                f"the buffer holds {target.nbytes} bytes, the read wants {length} (IBV_WC_LOC_LEN_ERR)"
            )
        remote = await self._usable_remote(remote_region_id, key, offset, length)
        assert remote.mapping is not None
        self._begin(remote)
        try:
            src = memoryview(remote.mapping)[offset : offset + length]
            try:
                cancelled = await self._copy(target[:length], src, length)
            finally:
                with contextlib.suppress(BufferError):
                    src.release()
        finally:
            self._end(remote)
        self._stats["reads"] += 1
        self._stats["bytes_read"] += length
        if cancelled:
            raise asyncio.CancelledError
        return WorkCompletion(wr_id, Opcode.RDMA_READ, WcStatus.SUCCESS, length, 0)

    async def send(self, *parts: Buffer) -> None:
        """Send a small message (at most `MAX_SEND_BYTES`), delivered in order to `recv()`:
        its parts, one after the other (bytes, or memoryviews of bytes that nobody
        changes until the message has left), not joined here."""
        await asyncio.shield(self.send_nowait(*parts))

    def send_nowait(self, *parts: Buffer) -> asyncio.Future[None]:
        """`send` without waiting: the message is queued in order (or sent at once);
        the future tells when it left."""
        nbytes = sum(map(len, parts))
        if nbytes > wire.MAX_SEND_BYTES:
            raise ValueError(f"send() carries at most {wire.MAX_SEND_BYTES} bytes, got {nbytes}")
        self._check_usable()
        self._stats["sends"] += 1
        return self._channel.send_nowait((wire.SEND_FRAME, *parts))

    async def recv(self) -> bytes:
        """The next message the peer sent."""
        while not self._messages:
            self._check_usable()
            waiter = self._loop.create_future()
            self._message_waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_receivers()
                raise
        return self._messages.popleft()

    def deliver_to(self, handler: Callable[[bytes | memoryview], None]) -> None:
        """Pass every message to `handler` as it arrives (see the class docstring)."""
        self._on_message = handler
        while self._messages:
            handler(self._messages.popleft())

    def statistics(self) -> QueuePairStatistics:
        cq = self.cq.statistics()
        return QueuePairStatistics(
            writes=self._stats["writes"],
            bytes_written=self._stats["bytes_written"],
            reads=self._stats["reads"],
            bytes_read=self._stats["bytes_read"],
            sends=self._stats["sends"],
            receives=self._stats["receives"],
            completions_posted=self._producer.posted if self._producer else 0,
            completions_received=cq.completions,
            cq_wakeups=cq.wakeups,
            regions_exposed=len(self._exposed),
            remote_regions=len(self._remote),
        )


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    future.set_exception(error)
    future.exception()  # retrieved: nobody may ever wait for it


def _as_op_error(exc: BaseException, what: str) -> errors.OpError:
    if isinstance(exc, errors.OpError):
        return exc
    return errors.InternalError(f"{what}: cannot map it ({exc})")


# -- connection establishment -----------------------------------------------------------


async def connect(
    pd: ProtectionDomain,
    address: str,
    *,
    cq_depth: int = DEFAULT_CQ_DEPTH,
    timeout: float = HANDSHAKE_TIMEOUT,
) -> QueuePair:
    """A queue pair to the `QueuePairAcceptor` at `address` (its `address` attribute, ticket included).

    Raises:
        UnavailableError: nothing listens there.
        PermissionDeniedError: the listener runs as another user.
        DeadlineExceededError: the setup took longer than `timeout` seconds.
    """
    socket_address, ticket = _split_ticket(address)
    loop = asyncio.get_running_loop()
    sock = seqpacket_socket()
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, _sockaddr(socket_address))
    except (OSError, TimeoutError) as exc:
        sock.close()
        raise errors.UnavailableError(
            f"cannot reach the verbs listener at {socket_address!r}: {exc!r}"
        ) from exc
    except BaseException:
        sock.close()
        raise
    try:
        qp = QueuePair(pd, sock, cq_depth=cq_depth)
    except BaseException:
        sock.close()
        raise
    await qp._handshake(timeout, ticket)
    return qp


def _split_ticket(address: str) -> tuple[str, bytes]:
    """A `connect` address's socket address and ticket (zeros when it names none)."""
    socket_address, sep, ticket_hex = address.rpartition("#")
    if sep and len(ticket_hex) == 2 * wire.TICKET_BYTES:
        with contextlib.suppress(ValueError):
            return socket_address, bytes.fromhex(ticket_hex)
    return address, bytes(wire.TICKET_BYTES)


@dataclass(frozen=True)
class ListenerStatistics:
    accepted: int
    rejected: int


class QueuePairAcceptor:
    """Accepts queue pairs on a Unix socket. Create with `await listen(pd)`.

    Contract:
        * `address` is what peers pass to `connect` (send it over the control plane).
        * `await accept()` returns the next queue pair whose setup succeeded; peers
          that fail the checks (other uid, bad handshake) are refused, logged and
          counted in `statistics().rejected`, never returned.
        * `async for qp in listener` accepts until the listener is closed.
        * `await close()` stops listening, closes queue pairs not yet accepted and,
          for a path address, removes the socket file; waiting `accept()` calls raise
          `UnavailableError`. Accepted queue pairs live on. Idempotent.
    """

    def __init__(
        self,
        pd: ProtectionDomain,
        sock: socket.socket,
        socket_address: str,
        *,
        cq_depth: int,
        handshake_timeout: float,
    ) -> None:
        pd._check_open()
        self.pd = pd
        self._ticket = secrets.token_bytes(wire.TICKET_BYTES)
        self.socket_address = socket_address
        self.address = f"{socket_address}#{self._ticket.hex()}"
        self._sock = sock
        self._cq_depth = cq_depth
        self._handshake_timeout = handshake_timeout
        # None is the "closed" sentinel; whoever takes it puts it back for the next.
        self._ready: asyncio.Queue[QueuePair | None] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepted = 0
        self._rejected = 0
        self._closed = False
        self._error = errors.UnavailableError(f"the verbs listener at {socket_address} is closed")
        pd._attach(self)
        self._spawn(self._accept_loop())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                # Out of fds or memory: retrying at once would spin; stop serving loudly.
                logger.error("verbs listener %s stops accepting: %s", self.socket_address, exc)
                self._error = errors.UnavailableError(
                    f"the verbs listener at {self.socket_address} failed: {exc}"
                )
                self._ready.put_nowait(None)
                return
            self._spawn(self._set_up(conn))

    async def _set_up(self, conn: socket.socket) -> None:
        try:
            qp = QueuePair(self.pd, conn, cq_depth=self._cq_depth)
        except Exception as exc:
            conn.close()
            self._rejected += 1
            logger.warning("verbs listener %s: cannot set up a queue pair: %s", self.socket_address, exc)
            return
        qp._expected_ticket = self._ticket
        try:
            await qp._handshake(self._handshake_timeout)
        except Exception as exc:  # OpErrors, and anything unexpected: refuse, keep serving
            self._rejected += 1
            logger.warning("verbs listener %s: refused a peer: %s", self.socket_address, exc)
            return
        self._accepted += 1
        self._ready.put_nowait(qp)

    async def accept(self) -> QueuePair:
        """The next established queue pair (raises UnavailableError once closed)."""
        qp = await self._ready.get()
        if qp is None:
            self._ready.put_nowait(None)
            raise self._error
        return qp

    def __aiter__(self) -> AsyncIterator[QueuePair]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[QueuePair]:
        while True:
            try:
                yield await self.accept()
            except errors.UnavailableError:
                if self._closed:
                    return
                raise

    def statistics(self) -> ListenerStatistics:
        return ListenerStatistics(self._accepted, self._rejected)

    async def close(self) -> None:
        """Stop listening (see the class docstring). Idempotent."""
        if self._closed:
            return
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while not self._ready.empty():
            qp = self._ready.get_nowait()
            if qp is not None:
                await qp.close()
        self._ready.put_nowait(None)
        self._sock.close()
        if not self.socket_address.startswith(_ABSTRACT_PREFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_address)
        self.pd._detach(self)

    async def __aenter__(self) -> QueuePairAcceptor:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def listen(
    pd: ProtectionDomain,
    address: str | None = None,
    *,
    cq_depth: int = DEFAULT_CQ_DEPTH,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    backlog: int = 64,
) -> QueuePairAcceptor:
    """Listen for queue pairs.

    Args:
        pd: The protection domain accepted queue pairs belong to.
        address: None for a fresh abstract-namespace address (recommended: nothing on
            disk, so nothing left behind by a crash), or a filesystem path for the
            socket (its directory should be private, e.g. mode 0700).
        cq_depth: Completion-queue depth of each accepted queue pair.
        handshake_timeout: Seconds a connecting peer has to complete the setup.
        backlog: The socket's listen backlog.
    """
    if address is None:
        address = f"{_ABSTRACT_PREFIX}distserver-verbs-{os.getpid()}-{secrets.token_hex(16)}"
    sock = seqpacket_socket()
    try:
        sock.bind(_sockaddr(address))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise errors.UnavailableError(f"cannot listen for verbs queue pairs at {address!r}: {exc}") from exc
    return QueuePairAcceptor(pd, sock, address, cq_depth=cq_depth, handshake_timeout=handshake_timeout)
