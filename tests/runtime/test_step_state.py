"""Finished steps leave no rendezvous state behind on any task (no leak per step)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import distserver as ds
from distserver.testing import free_ports


@pytest.mark.parametrize("size", [16, 2 << 20], ids=["pushed-in-response", "withheld-then-fetched"])
async def test_no_step_state_is_left_on_either_task(size):
    ports = free_ports(2)
    cluster = {"ps": [f"localhost:{ports[0]}"], "worker": [f"localhost:{ports[1]}"]}
    ps = ds.AsyncServer(cluster, "ps", 0)
    worker = ds.AsyncServer(cluster, "worker", 0)
    await ps.start()
    await worker.start()
    try:
        graph = ds.Graph()
        with graph.as_default():
            with ds.device("/job:ps/task:0"):
                v = ds.Variable(np.ones(size // 4, np.float32), name="v")
                read = v.read_value()
                x = ds.placeholder(ds.float32, shape=[], name="x")
                fed_on_ps = x * 2.0
            with ds.device("/job:worker/task:0"):
                first = read[0] + fed_on_ps  # ps -> worker (pushed or fetched), worker -> ps (feed)
                back = ds.identity(first)
            with ds.device("/job:ps/task:0"):
                round_trip = back * 1.0  # worker -> ps: a partition that receives
        async with ds.AsyncSession(worker.target, graph=graph) as session:
            await session.run(v.initializer)
            for step in range(20):
                assert await session.run(round_trip, feed_dict={x: float(step)}) == 1.0 + 2.0 * step
                assert await session.run(first, feed_dict={x: 0.0}) == 1.0
        # CleanupGraph notifications run in the background: poll, bounded.
        for _ in range(200):
            if len(ps.worker._rendezvous) == 0 and len(worker.worker._rendezvous) == 0:
                break
            await asyncio.sleep(0.01)
        assert len(ps.worker._rendezvous) == 0
        assert len(worker.worker._rendezvous) == 0
    finally:
        await worker.stop()
        await ps.stop()
