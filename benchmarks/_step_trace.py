"""Entry and exit times of a few runtime methods, for `trace_step.py`.

`instrument(directory)` wraps the methods of `POINTS` (each one skipped, with a
note, when this tree does not have it) so that every call appends
"<unix time> <label>< / >" to a list, written to `<directory>/<pid>.txt` every few
thousand events and at exit. Imported by the tasks' `sitecustomize` (see
`trace_step.py`) and by the client process itself. Wrapping costs ~1 us a call.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import os
import sys
import time
from collections.abc import Callable
from typing import Any

# (module, class, method, label): where a cluster step spends its time, from the
# client's call to the last answer.
POINTS = (
    ("distserver.wire", None, "encode_tensor_message", "encode"),
    ("distserver.transports.direct", "_ClientConnection", "call", "direct.call"),
    ("distserver.transports.direct", "_ServerConnection", "_call", "direct.request_read"),
    ("distserver.transports.direct", "_Connection", "send", "direct.send"),
    ("distserver.runtime.master", "Master", "run_callable", "master.run_callable"),
    ("distserver.runtime.master", "Master", "_run_partition", "master.partition"),
    ("distserver.runtime.worker", "Worker", "run_graph", "worker.run_graph"),
    ("distserver.runtime.worker", "Worker", "recv_tensor", "worker.recv_tensor"),
    ("distserver.runtime.worker", "Worker", "recv_tensors_rpc", "worker.recv_tensors"),
    ("distserver.runtime.executor", "Executor", "run", "executor.run"),
    ("distserver.transports.verbs._transport", "VerbsTensorPath", "recv_tensor", "verbs.recv_tensor"),
    ("distserver.transports.verbs._tensor", "TensorEndpoint", "_on_completion", "verbs.completion"),
    ("distserver.transports.verbs._qp", "QueuePair", "_copy", "verbs.copy"),
    ("distserver.kernels.math", "FusedMatMulKernel", "compute", "kernel.FusedMatMul"),
    ("distserver.kernels.math", "FusedMatMulGradKernel", "compute", "kernel.FusedMatMulGrad"),
    ("distserver.kernels.math", "MatMulKernel", "compute", "kernel.MatMul"),
    ("distserver.kernels.state", "_ApplyKernel", "compute", "kernel.Apply"),
    ("distserver.kernels.state", "GroupedUpdatesKernel", "compute", "kernel.GroupedUpdates"),
)

_FLUSH_EVENTS = 5000


def instrument(directory: str) -> Callable[[], None]:
    """Wrap the methods of `POINTS`; returns what writes the events recorded so far."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{os.getpid()}.txt")
    events: list[tuple[float, str]] = []

    def flush() -> None:
        if events and os.path.isdir(directory):  # (gone: whoever reads them has finished)
            with open(path, "a") as out:
                out.writelines(f"{when:.6f} {label}\n" for when, label in events)
        events.clear()

    def note(label: str) -> None:
        events.append((time.time(), label))
        if len(events) >= _FLUSH_EVENTS:
            flush()

    atexit.register(flush)
    for module_name, class_name, method, label in POINTS:
        try:
            owner: Any = importlib.import_module(module_name)
            if class_name is not None:
                owner = getattr(owner, class_name)
            original = getattr(owner, method)
        except (ImportError, AttributeError):
            print(f"trace_step: no {module_name}.{class_name}.{method} here; not traced", file=sys.stderr)
            continue
        traced = _traced(original, label, note)
        # The executor calls some kernels' `compute.without_dereference` (registry).
        inner = getattr(original, "without_dereference", None)
        if inner is not None:
            traced.without_dereference = _traced(inner, label, note)  # type: ignore[attr-defined]
        setattr(owner, method, traced)
    return flush


def _traced(function: Callable[..., Any], label: str, note: Callable[[str], None]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            note(label + "<")
            try:
                return await function(*args, **kwargs)
            finally:
                note(label + ">")

        return traced_async

    @functools.wraps(function)
    def traced(*args: Any, **kwargs: Any) -> Any:
        note(label + "<")
        try:
            return function(*args, **kwargs)
        finally:
            note(label + ">")

    return traced
