"""LocalCluster, the test helper: an error inside one says what its tasks said."""

from __future__ import annotations

import os

import pytest

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


def test_a_terminals_ctrl_c_reaches_the_owner_not_its_tasks():
    # Ctrl-C signals the terminal's foreground process group: the tasks lead sessions
    # of their own, so the program that owns them stops them in order (a task dying
    # of the signal first was reported lost by a coordinator still stepping on it).
    with LocalCluster({"worker": 1}) as local:
        task = local.process("worker", 0)
        assert os.getsid(task.pid) == os.getpgid(task.pid) == task.pid
        assert os.getpgid(task.pid) != os.getpgid(0)
