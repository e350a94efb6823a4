"""A new channel to a task that came back after an earlier channel failed to reach it."""

from __future__ import annotations

import asyncio

import pytest

from distserver import errors
from distserver.protos.services import WORKER_SERVICE
from distserver.protos.worker_pb2 import GetStatusRequest
from distserver.testing.cluster import LocalCluster
from distserver.transports import get_transport


@pytest.mark.parametrize("protocol", ["grpc", "grpc+verbs"])
async def test_a_new_channel_reaches_a_restarted_task_that_an_open_channel_found_down(protocol: str) -> None:
    # A coordinator keeps its channel to a task that died; the task comes back at the
    # same address; a channel opened now must reach it on its first call, not inherit
    # the old channel's "connection refused" (gRPC core shares connection state).
    transport = get_transport(protocol)
    with LocalCluster({"worker": 1}, protocol=protocol) as local:
        address = local.cluster["worker"][0]
        await asyncio.to_thread(local.kill, "worker")
        old = transport.connect(address)
        try:
            with pytest.raises(errors.UnavailableError):
                await old.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=5)
            await asyncio.to_thread(local.restart, "worker")
            new = transport.connect(address)
            try:
                status = await new.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=5)
                assert status.device_attributes
            finally:
                await new.close()
        finally:
            await old.close()
