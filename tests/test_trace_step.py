"""scripts/trace_step.py: the step timeline still finds every method it marks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_training_step_timeline_covers_client_master_worker_and_ps() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "trace_step.py"),
            "--workload",
            "small",
            "--protocol",
            "grpc",
            "--seconds",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    # (A renamed method fails the run: "could not install the marks".)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("small training step over grpc: median time of each mark")
    rows = [
        line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ") and "µs" not in line
    ]
    marks = [row[1] for row in rows if not row[0].startswith("|---")]
    for expected in (
        "client: client sends RunCallable",
        "worker: master handler starts",
        "worker: executor starts",
        "ps: RunGraph handler starts",
        "ps: grouped updates start",
        "client: client has the result",
    ):
        assert expected in marks, (expected, done.stdout)
    offsets = [float(row[0].strip("| ").replace(",", "")) for row in rows if not row[0].startswith("|---")]
    assert offsets == sorted(offsets)
