"""Between-graph asynchronous training: two TensorFlow worker processes, each with its own
MonitoredTrainingSession (one chief), sharing variables and the global step on two ps tasks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

LAST_STEP = 40


@pytest.fixture(scope="module")
def results(tf_client, tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint-root")
    with LocalCluster({"ps": 2, "worker": 2}, serve_args=["--checkpoint-root", str(root)]) as cluster:

        def worker(task: int) -> dict:
            arguments = {"cluster": cluster.cluster, "task": task, "checkpoint_dir": str(root / "run"),
                         "last_step": LAST_STEP}  # fmt: skip
            return tf_client.run("monitored_worker.py", arguments)

        with ThreadPoolExecutor(2) as pool:
            yield list(pool.map(worker, [0, 1]))


def test_both_workers_train_the_shared_model_until_the_last_step(results, check):
    chief, other = (check(r, "train") for r in results)
    assert chief["steps"], "the chief took no step"
    assert other["steps"], "the other worker took no step"
    # Each step bumps the shared global step once: together they reach the last step.
    assert max(chief["steps"] + other["steps"]) >= LAST_STEP
    assert len(chief["steps"]) + len(other["steps"]) >= LAST_STEP
    assert min(chief["losses"][-1], other["losses"][-1]) < chief["losses"][0] / 2
