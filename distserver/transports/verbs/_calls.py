"""Control calls over a queue pair: WorkerService calls between two distserver tasks
on one host, as SEND messages on the queue pair's socket (`QueuePairCalls`).

Why: a gRPC message costs its sender ~60 µs of loop time and its receiver two thread
hand-offs (grpc's poller thread, then the event loop); a RunGraph took ~130-185 µs
from the master's send to the worker's handler, on the critical path of every step.
A SEND is read by the peer's event loop itself. A grpc+verbs channel's first
WorkerService call to a same-host distserver peer sets the queue pair up
(`VerbsTensorPath.carry_call`), so its calls ride it from the start; TensorFlow
peers, peers on another host or namespace, and calls larger than `MAX_CALL_BYTES`
use gRPC.

Semantics match a unary call: the remote handler's error arrives as its `OpError`
class and message; a deadline gives DeadlineExceededError and cancels the remote
handler (CALL_CANCEL), as does cancelling the caller; a queue pair that fails (the
peer died or closed) fails every waiting call with its UnavailableError.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from distserver import errors
from distserver.transports.base import wait_for_answer
from distserver.transports.verbs import _wire as wire
from distserver.transports.verbs._qp import QueuePair

__all__ = ["CallHandler", "QueuePairCalls"]

CallHandler = Callable[[str, bytes], Awaitable[bytes]]
"""Runs one call (method path, serialized request) and returns the serialized
response; raises an OpError (or any exception, sent as UnknownError)."""


class QueuePairCalls:
    """Both sides of control calls over one queue pair.

    `await call(path, payload, timeout=, name=)` runs `path` on the peer; `handler`
    (optional) serves the peer's calls, each in a task made by `spawn` (the owner
    cancels them on close). The owner feeds every CALL* message to `on_message` and
    reports a failed queue pair to `fail`. `made` / `served` count calls.
    """

    def __init__(
        self,
        qp: QueuePair,
        handler: CallHandler | None,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        self._qp = qp
        self._handler = handler
        self._spawn = spawn
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[asyncio.Future[bytes], list[bytes | memoryview]]] = {}
        self._serving: dict[int, asyncio.Task[None]] = {}
        self._cancelled_by_peer: set[int] = set()
        self._error: errors.OpError | None = None
        self.made = 0
        self.served = 0

    async def call(self, path: str, payload: bytes, *, timeout: float | None, name: str) -> bytes:
        """The peer's serialized response to `payload` (see the module docstring);
        `name` (e.g. "RunGraph to grpc://host:port") starts the errors raised here."""
        if self._error is not None:
            raise self._error
        call_id = next(self._ids)
        self.made += 1
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = (future, [])
        try:
            self._qp.send_nowait(*wire.encode_call(call_id, path, payload))
            return await wait_for_answer(
                future, timeout, lambda: self._cancel(call_id), f"{name} failed: Deadline Exceeded"
            )
        finally:
            self._waiting.pop(call_id, None)

    def _cancel(self, call_id: int) -> None:
        with contextlib.suppress(errors.OpError):
            self._qp.send_nowait(wire.encode_call_cancel(call_id))

    def on_message(self, message: wire.Call | wire.CallCancel | wire.CallResult) -> None:
        if isinstance(message, wire.CallResult):
            entry = self._waiting.get(message.call_id)
            if entry is None or entry[0].done():
                return  # answered after the caller gave up
            future, pieces = entry
            pieces.append(message.body)
            if message.more:
                return
            if message.code == errors.OK:
                future.set_result(b"".join(pieces))  # (the answer's one copy out of its messages)
            else:
                text = b"".join(pieces).decode("utf-8", "replace")
                future.set_exception(errors.from_status(message.code, text))
        elif isinstance(message, wire.Call):
            if message.call_id in self._serving:
                raise wire.ProtocolError(f"the peer reused call id {message.call_id}")
            self.served += 1
            self._serving[message.call_id] = self._spawn(self._answer(message))
        else:
            task = self._serving.get(message.call_id)
            if task is not None:
                self._cancelled_by_peer.add(message.call_id)
                task.cancel()

    async def _answer(self, call: wire.Call) -> None:
        try:
            if self._handler is None:
                raise errors.UnimplementedError("this verbs endpoint serves no calls")
            code, body = errors.OK, await self._handler(call.path, call.payload)
        except asyncio.CancelledError:
            if call.call_id not in self._cancelled_by_peer:
                raise  # we are closing: the caller sees the queue pair fail (UnavailableError)
            code, body = errors.CANCELLED, b"the call was cancelled"
        except Exception as exc:
            code, message = errors.to_status(exc)
            body = message.encode()
        finally:
            self._serving.pop(call.call_id, None)
            self._cancelled_by_peer.discard(call.call_id)
        with contextlib.suppress(errors.OpError):  # the caller is gone: nobody to tell
            for head, piece in wire.encode_call_result(call.call_id, code, body):
                self._qp.send_nowait(head, piece)

    def fail(self, error: errors.OpError) -> None:
        """The queue pair failed: every waiting call fails with `error`."""
        if self._error is None:
            self._error = error
        for future, _ in self._waiting.values():
            if not future.done():
                future.set_exception(error)
