"""distserver's cluster coordinator driving TensorFlow's own servers (TF 2.21, one process per task).

The coordinator's sessions are plain TF 1.x between-graph sessions (device filters
per worker), its probe is WorkerService.GetStatus and its per-worker dataset is
made of resource variables, so it needs nothing that TensorFlow's servers lack:
training steps (ds.train) spread over TF's workers, each reading its own shard, and
a TF worker killed mid-run has its steps rerun on the other one.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading

import numpy as np
import pytest

import distserver as ds
from distserver.testing import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

SERVER = """
import json, sys, tensorflow as tf
cluster = json.loads(sys.argv[1])
server = tf.distribute.Server(cluster, sys.argv[2], int(sys.argv[3]))
print("serving", flush=True)
server.join()
"""


@pytest.fixture
def tf_cluster(tf_client):
    ports = iter(free_ports(3))
    cluster = {"ps": [f"localhost:{next(ports)}"], "worker": [f"localhost:{next(ports)}" for _ in range(2)]}
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("GRPC_EXPERIMENTS", None)
    processes = {
        (job, task): subprocess.Popen(
            [tf_client.python, "-c", SERVER, json.dumps(cluster), job, str(task)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for job, addresses in cluster.items()
        for task in range(len(addresses))
    }
    try:
        for process in processes.values():
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "serving"
        yield cluster, processes
    finally:
        for process in processes.values():
            process.kill()
            process.wait(timeout=30)
            if process.stdout is not None:
                process.stdout.close()


def test_the_coordinator_trains_on_tensorflow_servers_and_survives_a_killed_worker(tf_cluster):
    cluster, processes = tf_cluster
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(400, 3)).astype(np.float32)
    targets = rows @ np.array([2.0, -1.0, 0.5], np.float32) + 3.0
    graph = ds.Graph()
    released = threading.Event()
    arrived = threading.Event()

    def feed(worker):
        # Hold worker 1's first step until that worker has been killed.
        if worker == 1 and not released.is_set():
            arrived.set()
            released.wait(60)
        return {}

    with ds.ClusterCoordinator(cluster, graph, step_timeout=20) as coordinator:
        data = coordinator.create_per_worker_dataset((rows, targets), batch_size=20, shuffle_seed=None)
        with graph.as_default():
            with ds.device(ds.replica_device_setter(ps_tasks=1, worker_device="/job:worker")):
                w = ds.Variable(np.zeros(3, np.float32), name="w")
                b = ds.Variable(np.float32(0), name="b")
                x, y = data.batch
                error = ds.reduce_sum(x * w, axis=1) + b - y
                loss = ds.reduce_mean(error * error)
                global_step = ds.train.get_or_create_global_step()
                train = ds.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=global_step)
            init = ds.global_variables_initializer()
        coordinator.schedule(init).fetch()
        first = [coordinator.schedule([train, x], feed_dict=feed) for _ in range(60)]
        assert arrived.wait(120)
        processes[("worker", 1)].kill()
        processes[("worker", 1)].wait(timeout=30)
        released.set()
        coordinator.join()
        # Worker 0 read rows 0..199 only, worker 1 rows 200..399.
        for value in first:
            shard_rows = value.fetch()[1]
            start = 0 if value.worker == 0 else 200
            assert any(np.array_equal(shard_rows[0], rows[i]) for i in range(start, start + 200))
        moved = [v for v in first if v.attempts > 1]
        assert moved
        assert all(v.worker == 0 for v in moved)
        assert coordinator.available_workers() == [0]
        for _ in range(240):
            coordinator.schedule(train)
        coordinator.join()
        assert coordinator.schedule(global_step.value()).fetch() >= 300
        learned_w, learned_b = coordinator.schedule([w, b]).fetch()
        np.testing.assert_allclose(learned_w, [2.0, -1.0, 0.5], atol=0.05)
        assert abs(learned_b - 3.0) < 0.05
