"""The CPUs a process may use: its affinity and its cgroups' CPU quota (`distserver._cpus`)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

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
