"""The raw-grpcio baseline of `distserver bench`: the same bytes over plain grpcio.

A server process (``python -m distserver.bench.grpcio_baseline``) answers a request
carrying a size (8 bytes, little-endian) with that many bytes, either in one unary
response or as a stream of 1 MiB messages; the client here (`GrpcioSide`) times one
call per step. The bytes travel one way, server -> client, as a RecvTensor's do
(ps -> worker), so MB/s compare directly. The streamed bytes are copied into one
preallocated buffer, as the RecvTensor stream assembles its chunks; the unary
response is taken as the bytes grpcio hands over.

This is the one module outside `distserver/transports/` that imports grpc: it
measures grpcio itself, without distserver's transport.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np

from distserver._process import PARENT_PID_ENV, die_with_parent
from distserver.bench import timing

UNARY = "/distserver.bench.Bytes/Unary"
STREAM = "/distserver.bench.Bytes/Stream"
CHUNK = 1 << 20
MAX_BYTES = (1 << 31) - (1 << 20)  # grpcio's message limit is 2 GiB - 1
READY = "@@ready "
START_TIMEOUT_S = 60.0
OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


# --------------------------------------------------------------------------- server (its own process)


def _requested_size(request: bytes) -> int:
    if len(request) != 8:
        raise ValueError(f"request must be 8 bytes (a size), got {len(request)}")
    nbytes = int.from_bytes(request, "little")
    if not 0 < nbytes <= MAX_BYTES:
        raise ValueError(f"size {nbytes} outside 1..{MAX_BYTES}")
    return nbytes


class _Payloads:
    """The last payload asked for, kept for the next call (a benchmark asks for one size
    at a time): whole, or as 1 MiB chunks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key = (0, False)
        self._chunks: list[bytes] = []

    def get(self, nbytes: int, chunked: bool) -> list[bytes]:
        with self._lock:
            if (nbytes, chunked) != self._key:
                self._chunks = []  # free the old one first
                step = CHUNK if chunked else nbytes
                self._chunks = [b"\x01" * min(step, nbytes - i) for i in range(0, nbytes, step)]
                self._key = (nbytes, chunked)
            return self._chunks


def serve() -> None:
    die_with_parent()
    payloads = _Payloads()

    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return payloads.get(_requested_size(request), chunked=False)[0]
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # abort raises; this line is never reached

    def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            chunks = payloads.get(_requested_size(request), chunked=True)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise
        yield from chunks

    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=OPTIONS)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("distserver.bench.Bytes", handlers)]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    sys.stdout.write(READY + json.dumps({"pid": os.getpid(), "port": port}) + "\n")
    sys.stdout.flush()
    stopped.wait()
    server.stop(grace=1).wait()


# --------------------------------------------------------------------------- client side


class GrpcioSide:
    """Times one grpcio call per step against the server process (mode "unary" or "stream")."""

    def __init__(self, name: str, mode: str) -> None:
        if mode not in ("unary", "stream"):
            raise ValueError(f"grpcio mode must be unary or stream, not {mode!r}")
        self.name, self.mode = name, mode
        self.dead: str | None = None
        self.proc: subprocess.Popen[str] | None = None
        self.channel: grpc.Channel | None = None
        self._stderr: Any = None
        self._step: Any = None
        self._dst: np.ndarray | None = None
        self.nbytes = self.warmup = 0

    def start(self) -> None:
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "distserver.bench.grpcio_baseline"],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        port = self._wait_ready()["port"]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)

    def _wait_ready(self) -> dict[str, Any]:
        assert self.proc is not None
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if readable:
                line = self.proc.stdout.readline()
                if line.startswith(READY):
                    info: dict[str, Any] = json.loads(line[len(READY) :])
                    return info
            if self.proc.poll() is not None:
                self._stderr.seek(0)
                tail = (self._stderr.read().strip().splitlines() or ["(no stderr)"])[-1]
                raise RuntimeError(f"grpcio baseline server exited ({self.proc.returncode}): {tail}")
        raise RuntimeError(f"grpcio baseline server did not serve within {START_TIMEOUT_S:.0f} s")

    @property
    def pids(self) -> dict[str, int]:
        assert self.proc is not None
        return {"server": self.proc.pid, "client": os.getpid()}

    def lost_process(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            return f"grpcio baseline server exited ({self.proc.returncode})"
        return None

    def prepare(self, kind: str, nbytes: int, warmup: int, deadline: float, workers: int = 1) -> None:
        if kind != "recv":
            raise ValueError(f"the grpcio baseline has no {kind!r} benchmark")
        if nbytes > MAX_BYTES:
            raise ValueError(f"{nbytes} bytes is over grpcio's message limit")
        assert self.channel is not None
        request = nbytes.to_bytes(8, "little")
        self.nbytes, self.warmup = nbytes, warmup
        if self.mode == "unary":
            call = self.channel.unary_unary(UNARY, request_serializer=None, response_deserializer=None)

            def step() -> int:
                return len(call(request, timeout=60))

        else:
            call_stream = self.channel.unary_stream(
                STREAM, request_serializer=None, response_deserializer=None
            )
            dst = self._dst = np.empty(nbytes, np.uint8)

            def step() -> int:
                offset = 0
                for chunk in call_stream(request, timeout=60):
                    dst[offset : offset + len(chunk)] = np.frombuffer(chunk, np.uint8)
                    offset += len(chunk)
                return offset

        received = step()
        if received != nbytes:
            raise AssertionError(f"grpcio {self.mode} returned {received} bytes, expected {nbytes}")
        self._step = step
        for _ in range(warmup):
            timing.check_deadline(deadline)
            step()

    def block(self, repeat: int, deadline: float, settle_ms: float = 0.0) -> dict[str, Any]:
        step = self._step
        timing.settle(step, settle_ms, deadline)
        before = {role: timing.proc_counters(pid) for role, pid in self.pids.items()}
        times = []
        for _ in range(repeat):
            timing.check_deadline(deadline)
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        after = {role: timing.proc_counters(pid) for role, pid in self.pids.items()}
        deltas = {role: {k: after[role][k] - before[role][k] for k in before[role]} for role in self.pids}
        return {"times_s": times, "counters": deltas}

    def finish(self) -> dict[str, Any]:
        self._step, self._dst = None, None
        return {
            "kind": "recv",
            "nbytes": self.nbytes,
            "warmup": self.warmup,
            "init_s": 0.0,
            "memory_after": {},
        }

    def stop(self) -> None:
        self._step, self._dst = None, None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        proc, self.proc = self.proc, None
        if proc is not None:
            timing.stop_processes([proc])
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


if __name__ == "__main__":
    serve()
