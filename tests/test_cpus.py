"""The CPUs a process may use: its affinity and its cgroups' CPU quota (`distserver._cpus`)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time

import pytest

from distserver import _cpus
from distserver._cpus import usable_cpus


@pytest.mark.parametrize(
    ("own", "files", "cpus"),
    [
        ("0::/", {"cpu.max": "200000 100000"}, 2.0),  # a container's cgroup v2 namespace
        ("0::/", {"cpu.max": "max 100000"}, None),  # no limit
        ("0::/a/b", {"a/b/cpu.max": "150000 100000", "a/cpu.max": "max 100000"}, 1.5),
        ("0::/a/b", {"a/b/cpu.max": "300000 100000", "a/cpu.max": "100000 100000"}, 1.0),  # the parent's
        ("1:cpu:/", {"cpu/cpu.cfs_quota_us": "50000", "cpu/cpu.cfs_period_us": "100000"}, 0.5),  # v1
        ("1:cpu:/", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        ("0::/", {"cpu.max": "garbled"}, None),
        ("0::/", {}, None),  # no cgroup files
    ],
)
def test_a_containers_cpu_limit_is_read_from_its_cgroups(tmp_path, monkeypatch, own, files, cpus):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    (tmp_path / "own").write_text(own + "\n")
    monkeypatch.setattr(_cpus, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(_cpus, "PROC_CGROUP", str(tmp_path / "own"))
    assert _cpus._cgroup_cpu_quota() == cpus
    allowed = len(os.sched_getaffinity(0))
    assert usable_cpus() == (allowed if cpus is None else min(allowed, math.ceil(cpus)))


def test_usable_cpus_are_those_the_affinity_allows():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from distserver._cpus import usable_cpus; "
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); print(usable_cpus())",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert int(out) == 1


def test_the_calling_thread_runs_on_the_cpu_current_cpu_names():
    assert _cpus.current_cpu() in os.sched_getaffinity(0)


# Run in a process of its own: pinning moves every thread of the process.
PIN_PROBE = """
import asyncio, json, os, threading
from distserver._cpus import pin_event_loop

def affinity():
    return sorted(os.sched_getaffinity(0))

started = threading.Event()
stop = threading.Event()
before = {}

def waiting():  # a thread that runs before the loop is pinned (as BLAS's do)
    before["tid"] = threading.get_native_id()
    started.set()
    stop.wait()

threading.Thread(target=waiting).start()
started.wait()

async def main():
    cpu = pin_event_loop(asyncio.get_running_loop())
    started_by_loop = {}
    thread = threading.Thread(target=lambda: started_by_loop.update(cpus=affinity()))
    thread.start()
    thread.join()
    in_executor = await asyncio.to_thread(affinity)
    return {
        "allowed": sorted(os.sched_getaffinity(before["tid"]) | os.sched_getaffinity(0)),
        "cpu": cpu,
        "loop": affinity(),
        "earlier thread": sorted(os.sched_getaffinity(before["tid"])),
        "started by the loop": started_by_loop["cpus"],
        "default executor": in_executor,
    }

print(json.dumps(asyncio.run(main())))
stop.set()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_pinned_loop_keeps_its_cpu_and_its_threads_and_every_other_thread_keeps_off_it():
    done = subprocess.run(
        [sys.executable, "-c", PIN_PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(done.stdout)
    cpu = seen["cpu"]
    others = sorted(set(seen["allowed"]) - {cpu})
    assert seen["allowed"] == sorted(os.sched_getaffinity(0))
    assert seen["loop"] == [cpu]
    assert seen["started by the loop"] == [cpu]  # (a compute pool's threads, made lazily)
    assert seen["earlier thread"] == others
    assert seen["default executor"] == others


ONE_CPU_PROBE = """
import asyncio, os
from distserver._cpus import pin_event_loop

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

async def main():
    return pin_event_loop(asyncio.get_running_loop()), len(os.sched_getaffinity(0))

print(*asyncio.run(main()))
"""


def test_a_loop_allowed_one_cpu_is_left_as_it_is():
    done = subprocess.run(
        [sys.executable, "-c", ONE_CPU_PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["None", "1"]


def test_a_loop_kept_awake_polls_after_the_last_step_until_a_step_starts_or_its_time_is_up():
    async def cpu_while_waiting(seconds: float) -> float:
        """The loop thread's CPU time while it waits `seconds` for nothing."""
        before = time.thread_time()
        await asyncio.sleep(seconds)
        return time.thread_time() - before

    async def main() -> None:
        loop = asyncio.get_running_loop()
        awake = _cpus.AwakeBetweenSteps(loop, 60.0)  # (far longer than the test)
        assert not awake.polling
        assert await cpu_while_waiting(0.3) < 0.05  # a loop with nothing to do sleeps
        awake.idle()  # the last step ended: the loop polls instead of sleeping
        assert awake.polling
        assert await cpu_while_waiting(0.3) > 0.03
        assert awake.polling
        awake.busy()  # a step started: the loop sleeps again while it waits
        assert not awake.polling
        assert await cpu_while_waiting(0.3) < 0.05
        awake.idle()
        awake.idle()  # (a second polling replaces the first, it does not add to it)
        awake.busy()
        assert await cpu_while_waiting(0.3) < 0.05
        short = _cpus.AwakeBetweenSteps(loop, 0.05)
        short.idle()
        await asyncio.sleep(0.3)
        assert not short.polling  # its time ran out
        assert await cpu_while_waiting(0.3) < 0.05

    asyncio.run(main())


async def _cpu_while_waiting(seconds: float) -> float:
    """The loop thread's CPU time while it waits `seconds` for nothing."""
    before = time.thread_time()
    await asyncio.sleep(seconds)
    return time.thread_time() - before


def test_a_loop_kept_awake_after_its_sends_polls_until_it_hands_work_to_its_pool_or_its_time_is_up(
    monkeypatch,
):
    monkeypatch.setattr(_cpus, "_after_sends", None)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = _cpus.ComputePool(1)
        await loop.run_in_executor(pool, time.sleep, 0)  # (its thread started)
        awake = _cpus.poll_after_sends(loop, 60.0)  # (far longer than the test)
        assert not awake.polling
        assert await _cpu_while_waiting(0.3) < 0.05  # nothing sent: the loop sleeps
        _cpus.sent_to_peer(loop)
        assert awake.polling
        assert await _cpu_while_waiting(0.3) > 0.03
        _cpus.heard_from_peer(loop)  # an answer: more may come, it polls on
        assert awake.polling
        await loop.run_in_executor(pool, time.sleep, 0.05)  # its own work: polling ends
        assert not awake.polling
        assert await _cpu_while_waiting(0.3) < 0.05
        pool.shutdown()
        short = _cpus.poll_after_sends(loop, 0.05)
        _cpus.sent_to_peer(loop)
        assert short.polling
        await asyncio.sleep(0.3)
        assert not short.polling  # its time ran out
        assert await _cpu_while_waiting(0.3) < 0.05

    asyncio.run(main())


def test_sends_from_a_loop_not_kept_awake_leave_it_sleeping(monkeypatch):
    monkeypatch.setattr(_cpus, "_after_sends", None)

    async def main() -> None:
        _cpus.sent_to_peer(asyncio.get_running_loop())  # (no polling set up: nothing happens)
        assert await _cpu_while_waiting(0.3) < 0.05
        awake = _cpus.poll_after_sends(asyncio.new_event_loop(), 60.0)  # another loop's
        _cpus.sent_to_peer(asyncio.get_running_loop())
        assert not awake.polling
        assert await _cpu_while_waiting(0.3) < 0.05
        awake.loop.close()

    asyncio.run(main())


def test_a_loop_does_not_poll_after_its_sends_while_its_peers_usually_answer_after_its_polling_would_end(
    monkeypatch,
):
    monkeypatch.setattr(_cpus, "_after_sends", None)
    waits = _cpus.AwakeAfterSends.WAITS

    async def main() -> None:
        loop = asyncio.get_running_loop()
        awake = _cpus.poll_after_sends(loop, 0.02)
        for _ in range(waits):  # a peer that computes 40 ms before it answers
            _cpus.sent_to_peer(loop)
            await asyncio.sleep(0.04)
            _cpus.heard_from_peer(loop)
        _cpus.sent_to_peer(loop)
        assert not awake.polling
        assert await _cpu_while_waiting(0.1) < 0.02
        _cpus.heard_from_peer(loop)
        for _ in range(waits // 2 + 1):  # then answers at once: once most waits are short, it polls
            _cpus.sent_to_peer(loop)
            _cpus.heard_from_peer(loop)
        _cpus.sent_to_peer(loop)
        assert awake.polling

    asyncio.run(main())


def test_a_loop_polls_after_its_sends_only_while_it_is_allowed(monkeypatch):
    monkeypatch.setattr(_cpus, "_after_sends", None)
    monkeypatch.setattr(_cpus.AwakeAfterSends, "ALLOWED_EVERY", 0.05)
    allowed = [False]
    asked: list[float] = []

    def allow() -> bool:
        asked.append(time.monotonic())
        return allowed[0]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        awake = _cpus.poll_after_sends(loop, 60.0, allow)
        _cpus.sent_to_peer(loop)
        assert not awake.polling
        assert await _cpu_while_waiting(0.2) < 0.05
        allowed[0] = True
        _cpus.sent_to_peer(loop)  # (asked again: the last answer is older than ALLOWED_EVERY)
        assert awake.polling
        assert await _cpu_while_waiting(0.2) > 0.03
        for _ in range(100):  # a burst of sends asks once
            _cpus.sent_to_peer(loop)
        assert len(asked) == 3

    asyncio.run(main())


def test_host_tasks_count_the_tasks_that_run_a_graph_or_just_ended_one(tmp_path, monkeypatch):
    monkeypatch.setattr(_cpus.HostTasks, "RECENT", 0.05)
    first = _cpus.host_tasks(1, str(tmp_path))
    second = _cpus.host_tasks(1, str(tmp_path))
    assert first is not None
    assert second is not None
    assert first.path == second.path
    assert (os.stat(first.path).st_mode & 0o777) == 0o600
    assert first.working() == 0
    assert first.leave_a_cpu()
    first.busy()  # (a graph starts)
    assert second.working() == 1
    second.busy()
    assert first.working() == 2
    assert not first.leave_a_cpu()  # two working, one CPU
    first.busy()  # (a second graph at once)
    first.idle()  # (the last one running ended: it still counts a while)
    assert second.working() == 2
    time.sleep(0.1)
    assert second.working() == 1
    assert first.leave_a_cpu()
    # A graph that runs longer than LONGEST no longer counts (its task may have died).
    monkeypatch.setattr(_cpus.HostTasks, "LONGEST", 0.05)
    assert second.working() == 0
    first.close()
    third = _cpus.host_tasks(1, str(tmp_path))  # (takes the slot `first` freed)
    assert third is not None
    assert third._slot == first._slot
    second.close()
    third.close()


def test_a_host_tasks_slot_of_a_process_that_is_gone_is_taken_again(tmp_path):
    child = (
        "import sys; from distserver import _cpus; "
        "tasks = _cpus.host_tasks(2, sys.argv[1]); tasks.busy(); print(tasks._slot)"
    )
    done = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True, check=True
    )
    slot = int(done.stdout)
    tasks = _cpus.host_tasks(2, str(tmp_path))
    assert tasks is not None
    assert tasks.working() == 0  # its graph counts no more: its slot is ours
    assert tasks._slot == slot
    tasks.close()


def test_a_host_tasks_file_that_is_not_the_users_alone_or_full_or_locked_is_done_without(
    tmp_path, monkeypatch
):
    import fcntl

    tasks = _cpus.host_tasks(2, str(tmp_path))
    assert tasks is not None
    path = tasks.path
    tasks.close()
    os.chmod(path, 0o644)  # others may read it
    assert _cpus.host_tasks(2, str(tmp_path)) is None
    os.chmod(path, 0o600)
    os.rename(path, path + ".real")
    os.symlink(path + ".real", path)  # a link in its place
    assert _cpus.host_tasks(2, str(tmp_path)) is None
    os.remove(path)
    os.rename(path + ".real", path)
    with open(path, "r+b") as file:  # every slot held by a running process
        file.write(
            b"".join(os.getpid().to_bytes(8, "little") + bytes(16) for _ in range(_cpus.HostTasks.SLOTS))
        )
    assert _cpus.host_tasks(2, str(tmp_path)) is None
    os.truncate(path, 0)
    monkeypatch.setattr(_cpus.HostTasks, "LOCK_SECONDS", 0.1)
    with open(path, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process claiming a slot, for ever
        started = time.monotonic()
        assert _cpus.host_tasks(2, str(tmp_path)) is None
        assert time.monotonic() - started < 1.0
    assert _cpus.host_tasks(2, str(tmp_path)) is not None
