"""The helper process of `_cpus.IdleSpinner`: spins on one CPU, at the lowest nice
priority, while the server that started it is between steps.

Run by path (``python -I -S _spin.py FLAGS_FD WAKE_FD CPU BUDGET_US``), it imports
nothing of distserver. `FLAGS_FD` is shared memory of `FLAGS` bytes the server writes:
``ARMED`` (set at the end of a step, cleared when the next begins) and ``ARMINGS`` (a
count of the settings, modulo 256); and one this process writes: ``PARKED``, set
before it blocks on `WAKE_FD`, the read end of a pipe the server writes a byte to when
it arms a parked spinner. It spins while armed, for at most `BUDGET_US` after the last
arming; it exits when the pipe reaches its end (the server closed it, or died) or,
spinning, when the server is no longer its parent.

A step that never lets the CPU go leaves the spinner no time to see it disarmed: it
sees the next arming by the count.

Nice 19: a thread of the server that wakes takes the CPU from it at once; the
spinning only keeps the CPU from halting, so that the server's event loop wakes on it
without the ~40 us a halted vCPU takes.
"""

from __future__ import annotations

import mmap
import os
import sys
import time

ARMED, ARMINGS, PARKED, FLAGS = 0, 1, 2, 3
# Flag reads between two looks at the clock.
_CHECKS_PER_CLOCK = 64


def main(flags_fd: int, wake_fd: int, cpu: int, budget_us: int) -> int:
    os.sched_setaffinity(0, {cpu})
    os.nice(19)  # (not SCHED_IDLE: see `_cpus.IdleSpinner`)
    flags = mmap.mmap(flags_fd, FLAGS)
    budget = budget_us / 1e6
    clock = time.perf_counter
    checks = range(_CHECKS_PER_CLOCK)
    server = os.getppid()
    seen = flags[ARMINGS]
    while True:
        flags[PARKED] = 1
        if flags[ARMED] and flags[ARMINGS] != seen:  # armed again as it parked: spin
            flags[PARKED] = 0  # (a byte may come for this arming too: one more turn)
        elif not os.read(wake_fd, 4096):
            return 0
        seen = flags[ARMINGS]
        deadline = clock() + budget
        while flags[ARMED]:
            for _ in checks:
                if not flags[ARMED]:
                    break
            if flags[ARMINGS] != seen:
                seen = flags[ARMINGS]
                deadline = clock() + budget
            elif clock() > deadline:
                break
            if os.getppid() != server:  # (it died)
                return 0


if __name__ == "__main__":
    sys.exit(main(*map(int, sys.argv[1:5])))
