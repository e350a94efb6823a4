"""The grpc+verbs transport end to end: the shared-memory path is taken, fallbacks are loud."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.testing import free_ports
from distserver.transports import get_transport, register_transport
from distserver.transports.verbs import HOST_ID_OVERRIDE_ENV, VerbsTransport


def ps_to_worker_graph():
    graph = ds.Graph()
    with graph.as_default():
        with ds.device("/job:ps/task:0"):
            big = ds.range(0, 1 << 20, dtype=ds.int32)  # 4 MiB: written into worker memory
            scalar = ds.constant(3.5)
            words = ds.constant(np.array([b"not", b"plain", b"memory"], dtype=object))
        with ds.device("/job:worker/task:0"):
            total = ds.reduce_sum(ds.cast(big, ds.int64))
            doubled = scalar * 2.0
            echoed = ds.identity(words)
    return graph, [total, doubled, echoed]


async def start_cluster(protocol, *, ps_env=None, monkeypatch=None):
    ports = free_ports(2)
    cluster = {"ps": [f"localhost:{ports[0]}"], "worker": [f"localhost:{ports[1]}"]}
    if ps_env:
        for key, value in ps_env.items():
            monkeypatch.setenv(key, value)
    ps = ds.AsyncServer(cluster, "ps", 0, protocol=protocol)
    await ps.start()  # announces its (possibly overridden) host identity now
    if ps_env:
        for key in ps_env:
            monkeypatch.delenv(key)
    worker = ds.AsyncServer(cluster, "worker", 0, protocol=protocol)
    await worker.start()
    return ps, worker


async def run_steps(worker):
    graph, fetches = ps_to_worker_graph()
    async with ds.AsyncSession(worker.target, graph=graph) as session:
        for _ in range(3):
            total, doubled, echoed = await session.run(fetches)
    n = 1 << 20
    assert int(total) == n * (n - 1) // 2
    assert float(doubled) == 7.0
    assert echoed.tolist() == [b"not", b"plain", b"memory"]


def ps_channel_stats(worker):
    return worker._channels["/job:ps/replica:0/task:0"].statistics()


async def test_same_host_tensors_take_the_shared_memory_path():
    ps, worker = await start_cluster("grpc+verbs")
    try:
        await run_steps(worker)
        stats = ps_channel_stats(worker)
        assert stats.data_path == "verbs"
        assert stats.tensors_received >= 3  # the 4 MiB tensor, once per step
        assert stats.tensor_bytes_received >= 3 * (4 << 20)
        # WorkerService calls (RunGraph, ...) take the direct connection once it is up.
        assert worker._channels["/job:ps/replica:0/task:0"].direct_link.calls_made >= 2
    finally:
        await worker.stop()
        await ps.stop()


async def test_without_a_direct_connection_control_calls_ride_the_queue_pair(monkeypatch):
    monkeypatch.setenv("DISTSERVER_DIRECT", "0")
    ps, worker = await start_cluster("grpc+verbs")
    try:
        await run_steps(worker)
        channel = worker._channels["/job:ps/replica:0/task:0"]
        assert channel.statistics().data_path == "verbs"
        assert channel.direct_link.calls_made == 0
        assert channel.tensor_path.endpoint.statistics().calls_made >= 3  # the RunGraph of each step
    finally:
        await worker.stop()
        await ps.stop()


async def test_values_up_to_a_mebibyte_ride_batched_answers_and_larger_ones_shared_memory():
    # The ps receives `scale` from the worker, so its values are not pushed in its
    # RunGraph response: the worker fetches them while the ps's step runs.
    graph = ds.Graph()
    with graph.as_default():
        with ds.device("/job:worker/task:0"):
            fed = ds.placeholder(ds.int32, [])
            scale = ds.identity(fed)
        with ds.device("/job:ps/task:0"):
            medium = ds.range(0, 1 << 17, dtype=ds.int32) * scale  # 512 KiB
            large = ds.range(0, 1 << 19, dtype=ds.int32) * scale  # 2 MiB
        with ds.device("/job:worker/task:0"):
            sums = [ds.reduce_sum(ds.cast(value, ds.int64)) for value in (medium, large)]
    ps, worker = await start_cluster("grpc+verbs")
    try:
        async with ds.AsyncSession(worker.target, graph=graph) as session:
            for _ in range(3):
                assert [int(x) for x in await session.run(sums, feed_dict={fed: 3})] == [
                    3 * n * (n - 1) // 2 for n in (1 << 17, 1 << 19)
                ]
        stats = ps_channel_stats(worker)
        assert stats.data_path == "verbs"
        assert (stats.tensors_received, stats.tensor_bytes_received) == (3, 3 * (2 << 20))
        assert stats.call_bytes_received > 3 * (512 << 10)
    finally:
        await worker.stop()
        await ps.stop()


async def test_a_foreign_host_falls_back_to_grpc_and_says_so(monkeypatch, caplog):
    ps, worker = await start_cluster(
        "grpc+verbs", ps_env={HOST_ID_OVERRIDE_ENV: "boot_id=another-host"}, monkeypatch=monkeypatch
    )
    try:
        with caplog.at_level(logging.WARNING, logger="distserver.transports.verbs._transport"):
            await run_steps(worker)
        stats = ps_channel_stats(worker)
        assert stats.data_path.startswith("grpc (fallback: the peer runs on another host")
        assert stats.tensors_received >= 3
        warnings = [r for r in caplog.records if "uses the gRPC data path" in r.getMessage()]
        assert len(warnings) == 1  # once per peer, not per tensor
        channel = worker._channels["/job:ps/replica:0/task:0"]
        assert channel.tensor_path.endpoint is None  # calls over gRPC too
    finally:
        await worker.stop()
        await ps.stop()


async def test_strict_verbs_refuses_a_foreign_host(monkeypatch):
    register_transport("grpc+verbs-strict", VerbsTransport(strict=True))
    assert get_transport("grpc+verbs-strict").strict
    ps, worker = await start_cluster(
        "grpc+verbs-strict", ps_env={HOST_ID_OVERRIDE_ENV: "boot_id=another-host"}, monkeypatch=monkeypatch
    )
    try:
        with pytest.raises(errors.FailedPreconditionError, match=r"strict.*another host"):
            await run_steps(worker)
    finally:
        await worker.stop()
        await ps.stop()
