"""A gRPC proxy in front of one task that records every call it forwards (its own process).

    python recording_proxy.py UPSTREAM LOGFILE

Prints the port it listens on (127.0.0.1), then forwards each unary call's bytes to
UPSTREAM and appends one JSON line per call to LOGFILE: method, request and
response (base64) and the status code name. TensorFlow clients name it as their
session target, so tests see exactly the MasterService RPCs a client made and what
went over the wire. It runs in a process of its own because gRPC threads in the
pytest process would break the `fork()` that starts cluster tasks. Stops on SIGTERM.
"""

from __future__ import annotations

import base64
import json
import signal
import sys
import threading
from concurrent import futures
from typing import Any

import grpc

_NO_DEADLINE = 1e9  # seconds; a call without a deadline reports ~2**63 ns left


def main() -> int:
    upstream, log_path = sys.argv[1], sys.argv[2]
    channel = grpc.insecure_channel(upstream)
    lock = threading.Lock()
    log = open(log_path, "a")  # noqa: SIM115 - closed at exit

    def record(method: str, request: bytes, response: bytes | None, status: grpc.StatusCode) -> None:
        entry = {
            "method": method,
            "request": base64.b64encode(request).decode(),
            "response": None if response is None else base64.b64encode(response).decode(),
            "status": status.name,
        }
        with lock:
            log.write(json.dumps(entry) + "\n")
            log.flush()

    class Forwarder(grpc.GenericRpcHandler):
        def service(self, handler_call_details: Any) -> grpc.RpcMethodHandler:
            method: str = handler_call_details.method

            def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
                remaining = context.time_remaining()
                timeout = remaining if remaining is not None and remaining < _NO_DEADLINE else None
                try:
                    response: bytes = channel.unary_unary(method)(request, timeout=timeout)
                except grpc.RpcError as exc:
                    code: grpc.StatusCode = exc.code()  # type: ignore[attr-defined]
                    record(method, request, None, code)
                    context.abort(code, exc.details())  # type: ignore[attr-defined]
                    raise
                record(method, request, response, grpc.StatusCode.OK)
                return response

            return grpc.unary_unary_rpc_method_handler(handle)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers([Forwarder()])
    # One address family: "localhost" binds [::1] and 127.0.0.1 on the port the first
    # got, and a client may reach the other one, held by some other process.
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(port, flush=True)
    stop.wait()
    server.stop(None)
    channel.close()
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
