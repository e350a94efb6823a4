"""Between-graph synchronous training: SyncReplicasOptimizer(replicas_to_aggregate=2,
total_num_replicas=2) over ps:1 + worker:2, two TensorFlow client processes (chief and
non-chief) with MonitoredTrainingSession and the optimizer's hook; once on distserver,
once on a cluster of TensorFlow's own servers. The final variables must agree."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest

from distserver.testing import LocalCluster, free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

LAST_STEP = 12

TF_SERVER = """
import json, sys, tensorflow as tf
cluster, job, task = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
server = tf.distribute.Server(cluster, job, task)
print("serving", flush=True)
server.join()
"""


@contextmanager
def tensorflow_cluster(python: str, jobs: dict[str, int]) -> Iterator[dict[str, list[str]]]:
    """A cluster of `tf.distribute.Server` processes, one per task."""
    ports = iter(free_ports(sum(jobs.values())))
    cluster = {job: [f"localhost:{next(ports)}" for _ in range(count)] for job, count in jobs.items()}
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("GRPC_EXPERIMENTS", None)
    processes = []
    try:
        for job, count in jobs.items():
            for task in range(count):
                process = subprocess.Popen(
                    [python, "-c", TF_SERVER, json.dumps(cluster), job, str(task)],
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
                processes.append(process)
        for process in processes:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "serving"
        yield cluster
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=30)
            if process.stdout is not None:
                process.stdout.close()


def train_on(tf_client, cluster, ready_file) -> list[dict]:
    def worker(task: int) -> dict:
        arguments = {"cluster": cluster, "task": task, "last_step": LAST_STEP, "ready_file": str(ready_file)}
        return tf_client.run("sync_replicas_worker.py", arguments)

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(worker, [0, 1]))


@pytest.fixture(scope="module")
def results(tf_client, tmp_path_factory):
    base = tmp_path_factory.mktemp("sync")
    with LocalCluster({"ps": 1, "worker": 2}) as cluster:
        ours = train_on(tf_client, cluster.cluster, base / "distserver-ready")
    with tensorflow_cluster(tf_client.python, {"ps": 1, "worker": 2}) as cluster:
        theirs = train_on(tf_client, cluster, base / "tensorflow-ready")
    return {"distserver": ours, "tensorflow": theirs}


@pytest.mark.parametrize("side", ["distserver", "tensorflow"])
def test_both_workers_step_together_to_the_last_step(results, check, side):
    chief, other = (check(r, "train") for r in results[side])
    assert chief["global_step"] == LAST_STEP
    # Lockstep: each update averaged one gradient of each worker, so each took every step.
    # (The global step fetched with train_op is racy in TensorFlow too: not compared.)
    assert len(chief["losses"]) == LAST_STEP
    assert len(other["losses"]) == LAST_STEP
    assert chief["losses"][-1] < chief["losses"][0] / 2


def test_the_trained_variables_equal_tensorflows(results, check):
    ours = [check(r, "train") for r in results["distserver"]]
    theirs = [check(r, "train") for r in results["tensorflow"]]
    for name in ("w", "b", "emb"):
        np.testing.assert_allclose(ours[0][name], theirs[0][name], rtol=1e-5, atol=1e-6, err_msg=name)
    for task in (0, 1):
        np.testing.assert_allclose(ours[task]["losses"], theirs[task]["losses"], rtol=1e-5, atol=1e-6)
    # The embedding rows moved by different amounts: the sparse mean was per index.
    assert len({round(row[0], 6) for row in ours[0]["emb"]}) > 2
