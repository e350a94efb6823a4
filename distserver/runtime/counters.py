"""Cheap counters of the steps a master runs and the graphs a worker runs.

One `StepCounters` per master (steps) and per worker (partition graphs): a few integer
additions and one bisect per step, on the event loop, no locks. `snapshot()` copies
them into a frozen `StepStatistics` for `AsyncServer.statistics()`, `distserver status
--stats` and the Prometheus endpoint (`distserver serve --metrics-port`).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Protocol

# Upper bounds (seconds) of the latency histogram's buckets; one more bucket above.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


@dataclass(frozen=True)
class StepStatistics:
    """Steps (or graphs) so far: started, finished well, failed by error class, latency."""

    started: int
    succeeded: int
    failed: dict[str, int]  # error class name ("DeadlineExceededError") -> count
    latency_buckets: tuple[float, ...]  # upper bounds in seconds, as `LATENCY_BUCKETS`
    latency_counts: tuple[int, ...]  # per bucket, not cumulative; the last one is above every bound
    latency_sum: float  # seconds, over finished steps

    @property
    def in_flight(self) -> int:
        return self.started - self.succeeded - sum(self.failed.values())

    @property
    def finished(self) -> int:
        return self.succeeded + sum(self.failed.values())


class Activity(Protocol):
    """Told when a step a `StepCounters` counts starts running (`busy`) and when the
    last one running ends (`idle`)."""

    def busy(self) -> None: ...

    def idle(self) -> None: ...


class StepCounters:
    """Counts steps as they start and finish. Use: `began = c.start()`, then `c.finish(began, error)`.

    `activity`, when set, is told when a step starts and when the count of running
    steps reaches 0 (`distserver serve` keeps a lone task's event loop polling between
    its steps, `_cpus.AwakeBetweenSteps`, and records when a task's worker last ran a
    graph, `_cpus.HostTasks`)."""

    def __init__(self) -> None:
        self._started = 0
        self._succeeded = 0
        self._failed: dict[str, int] = {}
        self._counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self._sum = 0.0
        self._running = 0
        self.activity: Activity | None = None

    def start(self) -> float:
        self._started += 1
        self._running += 1
        if self.activity is not None:
            self.activity.busy()
        return time.perf_counter()

    def finish(self, began: float, error: BaseException | None) -> None:
        """One step that `start()` returned `began` for has ended, with `error` or well."""
        self._running -= 1
        if not self._running and self.activity is not None:
            self.activity.idle()
        seconds = time.perf_counter() - began
        self._counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self._sum += seconds
        if error is None:
            self._succeeded += 1
        else:
            name = type(error).__name__
            self._failed[name] = self._failed.get(name, 0) + 1

    def snapshot(self) -> StepStatistics:
        return StepStatistics(
            started=self._started,
            succeeded=self._succeeded,
            failed=dict(self._failed),
            latency_buckets=LATENCY_BUCKETS,
            latency_counts=tuple(self._counts),
            latency_sum=self._sum,
        )
