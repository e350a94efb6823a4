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


@pytest.mark.slow
def test_a_one_task_step_with_nodes_times_each_kernel_by_thread() -> None:
    command = [sys.executable, str(ROOT / "scripts" / "trace_step.py"), "--workload", "small"]
    command += ["--protocol", "grpc", "--layout", "one", "--nodes", "--seconds", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("small training step over grpc, one task: median time of each mark")
    timeline, kernels = done.stdout.split("\nKernels, the heaviest first")
    marks = [
        line.split(" | ")[1] for line in timeline.splitlines() if line.startswith("| ") and "µs" not in line
    ]
    assert "worker: node _DistserverFusedMatMul" in marks, done.stdout  # a mark as each kernel starts
    assert not any(mark.startswith("ps:") for mark in marks), done.stdout
    rows = {}
    for line in kernels.splitlines():
        if line.startswith("| worker: "):
            node, runs, wall, cpu = line.strip("| ").split(" | ")
            rows[node] = (float(runs), float(wall.replace(",", "")), float(cpu.replace(",", "")))
    # `small`'s 30 dense layers, each once a step, on the event loop (the main thread).
    layers = {node: times for node, times in rows.items() if "(_DistserverFusedMatMul, main thread)" in node}
    assert len(layers) == 30, done.stdout
    for runs, wall, cpu in layers.values():
        assert 0.9 <= runs <= 1.1, done.stdout
        assert cpu > 0, done.stdout
        assert wall > 0, done.stdout
    assert any("(_DistserverGroupedUpdates, main thread)" in node for node in rows), done.stdout
    # (the layers are the members of a stack: `executor._stack_dense_layers`)
    assert sum("(_DistserverDenseStack, main thread)" in node for node in rows) == 2, done.stdout
