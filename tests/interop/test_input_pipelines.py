"""Queue-runner input pipelines (shuffle_batch, batch) from a TensorFlow client, compared with TF."""

from __future__ import annotations

import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240, func_only=True)]


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        yield tf_client.run("input_pipelines.py", {"cluster": cluster.cluster})


@pytest.mark.parametrize("pipeline", ["shuffle_batch", "batch"])
def test_every_example_twice_in_tensorflows_batch_sizes(results, check, pipeline):
    ours, theirs = check(results, f"ours/{pipeline}"), check(results, f"theirs/{pipeline}")
    assert ours["examples"] == theirs["examples"] == sorted(list(range(20)) * 2)
    assert ours["sizes"] == theirs["sizes"]
