"""Completion queues: a shared-memory ring of work completions plus an eventfd doorbell.

The owner of a `CompletionQueue` creates the ring (a sealed memfd) and an eventfd and
passes both to its peer when the queue pair is set up. The peer (`CqProducer`) posts
a completion by writing a 32-byte record into the next ring slot and then adding 1 to
the eventfd. The owner watches the eventfd with `loop.add_reader`; one wake-up reads
the eventfd counter `n` and takes exactly `n` records from the ring, so completions
are batched per wake-up.

Why count with the eventfd instead of sharing head/tail indices: the eventfd write
and read are system calls, which order memory on every architecture, so a record
written before `eventfd_write` is fully visible after the matching `eventfd_read`.
Python has no memory barriers of its own.

The ring never overflows: the producer holds one credit per free slot (`depth` at
first) and the owner returns credits in batches over the queue pair's socket once it
has moved records out of the ring (`CREDIT` frames), as the TensorPipe ibv transport
acknowledges consumed bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import mmap
import os
import struct
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from distserver import errors
from distserver.transports.verbs._memory import PAGE_SIZE, create_shared_mapping, memfd_name, release_mapping

__all__ = ["CompletionQueue", "CompletionQueueStatistics", "Opcode", "WcStatus", "WorkCompletion"]

# wr_id, byte_len, opcode, status, imm_data, padding: one 32-byte ring slot.
CQE = struct.Struct("<QQIIII")


class Opcode(enum.IntEnum):
    """What a completion completes (the values of `ibv_wc_opcode`)."""

    SEND = 0
    RDMA_WRITE = 1
    RDMA_READ = 2
    RECV = 128
    RECV_RDMA_WITH_IMM = 129


class WcStatus(enum.IntEnum):
    """How a work request ended (the values of `ibv_wc_status` that can occur here)."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11


@dataclass(frozen=True, slots=True)
class WorkCompletion:
    """One completion, shaped like `ibv_wc`.

    Attributes:
        wr_id: The work-request id the poster chose (for remote completions, the
            writer's `wr_id`: there are no posted receives to take it from).
        opcode: What completed.
        status: `WcStatus.SUCCESS`, or why it failed.
        byte_len: Bytes transferred.
        imm_data: The 32-bit immediate value the writer attached.
    """

    wr_id: int
    opcode: Opcode
    status: WcStatus
    byte_len: int
    imm_data: int

    @property
    def ok(self) -> bool:
        return self.status == WcStatus.SUCCESS


@dataclass(frozen=True)
class CompletionQueueStatistics:
    completions: int
    wakeups: int
    largest_batch: int
    pending: int


class CompletionQueue:
    """Completions that the peer posts to this side of a queue pair.

    Contract:
        * `await poll()` returns the next completion, waiting without blocking the
          event loop (the eventfd is watched with `loop.add_reader`).
        * `poll_nowait(max_entries)` returns what is ready now (possibly nothing),
          like `ibv_poll_cq`.
        * `async for wc in cq` yields completions until the queue is closed.
        * Completions arrive in the order the peer posted them.
        * `deliver_to(handler)` instead passes every completion to `handler(wc)`, on the
          event loop, in the wake-up that read it (no task switch; `poll()` then
          finds nothing).
        * `close(error)` fails every waiting `poll()` with `error` (default:
          `UnavailableError`), unmaps the ring and closes the eventfd. Completions
          already taken out of the ring can still be polled after close; then
          `poll()` raises and `async for` stops (or raises `error` if one was given).
    """

    def __init__(self, depth: int, *, on_consumed: Callable[[int], None] | None = None) -> None:
        if not 1 <= depth <= 1 << 20:
            raise ValueError(f"completion queue depth must be in [1, 2**20], got {depth}")
        self.depth = depth
        self._ring_bytes = -(-depth * CQE.size // PAGE_SIZE) * PAGE_SIZE
        self._ring_fd, self._ring = create_shared_mapping(memfd_name("cq"), self._ring_bytes)
        try:
            self._eventfd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except BaseException:
            self._ring.close()
            os.close(self._ring_fd)
            raise
        self._on_consumed = on_consumed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._head = 0
        self._ready: deque[WorkCompletion] = deque()
        self._handler: Callable[[WorkCompletion], None] | None = None
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False
        self._error: errors.OpError | None = None
        self._completions = 0
        self._wakeups = 0
        self._largest_batch = 0

    @property
    def ring_fd(self) -> int:
        """The ring's memfd, passed to the peer at setup."""
        return self._ring_fd

    @property
    def ring_bytes(self) -> int:
        return self._ring_bytes

    @property
    def eventfd(self) -> int:
        """The doorbell eventfd, passed to the peer at setup."""
        return self._eventfd

    @property
    def closed(self) -> bool:
        return self._closed

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._eventfd, self._on_doorbell)

    def _on_doorbell(self) -> None:
        try:
            count = os.eventfd_read(self._eventfd)
        except BlockingIOError:
            return  # a spurious wake-up: someone else drained the counter
        self._wakeups += 1
        self._largest_batch = max(self._largest_batch, count)
        for _ in range(count):
            slot = (self._head % self.depth) * CQE.size
            wr_id, byte_len, opcode, status, imm, _ = CQE.unpack_from(self._ring, slot)
            self._head += 1
            try:
                wc = WorkCompletion(wr_id, Opcode(opcode), WcStatus(status), byte_len, imm)
            except ValueError:
                wc = WorkCompletion(wr_id, Opcode.RECV_RDMA_WITH_IMM, WcStatus.REM_OP_ERR, byte_len, imm)
            self._ready.append(wc)
        self._completions += count
        if self._on_consumed is not None:
            self._on_consumed(count)
        self._dispatch()

    def deliver_to(self, handler: Callable[[WorkCompletion], None]) -> None:
        """Pass every completion to `handler` as it arrives (see the class docstring)."""
        self._handler = handler
        self._dispatch()

    def _dispatch(self) -> None:
        if self._handler is None:
            self._wake()
            return
        while self._ready:
            self._handler(self._ready.popleft())

    def _wake(self) -> None:
        # One waiter per ready completion; each takes its own from the deque.
        ready = len(self._ready)
        while self._waiters and ready:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                ready -= 1

    def poll_nowait(self, max_entries: int | None = None) -> list[WorkCompletion]:
        """Up to `max_entries` completions that are ready now (all when None)."""
        count = len(self._ready) if max_entries is None else min(max_entries, len(self._ready))
        return [self._ready.popleft() for _ in range(count)]

    async def poll(self) -> WorkCompletion:
        """The next completion (see the class docstring)."""
        while not self._ready:
            if self._closed:
                raise self._error or errors.UnavailableError("the completion queue is closed")
            if self._loop is None:
                raise RuntimeError("the completion queue is not attached to a queue pair yet")
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # pass our turn on to the next waiter
                raise
        return self._ready.popleft()

    def __aiter__(self) -> CompletionQueue:
        return self

    async def __anext__(self) -> WorkCompletion:
        try:
            return await self.poll()
        except errors.OpError:
            if self._error is None and self._closed and not self._ready:
                raise StopAsyncIteration from None
            raise

    def statistics(self) -> CompletionQueueStatistics:
        return CompletionQueueStatistics(
            self._completions, self._wakeups, self._largest_batch, len(self._ready)
        )

    def close(self, error: errors.OpError | None = None) -> None:
        """Close the queue (see the class docstring). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._error = error
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._eventfd)
        failure = error or errors.UnavailableError("the completion queue is closed")
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(failure)
        os.close(self._eventfd)
        os.close(self._ring_fd)
        release_mapping(self._ring)


class CqProducer:
    """This side's handle on the peer's completion queue: its ring (mapped here) and eventfd.

    Contract: `await reserve()` takes a credit (waits while the ring is full);
    `post(wc)` uses one reserved credit (from any thread); `unreserve()` gives an unused one back;
    `add_credits(n)` is called when the peer reports consumed entries. `close(error)`
    fails credit waiters and releases the mapping and the eventfd.
    """

    def __init__(self, ring: mmap.mmap, eventfd: int, depth: int) -> None:
        self._ring = ring
        self._eventfd = eventfd
        self.depth = depth
        self._tail = 0
        self._credits = depth
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._error: errors.OpError | None = None
        self._post_lock = threading.Lock()
        self.posted = 0

    async def reserve(self) -> None:
        if self._error is not None:
            raise self._error
        if self._credits and not self._waiters:
            self._credits -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.unreserve()  # granted just as we were cancelled: give it back
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def unreserve(self) -> None:
        self.add_credits(1)

    def add_credits(self, count: int) -> None:
        self._credits += count
        if self._credits > self.depth:
            raise errors.InternalError(
                f"the peer returned more completion credits than it was owed ({count})"
            )
        while self._waiters and self._credits:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._credits -= 1
                waiter.set_result(None)

    def post(self, wc: WorkCompletion) -> None:
        """Write `wc` into the next ring slot and ring the doorbell. Thread-safe: the
        copy thread that finishes a write posts its completion."""
        with self._post_lock:
            if self._error is not None:
                raise self._error
            slot = (self._tail % self.depth) * CQE.size
            CQE.pack_into(
                self._ring, slot, wc.wr_id, wc.byte_len, wc.opcode, wc.status, wc.imm_data & 0xFFFFFFFF, 0
            )
            self._tail += 1
            self.posted += 1
            os.eventfd_write(self._eventfd, 1)  # after the record: the syscall orders the stores

    def fail(self, error: errors.OpError) -> None:
        """Refuse further posts and fail credit waiters (the queue pair is going away)."""
        if self._error is None:
            self._error = error
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    def close(self, error: errors.OpError) -> None:
        self.fail(error)
        with self._post_lock:
            if self._eventfd >= 0:
                os.close(self._eventfd)
                self._eventfd = -1
                release_mapping(self._ring)
