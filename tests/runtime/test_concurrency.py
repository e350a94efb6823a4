"""Tasks cancelled before they start leave no coroutine un-awaited (which warns, and fails CI)."""

from __future__ import annotations

import asyncio
import gc
import inspect
import warnings

import pytest

from distserver.protos.graph_pb2 import GraphDef
from distserver.runtime.concurrency import gather_all
from distserver.runtime.master import _Partition
from distserver.server import AsyncServer

LOCAL = {"localhost": ["localhost:0"]}


async def test_gather_all_closes_a_call_cancelled_before_it_started():
    outer = asyncio.current_task()

    async def cancels_every_other_task() -> None:
        # As a loop shutting down does (asyncio.run cancels every task left): the
        # second call's task is cancelled before it has run a step.
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task() and task is not outer:
                task.cancel()

    async def never_started() -> None:
        await asyncio.sleep(0)

    second = never_started()
    with pytest.raises(asyncio.CancelledError):
        await gather_all([cancels_every_other_task(), second])
    assert inspect.getcoroutinestate(second) == inspect.CORO_CLOSED


async def test_a_step_cleanup_cancelled_as_the_server_stops_leaves_no_call_unawaited():
    async with AsyncServer(LOCAL) as server:
        master = server.master
        assert master is not None
        task = "/job:localhost/replica:0/task:0"
        part = _Partition(task, master._worker(task), "no-graph", GraphDef(), [], [])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            master._send_cleanup(part, step_id=1)
            await master.close()  # cancels the cleanup before it has started
            gc.collect()
        assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []
