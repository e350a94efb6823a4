"""A cluster across network namespaces joined by a veth link: cutting the link fails steps in bounds.

The ps runs in one namespace, the worker (and the client) in another, joined by a veth
pair with private addresses that exist only inside the two namespaces. Taking the ps end
of the link down makes every packet between them vanish, as a pulled cable or a dead
switch would: no reset, no refusal, only silence. The keepalive bound must turn that
into an `UnavailableError` naming the ps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from distserver.testing import free_ports

pytestmark = pytest.mark.slow

PS_ADDRESS, WORKER_ADDRESS = "10.213.7.1", "10.213.7.2"

CLIENT = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import distserver as ds

    graph = ds.Graph()
    with graph.as_default():
        with ds.device("/job:ps/task:0"):
            on_ps = ds.constant(np.arange(4, dtype=np.float32)) * 2.0
        total = ds.reduce_sum(on_ps)
    with ds.Session(sys.argv[1], graph=graph) as session:
        for line in sys.stdin:  # one step per line, reported as a JSON line
            started = time.monotonic()
            try:
                result = {"value": float(session.run(total))}
            except ds.errors.OpError as exc:
                result = {"error": type(exc).__name__, "message": exc.message}
            result["seconds"] = time.monotonic() - started
            print(json.dumps(result), flush=True)
    """
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespaces():
    """Two namespaces joined by a veth pair; removed afterwards."""
    tag = f"{os.getpid() % 100000}"
    ps_ns, worker_ns = f"ds-ps-{tag}", f"ds-wk-{tag}"
    try:
        _ip("netns", "add", ps_ns)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot make network namespaces here (needs root or CAP_NET_ADMIN): {exc}")
    try:
        _ip("netns", "add", worker_ns)
        _ip(
            "link",
            "add",
            f"veth-ps-{tag}",
            "netns",
            ps_ns,
            "type",
            "veth",
            "peer",
            "name",
            f"veth-wk-{tag}",
            "netns",
            worker_ns,
        )
        for ns, link, address in (
            (ps_ns, f"veth-ps-{tag}", PS_ADDRESS),
            (worker_ns, f"veth-wk-{tag}", WORKER_ADDRESS),
        ):
            _ip("-n", ns, "addr", "add", f"{address}/30", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield ps_ns, worker_ns, f"veth-ps-{tag}"
    finally:
        for ns in (ps_ns, worker_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _in(ns: str, *command: str, **kwargs) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DISTSERVER_PARENT_PID": str(os.getpid())}
    return subprocess.Popen(["ip", "netns", "exec", ns, *command], text=True, env=env, **kwargs)


def _serving(task: subprocess.Popen[str]) -> None:
    assert task.stdout is not None
    line = task.stdout.readline()
    assert "serving at" in line, line


def test_a_cut_link_fails_steps_unavailable_naming_the_task_and_recovers(namespaces):
    ps_ns, worker_ns, ps_link = namespaces
    ps_port, worker_port = free_ports(2)
    cluster = json.dumps({"ps": [f"{PS_ADDRESS}:{ps_port}"], "worker": [f"{WORKER_ADDRESS}:{worker_port}"]})
    serve = [sys.executable, "-m", "distserver", "serve", "--cluster", cluster]
    tasks = [
        _in(ps_ns, *serve, "--job", "ps", "--task", "0", stdout=subprocess.PIPE),
        _in(worker_ns, *serve, "--job", "worker", "--task", "0", stdout=subprocess.PIPE),
    ]
    client = None
    try:
        for task in tasks:
            _serving(task)
        client = _in(
            worker_ns, sys.executable, "-c", CLIENT, f"grpc://{WORKER_ADDRESS}:{worker_port}",
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert client.stdin is not None
        assert client.stdout is not None

        def step() -> dict:
            client.stdin.write("step\n")
            client.stdin.flush()
            return json.loads(client.stdout.readline())

        assert step()["value"] == 12.0
        _ip("-n", ps_ns, "link", "set", ps_link, "down")  # silence: no reset, no refusal
        cut = step()
        assert cut.get("error") == "UnavailableError", cut
        assert "/job:ps/replica:0/task:0" in cut["message"], cut
        assert cut["seconds"] < 30, cut  # the keepalive bound is ~10 s
        print(f"link cut: {cut['error']} after {cut['seconds']:.1f} s")
        _ip("-n", ps_ns, "link", "set", ps_link, "up")
        deadline = time.monotonic() + 60
        while (again := step()).get("value") != 12.0:
            assert again.get("error") in ("UnavailableError", "AbortedError"), again
            assert time.monotonic() < deadline, again
            time.sleep(0.5)
    finally:
        for process in [*tasks, *([client] if client else [])]:
            process.kill()
            process.wait(timeout=30)
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()
