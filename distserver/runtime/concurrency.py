"""Run coroutines together (the first real error wins and cancels the others), and keep
heavy work off the event loop."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any, TypeVar

from google.protobuf.message import Message

from distserver import errors
from distserver.protos.tensor_pb2 import TensorProto
from distserver.tensors import decode_elements, decode_tensors
from distserver.wire import TensorRequest, tensor_field

T = TypeVar("T")
MessageT = TypeVar("MessageT", bound=Message)

# Decoding more elements one by one than this (typed fields, padding) takes long
# enough (~1 ms and up) to stall every other call of the task: it runs in a thread.
INLINE_DECODE_ELEMENTS = 1 << 15


async def decode_message_tensors(protos: Sequence[TensorProto], *, what: str) -> list[Any]:
    """`tensors.decode_tensors` of a request's tensors, in a thread when it is heavy."""
    if decode_elements(protos) > INLINE_DECODE_ELEMENTS:
        return await asyncio.to_thread(decode_tensors, protos, what=what)
    return decode_tensors(protos, what=what)


async def request_tensors(
    request: MessageT | TensorRequest[MessageT], *, what: str
) -> tuple[MessageT, list[tuple[str, Any]]]:
    """A RunStep, RunCallable or RunGraph request's message and its tensors as (name,
    value) pairs (the name "" for RunCallable's bare `TensorProto`s): as the transport
    read them (`wire.TensorRequest`), else decoded from protobuf here."""
    if isinstance(request, TensorRequest):
        return request.message, request.tensors
    field = tensor_field(type(request))
    assert field is not None, type(request).__name__
    items: Any = getattr(request, field.name)
    if field.named:
        values = await decode_message_tensors([item.tensor for item in items], what=what)
        return request, list(zip((item.name for item in items), values, strict=True))
    return request, [("", value) for value in await decode_message_tensors(items, what=what)]


def first_error(group: BaseExceptionGroup[Any]) -> BaseException:
    """The error to report for a failed task group: an OpError before cancellations."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for exc in leaves:
        if isinstance(exc, errors.OpError) and not isinstance(exc, errors.CancelledError):
            return exc
    for exc in leaves:
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return leaves[0]


async def gather_all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Await all concurrently in a task group; results in order.

    The first failure cancels the rest and is raised as itself (not as an
    ExceptionGroup), preferring an OpError over the cancellations it caused.
    """
    items = list(awaitables)
    if len(items) == 1:  # the common single-partition step: no task, no group
        return [await items[0]]
    try:
        async with asyncio.TaskGroup() as group:
            # A coroutine becomes the task itself: wrapped, it would go un-awaited
            # (and warn) if the group were cancelled before the task started.
            tasks = [group.create_task(a if inspect.iscoroutine(a) else _as_coroutine(a)) for a in items]
    except BaseExceptionGroup as group_error:
        raise first_error(group_error) from None
    return [task.result() for task in tasks]


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable
