"""The rendezvous table keeps no step that is not running for longer than its idle bound."""

from __future__ import annotations

import asyncio
import gc
import weakref

import numpy as np
import pytest

from distserver import errors
from distserver.devices import RendezvousKey
from distserver.runtime.rendezvous import RendezvousTable

HERE = "/job:ps/replica:0/task:0"
THERE = "/job:worker/replica:0/task:0"
TO_THERE = RendezvousKey(f"{HERE}/device:CPU:0", 1, f"{THERE}/device:CPU:0", "x:0")
LOCAL = RendezvousKey(f"{HERE}/device:CPU:0", 1, f"{HERE}/device:CPU:0", "y:0")
IDLE = 0.05


async def _until_empty(table: RendezvousTable) -> None:
    async with asyncio.timeout(10):
        while len(table):  # noqa: ASYNC110 - dropping is a loop timer, there is no event to wait on
            await asyncio.sleep(0.01)


async def test_a_receive_for_a_step_that_never_runs_fails_and_leaves_nothing():
    table = RendezvousTable(HERE, idle_seconds=IDLE)
    waiting = asyncio.ensure_future(table.find_or_create(7).recv_local(TO_THERE))
    with pytest.raises(errors.AbortedError, match="Step 7 was dropped on /job:ps/replica:0/task:0"):
        async with asyncio.timeout(10):
            await waiting
    assert len(table) == 0


async def test_a_running_step_is_kept_however_long_it_runs():
    table = RendezvousTable(HERE, idle_seconds=IDLE)
    table.find_or_create(7)  # a receive came first
    step = table.start(7)
    await asyncio.sleep(4 * IDLE)  # longer than the idle bound: the step must still be here
    assert len(table) == 1
    step.send(LOCAL, np.float32(1))
    assert await step.recv_local(LOCAL) == (1.0, False)
    assert table.release_if_done(7, set())
    assert len(table) == 0


async def test_a_finished_step_whose_value_nobody_fetches_is_dropped():
    table = RendezvousTable(HERE, idle_seconds=IDLE)
    step = table.start(3)
    step.send(TO_THERE, np.zeros(4, np.float32))  # for another task, which never asks
    assert not table.release_if_done(3, set())
    await _until_empty(table)


async def test_a_failed_step_pins_no_request_and_is_dropped_without_cleanup():
    table = RendezvousTable(HERE, idle_seconds=IDLE)
    step = table.start(5)
    receiver = asyncio.ensure_future(step.recv_local(TO_THERE))

    class Feeds:  # stands for the request and feeds a failing RunGraph holds in its frames
        pass

    async def fail() -> None:
        feeds = Feeds()  # noqa: F841 - a local of the failing frame
        raise errors.InvalidArgumentError("bad feed")

    try:
        await fail()
    except errors.OpError as exc:
        table.failed(5, exc)
    with pytest.raises(errors.InvalidArgumentError, match="bad feed"):
        await receiver
    del receiver
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, Feeds)]
    await _until_empty(table)


async def test_a_value_another_task_took_is_let_go_and_cannot_be_taken_again():
    table = RendezvousTable(HERE, idle_seconds=IDLE)
    step = table.start(9)
    value = np.arange(4, dtype=np.float32)
    watch = weakref.ref(value)
    step.send(TO_THERE, value)
    taken, is_dead = await step.recv_local(TO_THERE)
    assert taken is value
    assert not is_dead
    table.served(9, TO_THERE)
    del value, taken
    gc.collect()
    assert watch() is None  # the running step no longer holds it (a ps may update it in place)
    with pytest.raises(errors.InternalError, match="already received in step 9"):
        await step.recv_local(TO_THERE)
    assert table.release_if_done(9, set())
