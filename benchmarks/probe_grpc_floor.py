"""What grpcio's asyncio stack costs by itself, with empty handlers (no distserver code).

Three processes on loopback: a client, a server A and a server B. Measured, as the
median of `--calls` sequential unary calls with 100-byte payloads:

* ``client -> B``: one round trip to a handler that returns its request;
* ``client -> A -> B``: A's handler calls B and returns B's answer. This is the shape
  of a distributed step with the master on A: RunStep/RunCallable to the master,
  RunGraph from the master to the task that holds the ops. No runtime can do such a
  step over grpc.aio unary calls in less;
* ``client -> B, stream``: one message each way on an open bidirectional stream, the
  way distserver tasks call each other (`distserver.transports.call_stream`).

Each is measured with gRPC's default settings and with the setting distserver applies
at import (`distserver._grpc_env`: EventEngine client and listener off), each process
started with that environment.

    .venv/bin/python benchmarks/probe_grpc_floor.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

MODES = {
    "gRPC defaults": None,
    "distserver's setting": "-event_engine_client,-event_engine_listener",
}
START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 10.0


def _run(coro: Any) -> Any:
    """On uvloop when installed, as distserver's processes are."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _identity(data: bytes) -> bytes:
    return data


async def _serve(port: int, downstream: int | None) -> None:
    import grpc
    import grpc.aio

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    forward = None
    if downstream is not None:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{downstream}")
        forward = channel.unary_unary(
            "/probe.Echo/Echo", request_serializer=_identity, response_deserializer=_identity
        )

    async def echo(request: bytes, context: object) -> bytes:
        if forward is not None:
            answer: bytes = await forward(request, timeout=CALL_TIMEOUT_S)
            return answer
        return request

    async def echo_stream(requests: Any, context: Any) -> Any:
        async for request in requests:
            yield request

    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(
            echo, request_deserializer=_identity, response_serializer=_identity
        ),
        "Stream": grpc.stream_stream_rpc_method_handler(
            echo_stream, request_deserializer=_identity, response_serializer=_identity
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe.Echo", handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def _client_stream(port: int, calls: int) -> float:
    import grpc.aio

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream = channel.stream_stream(
            "/probe.Echo/Stream", request_serializer=_identity, response_deserializer=_identity
        )(None)
        payload = b"x" * 100
        times = []
        for i in range(min(300, calls) + calls):
            started = time.perf_counter()
            await stream.write(payload)
            await stream.read()
            if i >= min(300, calls):  # after the warm-up
                times.append(time.perf_counter() - started)
        await stream.done_writing()
    return statistics.median(times)


async def _client(port: int, calls: int) -> float:
    import grpc
    import grpc.aio

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(
            "/probe.Echo/Echo", request_serializer=_identity, response_deserializer=_identity
        )
        payload = b"x" * 100
        for _ in range(min(300, calls)):  # warm-up
            await call(payload, timeout=CALL_TIMEOUT_S)
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            await call(payload, timeout=CALL_TIMEOUT_S)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _environment(experiments: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if experiments is not None:
        env["GRPC_EXPERIMENTS"] = experiments
    return env


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip() == "ready":
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"probe server {args} did not start within {START_TIMEOUT_S} s")


def _measure(experiments: str | None, calls: int) -> dict[str, float]:
    env = _environment(experiments)
    port_a, port_b = _free_ports(2)
    servers: list[subprocess.Popen[str]] = []
    try:
        servers.append(_start(["serve", str(port_b)], env))
        servers.append(_start(["serve", str(port_a), "--downstream", str(port_b)], env))
        out = subprocess.run(
            [sys.executable, __file__, "client", str(port_b), str(port_a), "--calls", str(calls)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120 + calls * 0.01,
            check=True,
        )
        direct, chain, streamed = (float(x) for x in out.stdout.split())
        return {"client -> B": direct, "client -> A -> B": chain, "client -> B, stream": streamed}
    finally:
        for proc in servers:
            proc.terminate()
        for proc in servers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            if proc.poll() is None:
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role")
    serve = sub.add_parser("serve")
    serve.add_argument("port", type=int)
    serve.add_argument("--downstream", type=int)
    client = sub.add_parser("client")
    client.add_argument("direct", type=int)
    client.add_argument("chain", type=int)
    client.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--calls", type=int, default=3000, help="timed calls per figure (3000)")
    args = parser.parse_args()
    if args.role == "serve":
        _run(_serve(args.port, args.downstream))
        return
    if args.role == "client":
        direct = _run(_client(args.direct, args.calls))
        chain = _run(_client(args.chain, args.calls))
        streamed = _run(_client_stream(args.direct, args.calls))
        print(direct, chain, streamed)
        return
    if args.calls < 1:
        parser.error("--calls must be >= 1")
    results = {mode: _measure(experiments, args.calls) for mode, experiments in MODES.items()}
    print(f"grpc.aio with empty handlers, median of {args.calls} calls (100-byte messages, loopback)\n")
    print("| path | " + " | ".join(MODES) + " |")
    print("|---|" + "---:|" * len(MODES))
    for path in ("client -> B", "client -> A -> B", "client -> B, stream"):
        print(f"| {path} | " + " | ".join(f"{results[m][path] * 1e6:.0f} µs" for m in MODES) + " |")


if __name__ == "__main__":
    main()
