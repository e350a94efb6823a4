"""TensorFlow 2 `ParameterServerStrategy` with distserver tasks as its parameter servers.

A mixed cluster: a TensorFlow 2.21 coordinator (the chief, `clients/tf2_parameter_servers.py`)
and two TensorFlow worker processes (`clients/tf2_server.py`), with two distserver
`serve` processes as the ps tasks. The coordinator talks to the ps tasks through the
EagerService (contexts, variables, reads) and the workers run the ps part of each step
there (component functions, RecvTensor both ways).

The same program runs on an all-TensorFlow cluster; its deterministic part (steps run
one at a time) must end with the same variables within float32 rounding.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from distserver.testing import LocalCluster, free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600, func_only=True)]

CLIENTS = Path(__file__).resolve().parent / "clients"
JOBS = {"chief": 1, "worker": 2, "ps": 2}


class TFServers:
    """TensorFlow server processes for some tasks of a cluster (`clients/tf2_server.py`)."""

    def __init__(self, python: str, cluster: dict[str, list[str]], tasks: list[tuple[str, int]]) -> None:
        self.commands = {
            task: [python, str(CLIENTS / "tf2_server.py"), json.dumps({"cluster": cluster, "job": task[0],
                                                                       "task": task[1]})]
            for task in tasks
        }  # fmt: skip
        self.processes: dict[tuple[str, int], subprocess.Popen[str]] = {}
        try:
            for task, command in self.commands.items():
                self.processes[task] = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
            for task, process in self.processes.items():
                assert process.stdout is not None
                line = process.stdout.readline()  # bounded: the module's timeout
                if "serving at" not in line:
                    raise RuntimeError(f"TensorFlow server {task} did not start (exit {process.poll()})")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()


def _tf_cluster(python: str) -> tuple[dict[str, list[str]], TFServers]:
    ports = iter(free_ports(sum(JOBS.values())))
    cluster = {job: [f"localhost:{next(ports)}" for _ in range(n)] for job, n in JOBS.items()}
    servers = TFServers(python, cluster, [(job, i) for job in ("worker", "ps") for i in range(JOBS[job])])
    return cluster, servers


@pytest.fixture(scope="module")
def tensorflow_run(tf_client) -> dict:
    """The program on an all-TensorFlow cluster."""
    cluster, servers = _tf_cluster(tf_client.python)
    try:
        return tf_client.run("tf2_parameter_servers.py", {"cluster": cluster, "mode": "train"}, timeout=400)
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def mixed_cluster(tf_client) -> Iterator[tuple[LocalCluster, TFServers]]:
    """distserver ps tasks; TensorFlow workers; the chief's address is left for the coordinator."""
    with LocalCluster(JOBS, served_jobs=["ps"]) as cluster:
        servers = TFServers(tf_client.python, cluster.cluster, [("worker", 0), ("worker", 1)])
        try:
            yield cluster, servers
        finally:
            servers.stop()


@pytest.fixture(scope="module")
def distserver_run(tf_client, mixed_cluster) -> dict:
    cluster, _ = mixed_cluster
    return tf_client.run(
        "tf2_parameter_servers.py", {"cluster": cluster.cluster, "mode": "train"}, timeout=400
    )


def test_variables_are_spread_over_the_distserver_ps_tasks(distserver_run, check):
    placement = check(distserver_run, "placement")
    assert {device.split("/device")[0] for device in placement.values()} == {
        "/job:ps/replica:0/task:0",
        "/job:ps/replica:0/task:1",
    }


def test_sgd_and_adam_steps_lower_the_loss(distserver_run, check):
    sgd, adam = check(distserver_run, "sgd"), check(distserver_run, "adam")
    assert sgd[-1] < sgd[0]
    assert adam[-1] < adam[0]
    assert check(distserver_run, "loss_after_sequential") < check(distserver_run, "loss_before")


def test_losses_and_final_variables_match_tensorflow(distserver_run, tensorflow_run, check):
    for phase in ("loss_before", "sgd", "adam", "loss_after_sequential", "keras"):
        np.testing.assert_allclose(check(distserver_run, phase), check(tensorflow_run, phase), rtol=1e-5)
    for weights in ("weights", "keras_weights"):
        ours, theirs = check(distserver_run, weights), check(tensorflow_run, weights)
        assert sorted(ours) == sorted(theirs)
        for name in theirs:
            np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_keras_model_trains_with_keras_adam(distserver_run, check):
    losses = check(distserver_run, "keras")
    assert len(losses) == 8
    # Batch i and batch i + 4 are the same data (four batches of 16): each loss fell.
    assert all(later < earlier for earlier, later in zip(losses[:4], losses[4:], strict=True))
    weights = check(distserver_run, "keras_weights")
    assert weights["adam/iteration"] == 8


def test_steps_take_batches_from_a_per_worker_dataset(distserver_run, check):
    losses = check(distserver_run, "dataset")
    assert len(losses) == 8
    assert all(np.isfinite(losses))
    assert check(distserver_run, "loss_after_dataset") < check(distserver_run, "loss_before")


def test_many_concurrent_steps_all_run_and_train(distserver_run, check):
    concurrent = check(distserver_run, "concurrent")
    assert len(concurrent["losses"]) == 40
    # Every step ran its ps part once: 12 + 12 sequential steps, then 40 scheduled at once.
    assert concurrent["counter"] == 12 + 12 + 40
    assert check(distserver_run, "loss_after_concurrent") < check(distserver_run, "loss_after_sequential")


def test_the_coordinator_recovers_from_a_killed_worker(tf_client, mixed_cluster, distserver_run, check):
    # After the training run (module order): the same ps tasks, a fresh coordinator.
    cluster, servers = mixed_cluster
    worker = servers.processes[("worker", 1)]
    results = tf_client.run(
        "tf2_parameter_servers.py",
        {"cluster": cluster.cluster, "mode": "kill_worker",
         "kill": {"pid": worker.pid, "command": servers.commands[("worker", 1)]}},
        timeout=400,
    )  # fmt: skip
    recovery = check(results, "recovery")
    assert len(recovery["losses"]) == recovery["scheduled"] == 50
    # At least once: a step whose worker died after its ps part ran may run again.
    assert recovery["counter"] >= 50
    assert check(results, "loss_after") < check(results, "loss_before")
    worker.wait()
    assert all(process.poll() is None for task, process in servers.processes.items() if task != ("worker", 1))
    assert all(cluster.processes[task].poll() is None for task in cluster.processes)
