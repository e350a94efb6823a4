"""Helpers shared by the TensorFlow client scripts of the interoperability tests.

The scripts run under a Python with TensorFlow (see scripts/interop-setup), never
under distserver's venv. Each one prints a single JSON object as the last line of
its standard output; the tests read it. TensorFlow's own logging goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # TF's reference numbers without oneDNN rewrites
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np


def jsonable(value: Any) -> Any:
    """numpy values and nested structures as JSON-friendly Python values."""
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return [jsonable(v) for v in value.tolist()]
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def error_info(exc: BaseException) -> dict[str, Any]:
    """The class and the first line of the message of `exc` (TF adds stack traces after it)."""
    message = getattr(exc, "message", None) or str(exc)
    lines = [line for line in str(message).splitlines() if line.strip()]
    return {"error": type(exc).__name__, "message": "\n".join(lines[:12])}


class Checks:
    """Runs named checks, recording each result or error, so one failure hides no other."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            self.results[name] = {"value": jsonable(fn())}
        except Exception as exc:
            info = error_info(exc)
            info["traceback"] = traceback.format_exc()[-2000:]
            self.results[name] = info

    def emit(self, **extra: Any) -> None:
        print(json.dumps({"checks": self.results, **jsonable(extra)}), flush=True)


def target_of(address: str) -> str:
    return address if address.startswith("grpc://") else f"grpc://{address}"


def args() -> dict[str, Any]:
    """The JSON document the test passes as the script's only argument."""
    parsed: dict[str, Any] = json.loads(sys.argv[1])
    return parsed
