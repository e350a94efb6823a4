"""What waking a thread costs on this machine, and what a short piece of Python work
costs right after its thread slept.

A training step hands work between threads and processes many times: the client's
request wakes a task's event loop, the loop hands a run of large nodes to a pool
thread and gets it back, a ps and a worker wake each other's loops for every message.
On a VM whose idle CPUs halt, waking a thread on another CPU can cost far more than
on bare metal, and that cost lands on the step's critical path. This measures:

* a round trip between two processes over pipes, both pinned to one CPU, then to
  two different ones (two wake-ups each);
* a hand-off from an event loop (uvloop, as distserver's tasks run) to a thread pool
  and back, as the executor makes one (`loop.run_in_executor`), the loop otherwise
  idle;
* the same short piece of Python and numpy work (parse a small request, 30 products
  of 64x32 by 32x32, encode a response) back to back, and right after its thread
  slept 0.5 ms.

Medians and 90th percentiles of `--rounds` tries each.

    .venv/bin/python scripts/wake_costs.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from distserver._process import run
from distserver.protos import master_pb2
from distserver.tensors import write_tensor_proto


def _stats(micros: list[float]) -> str:
    ordered = sorted(micros)
    return f"{statistics.median(ordered):,.1f} | {ordered[int(len(ordered) * 0.9)]:,.1f}"


def pipe_round_trips(cpus: tuple[int, int], rounds: int) -> list[float]:
    """Microseconds for a byte to go to a child process (pinned to `cpus[1]`) and back
    to this one (pinned to `cpus[0]`), 0.2 ms apart."""
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    before = os.sched_getaffinity(0)
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        os.sched_setaffinity(0, {cpus[1]})
        while os.read(to_child, 1) == b"x":
            os.write(from_child, b"y")
        os._exit(0)
    try:
        os.sched_setaffinity(0, {cpus[0]})
        times = []
        for _ in range(rounds):
            time.sleep(0.0002)
            started = time.perf_counter_ns()
            os.write(from_parent, b"x")
            os.read(to_parent, 1)
            times.append((time.perf_counter_ns() - started) / 1e3)
        return times
    finally:
        os.write(from_parent, b"q")
        os.waitpid(child, 0)
        os.sched_setaffinity(0, before)
        for fd in (to_child, from_parent, to_parent, from_child):
            os.close(fd)


async def loop_hops(rounds: int) -> tuple[list[float], list[float]]:
    """Microseconds from the event loop handing a call to a pool thread to the call
    starting there, and from it ending to the loop going on, 0.2 ms apart."""
    loop = asyncio.get_running_loop()
    there, back = [], []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        await loop.run_in_executor(pool, time.perf_counter_ns)  # (the thread made)
        for _ in range(rounds):
            await asyncio.sleep(0.0002)
            started = time.perf_counter_ns()
            arrived = await loop.run_in_executor(pool, time.perf_counter_ns)
            returned = time.perf_counter_ns()
            there.append((arrived - started) / 1e3)
            back.append((returned - arrived) / 1e3)
    return there, back


def small_work() -> Callable[[], bytes]:
    """Parse a 16 KiB RunStep request, 30 tanh layers of 64x32 by 32x32, encode a scalar."""
    request = master_pb2.RunStepRequest(session_handle="s", fetch=["loss:0"])
    feed = np.ones((64, 32), np.float32)
    write_tensor_proto(request.feed.add(name="x:0").tensor, feed)
    data = request.SerializeToString()
    weights = np.full((32, 32), 0.01, np.float32)

    def work() -> bytes:
        master_pb2.RunStepRequest.FromString(data)
        h = feed
        for _ in range(30):
            h = np.tanh(h @ weights)
        response = master_pb2.RunStepResponse()
        write_tensor_proto(response.tensor.add(name="loss:0").tensor, np.array(h.mean(), np.float32))
        return response.SerializeToString()

    return work


def timed(work: Callable[[], object], rounds: int, pause: Callable[[], None] | None) -> list[float]:
    times = []
    for _ in range(rounds):
        if pause is not None:
            pause()
        started = time.perf_counter_ns()
        work()
        times.append((time.perf_counter_ns() - started) / 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000, help="tries of each measurement")
    args = parser.parse_args()
    rounds = args.rounds
    cpus = sorted(os.sched_getaffinity(0))
    rows = [("process round trip, both on one CPU", _stats(pipe_round_trips((cpus[0], cpus[0]), rounds)))]
    if len(cpus) > 1:
        rows.append(("process round trip, two CPUs", _stats(pipe_round_trips((cpus[0], cpus[1]), rounds))))
    there, back = run(loop_hops(rounds))
    rows += [("event loop -> pool thread", _stats(there)), ("pool thread -> event loop", _stats(back))]
    work = small_work()
    timed(work, rounds, None)  # (warm)
    rows += [
        ("small work, back to back", _stats(timed(work, rounds, None))),
        ("small work, after a 0.5 ms sleep", _stats(timed(work, rounds, lambda: time.sleep(0.0005)))),
    ]
    print(f"{len(cpus)} usable CPUs, {rounds} tries each")
    print()
    print("| what | median µs | p90 µs |")
    print("|---|---:|---:|")
    for what, figures in rows:
        print(f"| {what} | {figures} |")


if __name__ == "__main__":
    main()
