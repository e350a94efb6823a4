"""How many CPUs this process may use: what its affinity and its cgroup's CPU quota
allow; and keeping a task's event loop on one CPU (`pin_event_loop`).

`os.cpu_count()` counts the host's CPUs, which in a container limited to 2 of a
host's 64 is 64. `distserver serve` sizes numpy's BLAS by `usable_cpus()`
(`distserver._blas`), and tf.data's autotuned parallelism follows it too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import mmap
import os
import subprocess
import sys
import threading
import time

from distserver import _spin


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


class IdleSpinner:
    """Keeps one CPU awake between a task's steps: a helper process (`distserver._spin`)
    of the lowest nice priority (19) spins on `cpu` from the end of a step (`idle()`)
    until the next one begins (`busy()`), for at most `budget_us`.

    A virtual CPU that has nothing to run halts, and the hypervisor takes ~40 us to
    wake it when the next request arrives (`scripts/wake_costs.py`); TensorFlow's and
    OpenBLAS's thread pools spin a while before they sleep for that reason. The
    server's threads take the CPU from the spinner as they wake. It parks while a step
    runs: a thread that yields its CPU (OpenBLAS's, waiting for its other threads)
    would otherwise hand it over. `idle()` and `busy()` write shared memory; a parked
    spinner costs `idle()` one write to a pipe.

    Nice 19 rather than SCHED_IDLE: the scheduler counts a CPU running only SCHED_IDLE
    work as idle and puts a waking client there, beside the event loop. With
    SCHED_IDLE, one-task `small` steps from TensorFlow's client took 1.26-1.34 ms in
    some runs and 1.40-1.51 in others (1.42-1.47 without a spinner); at nice 19,
    1.27-1.28 in every run.

    Raises OSError when the process cannot be started.
    """

    def __init__(self, cpu: int, budget_us: int) -> None:
        flags_fd = os.memfd_create("distserver-spin")
        try:
            os.ftruncate(flags_fd, _spin.FLAGS)
            self._flags = mmap.mmap(flags_fd, _spin.FLAGS)
            wake_read, self._wake = os.pipe()
            try:
                command = [sys.executable, "-I", "-S", _spin.__file__, str(flags_fd), str(wake_read)]
                self._process = subprocess.Popen(
                    [*command, str(cpu), str(budget_us)],
                    pass_fds=(flags_fd, wake_read),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                )
            except BaseException:
                os.close(self._wake)
                self._flags.close()
                raise
            finally:
                os.close(wake_read)
        finally:
            os.close(flags_fd)
        os.set_blocking(self._wake, False)
        self.cpu = cpu
        self._others_from = _other_threads_cpu()

    @property
    def pid(self) -> int:
        """The helper process's."""
        return self._process.pid

    @property
    def parked(self) -> bool:
        """Whether the helper has stopped spinning (or is about to)."""
        return bool(self._flags[_spin.PARKED])

    def busy(self) -> None:
        """A step began: stop spinning."""
        self._flags[_spin.ARMED] = 0
        self._others_from = _other_threads_cpu()

    def idle(self) -> None:
        """The last running step ended: spin until the next begins, for at most the budget;
        not after steps in which other threads of this process worked (the compute pool,
        BLAS's threads), as then the CPUs are better left to them and to the client: a
        one-task `mlp` step from TensorFlow's client, its products in the pool on two
        BLAS threads, took 5-8% longer with the spinner, `small` and `embedding` (all on
        the event loop) 6-13% less."""
        if _other_threads_cpu() - self._others_from > _OTHERS_WORKED_S:
            return
        flags = self._flags
        flags[_spin.ARMINGS] = (flags[_spin.ARMINGS] + 1) & 0xFF
        flags[_spin.ARMED] = 1
        if flags[_spin.PARKED] and self._wake >= 0:
            flags[_spin.PARKED] = 0
            try:
                os.write(self._wake, b"\0")
            except BlockingIOError:  # (bytes are waiting already)
                pass
            except OSError:  # the helper is gone (killed): the CPU is left to halt
                os.close(self._wake)
                self._wake = -1

    def close(self) -> None:
        """Stop the process (the end of its pipe tells it) and wait for it."""
        if self._flags.closed:
            return
        self._flags[_spin.ARMED] = 0
        if self._wake >= 0:
            os.close(self._wake)
            self._wake = -1
        try:
            self._process.wait(timeout=_SPINNER_EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._flags.close()


# How long a spinner may take to see the end of its pipe (at most its budget) before
# it is killed.
_SPINNER_EXIT_SECONDS = 2.0
# CPU seconds the other threads of the process may use in a step that is followed by
# spinning.
_OTHERS_WORKED_S = 100e-6


def _other_threads_cpu() -> float:
    """The CPU seconds the threads of this process other than the calling one have used
    (those that ended included)."""
    return time.process_time() - time.thread_time()
