"""FULL_TRACE and output_partition_graphs from a TensorFlow client: what its timeline tool shows."""

from __future__ import annotations

import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180, func_only=True)]

PS = "/job:ps/replica:0/task:0/device:CPU:0"
WORKER = "/job:worker/replica:0/task:0/device:CPU:0"


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        yield tf_client.run("tracing.py", {"cluster": cluster.cluster})


def test_the_step_runs(results, check):
    assert check(results, "value") == 30.0


def test_step_stats_name_every_task_and_its_nodes(results, check):
    stats = check(results, "step_stats")
    assert set(stats) == {PS, WORKER}
    assert "scaled" in stats[PS]
    assert "total" in stats[WORKER]


def test_tensorflows_timeline_tool_renders_them(results, check):
    nodes = check(results, "chrome_trace_nodes")
    assert {"scaled", "total"} <= set(nodes)


def test_partition_graphs_cover_both_tasks(results, check):
    assert check(results, "partition_devices") == sorted([PS, WORKER])


def test_nothing_is_recorded_unless_asked(results, check):
    assert check(results, "untraced_is_empty") == [0, 0]
