"""Server statistics, `distserver status --stats` and the Prometheus endpoint, against a known workload.

Two tasks, each a `distserver serve` process; the worker also serves metrics. A client
runs `STEPS` steps, each pulling one 2 MiB tensor from the ps to the worker (above the
push limit, so it travels by RecvTensor on the data path) and one of 256 KiB (pushed:
it comes back inside the ps's RunGraph response), and one step that fails.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import distserver as ds
from distserver.testing import free_ports

STEPS = 4
ROWS, COLS = 512, 1024  # float32: 2 MiB
NBYTES = ROWS * COLS * 4
SMALL = 256 * 256  # float32: 256 KiB
WORKER = "/job:worker/replica:0/task:0"
PS = "/job:ps/replica:0/task:0"


def _serve(cluster, job, protocol, env, *extra):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distserver",
            "serve",
            "--cluster",
            json.dumps(cluster),
            "--job",
            job,
            "--task",
            "0",
            "--protocol",
            protocol,
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    lines = [proc.stdout.readline()]
    assert "serving at" in lines[0], proc.stderr.read() if proc.stderr else ""
    if extra:
        lines.append(proc.stdout.readline())
    return proc, lines


def _run_workload(target):
    graph = ds.Graph()
    with graph.as_default():
        with ds.device("/job:ps/task:0"):
            big = ds.fill([ROWS, COLS], np.float32(1.0))
            small = ds.fill([SMALL], np.float32(1.0))
        with ds.device("/job:worker/task:0"):
            total = ds.reduce_sum(big) + ds.reduce_sum(small)
            unfed = ds.placeholder(ds.float32, shape=[], name="unfed")
            needs_feed = unfed * 2.0
            weight = ds.Variable(np.ones(4, np.float32), name="weight")
            train = ds.train.GradientDescentOptimizer(0.1).minimize(ds.reduce_sum(weight * weight))
            init = ds.global_variables_initializer()
    with ds.Session(target, graph=graph) as session:
        session.run(init)
        for _ in range(STEPS):
            assert session.run([total, train])[0] == ROWS * COLS + SMALL
        with pytest.raises(ds.errors.InvalidArgumentError):
            session.run(needs_feed)


@pytest.mark.parametrize("protocol", ["grpc", "grpc+verbs"])
def test_counters_and_metrics_match_a_known_workload(python_env, protocol):
    ps_port, worker_port = free_ports(2)
    cluster = {"ps": [f"localhost:{ps_port}"], "worker": [f"localhost:{worker_port}"]}
    procs = []
    try:
        ps, _ = _serve(cluster, "ps", protocol, python_env)
        procs.append(ps)
        worker, lines = _serve(cluster, "worker", protocol, python_env, "--metrics-port", "0")
        procs.append(worker)
        url = lines[1].split(" metrics at ")[1].strip()
        assert url.startswith("http://127.0.0.1:")

        _run_workload(f"grpc://localhost:{worker_port}")

        status = subprocess.run(
            [sys.executable, "-m", "distserver", "status", f"grpc://localhost:{worker_port}", "--stats"],
            capture_output=True,
            text=True,
            env=python_env,
            timeout=60,
        )
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.status == 200
            scraped = response.read().decode()
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.communicate(timeout=30)
            finally:
                proc.kill()

    data_path = "verbs" if protocol == "grpc+verbs" else "direct"
    assert status.returncode == 0, status.stderr
    assert f"  steps: {STEPS + 1} ok, 0 in flight, failed: InvalidArgumentError 1;" in status.stdout
    assert f"  optimizer updates: {STEPS} in place, 0 into new arrays" in status.stdout
    # (the worker's GradientDescent has no compiled loop: none was asked for)
    assert "  compiled kernels: unused" in status.stdout
    peer_line = next(line for line in status.stdout.splitlines() if line.startswith(f"  peer {PS} "))
    assert f"via {data_path}:" in peer_line
    assert f"{STEPS} tensors / {STEPS * NBYTES} bytes received" in peer_line

    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(scraped)
        for sample in family.samples
    }

    def value(name, **labels):
        return samples[(name, tuple(sorted({"task": WORKER, **labels}.items())))]

    assert value("distserver_steps_total", result="ok") == STEPS + 1  # and the initializer
    assert value("distserver_steps_total", result="InvalidArgumentError") == 1
    assert value("distserver_steps_in_flight") == 0
    assert value("distserver_step_latency_seconds_count") == STEPS + 2
    assert value("distserver_step_latency_seconds_bucket", le="+Inf") == STEPS + 2
    assert value("distserver_optimizer_updates_total", written="in_place") == STEPS
    assert value("distserver_optimizer_updates_total", written="copied") == 0
    assert value("distserver_step_latency_seconds_sum") > 0
    peer = {"peer": PS, "address": f"localhost:{ps_port}", "data_path": data_path}
    assert value("distserver_peer_tensor_bytes_received_total", **peer) == STEPS * NBYTES
    assert value("distserver_peer_tensors_received_total", **peer) == STEPS
    assert value("distserver_peer_calls_failed_total", **peer) == 0
    # The pushed 256 KiB came back in RunGraph responses: counted there, not as tensors.
    assert value("distserver_peer_call_bytes_received_total", **peer) >= STEPS * SMALL * 4
    assert value("distserver_sessions") == 0


def test_in_process_server_statistics_count_steps_and_failures():
    with ds.Server({"local": ["localhost:0"]}) as server:
        before = server.statistics()
        assert before.steps.started == 0
        graph = ds.Graph()
        with graph.as_default():
            x = ds.placeholder(ds.float32, shape=[], name="x")
            y = x * 3.0
        with ds.Session(server.target, graph=graph) as session:
            for value in range(3):
                assert session.run(y, feed_dict={x: value}) == 3.0 * value
            with pytest.raises(ds.errors.InvalidArgumentError):
                session.run(y)
            during = server.statistics()
        assert during.sessions == 1
        after = server.statistics()
    assert (during.steps.succeeded, during.steps.failed, during.steps.in_flight) == (
        3,
        {"InvalidArgumentError": 1},
        0,
    )
    assert sum(during.steps.latency_counts) == 4
    assert during.graphs.succeeded >= 3
    assert after.sessions == 0
    assert after.as_dict()["steps"]["in_flight"] == 0


def test_step_counters_tell_their_activity_when_each_step_starts_and_when_the_last_one_ends():
    from distserver.runtime.counters import StepCounters

    class Seen:
        def __init__(self) -> None:
            self.told: list[str] = []

        def busy(self) -> None:
            self.told.append("busy")

        def idle(self) -> None:
            self.told.append("idle")

    counters = StepCounters()
    counters.finish(counters.start(), None)  # (no activity set: nothing to tell)
    seen = counters.activity = Seen()
    first = counters.start()
    second = counters.start()  # (two steps at once: each told, not idle between)
    counters.finish(first, None)
    assert seen.told == ["busy", "busy"]
    counters.finish(second, ds.errors.CancelledError("gone"))  # (a failed step ends too)
    assert seen.told == ["busy", "busy", "idle"]
    counters.finish(counters.start(), None)
    assert seen.told == ["busy", "busy", "idle", "busy", "idle"]
    assert counters.snapshot().started == 4
