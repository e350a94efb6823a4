"""TensorFlow's side of the benchmarks (`distserver bench`, `benchmarks/bench_*.py`).

Runs as a script under TensorFlow's Python, which has no distserver: it imports its
sibling file `timing.py` (standard library only) directly, never the package.

Two modes:

``server --cluster JSON --job J --task I``
    One `tf.distribute.Server`; prints ``@@ready {"pid": ..., "target": ...}`` once it
    serves, then serves until killed (it also dies with its parent).

``client [--netns] [--deadline-s S]``
    Starts a ps and a worker server (one ``server`` process each, loopback ports),
    prints ``@@ready {...}`` with their pids, then answers one JSON command per stdin
    line with one ``@@result {...}`` line on stdout: ``{"op": "prepare", "kind":
    "recv"|"trivial", "nbytes", "warmup"}`` (session open, initialised, warmed up),
    ``{"op": "block", "repeat"}`` (time that many steps), ``{"op": "finish"}``,
    ``{"op": "once", "kind", "nbytes", "warmup", "repeat"}`` (all three at once),
    ``{"op": "memory"}`` (VmHWM/VmRSS of the servers now), ``{"op": "restart"}``
    (fresh servers, new pids), ``{"op": "quit"}``.
    The session is a `tf.compat.v1.Session` on the worker's target, so the master
    runs on the worker, exactly as in our side. The graphs and the timing loop come
    from `timing.py`, the same code our side runs.

TensorFlow's gRPC server always binds ``0.0.0.0:<port>`` (hard-coded in
grpc_server_lib.cc). To keep everything on loopback, `sides.TFSide` starts
the client under ``unshare --net`` (a network namespace with only ``lo``) and passes
``--netns``: the client brings ``lo`` up, checks that it is the only interface, and
its servers inherit the namespace.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

# This file's directory is sys.path[0] when it runs as a script.
import timing  # type: ignore[import-not-found, unused-ignore]

READY = "@@ready "
RESULT = "@@result "
START_TIMEOUT_S = 90.0
MAX_COMMANDS = 1000
OPERATION_TIMEOUT_MS = 60_000


def _die_with_parent() -> None:
    # Not distserver._process.die_with_parent: this runs under TensorFlow's interpreter,
    # which has no distserver installed.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _emit(prefix: str, payload: dict[str, Any]) -> None:
    sys.stdout.write(prefix + json.dumps(payload) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- server


def serve(cluster: dict[str, list[str]], job: str, task: int) -> None:
    _die_with_parent()
    import tensorflow as tf

    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=job, task_index=task, protocol="grpc", start=True
    )
    _emit(READY, {"pid": os.getpid(), "target": server.target})
    server.join()  # until SIGTERM/SIGKILL


# --------------------------------------------------------------------------- network namespace


def _loopback_up() -> list[str]:
    """Bring ``lo`` up (SIOCGIFFLAGS/SIOCSIFFLAGS); return the interface names."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))
    return [name for _, name in socket.if_nameindex()]


# --------------------------------------------------------------------------- client


class _Cluster:
    """A ps and a worker `tf.distribute.Server`, one process each."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.pids: dict[str, int] = {}
        self.cluster: dict[str, list[str]] = {}
        self._stderr: dict[str, Any] = {}

    def start(self, attempts: int = 3) -> None:
        error: Exception | None = None
        for _ in range(attempts):
            try:
                self._start_once()
                return
            except RuntimeError as exc:
                error = exc
                self.stop()
        raise RuntimeError(f"could not start the TF cluster: {error}")

    def _start_once(self) -> None:
        ports = _free_ports(2)
        self.cluster = {"ps": [f"localhost:{ports[0]}"], "worker": [f"localhost:{ports[1]}"]}
        for job in ("ps", "worker"):
            self._stderr[job] = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
            self.procs[job] = subprocess.Popen(
                [sys.executable, __file__, "server", "--cluster", json.dumps(self.cluster), "--job", job],
                stdout=subprocess.PIPE,
                stderr=self._stderr[job],
                text=True,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        for job, proc in self.procs.items():
            self.pids[job] = self._wait_ready(job, proc, deadline)

    def _wait_ready(self, job: str, proc: subprocess.Popen[str], deadline: float) -> int:
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            readable, _, _ = select.select([proc.stdout], [], [], 1.0)
            if readable:
                line = proc.stdout.readline()
                if line.startswith(READY):
                    pid: int = json.loads(line[len(READY) :])["pid"]
                    if pid != proc.pid:
                        raise RuntimeError(f"TF {job} reports pid {pid}, started as {proc.pid}")
                    return pid
                if line:
                    continue
            if proc.poll() is not None:
                raise RuntimeError(f"TF {job} exited ({proc.returncode}): {self._tail(job)}")
        raise RuntimeError(f"TF {job} did not serve within {START_TIMEOUT_S:.0f} s")

    def _tail(self, job: str) -> str:
        stream = self._stderr[job]
        stream.flush()
        stream.seek(0)
        lines = stream.read().strip().splitlines()
        return lines[-1] if lines else "(no stderr)"

    def stop(self) -> None:
        timing.stop_processes(self.procs.values())
        for stream in self._stderr.values():
            stream.close()
        self.procs, self.pids, self._stderr = {}, {}, {}


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def client(netns: bool, deadline_s: float) -> None:
    _die_with_parent()
    deadline = time.monotonic() + deadline_s
    interfaces = _loopback_up() if netns else [name for _, name in socket.if_nameindex()]
    if netns and interfaces != ["lo"]:
        raise RuntimeError(f"--netns but the namespace has interfaces {interfaces}")
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    api = tf.compat.v1
    config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=OPERATION_TIMEOUT_MS)
    cluster = _Cluster()
    try:
        cluster.start()

        def pids() -> dict[str, int]:
            return {**cluster.pids, "client": os.getpid()}

        def ready() -> dict[str, Any]:
            return {"pids": pids(), "tensorflow": tf.__version__, "netns": netns, "interfaces": interfaces}

        _emit(READY, ready())
        prepared: timing.Prepared | None = None
        for _ in range(MAX_COMMANDS):
            line = sys.stdin.readline()
            if not line:
                break
            command = json.loads(line)
            op = command.pop("op")
            target = f"grpc://{cluster.cluster['worker'][0]}"
            try:
                if op == "quit":
                    _emit(RESULT, {"ok": True})
                    break
                if op == "prepare":
                    if prepared is not None:
                        prepared.finish()
                        prepared = None
                    prepared = timing.Prepared(api, config, target, **command, pids=pids(), deadline=deadline)
                    result: Any = {"init_s": prepared.init_s}
                elif op == "block":
                    if prepared is None:
                        raise RuntimeError("block before prepare")
                    result = prepared.block(command["repeat"], deadline, command.get("settle_ms", 0.0))
                elif op == "finish":
                    if prepared is None:
                        raise RuntimeError("finish before prepare")
                    result, prepared = prepared.finish(), None
                elif op == "once":
                    result = timing.run_once(api, config, target, **command, pids=pids(), deadline=deadline)
                elif op == "memory":
                    result = {role: timing.proc_memory(pid) for role, pid in pids().items()}
                elif op == "restart":
                    cluster.stop()
                    cluster.start()
                    result = ready()
                else:
                    raise ValueError(f"unknown op {op!r}")
                _emit(RESULT, {"ok": True, "result": result})
            except Exception as exc:
                _emit(RESULT, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                traceback.print_exc()
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    server_p = sub.add_parser("server")
    server_p.add_argument("--cluster", required=True)
    server_p.add_argument("--job", required=True)
    server_p.add_argument("--task", type=int, default=0)
    client_p = sub.add_parser("client")
    client_p.add_argument("--netns", action="store_true", help="running in a fresh network namespace")
    client_p.add_argument("--deadline-s", type=float, default=900.0)
    args = parser.parse_args()
    if args.mode == "server":
        serve(json.loads(args.cluster), args.job, args.task)
    else:
        client(args.netns, args.deadline_s)


if __name__ == "__main__":
    main()
