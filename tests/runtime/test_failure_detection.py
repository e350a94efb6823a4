"""A peer that stops answering (SIGSTOP: alive, port open, silent) fails steps within bounds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.testing import LocalCluster
from distserver.testing.cluster import free_ports

pytestmark = pytest.mark.slow

PS = "/job:ps/replica:0/task:0"


def _graph():
    graph = ds.Graph()
    with graph.as_default():
        with ds.device("/job:ps/task:0"):
            on_ps = ds.constant(np.arange(4, dtype=np.float32), name="on_ps") * 2.0
        total = ds.reduce_sum(on_ps, name="total")
    return graph, total


def _run_timed(session, fetch, **kwargs):
    started = time.monotonic()
    with pytest.raises(errors.OpError) as info:
        session.run(fetch, **kwargs)
    return info.value, time.monotonic() - started


@pytest.mark.parametrize(
    ("env", "bound"),
    [({}, 30.0), ({"DISTSERVER_KEEPALIVE_MS": "500", "DISTSERVER_KEEPALIVE_TIMEOUT_MS": "500"}, 3.0)],
    ids=["default", "configured"],
)
def test_a_step_touching_a_hung_task_fails_unavailable_naming_it(env, bound):
    with LocalCluster({"ps": 1, "worker": 1}, env=env) as cluster:
        graph, total = _graph()
        with ds.Session(cluster.target("worker"), graph=graph) as session:
            assert session.run(total) == 12.0
            os.kill(cluster.process("ps").pid, signal.SIGSTOP)
            try:
                # No step timeout: keepalive alone must end the wait (~10 s by default).
                error, took = _run_timed(session, total)
            finally:
                os.kill(cluster.process("ps").pid, signal.SIGCONT)
            assert isinstance(error, errors.UnavailableError), error
            assert PS in error.message
            assert took < bound, (took, error)
            print(f"hung ps noticed after {took:.1f} s ({env or 'defaults'})")
            # The task answers again: the next step runs.
            assert session.run(total) == 12.0


def _step_against_a_hung_master(config=None, options=None):
    """A step whose master task is SIGSTOPped once the session works: (error, seconds)."""
    with LocalCluster({"worker": 1}) as cluster:
        graph = ds.Graph()
        with graph.as_default():
            value = ds.constant(3.0) * 2.0
        with ds.Session(cluster.target("worker"), graph=graph, config=config) as session:
            assert session.run(value) == 6.0
            os.kill(cluster.process("worker").pid, signal.SIGSTOP)
            try:
                return _run_timed(session, value, options=options)
            finally:
                os.kill(cluster.process("worker").pid, signal.SIGCONT)
                assert session.run(value) == 6.0  # it answers again


@pytest.mark.parametrize("where", ["RunOptions", "ConfigProto"])
def test_a_hung_master_fails_the_client_soon_after_the_step_timeout(where):
    options = ds.RunOptions(timeout_in_ms=2000 if where == "RunOptions" else 0)
    config = ds.ConfigProto(operation_timeout_in_ms=2000) if where == "ConfigProto" else None
    error, took = _step_against_a_hung_master(config, options)
    assert isinstance(error, errors.DeadlineExceededError), error
    assert took < 10
    assert options.timeout_in_ms == (2000 if where == "RunOptions" else 0)  # the caller's, unchanged


def test_create_session_waits_for_an_absent_task_only_as_long_as_told():
    worker_port, ps_port = free_ports(2)
    spec = {"worker": [f"localhost:{worker_port}"], "ps": [f"localhost:{ps_port}"]}  # ps never starts
    with ds.Server(spec, "worker", 0) as server:
        graph = ds.Graph()
        with graph.as_default():
            value = ds.constant(1.0)
        config = ds.ConfigProto(operation_timeout_in_ms=1500)
        started = time.monotonic()
        with (
            pytest.raises(errors.UnavailableError) as info,
            ds.Session(server.target, graph=graph, config=config) as session,
        ):
            session.run(value)
        assert time.monotonic() - started < 10
        assert "/job:ps/replica:0/task:0" in info.value.message


# A client that connects while its task is paused (SIGSTOP: the kernel accepts the
# connection, nobody answers it), then prints what its step gave and when.
_CONNECTING_CLIENT = """
import json, os, signal, sys, threading, time
import distserver as ds
target, pid, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
graph = ds.Graph()
with graph.as_default():
    value = ds.constant(3.0) * 2.0
os.kill(pid, signal.SIGSTOP)
resume = threading.Timer(pause, os.kill, (pid, signal.SIGCONT))
resume.daemon = True  # the test resumes the task too, once this client is done
resume.start()
started = time.monotonic()
try:
    with ds.Session(target, graph=graph) as session:
        outcome = float(session.run(value))
except ds.errors.OpError as exc:
    outcome = type(exc).__name__ + ": " + exc.message
print(json.dumps([outcome, time.monotonic() - started]))
"""


def _connect_while_paused(pause, **env):
    with LocalCluster({"worker": 1}) as cluster:
        pid = cluster.process("worker").pid
        try:
            out = subprocess.run(
                [sys.executable, "-c", _CONNECTING_CLIENT, cluster.target("worker"), str(pid), str(pause)],
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, **env},
            )
        finally:
            os.kill(pid, signal.SIGCONT)
        assert out.returncode == 0, out.stderr
        outcome, took = json.loads(out.stdout.splitlines()[-1])
        return outcome, took


def test_a_new_connection_waits_for_a_task_busy_for_a_moment():
    # gRPC core's handshake timeout was 100-250 ms: any pause longer failed the call.
    outcome, took = _connect_while_paused(1.5)
    assert outcome == 6.0
    assert took >= 1.4


def test_a_new_connection_to_a_silent_task_fails_within_the_keepalive_bound():
    # DISTSERVER_KEEPALIVE_MS + DISTSERVER_KEEPALIVE_TIMEOUT_MS: 1 s to finish a handshake.
    outcome, took = _connect_while_paused(
        20.0, DISTSERVER_KEEPALIVE_MS="500", DISTSERVER_KEEPALIVE_TIMEOUT_MS="500"
    )
    assert outcome.startswith("UnavailableError"), outcome
    assert "SETTINGS" in outcome or "connect" in outcome, outcome
    assert took < 5, took
