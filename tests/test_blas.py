"""`distserver serve` limits numpy's BLAS threads (`distserver._blas`)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from distserver import _blas
from distserver._blas import set_blas_threads, threads_per_local_task, usable_cpus

PROBE = """
import sys
from distserver._blas import blas_threads, set_blas_threads
before = blas_threads()
assert set_blas_threads(int(sys.argv[1])), "no OpenBLAS found"
print(before, blas_threads())
"""


def _probe(threads: int, **env: str) -> tuple[int, int]:
    environment = {
        k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(threads)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**environment, **env},
    ).stdout.split()
    return int(out[0]), int(out[1])


def test_set_blas_threads_changes_numpys_openblas():
    before, after = _probe(1, OPENBLAS_NUM_THREADS="2")
    assert (before, after) == (2, 1)
    assert _probe(2, OPENBLAS_NUM_THREADS="1") == (1, 2)


def test_a_thread_count_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        set_blas_threads(0)


def test_tasks_sharing_a_host_get_half_their_share_of_its_cpus():
    three_local = ["localhost:1", "127.0.0.1:2", "[::1]:3"]
    assert threads_per_local_task(three_local, 2) == 1
    assert threads_per_local_task(three_local, 12) == 2
    assert threads_per_local_task(["localhost:1", "localhost:2"], 2) == 1
    assert threads_per_local_task(["localhost:1", "localhost:2"], 32) == 8


def test_a_task_alone_on_its_host_gets_every_cpu():
    assert threads_per_local_task(["localhost:1"], 2) == 2
    assert threads_per_local_task(["localhost:1"], 32) == 32
    assert threads_per_local_task(["localhost:1", "far.example.com:2"], 8) == 8  # another host
    assert threads_per_local_task([], 8) == 8
    assert threads_per_local_task(["localhost:1"], 1) == 1


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
    monkeypatch.setattr(_blas, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(_blas, "PROC_CGROUP", str(tmp_path / "own"))
    assert _blas._cgroup_cpu_quota() == cpus
    allowed = len(os.sched_getaffinity(0))
    assert usable_cpus() == (allowed if cpus is None else min(allowed, math.ceil(cpus)))


def test_usable_cpus_are_those_the_affinity_allows():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from distserver._blas import usable_cpus; "
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); print(usable_cpus())",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert int(out) == 1
