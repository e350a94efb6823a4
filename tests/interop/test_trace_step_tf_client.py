"""scripts/trace_step.py with TensorFlow's own client on a one-task cluster: the
marks of the master, the executor and the HTTP/2 front are found, counted from the
RunStep handler up to the next step's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_one_task_timeline_of_tensorflows_client_starts_at_the_runstep_handler(tf_client) -> None:
    env = {**os.environ, "DISTSERVER_TF_PYTHON": tf_client.python}
    command = [sys.executable, str(ROOT / "scripts" / "trace_step.py"), "--workload", "small"]
    command += ["--protocol", "grpc", "--layout", "one", "--client", "tf", "--seconds", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "small training step over grpc, one task, TensorFlow's client: median time of each mark "
        "after the master's RunStep handler started"
    ), done.stdout
    rows = [
        line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ") and "µs" not in line
    ]
    rows = [row for row in rows if not row[0].startswith("|---")]
    marks = [row[1] for row in rows]
    assert marks[0] == "worker: master RunStep handler starts", done.stdout
    for expected in (
        "worker: executor starts",
        "worker: grouped updates start",
        "worker: master RunStep handler ends",
        # A step runs to the next one's start: the answer going out, the next request in.
        "worker: front has answered",
        "worker: front reads bytes",
        "worker: master RunStep handler starts (2nd)",
    ):
        assert expected in marks, (expected, done.stdout)
    assert marks.index("worker: front has answered") > marks.index("worker: master RunStep handler ends")
    assert not any(mark.startswith(("ps:", "client:")) for mark in marks), done.stdout
    offsets = [float(row[0].strip("| ").replace(",", "")) for row in rows]
    assert offsets == sorted(offsets)
