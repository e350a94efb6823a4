"""LocalCluster, the test helper: an error inside one says what its tasks said."""

from __future__ import annotations

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
