"""How many CPUs this process may use: what its affinity and its cgroup's CPU quota
allow; keeping a task's event loop on one CPU (`pin_event_loop`), and that loop
polling for a while instead of sleeping at once: between steps (`AwakeBetweenSteps`)
and after its sends to peers (`AwakeAfterSends`), while the tasks working on this
host leave it a CPU (`HostTasks`); a task's threads scheduled as batch work where the
host's tasks outnumber its CPUs (`schedule_as_batch`).

`os.cpu_count()` counts the host's CPUs, which in a container limited to 2 of a
host's 64 is 64. `distserver serve` sizes numpy's BLAS by `usable_cpus()`
(`distserver._blas`), and tf.data's autotuned parallelism follows it too.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import fcntl
import math
import mmap
import os
import stat
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np


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
    """The CPU the calling thread runs on (Linux: glibc's `sched_getcpu`, ~0.2 us, else
    /proc/thread-self/stat), or None."""
    if _sched_getcpu is not None:
        cpu = int(_sched_getcpu())
        return cpu if cpu >= 0 else None
    try:
        with open("/proc/thread-self/stat") as f:
            stat = f.read()
        # (after the command's closing parenthesis: state is field 3, processor field 39)
        return int(stat.rpartition(")")[2].split()[36])
    except (OSError, ValueError, IndexError):
        return None


try:
    _sched_getcpu: Callable[[], int] | None = ctypes.CDLL(None).sched_getcpu
except (OSError, AttributeError):  # (not glibc, not Linux)
    _sched_getcpu = None


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


def schedule_as_batch() -> bool:
    """Give every thread of this process Linux's batch policy (`SCHED_BATCH`), and
    return whether it could (not on Linux, or refused for any thread: False). A thread
    inherits its starter's policy, so the threads started later (the compute pool) have
    it too.

    A batch thread that wakes does not preempt the thread running on its CPU: it waits
    for that thread to sleep or for the scheduler's next turn. Where a host's tasks
    outnumber its CPUs, each message between them woke its reader onto a CPU that was
    busy, and the woken event loop preempted the thread there, most often a matrix
    product or another task's loop, whose caches it then left cold. A ps and two
    workers training `mlp` at once on two CPUs: 11.3 -> 10.2 ms a step over
    grpc+verbs, 12.5 -> 11.6 over grpc (docs/benchmarks.md, round 47)."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
        for name in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # (a thread that ended meanwhile)
                os.sched_setscheduler(int(name), policy, os.sched_param(0))
    except OSError:
        return False
    return True


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
    # How often `allowed` is asked again (seconds).
    ALLOWED_EVERY = 0.01

    def __init__(
        self, loop: asyncio.AbstractEventLoop, seconds: float, allowed: Callable[[], bool] | None = None
    ) -> None:
        self._polling = _LoopPolling(loop)
        self._seconds = seconds
        self._waiting_since: float | None = None  # the first send not yet answered
        self._waits: collections.deque[float] = collections.deque(maxlen=self.WAITS)
        self._slow = False  # the median of `_waits` is over `seconds` (decided as each ends)
        # Whether the host has a CPU to poll with (`HostTasks.leave_a_cpu`), asked at
        # most every `ALLOWED_EVERY`; None: always.
        self._allowed = allowed
        self._allowed_until = 0.0  # when `_allowed` is asked again
        self._may_poll = True

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
        if self._allowed is not None and now >= self._allowed_until:
            self._allowed_until = now + self.ALLOWED_EVERY
            self._may_poll = self._allowed()
        if not self._slow and self._may_poll:
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


def poll_after_sends(
    loop: asyncio.AbstractEventLoop, seconds: float, allowed: Callable[[], bool] | None = None
) -> AwakeAfterSends:
    """Keep `loop` polling after its sends to peers (`AwakeAfterSends`), while `allowed()`."""
    global _after_sends
    _after_sends = AwakeAfterSends(loop, seconds, allowed)
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


class HostTasks:
    """The `distserver serve` tasks of this user on this host that are working: that
    run a graph, or ended one within `RECENT` seconds. A small file they share
    (`path`) has a slot for each: its process id, when it last started a graph while
    graphs run (else 0) and when the last one ended (`CLOCK_MONOTONIC`, the same in
    every process of a host). For `StepCounters.activity` of a task's worker.

    Why: polling after sends pays when the tasks working on a host leave it a CPU (a
    ps and a worker on two CPUs), and costs when they do not (a ps and two workers
    training at once on two CPUs: 2-8% slower steps). A cluster often names more
    tasks on a host than work at once (an idle second worker, a chief that waits):
    counted by the cluster spec, a ps and a worker beside an idle worker never polled.

    The file is the user's own (mode 0600, refused otherwise); a slot is claimed
    under an exclusive lock, from those free or held by a process that is gone; a
    task that ends frees its slot (`close`). Values are read and written without a
    lock: a stale count misleads one decision of `leave_a_cpu` for `ALLOWED_EVERY`.
    A task that cannot claim a slot within `LOCK_SECONDS` does without the record,
    and a graph that has run for `LONGEST` seconds no longer counts (its task may
    have died running it)."""

    SLOTS = 64
    # A task that ended a graph within this many seconds counts as working: the time
    # between a training client's steps, with room to spare.
    RECENT = 0.02
    LONGEST = 10.0
    # How long a task waits for another that claims a slot before doing without.
    LOCK_SECONDS = 1.0
    _BYTES = SLOTS * 3 * 8  # (pid, last start while running, last end) per slot, int64

    def __init__(self, path: str, cpus: int) -> None:
        self.path = path
        self._cpus = cpus
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            info = os.fstat(fd)
            mode = info.st_mode
            if info.st_uid != os.getuid() or stat.S_IMODE(mode) & 0o077 or not stat.S_ISREG(mode):
                raise PermissionError(f"{path} is not a file of this user's alone (mode 0600)")
            _lock_within(fd, self.LOCK_SECONDS)
            try:
                if info.st_size < self._BYTES:
                    os.ftruncate(fd, self._BYTES)
                self._map = mmap.mmap(fd, self._BYTES)
                slots = np.frombuffer(self._map, np.int64).reshape(self.SLOTS, 3)
                self._slot = self._claim(slots)
                self._pids, self._running, self._ended = slots[:, 0], slots[:, 1], slots[:, 2]
            finally:
                # (by hand: the map holds a duplicate of `fd`, and with it the lock)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @staticmethod
    def _claim(slots: np.ndarray) -> int:
        for i, pid in enumerate(slots[:, 0].tolist()):
            if pid == 0 or not _alive(pid):
                slots[i] = (os.getpid(), 0, 0)
                return i
        raise OSError(f"all {HostTasks.SLOTS} slots are held by running processes")

    def busy(self) -> None:
        self._running[self._slot] = time.monotonic_ns()

    def idle(self) -> None:
        self._running[self._slot] = 0
        self._ended[self._slot] = time.monotonic_ns()

    def working(self) -> int:
        """How many tasks run a graph, or ended one within `RECENT` seconds."""
        now = time.monotonic_ns()
        running = self._running > now - int(self.LONGEST * 1e9)
        return int(np.count_nonzero(running | (self._ended > now - int(self.RECENT * 1e9))))

    def leave_a_cpu(self) -> bool:
        """Whether the tasks working on this host number at most its CPUs."""
        return self.working() <= self._cpus

    def close(self) -> None:
        if self._pids[self._slot] == os.getpid():
            self._running[self._slot] = self._ended[self._slot] = 0
            self._pids[self._slot] = 0


def _lock_within(fd: int, seconds: float) -> None:
    """An exclusive `flock` of `fd`, or TimeoutError after `seconds` of another's."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError("another process holds the lock") from None
            time.sleep(0.005)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process took the number)
        return True
    return True


def host_tasks(cpus: int, directory: str | None = None) -> HostTasks | None:
    """This user's `HostTasks` record in `directory` (default: /dev/shm, else the
    temporary directory), or None when it cannot be used (then nothing is known of
    what the host's other tasks do)."""
    if directory is None:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    try:
        return HostTasks(os.path.join(directory, f"distserver-{os.getuid()}-host-tasks"), cpus)
    except (OSError, ValueError):
        return None
