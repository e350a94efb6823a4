"""Worker sessions: those of a master that restarted are dropped when its new incarnation
shows up; a session's graphs are built off the event loop, one at a time."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import distserver as ds
from distserver import errors
from distserver.protos import worker_pb2 as w

MASTER = "/job:worker/replica:0/task:0"


async def _create(worker, handle: str, master_task: str = "", incarnation: int = 0) -> None:
    request = w.CreateWorkerSessionRequest(
        session_handle=handle, master_task=master_task, master_incarnation=incarnation
    )
    await worker.call("CreateWorkerSession", request)


async def _has_session(worker, handle: str) -> bool:
    request = w.DeregisterGraphRequest(
        session_handle=handle, create_worker_session_called=True, graph_handle="x"
    )
    try:
        await worker.call("DeregisterGraph", request)
    except errors.AbortedError as exc:
        if "Session handle is not found" not in exc.message:
            raise
        return False
    return True


async def test_a_restarted_master_takes_the_place_of_its_old_incarnation():
    async with ds.AsyncServer({"ps": ["localhost:0"]}, "ps", 0) as server:
        worker = server.worker
        await _create(worker, "old-1", MASTER, 11)
        await _create(worker, "old-2", MASTER, 11)
        await _create(worker, "other-master", "/job:worker/replica:0/task:1", 5)
        await _create(worker, "tf-1.x-master")  # says nothing about its master: never dropped
        assert all([await _has_session(worker, h) for h in ("old-1", "old-2", "other-master")])

        await _create(worker, "new", MASTER, 12)  # the same task, restarted

        assert not await _has_session(worker, "old-1")
        assert not await _has_session(worker, "old-2")
        for kept in ("new", "other-master", "tf-1.x-master"):
            assert await _has_session(worker, kept), kept


@pytest.mark.parametrize("incarnation", [11, 0])
async def test_more_sessions_of_the_same_incarnation_keep_each_other(incarnation):
    async with ds.AsyncServer({"ps": ["localhost:0"]}, "ps", 0) as server:
        await _create(server.worker, "a", MASTER, incarnation)
        await _create(server.worker, "b", MASTER, incarnation)
        assert await _has_session(server.worker, "a")


async def test_graphs_are_built_in_a_thread_one_at_a_time_per_session(monkeypatch):
    # A graph of 30,000 nodes takes over a second to build: not on the event loop. Two
    # graphs of one session share its stateful kernels, so they are built in turn.
    from distserver.runtime import worker as worker_module

    built: list[tuple[int, float, float]] = []  # (thread, start, end) of each build
    real_executor = worker_module.Executor

    def recording_executor(*args):
        start = time.perf_counter()
        executor = real_executor(*args)
        built.append((threading.get_ident(), start, time.perf_counter()))
        return executor

    monkeypatch.setattr(worker_module, "Executor", recording_executor)
    graph = ds.Graph()
    with graph.as_default():
        h = ds.placeholder(ds.float32, [2, 2], name="x")
        for _ in range(800):
            h = ds.tanh(ds.matmul(h, ds.constant([[0.5, 0.0], [0.0, 0.5]])))
    request = w.RegisterGraphRequest(graph_def=graph.as_graph_def())
    async with ds.AsyncServer({"ps": ["localhost:0"]}, "ps", 0) as server:
        await asyncio.gather(*(server.worker.call("RegisterGraph", request) for _ in range(2)))
    assert len(built) == 2
    assert threading.get_ident() not in {thread for thread, _, _ in built}
    first, second = sorted(built, key=lambda b: b[1])
    assert first[2] <= second[1], "the second build started before the first ended"
