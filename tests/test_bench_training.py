"""The training benchmark's own process handling (its measurements run in the suite's
slow tests and in `benchmarks/bench_training.py`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

# Started by `start_measurement`: starts a child, pauses it (as the benchmark pauses
# the runtimes it is not timing), says both process ids, and waits.
_MEASURER = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
os.kill(child.pid, signal.SIGSTOP)
print(os.getpid(), child.pid, flush=True)
time.sleep(60)
"""

# A job a shell would start (a process group of its own in the caller's session): it
# starts the measurer, says what the measurer said, and exits, which orphans its group.
_LAUNCHER = f"""
import sys
from distserver.bench.training import start_measurement
proc = start_measurement([sys.executable, "-c", {_MEASURER!r}])
print(proc.stdout.readline().strip(), flush=True)
"""


def _state(pid: int) -> str:
    """The state letter of process `pid` ("T": stopped), or "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except OSError:
        return ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's orphaned process groups")
def test_a_paused_runtime_outlives_the_shell_that_started_the_benchmark(tmp_path):
    # (The measurer keeps the launcher's stderr open after it exits: a file, not a pipe.)
    with open(tmp_path / "stderr", "w+") as stderr:
        launcher = subprocess.run(
            [sys.executable, "-c", _LAUNCHER],
            process_group=0,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=60,
        )
        stderr.seek(0)
        assert launcher.returncode == 0, stderr.read()
    measurer, child = map(int, launcher.stdout.split())
    try:
        # (Linux sends an orphaned group's stopped processes SIGHUP as the launcher exits.)
        time.sleep(0.5)
        assert _state(child) == "T"
        assert os.getsid(measurer) == measurer  # a session of its own
    finally:
        for pid in (child, measurer):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
