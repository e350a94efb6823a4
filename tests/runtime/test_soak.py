"""Soak: thousands of concurrent steps from several client processes while a task is killed and restarted.

Three tasks (ps, worker 0 with the master the clients use, worker 1), each its own
process; three client processes (`soak_client.py`), eight steps in flight each, with
random tensor sizes, every value checked. Worker 1 and then the ps are killed and
restarted while they run. Every step must give the right value or fail with an expected OpError class;
the clients recover by making new sessions; memory and open files of the tasks that
stayed up must be flat.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distserver.testing import LocalCluster

pytestmark = pytest.mark.slow

CLIENTS = 3
STEPS_PER_CLIENT = 4000
CONCURRENCY = 8
CLIENT_SECONDS = 150.0
# From here on the faults are over and the heap has reached its high-water mark.
STEADY_FROM_SECONDS = 20.0
HERE = Path(__file__).resolve().parent


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _clients(target: str, steps: int, seed: int) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(
            [
                sys.executable, str(HERE / "soak_client.py"), "--target", target, "--steps", str(steps),
                "--concurrency", str(CONCURRENCY), "--seed", str(seed + i), "--seconds", str(CLIENT_SECONDS),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(CLIENTS)
    ]  # fmt: skip


def _reports(clients: list[subprocess.Popen[str]]) -> list[dict]:
    reports = []
    for client in clients:
        out, err = client.communicate(timeout=CLIENT_SECONDS + 60)
        assert client.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def test_steps_stay_right_while_a_task_is_killed_and_restarted():
    with LocalCluster({"ps": 1, "worker": 2}) as cluster:
        target = cluster.target("worker", 0)
        master = "/job:worker/replica:0/task:0"  # the one task that is never restarted
        steady_pids = {master: cluster.pids[master]}
        warm = _reports(_clients(target, 200, seed=100))  # warm up: pools, caches, allocator
        assert all(r["ok"] == 200 for r in warm), [
            {k: r[k] for k in ("ok", "failures", "unexpected", "wrong")} for r in warm
        ]
        before = {task: (_rss_mib(pid), _fds(pid)) for task, pid in steady_pids.items()}

        started = time.monotonic()
        clients = _clients(target, STEPS_PER_CLIENT, seed=1)
        # The schedule of the faults (these sleeps are the test's timeline, not waits for events):
        # worker 1, then the ps, each dead for a second while steps keep coming.
        for job, at in (("worker", 3.0), ("ps", 10.0)):
            time.sleep(max(0.0, started + at - time.monotonic()))
            cluster.kill(job, 1 if job == "worker" else 0)
            time.sleep(1.0)
            cluster.restart(job, 1 if job == "worker" else 0)
        # The master's RSS while the steps go on, once the faults are over: a leak grows it
        # with every step; the heap's high-water mark, reached early, does not.
        samples: list[tuple[float, float]] = []
        deadline = started + CLIENT_SECONDS + 60
        while any(client.poll() is None for client in clients) and time.monotonic() < deadline:
            samples.append((time.monotonic() - started, _rss_mib(steady_pids[master])))
            time.sleep(1.0)
        reports = _reports(clients)
        elapsed = time.monotonic() - started

        after_run = _reports(_clients(target, 200, seed=200))  # everything works again
        for task in steady_pids:
            process = cluster.processes[task]
            assert process.poll() is None, f"{task} exited:\n{cluster.stderr(task)[-3000:]}"
        after = {task: (_rss_mib(pid), _fds(pid)) for task, pid in steady_pids.items()}

    ok = sum(r["ok"] for r in reports)
    failures: dict[str, int] = {}
    for report in reports:
        for name, count in report["failures"].items():
            failures[name] = failures.get(name, 0) + count
    print(
        f"soak: {ok} right steps in {elapsed:.0f} s, failures by class {failures}, "
        f"RSS/fds before {before} after {after}; RSS over the run {[round(r) for _, r in samples[::5]]}"
    )
    assert not [r["wrong"] for r in reports if r["wrong"]], "wrong values"
    assert not [r["unexpected"] for r in reports if r["unexpected"]], (
        "failures that are not expected OpErrors"
    )
    assert ok >= CLIENTS * STEPS_PER_CLIENT // 2, f"only {ok} steps went right ({failures})"
    assert all(r["ok"] == 200 and not r["failures"] for r in after_run), after_run
    for task, (rss, fds) in after.items():
        rss_before, fds_before = before[task]
        assert rss - rss_before < 250, f"{task}: RSS {rss_before:.0f} -> {rss:.0f} MiB"
        assert fds - fds_before < 20, f"{task}: {fds_before} -> {fds} open files"
    # RSS swings by ~100 MiB as large tensors come and go, and the heap may reach its
    # high-water mark a little after the faults (24 steps of up to 4 MiB in flight): the
    # late median is compared with the early window's highest sample, not its median
    # (which gave +98 MiB on a run where every later sample stayed within that swing;
    # 0f8e959's tree showed +69 the same way). A leak still shows as a rising middle.
    steady = [rss for at, rss in samples if at >= STEADY_FROM_SECONDS]
    if len(steady) >= 20:  # enough steady time to see a leak (here: ~40 s, ~8k steps)
        early, late = max(steady[:7]), statistics.median(steady[-7:])
        assert late - early < 96, f"{master}: RSS rose from ~{early:.0f} to ~{late:.0f} MiB while steps ran"
