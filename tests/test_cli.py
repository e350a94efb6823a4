"""The distserver command, driven as subprocesses."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import distserver
from distserver._cpus import usable_cpus
from distserver.cli import build_parser
from distserver.testing import free_ports

ROOT = Path(__file__).resolve().parent.parent


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
            # (one BLAS thread each: two tasks on this host's CPUs, `_blas.threads_per_local_task`)
            assert "matrix products: OpenBLAS's " in err
            assert " kernels" in err
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
    assert result.stderr.startswith(
        f"distserver status: UnavailableError: grpc://localhost:{port} does not answer; is it running? "
        f"GetStatus to localhost:{port} failed"
    )
    assert "Traceback" not in result.stderr


def test_serve_with_a_bad_cluster_says_what_is_wrong(python_env):
    result = run_cli(["serve", "--cluster", "{not json"], python_env)
    assert result.returncode != 0
    assert "--cluster is not valid JSON" in result.stderr
    result = run_cli(
        ["serve", "--cluster", '{"worker": ["localhost:1"]}', "--job", "ps", "--task", "0"], python_env
    )
    assert result.returncode == 2
    assert "--job 'ps' is not a job of the cluster; its jobs: worker" in result.stderr


def test_serve_with_a_missing_checkpoint_root_says_so(python_env, tmp_path):
    missing = tmp_path / "missing"
    result = run_cli(
        ["serve", "--cluster", '{"worker": ["localhost:0"]}', "--checkpoint-root", str(missing)], python_env
    )
    assert result.returncode == 2
    assert f"checkpoint_root '{missing}' is not an existing directory" in result.stderr


@pytest.mark.parametrize("value", ["-1", "1000001", "half"])
def test_serve_with_a_bad_spin_budget_says_what_is_wrong(python_env, value):
    result = run_cli(["serve", "--cluster", '{"worker": ["localhost:0"]}', "--spin-us", value], python_env)
    assert result.returncode == 2
    expected = f"argument --spin-us: {value!r} is not a whole number of microseconds from 0 to 1000000"
    assert expected in result.stderr


def test_local_cluster_command(python_env):
    result = run_cli(["local-cluster", "--ps", "1", "--workers", "2"], python_env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "3 devices in the cluster:" in result.stdout
    assert "cluster stopped" in result.stdout


def start_serve(args, env):
    proc = subprocess.Popen(
        [sys.executable, "-m", "distserver", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "serving at" in line, proc.stderr.read() if proc.stderr else ""
    return proc


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=30)
    finally:
        proc.kill()


def test_status_names_the_task_that_is_down_within_its_timeout(python_env):
    """The worker is up, its ps is not: status says which task is missing, not DeadlineExceeded.

    A 13 s timeout lets the worker wait past its 10 s "still waiting" log line, which
    `serve`'s default log level shows on stderr.
    """
    ps_port, worker_port = free_ports(2)
    cluster = {"ps": [f"localhost:{ps_port}"], "worker": [f"localhost:{worker_port}"]}
    worker = start_serve(["--cluster", json.dumps(cluster), "--job", "worker", "--task", "0"], python_env)
    try:
        result = run_cli(["status", f"grpc://localhost:{worker_port}", "--timeout", "13"], python_env)
    finally:
        _, worker_log = stop(worker)
    assert result.returncode == 1
    assert result.stderr.startswith(
        "distserver status: UnavailableError: Task /job:ps/replica:0/task:0 did not answer within"
    ), result.stderr
    assert "ListDevices still waiting for response from worker: /job:ps/replica:0/task:0" in worker_log


CLUSTER_2W = '{"ps": ["localhost:1"], "worker": ["localhost:2", "localhost:3"]}'


@pytest.mark.parametrize(
    ("args", "tf_config", "message"),
    [
        (
            ["serve", "--cluster", CLUSTER_2W, "--job", "wroker", "--task", "0"],
            None,
            "distserver serve: --job 'wroker' is not a job of the cluster; its jobs: ps, worker",
        ),
        (
            ["serve", "--cluster", CLUSTER_2W, "--job", "worker", "--task", "3"],
            None,
            "distserver serve: --task 3 is not a task of job 'worker'; its tasks: 0, 1",
        ),
        (
            ["serve", "--cluster", CLUSTER_2W, "--job", "worker"],
            None,
            "distserver serve: --task is missing: job 'worker' has tasks 0, 1",
        ),
        (["serve"], "{not json", "distserver serve: TF_CONFIG is not valid JSON"),
        (["serve"], "[1, 2]", 'distserver serve: TF_CONFIG must look like {"cluster": '),
        (
            ["serve"],
            json.dumps({"cluster": json.loads(CLUSTER_2W), "task": {"type": "chief", "index": 0}}),
            "distserver serve: TF_CONFIG's task.type 'chief' is not a job of the cluster; "
            "its jobs: ps, worker",
        ),
        (["serve", "--cluster", "[1]"], None, "distserver serve: --cluster must map job names to address"),
        (
            ["status", "http://localhost:1"],
            None,
            "distserver status: target 'http://localhost:1': unknown scheme 'http://'; "
            "use one of grpc://, grpc+verbs://",
        ),
        (["local-cluster", "--workers", "0"], None, "distserver local-cluster: --workers must be at least 1"),
        (["local-cluster", "--ps", "-1"], None, "distserver local-cluster: --ps must be 0 or more, not -1"),
        (
            ["local-cluster", "--protocol", "foo"],
            None,
            "distserver local-cluster: --protocol 'foo' is unknown; use one of grpc, grpc+verbs",
        ),
    ],
)
def test_command_line_mistakes_get_one_line_naming_the_option(python_env, args, tf_config, message):
    env = dict(python_env)
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    result = run_cli(args, env)
    assert result.returncode == 2
    assert result.stderr.startswith(message), result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_version(python_env):
    result = run_cli(["--version"], python_env)
    assert result.returncode == 0
    assert result.stdout.strip() == f"distserver {distserver.__version__}"


def _actions(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from ((f"{name} {flag}", sub) for flag, sub in _actions(subparser))
        else:
            yield ",".join(action.option_strings) or action.dest, action


def test_every_option_has_help():
    missing = [name for name, action in _actions(build_parser()) if not action.help]
    assert missing == []


def test_serve_help_names_both_transports(python_env):
    result = run_cli(["serve", "--help"], python_env)
    assert result.returncode == 0
    assert "grpc+verbs" in result.stdout
    assert "grpc+verbs" in (distserver.Server.__doc__ or "")
    assert "grpc+verbs" in (distserver.AsyncServer.__doc__ or "")


def test_local_cluster_keep_serves_until_ctrl_c(python_env):
    proc = subprocess.Popen(
        [sys.executable, "-m", "distserver", "local-cluster", "--ps", "1", "--workers", "1", "--keep"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env,
        start_new_session=True,  # Ctrl-C reaches the whole process group, as in a terminal
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serving until Ctrl-C"):
                break
        target = next(line.split()[1] for line in lines if line.startswith("target: "))
        export = next(line for line in lines if line.startswith("export TF_CONFIG="))
        tf_config = json.loads(export.strip().removeprefix("export TF_CONFIG=").strip("'"))
        assert sorted(tf_config["cluster"]) == ["ps", "worker"]
        assert target == f"grpc://{tf_config['cluster']['worker'][0]}"
        status = run_cli(["status", target], python_env)
        assert status.returncode == 0, status.stderr
        assert len(status.stdout.splitlines()) == 2
        # The pasted TF_CONFIG is enough for a client: status of the ps through it.
        ps_status = run_cli(["status", tf_config["cluster"]["ps"][0]], python_env)
        assert ps_status.returncode == 0, ps_status.stderr
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out.rstrip().endswith("cluster stopped")
        assert "Traceback" not in err
    finally:
        proc.kill()


def test_ctrl_c_in_the_demo_exits_quietly(python_env):
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "examples" / "parameter_server_training.py"),
            "--local",
            "--dataset",
            "blobs",
            "--steps",
            "1000000",
            "--log-every",
            "1000000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("initial test loss"):  # training is under way
                break
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert err.strip() == "interrupted"
    finally:
        proc.kill()


_SWALLOWED_INTERRUPT = """
import os, signal
from distserver._process import exit_quietly_on_interrupt

def tick():
    pass

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives while a finalizer runs,
        tick()  # where Python raises it, prints it and swallows it

def main():
    Finalized()
    raise RuntimeError("the tasks the same Ctrl-C stopped failed the next call")

exit_quietly_on_interrupt(main)
"""


def test_ctrl_c_swallowed_by_a_finalizer_still_exits_quietly(python_env, tmp_path):
    # How the demo's Ctrl-C test can fail (it did once in CI, exit 1, its stderr not
    # kept): the interrupt raised inside a finalizer, `main` going on to fail on the
    # tasks the same Ctrl-C stopped.
    script = tmp_path / "swallowed.py"
    script.write_text(_SWALLOWED_INTERRUPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=python_env, timeout=60
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "interrupted"


def test_status_only_target_checks_the_task_not_its_cluster(python_env):
    ps_port, worker_port = free_ports(2)
    cluster = {"ps": [f"localhost:{ps_port}"], "worker": [f"localhost:{worker_port}"]}  # no ps running
    worker = start_serve(["--cluster", json.dumps(cluster), "--job", "worker", "--task", "0"], python_env)
    try:
        result = run_cli(["status", f"grpc://localhost:{worker_port}", "--only-target"], python_env)
    finally:
        stop(worker)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"grpc://localhost:{worker_port} is serving\n"


def _thread_cpus(pid: int) -> dict[int, set[int]]:
    """Each thread of process `pid` (its id) -> the CPUs it may run on."""
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
@pytest.mark.parametrize(
    ("jobs", "serve_args", "pinned"),
    [({"worker": 1}, [], True), ({"worker": 1}, ["--no-pin-loop"], False), ({"worker": 2}, [], False)],
    ids=["alone on its host", "--no-pin-loop", "sharing its host"],
)
def test_serve_keeps_the_event_loop_of_a_task_alone_on_its_host_on_one_cpu(jobs, serve_args, pinned):
    from distserver.testing import LocalCluster

    allowed = os.sched_getaffinity(0)
    with LocalCluster(jobs, serve_args=serve_args) as cluster:
        with distserver.Session(cluster.target("worker")) as session:  # a step: the compute pool starts
            assert session.run(distserver.constant(2.0) * 3.0) == 6.0
        pid = cluster.processes["/job:worker/replica:0/task:0"].pid
        threads = _thread_cpus(pid)
    loop = threads.pop(pid)  # (the main thread runs the event loop)
    if not pinned:
        assert loop == allowed
        assert all(cpus == allowed for cpus in threads.values())
        return
    assert len(loop) == 1
    assert loop < allowed
    # The compute pool's threads share the loop's CPU; every other thread keeps off it.
    assert all(cpus == loop or cpus == allowed - loop for cpus in threads.values())
    assert any(cpus == allowed - loop for cpus in threads.values())


@pytest.mark.skipif(usable_cpus() > 4, reason="as many task processes as CPUs")
@pytest.mark.parametrize(
    ("workers", "serve_args", "batch"),
    [(1, [], False), (usable_cpus() + 1, [], True), (usable_cpus() + 1, ["--no-batch-scheduling"], False)],
    ids=["alone on its host", "more tasks than CPUs", "--no-batch-scheduling"],
)
def test_serve_schedules_every_thread_as_batch_work_where_tasks_outnumber_cpus(workers, serve_args, batch):
    from distserver.testing import LocalCluster

    with LocalCluster({"worker": workers}, serve_args=serve_args) as cluster:
        with distserver.Session(cluster.target("worker")) as session:  # a step: the compute pool starts
            assert session.run(distserver.constant(2.0) * 3.0) == 6.0
        pid = cluster.processes["/job:worker/replica:0/task:0"].pid
        policies = {int(tid): os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}
        log = cluster.stderr("/job:worker/replica:0/task:0")
    # Every thread: the loop's, those started before the policy was set (BLAS's, the
    # transports'), and after it (the compute pool's).
    assert len(policies) > 2
    # (not batch: the policy the task inherited from this process)
    expected = os.SCHED_BATCH if batch else os.sched_getscheduler(0)
    assert set(policies.values()) == {expected}, policies
    assert ("threads scheduled as batch work" in log) == batch, log


def _cpu_seconds(pid: int) -> float:
    """The CPU time process `pid` has used (user and system)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_MORE_TASKS_THAN_CPUS = pytest.mark.skipif(usable_cpus() > 4, reason="as many task processes as CPUs")


@contextlib.contextmanager
def _other_tasks_working(count: int) -> Iterator[None]:
    """`count` other tasks of this host running a graph, as `distserver serve` records them."""
    from distserver import _cpus

    others = [_cpus.host_tasks(usable_cpus()) for _ in range(count)]
    try:
        for other in others:
            assert other is not None
            other.busy()
        yield
    finally:
        for other in others:
            if other is not None:
                other.close()


@pytest.mark.skipif(usable_cpus() < 2, reason="needs two CPUs (a task on one never polls)")
@pytest.mark.parametrize(
    ("jobs", "serve_args", "others_working", "polls"),
    [
        ({"worker": 1}, ["--spin-us", "500000"], 0, True),
        ({"worker": 1}, ["--spin-us", "0"], 0, False),
        pytest.param(
            {"worker": usable_cpus() + 1},
            ["--spin-us", "500000"],
            usable_cpus(),
            False,
            marks=_MORE_TASKS_THAN_CPUS,
        ),
    ],
    # (A task that shares its host polls after it answers distserver's client while
    # the tasks working on the host leave it a CPU:
    # `test_serve_keeps_the_event_loop_polling_after_its_answer_to_a_peer_task`.)
    ids=["alone on its host", "--spin-us 0", "more tasks than CPUs, more working"],
)
def test_serve_keeps_the_event_loop_of_a_task_alone_on_its_host_polling_after_a_step(
    jobs, serve_args, others_working, polls
):
    from distserver.testing import LocalCluster

    with (
        _other_tasks_working(others_working),
        LocalCluster(jobs, serve_args=serve_args) as cluster,
    ):
        pid = cluster.processes["/job:worker/replica:0/task:0"].pid
        with distserver.Session(cluster.target("worker")) as session:
            step = distserver.constant(2.0) * 3.0
            assert session.run(step) == 6.0  # (the first step starts the compute pool)
            time.sleep(0.7)  # (its polling, if any, is over)
            used, after = _cpu_after_a_step(session, step, pid)
    # Polling, the loop's thread takes a CPU (or its share of one) for the whole wait;
    # else the task uses a few milliseconds for the step.
    assert (used > 0.1) == polls, used
    assert after < 0.1, after


def _cpu_after_a_step(session: distserver.Session, step: distserver.Tensor, pid: int) -> tuple[float, float]:
    """The CPU seconds process `pid` uses in the 0.3 s after a step (within a half
    second of polling), and in 0.3 s starting 0.7 s after it (when that is over)."""
    before = _cpu_seconds(pid)
    assert session.run(step) == 6.0
    time.sleep(0.3)
    used = _cpu_seconds(pid) - before
    time.sleep(0.4)
    before = _cpu_seconds(pid)
    time.sleep(0.3)
    return used, _cpu_seconds(pid) - before


@pytest.mark.skipif(usable_cpus() < 2, reason="needs two CPUs (a task on one never polls)")
@pytest.mark.parametrize(
    ("protocol", "jobs", "serve_args", "others_working", "polls"),
    [
        ("grpc", {"ps": 1, "worker": 1}, ["--spin-us", "500000"], 0, True),
        ("grpc+verbs", {"ps": 1, "worker": 1}, ["--spin-us", "500000"], 0, True),
        ("grpc", {"ps": 1, "worker": 1}, ["--spin-us", "0"], 0, False),
        pytest.param(
            "grpc",
            {"ps": 1, "worker": usable_cpus()},
            ["--spin-us", "500000"],
            0,
            True,
            marks=_MORE_TASKS_THAN_CPUS,
        ),
        pytest.param(
            "grpc",
            {"ps": 1, "worker": usable_cpus()},
            ["--spin-us", "500000"],
            usable_cpus() - 1,
            False,
            marks=_MORE_TASKS_THAN_CPUS,
        ),
    ],
    ids=[
        "grpc",
        "grpc+verbs",
        "--spin-us 0",
        "more tasks than CPUs, as many working",
        "more tasks than CPUs, more working",
    ],
)
def test_serve_keeps_the_event_loop_polling_after_its_answer_to_a_peer_task(
    protocol, jobs, serve_args, others_working, polls
):
    from distserver.testing import LocalCluster

    env = {"DISTSERVER_VERBS_STRICT": "1"} if protocol == "grpc+verbs" else None
    with (
        _other_tasks_working(others_working),
        LocalCluster(jobs, protocol=protocol, serve_args=serve_args, env=env) as cluster,
    ):
        ps = cluster.processes["/job:ps/replica:0/task:0"].pid
        with distserver.Session(cluster.target("worker")) as session:
            with distserver.device("/job:ps/task:0"):
                two = distserver.constant(2.0) + 0.0
            with distserver.device("/job:worker/task:0"):
                step = two * 3.0  # the worker asks the ps for `two`: the ps answers it
            assert session.run(step) == 6.0
            time.sleep(0.7)  # (its polling, if any, is over)
            assert session.run(step) == 6.0  # (the direct connection between them is up)
            time.sleep(0.7)
            used, after = _cpu_after_a_step(session, step, ps)
    assert (used > 0.1) == polls, used
    assert after < 0.1, after
