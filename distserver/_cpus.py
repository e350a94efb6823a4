"""How many CPUs this process may use: what its affinity and its cgroup's CPU quota
allow; keeping a task's event loop on one CPU (`pin_event_loop`), and that loop
polling for a while between steps instead of sleeping at once (`AwakeBetweenSteps`).

`os.cpu_count()` counts the host's CPUs, which in a container limited to 2 of a
host's 64 is 64. `distserver serve` sizes numpy's BLAS by `usable_cpus()`
(`distserver._blas`), and tf.data's autotuned parallelism follows it too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import threading
import time


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

    How: a callback that schedules itself again (`call_soon`) keeps the loop's poll
    at a zero timeout, so a request is read as soon as it is in; each turn yields the
    CPU (`os.sched_yield`) to any other thread that wants it. Costs the CPU time it
    polls, at most `seconds` after each step."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        self._loop = loop
        self._seconds = seconds
        self._polls = 0  # which polling is current: a new one, or a step, ends the one before
        self.polling = False

    def busy(self) -> None:
        self._polls += 1
        self.polling = False

    def idle(self) -> None:
        self._polls += 1
        self.polling = True
        self._loop.call_soon(self._poll, self._polls, time.monotonic() + self._seconds)

    def _poll(self, polls: int, until: float) -> None:
        if polls != self._polls:
            return
        if time.monotonic() >= until:
            self.polling = False
            return
        os.sched_yield()
        self._loop.call_soon(self._poll, polls, until)
