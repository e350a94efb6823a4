"""benchmarks/trace_step.py: the step timeline tool still finds what it traces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_timeline_covers_client_master_worker_and_ps() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "trace_step.py"),
            "--workload",
            "small",
            "--protocol",
            "grpc",
            "--steps",
            "6",
            "--warmup",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    # A renamed method is reported, not silently dropped from the timeline.
    assert "not traced" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("small over grpc: median offset")
    assert lines[-1].startswith("median step: ")
    events = [line.split("us", 1)[1].strip() for line in lines[1:-1]]
    for expected in (
        "client: direct.call< #1",
        "worker: master.run_callable< #1",
        "worker: executor.run< #1",
        "ps: worker.run_graph< #1",
        "ps: kernel.GroupedUpdates< #1",
        "client: direct.call> #1",
    ):
        assert expected in events, (expected, done.stdout)
    offsets = [float(line.split("us", 1)[0]) for line in lines[1:-1]]
    assert offsets == sorted(offsets)
