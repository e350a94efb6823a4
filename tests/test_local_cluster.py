"""LocalCluster, the test helper: an error inside one says what its tasks said."""

from __future__ import annotations

import signal

import pytest

import distserver as ds
from distserver.testing.cluster import LocalCluster


def test_an_error_inside_a_local_cluster_carries_its_tasks_states_and_stderr():
    with (  # noqa: PT012
        pytest.raises(AssertionError, match="the test's own failure") as caught,
        LocalCluster({"worker": 2}) as local,
    ):
        stopped = local.process("worker", 1)
        stopped.terminate()  # it says so on stderr as it stops
        stopped.wait(timeout=30)
        raise AssertionError("the test's own failure")
    notes = "\n".join(caught.value.__notes__)
    assert "/job:worker/replica:0/task:1 (exited with status 0) wrote to stderr" in notes
    assert "SIGTERM, stopping /job:worker/replica:0/task:1" in notes
    assert "/job:worker/replica:0/task:0 (running) wrote to stderr" in notes
    assert "Started server with target" in notes


def test_its_tasks_leave_a_terminals_ctrl_c_to_the_program_that_started_them():
    # Ctrl-C signals the terminal's whole foreground process group: the program that
    # owns the cluster stops its tasks once done with them (a task that died of the
    # signal first was reported lost by a coordinator still stepping on it).
    with LocalCluster({"worker": 1}) as local:
        task = local.process("worker", 0)
        task.send_signal(signal.SIGINT)
        graph = ds.Graph()
        with graph.as_default():
            total = ds.constant(2.0) + 3.0
        with ds.Session(local.target("worker", 0), graph=graph) as session:
            assert session.run(total) == 5.0
        assert task.poll() is None
    assert task.returncode == 0  # stopped by the cluster (SIGTERM), cleanly
