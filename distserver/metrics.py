"""Prometheus metrics of one task: `distserver serve --metrics-port P` serves them at `/metrics`.

Nothing is counted for Prometheus' sake: a scrape reads `AsyncServer.statistics()` (on
the server's event loop, so that the counters are read between steps) and turns it
into metric families. What is exported, every series labelled with the task
(`task="/job:ps/replica:0/task:0"`):

* `distserver_steps_total{result}`: steps this task's master ran, `result` "ok" or the
  error class ("DeadlineExceededError"); `distserver_steps_in_flight`;
  `distserver_step_latency_seconds` (histogram).
* `distserver_graphs_total{result}`, `distserver_graphs_in_flight`,
  `distserver_graph_latency_seconds`: the same for the partition graphs its worker ran.
* Per peer task (`peer`, `address`, `data_path` labels; `data_path` is "grpc", or "verbs"
  when grpc+verbs moves tensors through shared memory):
  `distserver_peer_tensor_bytes_received_total`, `distserver_peer_tensors_received_total`,
  `distserver_peer_call_bytes_received_total` (responses of calls, where values of 1 MiB
  or less come back inside RunGraph responses),
  `distserver_peer_calls_total`, `distserver_peer_calls_failed_total`.
* `distserver_sessions`: master sessions open; and the process' own (`process_*`).
* `distserver_optimizer_updates_total{written}`: optimizer updates of the process,
  `written` "in_place" (into the variable's own array) or "copied" (into a new one,
  because a reader still held the old one: each costs an allocation of the variable's size).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from distserver.runtime.counters import StepStatistics
from distserver.server import AsyncServer, ServerStatistics

SCRAPE_TIMEOUT = 5.0  # seconds a scrape waits for the server's event loop


class ServerCollector:
    """A prometheus-client collector reading one `AsyncServer`'s statistics at each scrape."""

    def __init__(self, server: AsyncServer, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self._loop = loop

    def collect(self) -> Iterator[Metric]:
        future = asyncio.run_coroutine_threadsafe(_statistics(self._server), self._loop)
        yield from metric_families(future.result(timeout=SCRAPE_TIMEOUT), self._server.task)


async def _statistics(server: AsyncServer) -> ServerStatistics:
    return server.statistics()


def metric_families(stats: ServerStatistics, task: str) -> list[Metric]:
    families: list[Metric] = []
    families += _step_families("steps", "step", "steps this task's master ran", stats.steps, task)
    families += _step_families("graphs", "graph", "graphs this task's worker ran", stats.graphs, task)
    peer_labels = ["task", "peer", "address", "data_path"]
    counters = {
        "peer_tensor_bytes_received": ("tensor bytes received from the peer", "tensor_bytes_received"),
        "peer_tensors_received": ("tensors received from the peer", "tensors_received"),
        "peer_call_bytes_received": (
            "bytes of call responses from the peer (RunGraph responses carry pushed values)",
            "call_bytes_received",
        ),
        "peer_calls": ("calls made to the peer", "calls_started"),
        "peer_calls_failed": ("calls to the peer that failed", "calls_failed"),
    }
    for name, (documentation, field) in counters.items():
        family = CounterMetricFamily(f"distserver_{name}", documentation, labels=peer_labels)
        for peer, channel in sorted(stats.peers.items()):
            family.add_metric([task, peer, channel.target, channel.data_path], getattr(channel, field))
        families.append(family)
    sessions = GaugeMetricFamily("distserver_sessions", "master sessions open", labels=["task"])
    sessions.add_metric([task], stats.sessions)
    families.append(sessions)
    updates = CounterMetricFamily(
        "distserver_optimizer_updates",
        "optimizer updates of this process, by how they were written",
        labels=["task", "written"],
    )
    for written, count in sorted(stats.optimizer_updates.items()):
        updates.add_metric([task, written], count)
    families.append(updates)
    return families


def _step_families(plural: str, singular: str, what: str, stats: StepStatistics, task: str) -> list[Metric]:
    total = CounterMetricFamily(
        f"distserver_{plural}", f"{what}, by result (ok or the error class)", labels=["task", "result"]
    )
    total.add_metric([task, "ok"], stats.succeeded)
    for error, count in sorted(stats.failed.items()):
        total.add_metric([task, error], count)
    in_flight = GaugeMetricFamily(f"distserver_{plural}_in_flight", f"{what}: running now", labels=["task"])
    in_flight.add_metric([task], stats.in_flight)
    latency = HistogramMetricFamily(
        f"distserver_{singular}_latency_seconds", f"{what}: seconds from start to end", labels=["task"]
    )
    buckets: list[Any] = []
    cumulative = 0
    for bound, count in zip([*stats.latency_buckets, float("inf")], stats.latency_counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    latency.add_metric([task], buckets, sum_value=stats.latency_sum)
    return [total, in_flight, latency]


class MetricsEndpoint:
    """An HTTP server (its own thread) answering `GET /metrics` for one `AsyncServer`."""

    def __init__(self, server: AsyncServer, host: str, port: int) -> None:
        loop = server.loop
        if loop is None:
            raise ValueError("the server must be bound (or started) before its metrics are served")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ServerCollector(server, loop))
        registry.register(ProcessCollector(registry=None))
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            reason = exc.strerror or exc
            raise ValueError(f"metrics: cannot listen on {host}:{port}: {reason}") from None
        self.host = host
        self.port: int = self._httpd.server_port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
