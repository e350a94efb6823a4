"""The tensor path: receiver-allocated, one-copy tensor transfers over a queue pair.

Message flow of one `recv_tensor_into` (TF verbs' receiver-driven protocol, with the
GDR idea that the destination travels with the request):

    receiver                                         sender (source(header) -> array)
    take flow-control budget, allocate a pool slice
    expose its region (REG_MR, once per region)
    REQUEST(id, region, key, offset, capacity, header)  ->
                                                     array = await source(header)
                                                     small:    <- RESPONSE INLINE (bytes in the message)
                                                     too big:  <- RESPONSE NEEDS_SPACE (dtype, shape, nbytes)
    (NEEDS_SPACE: new slice of nbytes) RE_REQUEST ->
                                                     <- RESPONSE WRITING (dtype, shape, nbytes, meta)
                                                     write(region, key, offset, array)  (one copy)
                                                     -> completion on the receiver's CQ (wr_id = id)
    WRITING, then the completion seen:
    the array is a view of the pool slice

The description travels before the copy, so the completion -- posted by the thread
that copies the last byte -- is all the receiver waits for once the bytes land. With
`cache_key` the REQUEST carries the description the receiver expects; when it holds
(or NEEDS_SPACE gave it), no WRITING is sent and the completion says so
(`imm_data = IMM_AS_EXPECTED`): one REQUEST and one write per tensor.

Errors of the source reach the receiver as RESPONSE ERROR(code, message) and are
raised there as the matching `OpError` (`errors.from_status`); after WRITING, an
ERROR instead of the completion (the write failed: region withdrawn, queue pair
closing).

Memory safety rule: a destination slice is reused only when the sender can no longer
write into it -- after its final answer for that destination (a RESPONSE other than
WRITING, or the completion), or after the peer's socket closed
(`QueuePair.peer_gone`). A receiver that gives up (cancelled, timed out) sends CANCEL
and keeps the slice until then. (A write cancelled after it started copying still
completes; its ERROR CANCELLED then arrives for a settled request and is ignored.)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from distserver import errors
from distserver.transports.verbs import _wire as wire
from distserver.transports.verbs._calls import CallHandler, QueuePairCalls
from distserver.transports.verbs._cq import WorkCompletion
from distserver.transports.verbs._memory import OFFLOAD_BYTES, PoolSlice, ProtectionDomain, RegionPool
from distserver.transports.verbs._qp import (
    DEFAULT_CQ_DEPTH,
    HANDSHAKE_TIMEOUT,
    QueuePair,
    QueuePairAcceptor,
    connect,
    listen,
)

__all__ = [
    "DEFAULT_CLOSE_TIMEOUT",
    "DEFAULT_INLINE_LIMIT",
    "DEFAULT_MAX_BYTES_IN_FLIGHT",
    "EndpointStatistics",
    "ReceivedTensor",
    "TensorEndpoint",
    "TensorReply",
    "TensorServer",
    "TensorSource",
]

logger = logging.getLogger(__name__)

DEFAULT_INLINE_LIMIT = 64 << 10
"""Tensors up to this many bytes ride inside the RESPONSE message (no region, no completion)."""

DEFAULT_MAX_BYTES_IN_FLIGHT = 256 << 20
_MAX_INLINE_LIMIT = 128 << 10
_MAX_HEADER_BYTES = 32 << 10
_MAX_META_BYTES = 16 << 10
# A write's copy of more than this holds the event loop for over ~30 us: its request
# lets what was queued with it (a batch of small values to answer) go first.
_STALL_BYTES = 256 << 10
_DESCRIPTION_CACHE_ENTRIES = 4096
DEFAULT_CLOSE_TIMEOUT = 5.0


@dataclass(frozen=True)
class TensorReply:
    """What a `TensorSource` returns when it has more to say than the array.

    Attributes:
        value: The tensor (any numeric, bool, complex, string-of-fixed-width or
            ml_dtypes dtype; any memory layout).
        meta: Opaque bytes (at most 16 KiB) handed to the receiver with the tensor,
            e.g. RecvTensor's `is_dead` flag.
    """

    value: NDArray[Any]
    meta: bytes = b""


TensorSource = Callable[[bytes], Awaitable["NDArray[Any] | TensorReply"]]
"""The sender side: request header -> the tensor to send. Raising an `OpError` sends that status."""


@dataclass(frozen=True)
class ReceivedTensor:
    """A tensor that arrived.

    Attributes:
        value: The array, C-ordered and writable.
        meta: The sender's `TensorReply.meta`.
        zero_copy: True when `value` is a view of registered pool memory (it holds its
            pool slice until it and every view of it are garbage collected); False
            when it owns its memory (inline transfers, or `copy=True`).
    """

    value: NDArray[Any]
    meta: bytes
    zero_copy: bool


@dataclass(frozen=True)
class EndpointStatistics:
    """A snapshot of one endpoint's tensor traffic, both directions."""

    requests: int
    inline: int
    written: int
    re_requests: int
    failed: int
    bytes_received: int
    bytes_in_flight: int
    peak_bytes_in_flight: int
    max_bytes_in_flight: int
    quarantined_bytes: int
    served: int
    bytes_served: int
    described_in_advance: int
    """Written tensors that needed no WRITING message: the description the receiver
    had cached (or got in NEEDS_SPACE) still held."""
    calls_made: int
    calls_served: int
    """Control calls run on the peer / for the peer over this queue pair (`_calls`)."""


class _ByteBudget:
    """Flow control: at most `limit` bytes of destinations handed to the sender at once.

    FIFO, so a large request is not starved by a stream of small ones. A request
    larger than the limit is admitted alone (when nothing else is in flight): it gets
    its own slice, and the bound becomes max(limit, largest tensor).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        """Requests queued for admission."""
        return len(self._waiters)

    def _fits(self, nbytes: int) -> bool:
        return self.in_use == 0 or self.in_use + nbytes <= self.limit

    def _take(self, nbytes: int) -> None:
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)

    async def acquire(self, nbytes: int) -> None:
        if not self._waiters and self._fits(nbytes):
            self._take(nbytes)
            return
        waiter = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(nbytes)  # granted as we were cancelled
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._grant()
            raise

    def release(self, nbytes: int) -> None:
        self.in_use -= nbytes
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            nbytes, waiter = self._waiters.popleft()
            if not waiter.done():
                self._take(nbytes)
                waiter.set_result(None)


class _Pending:
    """Receiver-side state of one request."""

    def __init__(self, req_id: int, loop: asyncio.AbstractEventLoop) -> None:
        self.req_id = req_id
        self._loop = loop
        self.responses: deque[wire.Response] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.error: errors.OpError | None = None
        self.completion: asyncio.Future[WorkCompletion] = loop.create_future()
        self.slice: PoolSlice | None = None
        self.budget = 0
        self.announced = False  # the sender knows `slice` (may write into it)
        self.sent = False
        self.expected: wire.TensorDescription | None = None  # what the sender need not describe
        self.writing = False  # WRITING came: the completion or an ERROR is the final answer
        self.finished = False
        self.abandoned = False

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    async def next_response(self) -> wire.Response:
        while not self.responses:
            if self.error is not None:
                raise self.error
            self._waiter = self._loop.create_future()
            await self._waiter
        return self.responses.popleft()

    def deliver(self, response: wire.Response) -> None:
        self.responses.append(response)
        self._wake()

    def fail(self, error: errors.OpError) -> None:
        if self.error is None:
            self.error = error
        if not self.completion.done():
            self.completion.set_exception(error)
            self.completion.exception()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Serving:
    """Sender-side state of one request."""

    def __init__(self, req_id: int) -> None:
        self.req_id = req_id
        self.task: asyncio.Task[None] | None = None
        self.re_request: asyncio.Future[wire.Destination] | None = None
        self.cancel_requested = False


class TensorEndpoint:
    """One side of the tensor path over one `QueuePair`; it can receive and serve.

    Contract:
        * `await recv_tensor_into(pool, request_header, ...)` asks the peer for one
          tensor and returns a `ReceivedTensor` (see the module docstring for the
          flow). The destination is a slice of `pool`; the sender copies the tensor
          into it once. Tensors up to `inline_limit` bytes come inside the reply.
        * `source` (optional) serves the peer's requests; without one, the peer's
          requests fail with `UnimplementedError`.
        * `calls` (a `QueuePairCalls`) runs control calls on the peer; `call_handler`
          (optional) serves the peer's (see `_calls`).
        * Flow control: destinations handed to the sender total at most
          `max_bytes_in_flight` bytes (a larger tensor is admitted alone).
        * Errors: the source's exception reaches the receiver as the same `OpError`
          class and message; a vanished peer fails every pending request with
          `UnavailableError`; `timeout` gives `DeadlineExceededError`.
        * `await close()` cancels outstanding requests, waits up to `close_timeout`
          seconds for the sender to let go of their destinations, then closes the
          queue pair.
          Destinations whose fate is unknown then (a hung peer) are never reused
          (`statistics().quarantined_bytes`). Idempotent; also `async with`.
        * Use from the event loop that created it.
    """

    def __init__(
        self,
        qp: QueuePair,
        *,
        source: TensorSource | None = None,
        call_handler: CallHandler | None = None,
        max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT,
        inline_limit: int = DEFAULT_INLINE_LIMIT,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
    ) -> None:
        if not 0 <= inline_limit <= _MAX_INLINE_LIMIT:
            raise ValueError(f"inline_limit must be in [0, {_MAX_INLINE_LIMIT}], got {inline_limit}")
        if max_bytes_in_flight <= 0:
            raise ValueError(f"max_bytes_in_flight must be positive, got {max_bytes_in_flight}")
        self.qp = qp
        self._source = source
        self._inline_limit = inline_limit
        self._close_timeout = close_timeout
        self._budget = _ByteBudget(max_bytes_in_flight)
        self._loop = asyncio.get_running_loop()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._serving: dict[int, _Serving] = {}
        self._descriptions: OrderedDict[Hashable, wire.TensorDescription] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._error: errors.OpError | None = None
        self._closing = False
        self._done = asyncio.Event()
        self._settled = asyncio.Event()  # an abandoned request was let go of
        self._counts = dict.fromkeys(
            (
                "requests",
                "inline",
                "written",
                "re_requests",
                "failed",
                "bytes_received",
                "served",
                "bytes_served",
                "described_in_advance",
            ),
            0,
        )
        self._quarantined = 0
        self.calls = QueuePairCalls(qp, call_handler, self._spawn)
        self.qp.deliver_to(self._on_message)
        self.qp.cq.deliver_to(self._on_completion)
        self._spawn(self._watch())

    @classmethod
    async def connect(
        cls,
        pd: ProtectionDomain,
        address: str,
        *,
        source: TensorSource | None = None,
        cq_depth: int = DEFAULT_CQ_DEPTH,
        timeout: float = HANDSHAKE_TIMEOUT,
        max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT,
        inline_limit: int = DEFAULT_INLINE_LIMIT,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
    ) -> TensorEndpoint:
        """Connect a queue pair to the listener at `address` and wrap it (the endpoint owns it)."""
        qp = await connect(pd, address, cq_depth=cq_depth, timeout=timeout)
        try:
            return cls(
                qp,
                source=source,
                max_bytes_in_flight=max_bytes_in_flight,
                inline_limit=inline_limit,
                close_timeout=close_timeout,
            )
        except BaseException:
            await qp.close()
            raise

    @property
    def closed(self) -> bool:
        return self._closing or self._error is not None

    async def wait_closed(self) -> None:
        """Return once the endpoint is closed or its peer is gone."""
        await self._done.wait()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closing:
            raise errors.UnavailableError("the verbs tensor endpoint is closed")

    # -- receiving ---------------------------------------------------------------------

    async def recv_tensor_into(
        self,
        pool: RegionPool,
        request_header: bytes,
        *,
        size_hint: int | None = None,
        cache_key: Hashable | None = None,
        copy: bool = False,
        timeout: float | None = None,
    ) -> ReceivedTensor:
        """Receive one tensor from the peer into registered memory from `pool`.

        Args:
            pool: Where the destination is allocated (its regions are exposed to the
                peer on first use).
            request_header: Opaque bytes for the peer's `source` (at most 32 KiB),
                e.g. a serialized RecvTensorRequest.
            size_hint: Expected tensor size in bytes. With a good hint a large tensor
                takes one round trip; without one, two (NEEDS_SPACE, then RE_REQUEST).
            cache_key: Remember the tensor's description under this key: next time
                its size is the hint, and the sender skips describing the tensor
                when it still matches (TF verbs' metadata cache; a rendezvous key
                without its step id is a good key).
            copy: Return an array that owns its memory and free the pool slice at once
                (one more copy). The default returns a zero-copy view that holds the
                slice until it is garbage collected: right for tensors consumed soon,
                wrong for tensors kept for long (they would pin pool memory).
            timeout: Seconds to wait for the tensor (None: no limit).

        Raises:
            OpError: the sender's error, as its class (InvalidArgumentError, ...).
            UnavailableError: the peer closed or died.
            DeadlineExceededError: `timeout` expired.
        """
        self._check_open()
        if len(request_header) > _MAX_HEADER_BYTES:
            raise ValueError(f"request headers are limited to {_MAX_HEADER_BYTES} bytes")
        pending = _Pending(next(self._ids), self._loop)
        self._pending[pending.req_id] = pending
        self._counts["requests"] += 1
        timer = asyncio.timeout(timeout)
        try:
            try:
                async with timer:
                    return await self._receive(
                        pending, pool, bytes(request_header), size_hint, cache_key, copy
                    )
            except TimeoutError as exc:
                if not timer.expired():
                    raise  # the sender's own DeadlineExceededError (also a TimeoutError)
                raise errors.DeadlineExceededError(
                    f"no tensor from the verbs peer (pid {self.qp.peer_pid}) within {timeout} s"
                ) from exc
        except BaseException:
            self._counts["failed"] += 1
            raise
        finally:
            self._settle(pending)

    async def _receive(
        self,
        pending: _Pending,
        pool: RegionPool,
        header: bytes,
        size_hint: int | None,
        cache_key: Hashable | None,
        copy: bool,
    ) -> ReceivedTensor:
        cached = self._descriptions.get(cache_key) if cache_key is not None else None
        capacity = size_hint if size_hint is not None else cached.nbytes if cached is not None else 0
        destination = wire.NO_DESTINATION
        if capacity > self._inline_limit:
            destination = await self._provide(pending, pool, capacity)
            if cached is not None and cached.nbytes <= destination.capacity:
                pending.expected = cached  # the sender skips WRITING if it still holds
        pending.check()  # closed meanwhile: the slice may be gone, never announce it
        pending.announced = destination is not wire.NO_DESTINATION
        pending.sent = True
        await self.qp.send(wire.encode_request(pending.req_id, destination, header, pending.expected))
        response = await pending.next_response()
        if response.kind == wire.ResponseKind.NEEDS_SPACE:
            assert response.description is not None
            # The sender never writes into a destination it answered NEEDS_SPACE to; it
            # will not describe the tensor again either.
            pending.announced = False
            pending.expected = response.description
            self._drop_destination(pending)
            destination = await self._provide(pending, pool, response.description.nbytes)
            self._counts["re_requests"] += 1
            pending.check()
            pending.announced = True
            await self.qp.send(wire.encode_re_request(pending.req_id, destination))
            response = await pending.next_response()
        if response.kind == wire.ResponseKind.ERROR:
            pending.finished = True
            raise errors.from_status(response.code, response.message)
        description = response.description
        if description is None or response.kind == wire.ResponseKind.NEEDS_SPACE:
            raise wire.ProtocolError(f"unexpected {response.kind.name} response from the verbs peer")
        if cache_key is not None:
            self._remember(cache_key, description)
        if response.kind == wire.ResponseKind.INLINE:
            pending.finished = True
            self._counts["inline"] += 1
            self._counts["bytes_received"] += description.nbytes
            value = np.frombuffer(response.payload, dtype=description.dtype).reshape(description.shape)
            return ReceivedTensor(value, description.meta, zero_copy=False)
        return await self._take_written(pending, description, copy)

    async def _take_written(
        self, pending: _Pending, description: wire.TensorDescription, copy: bool
    ) -> ReceivedTensor:
        # After WRITING: the completion (ring + eventfd), or the sender's ERROR, which
        # `_on_response` turns into this future's exception.
        completion = await pending.completion  # nothing else awaits it: a cancel may cancel it
        pending.finished = True  # the sender is done with the destination
        piece = pending.slice
        if piece is None or completion.byte_len != description.nbytes or description.nbytes > piece.nbytes:
            raise errors.DataLossError(
                f"the verbs peer wrote {completion.byte_len} bytes but described {description.nbytes}"
            )
        pending.slice = None
        self._budget.release(pending.budget)
        pending.budget = 0
        self._counts["written"] += 1
        self._counts["bytes_received"] += description.nbytes
        value = piece.array(description.dtype, description.shape)
        piece.release()  # from now on `value` (and its views) hold the memory
        if not copy:
            return ReceivedTensor(value, description.meta, zero_copy=True)
        if value.nbytes <= OFFLOAD_BYTES:
            return ReceivedTensor(value.copy(), description.meta, zero_copy=False)
        # The executor's work item would keep its arguments (and so the slice) alive
        # a little after the copy; hand the view over in a box the copy empties.
        box = [value]
        del value
        owned = await self._loop.run_in_executor(self.qp.pd.executor, _copy_out, box)
        return ReceivedTensor(owned, description.meta, zero_copy=False)

    async def _provide(self, pending: _Pending, pool: RegionPool, nbytes: int) -> wire.Destination:
        await self._budget.acquire(nbytes)
        pending.budget = nbytes
        pending.slice = await pool.allocate(nbytes)
        region = pending.slice.region
        await self.qp.expose(region)
        return wire.Destination(region.id, region.key, pending.slice.offset, pending.slice.nbytes)

    def _drop_destination(self, pending: _Pending) -> None:
        if pending.slice is not None:
            pending.slice.release()
            pending.slice = None
        if pending.budget:
            self._budget.release(pending.budget)
            pending.budget = 0

    def _quarantine(self, pending: _Pending) -> None:
        # The sender may still write into this slice: never give it back to the pool.
        if pending.slice is not None:
            self._quarantined += pending.slice.capacity
            logger.warning(
                "verbs endpoint: a %d-byte destination stays reserved; its sender (pid %d) may still write",
                pending.slice.capacity,
                self.qp.peer_pid,
            )
            pending.slice = None
        if pending.budget:
            self._budget.release(pending.budget)
            pending.budget = 0

    def _settle(self, pending: _Pending) -> None:
        """After `recv_tensor_into` returns or raises: free its destination when safe.

        May run twice for one request (from `close()` and from the request itself).
        """
        if pending.abandoned:
            return  # the dispatcher frees it when the sender answers
        if pending.finished or not pending.announced or self.qp.peer_gone:
            self._pending.pop(pending.req_id, None)
            self._drop_destination(pending)
            if pending.sent and not pending.finished and not self.qp.closed:
                self._send_cancel(pending.req_id)
            return
        if self.qp.closed:
            self._pending.pop(pending.req_id, None)
            self._quarantine(pending)
            return
        # Abandoned while the sender may write: cancel, keep the slice until it answers.
        pending.abandoned = True
        self._send_cancel(pending.req_id)

    def _send_cancel(self, req_id: int) -> None:
        with contextlib.suppress(errors.OpError):
            self.qp.send_nowait(wire.encode_cancel(req_id))

    def _remember(self, key: Hashable, description: wire.TensorDescription) -> None:
        self._descriptions[key] = description
        self._descriptions.move_to_end(key)
        if len(self._descriptions) > _DESCRIPTION_CACHE_ENTRIES:
            self._descriptions.popitem(last=False)

    # -- dispatch ------------------------------------------------------------------------

    def _on_message(self, data: bytes | memoryview) -> None:
        """Every message from the peer, as the queue pair reads it (no task switch)."""
        try:
            message = wire.decode_tensor_message(data)
            if isinstance(message, wire.Response):
                self._on_response(message)
            elif isinstance(message, wire.Request):
                self._on_request(message)
            elif isinstance(message, wire.ReRequest):
                serving = self._serving.get(message.req_id)
                if serving is not None and serving.re_request is not None and not serving.re_request.done():
                    serving.re_request.set_result(message.destination)
            elif isinstance(message, wire.Call | wire.CallCancel | wire.CallResult):
                self.calls.on_message(message)
            else:
                serving = self._serving.get(message.req_id)
                if serving is not None and serving.task is not None:
                    serving.cancel_requested = True
                    serving.task.cancel()
        except wire.ProtocolError as exc:  # raised on: the queue pair fails with it
            logger.error("verbs endpoint: dropping the queue pair to pid %d: %s", self.qp.peer_pid, exc)
            raise
        except Exception as exc:  # a bug: fail loudly, and fail the queue pair
            logger.exception("verbs endpoint: cannot handle a message")
            raise errors.InternalError(f"the verbs tensor endpoint failed: {exc!r}") from exc

    async def _watch(self) -> None:
        """Wait for the queue pair to fail (messages arrive through `_on_message`)."""
        try:
            while True:
                await self.qp.recv()  # returns nothing while `_on_message` takes them
        except errors.OpError as exc:
            self._on_queue_pair_failed(exc)

    def _on_completion(self, completion: WorkCompletion) -> None:
        # A failing queue pair reaches `_watch` too: its failure is handled there.
        pending = self._pending.get(completion.wr_id)
        if pending is None:
            return
        if pending.abandoned:
            self._forget(pending)  # the write is over: the slice is free
            return
        if not pending.completion.done():
            pending.completion.set_result(completion)
        if completion.imm_data == wire.IMM_AS_EXPECTED and not pending.writing:
            if pending.expected is None:
                pending.fail(wire.ProtocolError("the verbs peer wrote a tensor it never described"))
                return
            # No WRITING comes: the description we expected holds.
            pending.writing = True
            self._counts["described_in_advance"] += 1
            pending.deliver(wire.Response(pending.req_id, wire.ResponseKind.WRITING, pending.expected))

    def _on_response(self, response: wire.Response) -> None:
        pending = self._pending.get(response.req_id)
        if pending is None:
            return  # a late answer to a request that already settled
        if response.kind == wire.ResponseKind.WRITING:
            pending.writing = True
        elif pending.writing and response.kind == wire.ResponseKind.ERROR:
            # The write failed instead of completing: the sender will not write now.
            if pending.abandoned:
                self._forget(pending)
            elif not pending.completion.done():
                pending.finished = True
                pending.completion.set_exception(errors.from_status(response.code, response.message))
                pending.completion.exception()  # retrieved: the receiver may be gone already
            return
        if pending.abandoned:
            if not pending.writing:  # NEEDS_SPACE or a final answer: no write there now
                self._forget(pending)
            return
        pending.deliver(response)

    def _forget(self, pending: _Pending) -> None:
        """An abandoned request got its final answer: free its destination."""
        self._pending.pop(pending.req_id, None)
        self._drop_destination(pending)
        self._settled.set()

    def _on_queue_pair_failed(self, error: errors.OpError) -> None:
        if self._error is None:
            self._error = error
        for pending in list(self._pending.values()):
            if pending.abandoned:
                self._pending.pop(pending.req_id)
                if self.qp.peer_gone:
                    self._drop_destination(pending)
                else:
                    self._quarantine(pending)
            else:
                pending.fail(error)
        for serving in self._serving.values():
            if serving.task is not None:
                serving.task.cancel()
        self.calls.fail(error)
        self._settled.set()
        self._done.set()

    # -- serving -----------------------------------------------------------------------

    def _on_request(self, request: wire.Request) -> None:
        if request.req_id in self._serving:
            raise wire.ProtocolError(f"the peer reused request id {request.req_id}")
        serving = _Serving(request.req_id)
        self._serving[request.req_id] = serving
        serving.task = self._spawn(self._serve(serving, request))

    async def _serve(self, serving: _Serving, request: wire.Request) -> None:
        req_id = request.req_id
        try:
            try:
                if self._source is None:
                    raise errors.UnimplementedError("this verbs endpoint serves no tensors")
                reply = await self._source(request.header)
                value, meta = (reply.value, reply.meta) if isinstance(reply, TensorReply) else (reply, b"")
                if not isinstance(value, np.ndarray):
                    raise errors.InternalError(
                        f"the tensor source returned {type(value).__name__}, not an array"
                    )
                if len(meta) > _MAX_META_BYTES:
                    raise errors.InvalidArgumentError(f"tensor meta is limited to {_MAX_META_BYTES} bytes")
                description = wire.describe(value, meta)
                if description.nbytes <= self._inline_limit:
                    payload = value.tobytes(order="C")
                    await self._reply(
                        wire.encode_response(req_id, wire.ResponseKind.INLINE, description, payload)
                    )
                else:
                    await self._write(serving, request, value, description)
                self._counts["served"] += 1
                self._counts["bytes_served"] += description.nbytes
            except asyncio.CancelledError:
                if not serving.cancel_requested:
                    raise  # the endpoint is closing; the peer will see EOF
                await self._reply(
                    wire.encode_error(req_id, errors.CANCELLED, "the receiver cancelled the request")
                )
            except Exception as exc:
                code, message = errors.to_status(exc)
                await self._reply(wire.encode_error(req_id, code, message))
        finally:
            self._serving.pop(req_id, None)

    async def _write(
        self,
        serving: _Serving,
        request: wire.Request,
        value: NDArray[Any],
        description: wire.TensorDescription,
    ) -> None:
        req_id = serving.req_id
        destination = request.destination
        described = description == request.expected  # the receiver's metadata cache holds
        if destination.capacity < description.nbytes:
            described = True  # NEEDS_SPACE carries the description
            serving.re_request = self._loop.create_future()
            await self._reply(wire.encode_response(req_id, wire.ResponseKind.NEEDS_SPACE, description))
            destination = await serving.re_request
            if destination.capacity < description.nbytes:
                raise errors.InvalidArgumentError(
                    f"the receiver offered {destination.capacity} bytes for a tensor of {description.nbytes}"
                )
        if not described:
            # The description first: once the bytes land, the completion is all the
            # receiver needs (an error from here on is answered with ERROR by `_serve`).
            await self._reply(wire.encode_response(req_id, wire.ResponseKind.WRITING, description))
        if description.nbytes > _STALL_BYTES:
            await asyncio.sleep(0)  # what was queued with this request goes first
        await self.qp.write(
            destination.region_id,
            destination.key,
            destination.offset,
            value,
            wr_id=req_id,
            imm_data=wire.IMM_AS_EXPECTED if described else wire.IMM_WRITING_SENT,
        )

    async def _reply(self, message: bytes) -> None:
        with contextlib.suppress(errors.OpError):  # the receiver is gone: nobody to tell
            await self.qp.send(message)

    # -- lifecycle -----------------------------------------------------------------------

    def statistics(self) -> EndpointStatistics:
        counts = self._counts
        return EndpointStatistics(
            requests=counts["requests"],
            inline=counts["inline"],
            written=counts["written"],
            re_requests=counts["re_requests"],
            failed=counts["failed"],
            bytes_received=counts["bytes_received"],
            bytes_in_flight=self._budget.in_use,
            peak_bytes_in_flight=self._budget.peak,
            max_bytes_in_flight=self._budget.limit,
            quarantined_bytes=self._quarantined,
            served=counts["served"],
            bytes_served=counts["bytes_served"],
            described_in_advance=counts["described_in_advance"],
            calls_made=self.calls.made,
            calls_served=self.calls.served,
        )

    async def close(self) -> None:
        """Close the endpoint and its queue pair (see the class docstring)."""
        if self._closing:
            await self._done.wait()
            return
        self._closing = True
        closing = errors.UnavailableError("the verbs tensor endpoint is closed")
        for pending in list(self._pending.values()):
            pending.fail(closing)
            self._settle(pending)  # frees what the sender cannot touch, CANCELs the rest
        self.calls.fail(closing)  # at once, like the receives
        # Give the sender a moment to answer the CANCELs, so destinations can be reused.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._close_timeout):
                while any(p.abandoned for p in self._pending.values()) and self._error is None:
                    self._settled.clear()
                    await self._settled.wait()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.qp.close()
        self._on_queue_pair_failed(closing)

    async def __aenter__(self) -> TensorEndpoint:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _copy_out(box: list[NDArray[Any]]) -> NDArray[Any]:
    return np.array(box.pop())


class TensorServer:
    """Serves tensors from `source` to every peer that connects. Create with `await TensorServer.start(...)`.

    Contract:
        * `address` is the listener address to send to receivers (over the control
          plane); each accepted queue pair gets a `TensorEndpoint` serving `source`.
        * Endpoints whose peer went away are closed and dropped.
        * `await close()` closes the listener and every endpoint. Idempotent.
    """

    def __init__(
        self,
        listener: QueuePairAcceptor,
        source: TensorSource,
        call_handler: CallHandler | None,
        options: dict[str, Any],
    ) -> None:
        self._listener = listener
        self.address = listener.address
        self._source = source
        self._call_handler = call_handler
        self._options = options
        self._endpoints: set[TensorEndpoint] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._spawn(self._accept_loop())

    @classmethod
    async def start(
        cls,
        pd: ProtectionDomain,
        source: TensorSource,
        *,
        call_handler: CallHandler | None = None,
        address: str | None = None,
        cq_depth: int = DEFAULT_CQ_DEPTH,
        max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT,
        inline_limit: int = DEFAULT_INLINE_LIMIT,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
    ) -> TensorServer:
        """Listen at `address` (None: a fresh abstract address) and serve `source` (and
        `call_handler`, the peers' control calls)."""
        listener = await listen(pd, address, cq_depth=cq_depth)
        options = {
            "max_bytes_in_flight": max_bytes_in_flight,
            "inline_limit": inline_limit,
            "close_timeout": close_timeout,
        }
        return cls(listener, source, call_handler, options)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def endpoints(self) -> tuple[TensorEndpoint, ...]:
        """The live endpoints, one per connected receiver."""
        return tuple(self._endpoints)

    async def _accept_loop(self) -> None:
        try:
            async for qp in self._listener:
                endpoint = TensorEndpoint(
                    qp, source=self._source, call_handler=self._call_handler, **self._options
                )
                self._endpoints.add(endpoint)
                self._spawn(self._reap(endpoint))
        except errors.UnavailableError as exc:  # the listener failed (it logged why)
            logger.error("verbs tensor server stopped accepting: %s", exc)

    async def _reap(self, endpoint: TensorEndpoint) -> None:
        await endpoint.wait_closed()
        await endpoint.close()
        self._endpoints.discard(endpoint)

    async def close(self) -> None:
        """Close the listener and every endpoint (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await self._listener.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for endpoint in list(self._endpoints):
            await endpoint.close()
        self._endpoints.clear()

    async def __aenter__(self) -> TensorServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
