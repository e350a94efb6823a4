"""`LocalCluster`: N tasks of a cluster, each its own OS process, on this machine.

Each task runs `python -m distserver serve` on a loopback port chosen for it.
`start()` returns once every task prints that it is serving; `stop()` sends
SIGTERM (a graceful stop), then SIGKILL after a bound. Children also die with the
parent (`distserver serve` sets Linux's `PR_SET_PDEATHSIG` when the environment
names its parent), so a crashed test leaves no server behind.

Ports: the cluster spec must list every address before any task starts, so free
ports are picked up front by binding port 0 and releasing it. Another process
could take such a port in between; `start()` then retries with new ports.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

# How many of a task's last stderr lines an error inside a `LocalCluster` carries.
NOTED_STDERR_LINES = 20


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


class LocalCluster:
    """Start `{job: number_of_tasks}` as separate `distserver serve` processes.

    Args:
        jobs: Job name -> number of tasks, e.g. `{"ps": 1, "worker": 2}`.
        protocol: Transport for every task.
        host: Host in every address ("localhost" binds loopback only).
        env: Extra environment variables for the task processes.
        start_timeout: Seconds each start attempt may take.
        serve_args: More `distserver serve` options for every task (e.g. the
            security options `--tls-cert F ... --auth-token-file F`).
        served_jobs: The jobs this cluster starts processes for (default: all). The
            other jobs get addresses in `cluster` but no process: something else
            serves them (TensorFlow servers, in a mixed cluster).

    The tasks leave a terminal's Ctrl-C (SIGINT) to the program that started them:
    `stop()` ends them, and they end themselves when that program dies.

    Use as a context manager, or call `start()` and `stop()`.
    """

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        *,
        protocol: str = "grpc",
        host: str = "localhost",
        env: Mapping[str, str] | None = None,
        start_timeout: float = 60.0,
        serve_args: Sequence[str] = (),
        served_jobs: Sequence[str] | None = None,
    ) -> None:
        self.jobs = dict(jobs or {"ps": 1, "worker": 2})
        self.served_jobs = list(self.jobs if served_jobs is None else served_jobs)
        unknown = sorted(set(self.served_jobs) - set(self.jobs))
        if unknown:
            raise ValueError(f"served_jobs names jobs the cluster lacks: {unknown}")
        self.protocol = protocol
        self.host = host
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.serve_args = list(serve_args)
        self.cluster: dict[str, list[str]] = {}
        self.processes: dict[str, subprocess.Popen[str]] = {}
        # stderr goes to files: an undrained pipe would block a chatty task.
        self._stderr: dict[str, Any] = {}
        self._commands: dict[str, list[str]] = {}
        self._env: dict[str, str] = {}

    @property
    def targets(self) -> dict[str, str]:
        """Task name ("/job:ps/replica:0/task:0") -> "grpc://host:port"."""
        return {
            f"/job:{job}/replica:0/task:{i}": f"grpc://{address}"
            for job, addresses in self.cluster.items()
            for i, address in enumerate(addresses)
        }

    @property
    def pids(self) -> dict[str, int]:
        return {task: proc.pid for task, proc in self.processes.items()}

    def target(self, job: str, task: int = 0) -> str:
        return f"grpc://{self.cluster[job][task]}"

    def process(self, job: str, task: int = 0) -> subprocess.Popen[str]:
        return self.processes[f"/job:{job}/replica:0/task:{task}"]

    def start(self, attempts: int = 3) -> LocalCluster:
        last_error: Exception | None = None
        for _ in range(attempts):
            try:
                self._start_once()
                return self
            except _PortTaken as exc:
                last_error = exc
                self.stop()
        raise RuntimeError(f"could not start the local cluster: {last_error}")

    def _start_once(self) -> None:
        total = sum(self.jobs.values())
        ports = iter(free_ports(total))
        self.cluster = {job: [f"{self.host}:{next(ports)}" for _ in range(n)] for job, n in self.jobs.items()}
        # DISTSERVER_PARENT_PID: the task kills itself when this process dies (set
        # by the task itself; a preexec_fn would make Popen fork, which breaks gRPC).
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1", "DISTSERVER_PARENT_PID": str(os.getpid())}
        env.pop("TF_CONFIG", None)
        self._env = env
        cluster_json = json.dumps(self.cluster)
        for job, addresses in self.cluster.items():
            if job not in self.served_jobs:
                continue
            for index in range(len(addresses)):
                command = [
                    sys.executable, "-m", "distserver", "serve",
                    "--cluster", cluster_json, "--job", job, "--task", str(index),
                    "--protocol", self.protocol, *self.serve_args,
                ]  # fmt: skip
                task = f"/job:{job}/replica:0/task:{index}"
                self._commands[task] = command
                self._spawn(task)
        deadline = time.monotonic() + self.start_timeout
        for task, proc in self.processes.items():
            self._wait_serving(task, proc, deadline)

    def _spawn(self, task: str) -> None:
        if task not in self._stderr:
            self._stderr[task] = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        self.processes[task] = subprocess.Popen(
            self._commands[task],
            stdout=subprocess.PIPE,
            stderr=self._stderr[task],
            text=True,
            env=self._env,
        )

    def restart(self, job: str, task: int = 0) -> None:
        """Start a task again at the same address (after `kill`); waits until it serves."""
        name = f"/job:{job}/replica:0/task:{task}"
        old = self.processes[name]
        if old.poll() is None:
            raise RuntimeError(f"{name} is still running; kill() it first")
        if old.stdout is not None:
            old.stdout.close()
        self._spawn(name)
        self._wait_serving(name, self.processes[name], time.monotonic() + self.start_timeout)

    def _wait_serving(self, task: str, proc: subprocess.Popen[str], deadline: float) -> None:
        assert proc.stdout is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"{task} did not start serving within {self.start_timeout} s")
            readable, _, _ = select.select([proc.stdout], [], [], min(remaining, 1.0))
            if readable:
                line = proc.stdout.readline()
                if "serving at" in line:
                    return
                if line:
                    continue
            if proc.poll() is not None:
                stderr = self.stderr(task)
                if "address" in stderr.lower() and ("in use" in stderr.lower() or "bind" in stderr.lower()):
                    raise _PortTaken(f"{task}: {stderr.strip().splitlines()[-1]}")
                raise RuntimeError(f"{task} exited with status {proc.returncode} before serving:\n{stderr}")

    def kill(self, job: str, task: int = 0) -> None:
        """SIGKILL one task (to test peer death)."""
        proc = self.process(job, task)
        proc.kill()
        proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> dict[str, int]:
        """Stop every task; returns their exit codes. Idempotent."""
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        deadline = time.monotonic() + timeout
        for task, proc in self.processes.items():
            try:
                codes[task] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[task] = proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for stream in self._stderr.values():
            stream.close()
        self.processes = {}
        self._stderr = {}
        return codes

    def stderr(self, task: str) -> str:
        """What a task wrote to stderr so far."""
        stream = self._stderr[task]
        stream.flush()
        stream.seek(0)
        text: str = stream.read()
        return text

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type: Any, exc: BaseException | None, traceback: Any) -> None:
        if exc is not None:
            self._note_tasks(exc)
        self.stop()

    def _note_tasks(self, exc: BaseException) -> None:
        """Add to `exc` each task's state and the last lines it wrote to stderr: an
        error inside the cluster (a failing test) then says what its tasks said."""
        for task, proc in self.processes.items():
            try:
                lines = self.stderr(task).strip().splitlines()[-NOTED_STDERR_LINES:]
            except (OSError, ValueError):  # (its file already closed)
                continue
            state = "running" if proc.poll() is None else f"exited with status {proc.returncode}"
            said = "\n".join(f"  {line}" for line in lines) if lines else "  (nothing)"
            exc.add_note(f"{task} ({state}) wrote to stderr, last lines:\n{said}")


class _PortTaken(Exception):
    pass
