"""The distserver command, driven as subprocesses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from distserver.testing import free_ports


def run_cli(args, env, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "distserver", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_serve_then_status_then_sigterm(python_env):
    ports = free_ports(2)
    cluster = {"ps": [f"localhost:{ports[0]}"], "worker": [f"localhost:{ports[1]}"]}
    procs = []
    try:
        for job in ("ps", "worker"):
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
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=python_env,
            )
            procs.append(proc)
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert f"/job:{job}/replica:0/task:0 serving at grpc://localhost:" in line
        result = run_cli(["status", f"grpc://localhost:{ports[1]}"], python_env)
        assert result.returncode == 0, result.stderr
        names = [line.split("\t")[0] for line in result.stdout.splitlines()]
        assert names == ["/job:worker/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:0/device:CPU:0"]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
            assert "SIGTERM, stopping" in err
    finally:
        for proc in procs:
            proc.kill()


def test_serve_from_tf_config(python_env):
    (port,) = free_ports(1)
    env = dict(python_env)
    env["TF_CONFIG"] = json.dumps(
        {"cluster": {"chief": [f"localhost:{port}"]}, "task": {"type": "chief", "index": 0}}
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "distserver", "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        assert f"/job:chief/replica:0/task:0 serving at grpc://localhost:{port}" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
        assert proc.returncode == 0
    finally:
        proc.kill()


def test_status_of_a_target_that_is_down(python_env):
    (port,) = free_ports(1)
    result = run_cli(["status", f"grpc://localhost:{port}", "--timeout", "5"], python_env)
    assert result.returncode == 1
    assert result.stderr.startswith("distserver status: UnavailableError: ListDevices to localhost:")
    assert "Traceback" not in result.stderr


def test_serve_with_a_bad_cluster_says_what_is_wrong(python_env):
    result = run_cli(["serve", "--cluster", "{not json"], python_env)
    assert result.returncode != 0
    assert "--cluster is not valid JSON" in result.stderr
    result = run_cli(
        ["serve", "--cluster", '{"worker": ["localhost:1"]}', "--job", "ps", "--task", "0"], python_env
    )
    assert result.returncode == 1
    assert 'InternalError: Job "ps" was not defined in cluster' in result.stderr


def test_serve_with_a_missing_checkpoint_root_says_so(python_env, tmp_path):
    missing = tmp_path / "missing"
    result = run_cli(
        ["serve", "--cluster", '{"worker": ["localhost:0"]}', "--checkpoint-root", str(missing)], python_env
    )
    assert result.returncode == 2
    assert f"checkpoint_root '{missing}' is not an existing directory" in result.stderr


def test_local_cluster_command(python_env):
    result = run_cli(["local-cluster", "--ps", "1", "--workers", "2"], python_env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "3 devices in the cluster:" in result.stdout
    assert "cluster stopped" in result.stdout
