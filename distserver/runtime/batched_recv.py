"""Batched receives: the values one step needs from one distserver task, in few calls.

Without this, every `_Recv` of a remote value makes its own RecvTensor call; a
training step with 60 small variables on a ps makes about 120 of them (the worker
pulls 60 reads, the ps pulls 60 gradients), and over gRPC each costs a round trip
and ~0.2 ms of CPU per side.

The receiving side (`BatchedReceiver`): `_Recv`s that ask for values of the same
step from the same task in one turn of the event loop (an executor starts every
`_Recv` of a partition at once) are gathered into one `RecvTensors` call
(`distserver.protos.services.TENSOR_SERVICE`). The sending side (`answer`) waits
until at least one of the asked keys has been sent and returns every value sent by
then: the executor sends a pass's values before the loop wakes the request, so
those sent with the first come along (no loop turn more: one would let a large copy
or the task's own receives go first); the receiver delivers those and asks again
for the rest. A call never waits for a value that is not ready while another one
is, so no key waits behind another (no new dependencies between values, hence no
deadlock), and keys that arrive while a call is out go in a call of their own. A
turn's batches are asked for before its values fetched one by one (`_start`).

Except when the receiver goes on only once every receive is in: a partition the
planner marked (`plan.mark_receives_first`: no receive of it waits, through other
tasks, for a node that uses a received value). Its receives come `together`, and
their batch is a `RecvAllTensors` call, answered once every key asked for is sent:
holding a value back then makes nothing wait that would not wait anyway, and the
values a sender computes after the first ones are ready come in the same answer
instead of a second call's (an `embedding` worker's rows, after the ps's variable
reads: one round trip a step less).

Large values (over the transport's `batched_value_bytes`: 1 MiB over grpc and
grpc+verbs; never over `PUSH_LIMIT_BYTES`) and dead ones are answered "ready, fetch it
with RecvTensor": the transports move big tensors better (grpc+verbs through shared
memory), and RecvTensor says a value is dead. A peer without the method (TensorFlow)
answers UNIMPLEMENTED; it then gets plain RecvTensors for good. A key once answered
"fetch it" is fetched with RecvTensor right away in later steps (rendezvous keys do
not name the step), saving the batch's round trip before the fetch.

Budgets: at most `MAX_BATCH_KEYS` keys per call (checked before anything is
waited for), and at most `BATCH_RESPONSE_BYTES` of values per response (the rest
are left for the next call). Failure: the step's error on the sender, or the call's
(an UnavailableError when the peer dies, a DeadlineExceededError after the receive
timeout), fails every receive of the batch.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from distserver import errors
from distserver.devices import RendezvousKey
from distserver.runtime.push import PUSH_LIMIT_BYTES
from distserver.runtime.rendezvous import StepRendezvous
from distserver.tensors import tensor_nbytes

logger = logging.getLogger(__name__)

# How many keys answered "fetch it with RecvTensor" a receiver remembers.
REMEMBERED_KEYS = 4096
# Keys one RecvTensors call may ask for.
MAX_BATCH_KEYS = 1024
# Bytes of values one response carries (each value at most PUSH_LIMIT_BYTES).
BATCH_RESPONSE_BYTES = 4 << 20

# What `answer` returns for a key that is ready but must be fetched with RecvTensor.
FETCH_SEPARATELY: Any = None

# (step_id, keys, every) -> {key text: value, or FETCH_SEPARATELY} for some of the
# keys (RecvTensors), or for all of them up to the response's budget when `every`
# (RecvAllTensors).
BatchCall = Callable[[int, list[str], bool], Awaitable[dict[str, Any]]]
# (step_id, key) -> (value, is_dead) with a plain RecvTensor.
SingleFetch = Callable[[int, RendezvousKey], Awaitable[tuple[Any, bool]]]


async def answer(
    rendezvous: StepRendezvous,
    keys: list[RendezvousKey],
    value_limit: int = PUSH_LIMIT_BYTES,
    every: bool = False,
) -> dict[str, Any]:
    """The sending side: once some of `keys` are sent here (all of them with `every`),
    those values (by key text).

    Each is the value, or `FETCH_SEPARATELY` for a dead one or one over `value_limit`
    bytes (the transport's `batched_value_bytes`, at most `PUSH_LIMIT_BYTES`). Raises the
    step's error if it failed. The caller has checked `len(keys) <= MAX_BATCH_KEYS`.
    """
    slots = rendezvous.slots(keys)
    if every:  # (a failing step makes every slot done)
        pending = [(key, slot) for key, slot in zip(keys, slots, strict=True) if not slot.done()]
        while pending:
            await rendezvous.wait_for_any([key for key, _ in pending])
            pending = [(key, slot) for key, slot in pending if not slot.done()]
    elif not any(slot.done() for slot in slots):
        await rendezvous.wait_for_any(keys)
    ready: dict[str, Any] = {}
    budget = BATCH_RESPONSE_BYTES
    for key, slot in zip(keys, slots, strict=True):
        if not slot.done():
            continue
        value, is_dead = slot.result()  # raises the step's error
        if is_dead:
            ready[key.text] = FETCH_SEPARATELY
            continue
        nbytes = tensor_nbytes(value)
        if nbytes > value_limit:
            ready[key.text] = FETCH_SEPARATELY
        elif nbytes <= budget or not ready:
            ready[key.text] = value
            budget -= nbytes
    return ready


@dataclass
class _Batch:
    """Receives of one step from one task, asked for in the same call."""

    task: str
    step_id: int
    waiting: dict[str, tuple[RendezvousKey, asyncio.Future[tuple[Any, bool]]]] = field(default_factory=dict)
    runner: asyncio.Task[None] | None = None
    # Whether every receive of the batch came `together` (then one call asks for all).
    every: bool = True

    def abandoned(self) -> bool:
        return all(future.done() for _, future in self.waiting.values())

    def give_up(self, receive: asyncio.Future[tuple[Any, bool]]) -> None:
        """A done callback of each receive: when it was cancelled, stop asking once
        nobody waits for the rest. (Taken off a receive before its value is delivered:
        a callback scheduled costs ~0.6 us, and a batch brings dozens of values.)"""
        if receive.cancelled() and self.runner is not None and self.abandoned():
            self.runner.cancel()


def _stop_when_given_up(fetching: asyncio.Task[None], receive: asyncio.Future[tuple[Any, bool]]) -> None:
    if receive.cancelled():
        fetching.cancel()


class BatchedReceiver:
    """The receiving side: gathers the remote receives of a step per sending task.

    `batch_call(task)` gives the task's RecvTensors call; `fetch_one` is the plain
    RecvTensor fetch, for values answered `FETCH_SEPARATELY` and for peers without
    the method.
    """

    def __init__(self, batch_call: Callable[[str], BatchCall], fetch_one: SingleFetch) -> None:
        self._batch_call = batch_call
        self._fetch_one = fetch_one
        # This turn's receives, started together by `_start`.
        self._gathering: dict[tuple[str, int], _Batch] = {}
        self._separate: list[tuple[int, RendezvousKey, asyncio.Future[tuple[Any, bool]]]] = []
        # (task, every): the method of such batches (`_Batch.every`) has answered there.
        self._batching_peers: set[tuple[str, bool]] = set()
        self._plain_peers: set[str] = set()  # answered UNIMPLEMENTED
        self._fetched_separately: set[str] = set()  # keys once answered FETCH_SEPARATELY
        self._tasks: set[asyncio.Task[Any]] = set()

    async def fetch(self, step_id: int, key: RendezvousKey) -> tuple[Any, bool]:
        """The value of `key` in step `step_id` from its sending task."""
        return await self.fetch_soon(step_id, key)

    def fetch_soon(
        self, step_id: int, key: RendezvousKey, together: bool = False
    ) -> asyncio.Future[tuple[Any, bool]]:
        """`fetch` as a future the caller owns: cancelling it gives up this receive (and
        the batch's call once no receive waits on it). `together`: the caller goes on
        only once all its receives are in, so the sender may answer this one with the
        others (a batch of such receives only is a `RecvAllTensors` call)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[Any, bool]] = loop.create_future()
        if not self._gathering and not self._separate:
            loop.call_soon(self._start)
        if key.src_task in self._plain_peers or key.text in self._fetched_separately:
            self._separate.append((step_id, key, future))
            return future
        batch = self._gathering.get((key.src_task, step_id))
        if batch is None:
            batch = self._gathering[(key.src_task, step_id)] = _Batch(key.src_task, step_id)
        batch.every = batch.every and together
        entry = batch.waiting.get(key.text)
        if entry is not None:  # received twice in one step (no graph of ours does that)
            return asyncio.shield(entry[1])
        batch.waiting[key.text] = (key, future)
        future.add_done_callback(batch.give_up)
        return future

    def _start(self) -> None:
        """Ask for this turn's receives: the batches first (the small values a peer's
        first nodes wait for; a request sent first is served first), then the values
        fetched one by one (large ones, whose copy holds the sender's loop)."""
        batches, self._gathering = list(self._gathering.values()), {}
        separate, self._separate = self._separate, []
        for batch in batches:
            batch.runner = self._spawn(self._run(batch))
        for step_id, key, future in separate:
            if future.done():  # given up meanwhile
                continue
            fetching = self._spawn(self._fetch_into(step_id, key, future))
            future.add_done_callback(functools.partial(_stop_when_given_up, fetching))

    def _spawn(self, coroutine: Awaitable[Any]) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _run(self, batch: _Batch) -> None:
        call = self._batch_call(batch.task)
        waiting = batch.waiting
        try:
            while True:
                for text in [text for text, (_, future) in waiting.items() if future.done()]:
                    del waiting[text]
                if not waiting:
                    return
                keys = list(waiting)[:MAX_BATCH_KEYS]
                try:
                    values = await call(batch.step_id, keys, batch.every)
                except errors.UnimplementedError:
                    if (batch.task, batch.every) in self._batching_peers:
                        raise  # the step's own error (a peer that answered knows the method)
                    self._plain_peers.add(batch.task)
                    logger.debug("%s has no RecvTensors: plain RecvTensor from now on", batch.task)
                    for key, future in list(waiting.values()):
                        self._spawn(self._fetch_into(batch.step_id, key, future))
                    return
                self._batching_peers.add((batch.task, batch.every))
                delivered = 0
                for text, value in values.items():
                    entry = waiting.pop(text, None)
                    if entry is None:
                        continue  # not asked for: ignored
                    delivered += 1
                    key, future = entry
                    if value is FETCH_SEPARATELY:
                        if len(self._fetched_separately) >= REMEMBERED_KEYS:
                            self._fetched_separately.clear()
                        self._fetched_separately.add(text)
                        self._spawn(self._fetch_into(batch.step_id, key, future))
                    elif not future.done():
                        future.remove_done_callback(batch.give_up)
                        future.set_result((value, False))
                if not delivered:
                    raise errors.InternalError(
                        f"RecvTensors from {batch.task} for step {batch.step_id} answered none of "
                        f"the {len(keys)} keys asked for"
                    )
        except Exception as exc:  # (an OpError, or a bug here: the receives fail, not hang)
            for _, future in waiting.values():
                if not future.done():
                    future.set_exception(exc)
        except asyncio.CancelledError:
            for _, future in waiting.values():
                future.cancel()
            raise

    async def _fetch_into(
        self, step_id: int, key: RendezvousKey, future: asyncio.Future[tuple[Any, bool]]
    ) -> None:
        try:
            result = await self._fetch_one(step_id, key)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(result)
