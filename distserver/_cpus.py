"""How many CPUs this process may use: what its affinity and its cgroup's CPU quota
allow; keeping a task's event loop on one CPU (`pin_event_loop`), and that loop
polling for a while instead of sleeping at once: between steps (`AwakeBetweenSteps`)
and after its sends to peers (`AwakeAfterSends`).

`os.cpu_count()` counts the host's CPUs, which in a container limited to 2 of a
host's 64 is 64. `distserver serve` sizes numpy's BLAS by `usable_cpus()`
(`distserver._blas`), and tf.data's autotuned parallelism follows it too.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any


def usable_cpus() -> int:
    """The CPUs this process may run on: those its affinity allows, fewer when a
    cgroup's CPU quota (a container's CPU limit: cgroup v2 `cpu.max`, v1
    `cpu.cfs_quota_us`) allows less time than that, rounded up; at least one.
    `os.cpu_count()` counts the host's."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def _cgroup_cpu_quota() -> float | None:
    """The smallest CPU quota (CPUs' worth of time per period) set on this process's
    cgroup or an ancestor of it, or None when none sets one (or this is not Linux)."""
    quotas = [_read_quota(os.path.join(directory, "cpu.max")) for directory in _cgroup_v2_directories()]
    quotas.append(  # cgroup v1, at its controller's mount
        _read_quota(
            os.path.join(CGROUP_ROOT, "cpu", "cpu.cfs_quota_us"),
            os.path.join(CGROUP_ROOT, "cpu", "cpu.cfs_period_us"),
        )
    )
    found = [quota for quota in quotas if quota is not None]
    return min(found) if found else None


# Where cgroups are mounted, and the file naming this process's cgroup (tests point
# them elsewhere).
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def _cgroup_v2_directories() -> list[str]:
    """The cgroup v2 directory of this process (the "0::" line of /proc/self/cgroup:
    "/" in a container with its own cgroup namespace, a service's path on a host)
    and its ancestors' up to the root."""
    try:
        with open(PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        if line.startswith("0::"):
            parts = [part for part in line[3:].split("/") if part and part != ".."]
            return [os.path.join(CGROUP_ROOT, *parts[:n]) for n in range(len(parts), -1, -1)]
    return []


def _read_quota(path: str, period_path: str | None = None) -> float | None:
    """A quota file's limit in CPUs: v2's "QUOTA PERIOD" ("max PERIOD": none), or v1's
    quota ("-1": none) with its period in `period_path`; None when absent or unreadable."""
    try:
        with open(path) as f:
            fields = f.read().split()
        if period_path is not None:
            with open(period_path) as f:
                fields += f.read().split()
        quota, period = int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):  # absent, "max", garbled
        return None
    return quota / period if quota > 0 and period > 0 else None


def current_cpu() -> int | None:
    """The CPU the calling thread runs on (Linux: /proc/thread-self/stat), or None."""
    try:
        with open("/proc/thread-self/stat") as f:
            stat = f.read()
        # (after the command's closing parenthesis: state is field 3, processor field 39)
        return int(stat.rpartition(")")[2].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def pin_event_loop(loop: asyncio.AbstractEventLoop) -> int | None:
    """From the thread running `loop`: keep that thread on the CPU it is on and every
    other thread of the process off it, and return that CPU (None when it cannot: not
    Linux, one CPU allowed, or refused).

    A thread inherits the CPUs of the thread that starts it, so the threads the loop
    starts from now on (a task's compute pool, made lazily) share its CPU: a hand-off
    between them does not wake another CPU (~2-4 us on one CPU, ~40 us across two on a
    VM whose idle vCPUs halt: `scripts/wake_costs.py`), and the loop's caches stay
    warm. The threads already running (BLAS's, the transports') move to the other
    CPUs, so that a matrix product's second BLAS thread never queues behind the first.
    The loop's default executor (`asyncio.to_thread`: planning a large graph, decoding
    a large request) is replaced by one whose threads run on the other CPUs too."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    cpu = current_cpu()
    if len(allowed) < 2 or cpu not in allowed:
        return None
    others = allowed - {cpu}
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        return None
    this = threading.get_native_id()
    for name in os.listdir("/proc/self/task"):
        if int(name) != this:
            with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
                os.sched_setaffinity(int(name), others)
    loop.set_default_executor(
        concurrent.futures.ThreadPoolExecutor(
            thread_name_prefix="distserver-default", initializer=os.sched_setaffinity, initargs=(0, others)
        )
    )
    return cpu


class _LoopPolling:
    """An event loop kept polling until a moment: a callback that schedules itself
    again (`call_soon`) keeps the loop's poll at a zero timeout, so what arrives is
    read as soon as it is in; each turn yields the CPU (`os.sched_yield`) to any other
    thread that wants it. Costs the CPU time it polls."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._until = 0.0
        self._scheduled = False

    @property
    def polling(self) -> bool:
        return time.monotonic() < self._until

    def until(self, deadline: float) -> None:
        """Poll until `deadline` (`time.monotonic()`), instead of any earlier or later end."""
        self._until = deadline
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._poll)

    def stop(self) -> None:
        self._until = 0.0

    def _poll(self) -> None:
        if time.monotonic() >= self._until:
            self._scheduled = False
            return
        os.sched_yield()
        self.loop.call_soon(self._poll)


class AwakeBetweenSteps:
    """Keeps an event loop polling for up to `seconds` after the last running step
    ends, so that a client's next step finds the loop awake; a step that starts, or
    the time running out, puts it back to sleeping in its poll as usual. For
    `StepCounters.activity` (`busy`, `idle`): `distserver serve` sets it for a task
    alone on its host (`--spin-us`).

    Why: a training client sends its next step a few hundred microseconds after the
    answer. A loop that sleeps meanwhile lets its vCPU halt, and the request then
    waits for the host to wake it and finds the core's caches cold (a one-task step
    from TensorFlow's client took 10-15% longer; docs/benchmarks.md). TensorFlow's
    and OpenBLAS's thread pools spin a while before they sleep for the same reason.
    Costs the CPU time it polls (`_LoopPolling`), at most `seconds` after each step."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        self._polling = _LoopPolling(loop)
        self._seconds = seconds

    @property
    def polling(self) -> bool:
        return self._polling.polling

    def busy(self) -> None:
        self._polling.stop()

    def idle(self) -> None:
        self._polling.until(time.monotonic() + self._seconds)


class AwakeAfterSends:
    """Keeps an event loop polling for up to `seconds` after it sends a message to a
    peer (another task; distserver's own client, whose calls ride the same direct
    connections), while its peers usually answer within that time, so that the answer
    finds the loop awake. Handing work to its own compute pool (`ComputePool`) or the
    time running out puts it back to sleeping in its poll as usual. The transports
    between distserver processes (grpc+verbs' queue pairs, the direct TCP
    connections) tell it what they send and hear through `sent_to_peer` and
    `heard_from_peer`;
    `distserver serve` turns it on (`poll_after_sends`, `--spin-us`).

    Why: a step across tasks is a chain of messages between them (a parameter
    server's values, the worker's gradients, the answers), and a loop that sleeps
    while it waits lets its vCPU halt: each link then also waits for the host to wake
    that vCPU (~40 us on this 2-vCPU VM, `scripts/wake_costs.py`). A ps and a worker
    on two vCPUs, `embedding` steps: 0.86-0.89x -> 0.72-0.76x TensorFlow's
    (docs/benchmarks.md, round 34).

    When not: a wait that usually lasts longer than `seconds` is a peer computing (a
    worker's matrix products while its parameter server waits for the gradients);
    polling through it would take CPU from that peer for nothing. So the loop polls
    only while the median of its last `WAITS` waits (from a send to the next message
    heard from a peer) is at most `seconds`. Its own kernels' threads want the CPU
    too: work handed to the pool ends the polling."""

    WAITS = 16
    # Fewer waits seen than this: poll (nothing says the answers are slow yet).
    MIN_WAITS = 4

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        self._polling = _LoopPolling(loop)
        self._seconds = seconds
        self._waiting_since: float | None = None  # the first send not yet answered
        self._waits: collections.deque[float] = collections.deque(maxlen=self.WAITS)
        self._slow = False  # the median of `_waits` is over `seconds` (decided as each ends)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._polling.loop

    @property
    def polling(self) -> bool:
        return self._polling.polling

    def sent(self) -> None:
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        if not self._slow:
            self._polling.until(now + self._seconds)

    def heard(self) -> None:
        if self._waiting_since is not None:
            self._waits.append(time.monotonic() - self._waiting_since)
            self._waiting_since = None
            self._slow = len(self._waits) >= self.MIN_WAITS and statistics.median(self._waits) > self._seconds

    def computing(self) -> None:
        self._polling.stop()


# The serving loop's `AwakeAfterSends` (`distserver serve` runs one loop a process).
_after_sends: AwakeAfterSends | None = None


def poll_after_sends(loop: asyncio.AbstractEventLoop, seconds: float) -> AwakeAfterSends:
    """Keep `loop` polling after its sends to peers (`AwakeAfterSends`)."""
    global _after_sends
    _after_sends = AwakeAfterSends(loop, seconds)
    return _after_sends


def sent_to_peer(loop: asyncio.AbstractEventLoop) -> None:
    """A transport sent a message to a peer from `loop`."""
    awake = _after_sends
    if awake is not None and awake.loop is loop:
        awake.sent()


def heard_from_peer(loop: asyncio.AbstractEventLoop) -> None:
    """A transport read a message from a peer on `loop`."""
    awake = _after_sends
    if awake is not None and awake.loop is loop:
        awake.heard()


class ComputePool(concurrent.futures.ThreadPoolExecutor):
    """A task's compute pool (kernels run off the event loop): work handed to it from
    the loop that `poll_after_sends` keeps awake ends that polling, as the pool's
    thread now wants the CPU."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        awake = _after_sends
        if awake is not None and awake.polling and _running_loop() is awake.loop:
            awake.computing()
        return super().submit(fn, *args, **kwargs)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # (not on a loop's thread)
        return None
