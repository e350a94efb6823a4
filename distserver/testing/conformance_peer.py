"""The serving side of the transport conformance suite, as its own OS process.

Run as ``python -m distserver.testing.conformance_peer --transport module:name``,
where ``module:name`` is a `Transport` class or factory (called with no arguments)
or instance. The process serves WorkerService over that transport on a free
loopback port, exactly as a task does (``transport.listen`` then
``listener.start()``), and writes JSON lines to stdout: first
``{"port": ..., "pid": ..., "transport": ...}`` once it serves,
later ``{"event": "waiting" | "answered" | "cancelled", "step_id": ..., "tensor": ...}``
around each ``wait=`` receive (so a test can act while a call is surely pending,
or once the sender is surely done, instead of sleeping). SIGTERM or SIGINT stops
it (exit status 0). When ``DISTSERVER_PARENT_PID`` is set it also dies with that
process.

What it serves (`tensor_name` builds, `parse_spec` reads):

``RecvTensor`` (the tensor source, `serve_tensor`)
    The tensor named by the rendezvous key's tensor name, a comma-separated list of
    fields:

    * ``dtype=D`` -- a key of `DTYPES` (``float32`` when absent);
    * ``shape=AxBxC`` -- dimensions (``shape=scalar`` or no field: 0-d); or
      ``shapes=S0|S1|...`` -- shape ``S[step_id % n]``, so one name can carry
      tensors of different sizes in different steps, as in TensorFlow;
    * ``seed=N`` or ``seed=step`` (the request's step id) -- the values, built by
      `make_tensor`, so the receiver can rebuild the same array to compare;
    * ``wait=S`` -- answer after ``S`` seconds (at most `MAX_WAIT_SECONDS`); the
      peer reports ``waiting`` when it starts, then ``answered`` or ``cancelled``;
    * ``error=C`` -- raise the `OpError` subclass ``C`` (``InvalidArgument`` or
      ``InvalidArgumentError``) with the message `error_message` gives; with
      ``error_step=N`` only for step ``N`` (other steps get the tensor);
    * ``dead`` -- answer ``is_dead=True`` (with the tensor the other fields name);
    * ``tag=T`` -- ignored; makes a name unique.

``GetStatus``
    One CPU device, `PEER_DEVICE`, whose incarnation is the peer's pid.

``CleanupGraph``
    ``step_id`` 0 succeeds; a status code 1..16 raises that code's `OpError` with
    `error_message`.

``RunGraph``
    Echoes each ``send`` tensor back as ``recv`` under the same name (large
    control messages in both directions).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import ml_dtypes
import numpy as np

from distserver import errors
from distserver._process import die_with_parent, run
from distserver.devices import RendezvousKey
from distserver.protos.device_attributes_pb2 import DeviceAttributes
from distserver.protos.services import WORKER_SERVICE
from distserver.protos.worker_pb2 import (
    CleanupGraphRequest,
    CleanupGraphResponse,
    GetStatusRequest,
    GetStatusResponse,
    RunGraphRequest,
    RunGraphResponse,
)
from distserver.runtime.concurrency import request_tensors
from distserver.transports import Transport
from distserver.wire import EncodedMessage, TensorRequest, encode_off_loop

__all__ = [
    "DTYPES",
    "MAX_WAIT_SECONDS",
    "PEER_DEVICE",
    "TensorSpec",
    "error_message",
    "make_tensor",
    "parse_spec",
    "tensor_name",
]

# Every dtype a tensor can have on the wire, by the name used in `dtype=`.
DTYPES: dict[str, np.dtype[Any]] = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
    "string": np.dtype(object),
}

MAX_WAIT_SECONDS = 60.0
PEER_DEVICE = "/job:conformance/replica:0/task:0/device:CPU:0"

# Random content up to this size; above it a random block of `_PERIOD` bytes repeats.
# The period is not a multiple of any power of two, so a chunk that lands at the
# wrong offset, twice, or not at all still shows up as a difference.
_RANDOM_BYTES = 4 << 20
_PERIOD = (1 << 20) + 4099

_FLAGS = frozenset({"dead"})
_FIELDS = frozenset({"dtype", "shape", "shapes", "seed", "wait", "error", "error_step", "tag"})


class TensorSpec:
    """A parsed tensor name (see the module docstring)."""

    def __init__(
        self,
        *,
        dtype: str = "float32",
        shapes: tuple[tuple[int, ...], ...] = ((),),
        seed: int | str = 0,
        wait: float = 0.0,
        error: str | None = None,
        error_step: int | None = None,
        dead: bool = False,
        tag: str | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise errors.InvalidArgumentError(f"conformance peer: unknown dtype {dtype!r}")
        if not shapes:
            raise errors.InvalidArgumentError("conformance peer: no shape")
        self.dtype = dtype
        self.shapes = shapes
        self.seed = seed
        self.wait = wait
        self.error = error
        self.error_step = error_step
        self.dead = dead
        self.tag = tag

    def shape_for(self, step_id: int) -> tuple[int, ...]:
        """The shape of the tensor for `step_id`."""
        return self.shapes[step_id % len(self.shapes)]

    def seed_for(self, step_id: int) -> int:
        """The random seed of the values for `step_id`."""
        return step_id if self.seed == "step" else int(self.seed)


def tensor_name(
    dtype: str = "float32",
    shape: tuple[int, ...] | list[tuple[int, ...]] = (),
    *,
    seed: int | str = 0,
    wait: float | None = None,
    error: type[errors.OpError] | str | None = None,
    error_step: int | None = None,
    dead: bool = False,
    tag: str | None = None,
) -> str:
    """The tensor name that asks the peer for a tensor (the inverse of `parse_spec`).

    A list of shapes means ``shapes=``: shape ``shape[step_id % len(shape)]``.
    """
    if isinstance(shape, list):
        shape_field = "shapes=" + "|".join(map(_shape_text, shape))
    else:
        shape_field = f"shape={_shape_text(shape)}"
    fields = [f"dtype={dtype}", shape_field, f"seed={seed}"]
    if wait is not None:
        fields.append(f"wait={wait:g}")
    if error is not None:
        fields.append(f"error={error if isinstance(error, str) else error.__name__}")
    if error_step is not None:
        fields.append(f"error_step={error_step}")
    if dead:
        fields.append("dead")
    if tag is not None:
        fields.append(f"tag={tag}")
    return ",".join(fields)


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def _parse_shape(text: str) -> tuple[int, ...]:
    return () if text in ("", "scalar") else tuple(int(d) for d in text.split("x"))


def parse_spec(name: str) -> TensorSpec:
    """The `TensorSpec` a tensor name stands for.

    Raises:
        InvalidArgumentError: a field is unknown or malformed.
    """
    values: dict[str, str] = {}
    flags: set[str] = set()
    for field in filter(None, name.split(",")):
        key, sep, value = field.partition("=")
        if not sep and key in _FLAGS:
            flags.add(key)
        elif sep and key in _FIELDS:
            values[key] = value
        else:
            raise errors.InvalidArgumentError(f"conformance peer: unknown field {field!r} in {name!r}")
    try:
        if "shapes" in values:
            shapes = tuple(_parse_shape(text) for text in values["shapes"].split("|"))
        else:
            shapes = (_parse_shape(values.get("shape", "scalar")),)
        seed_text = values.get("seed", "0")
        return TensorSpec(
            dtype=values.get("dtype", "float32"),
            shapes=shapes,
            seed="step" if seed_text == "step" else int(seed_text),
            wait=min(float(values.get("wait", 0.0)), MAX_WAIT_SECONDS),
            error=values.get("error"),
            error_step=int(values["error_step"]) if "error_step" in values else None,
            dead="dead" in flags,
            tag=values.get("tag"),
        )
    except ValueError as exc:
        raise errors.InvalidArgumentError(f"conformance peer: malformed tensor name {name!r}: {exc}") from exc


def error_class(name: str) -> type[errors.OpError]:
    """The `OpError` subclass `error=` names ("InvalidArgument" or "InvalidArgumentError")."""
    cls = getattr(errors, name if name.endswith("Error") else f"{name}Error", None)
    if not (isinstance(cls, type) and issubclass(cls, errors.OpError)) or cls is errors.OpError:
        raise errors.InvalidArgumentError(f"conformance peer: {name!r} is not an OpError class")
    return cls


def error_message(cls: type[errors.OpError], step_id: int) -> str:
    """The message of the error the peer raises for `cls` in step `step_id`.

    Not ASCII on purpose: the message must arrive unchanged, whatever the encoding.
    """
    return f"conformance peer raised {cls.__name__} for step {step_id}: naïve ✓ «quoted»"


def make_tensor(spec: TensorSpec | str, step_id: int = 0) -> np.ndarray:
    """The tensor the peer serves for `spec` in step `step_id`; the same on every call.

    Numeric tensors hold arbitrary bit patterns (NaN payloads, subnormals, every
    byte value), compared byte for byte; bools hold only 0 and 1; strings are
    object arrays of `bytes` of mixed lengths (empty, NUL bytes, non-UTF-8, 70 KB).
    """
    if isinstance(spec, str):
        spec = parse_spec(spec)
    dtype = DTYPES[spec.dtype]
    rng = np.random.default_rng(spec.seed_for(step_id))
    shape = spec.shape_for(step_id)
    count = math.prod(shape)
    if spec.dtype == "string":
        items = np.empty(count, dtype=object)
        for i in range(count):
            length = 70_000 if i % 7 == 3 else int(rng.integers(0, 40)) if i else 0
            items[i] = rng.bytes(length)
        return items.reshape(shape)
    if spec.dtype == "bool":
        return rng.integers(0, 2, size=count, dtype=np.uint8).view(np.bool_).reshape(shape)
    nbytes = count * dtype.itemsize
    if nbytes <= _RANDOM_BYTES:
        flat = np.frombuffer(bytearray(rng.bytes(nbytes)), np.uint8)
    else:
        flat = _repeat(np.frombuffer(rng.bytes(_PERIOD), np.uint8), nbytes)
    return flat.view(dtype).reshape(shape)


def _repeat(block: np.ndarray, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    filled = min(block.size, nbytes)
    out[:filled] = block[:filled]
    while filled < nbytes:  # doubling copies: log2(nbytes / block) memcpys
        step = min(filled, nbytes - filled)
        out[filled : filled + step] = out[:step]
        filled += step
    return out


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def serve_tensor(step_id: int, key: RendezvousKey) -> tuple[np.ndarray, bool]:
    """The tensor source: the tensor the rendezvous key's tensor name describes."""
    name = key.tensor_name
    spec = parse_spec(name)
    if spec.wait > 0:
        _say(event="waiting", step_id=step_id, tensor=name)
        try:
            await asyncio.sleep(spec.wait)
        except asyncio.CancelledError:
            _say(event="cancelled", step_id=step_id, tensor=name)
            raise
        _say(event="answered", step_id=step_id, tensor=name)
    if spec.error is not None and spec.error_step in (None, step_id):
        cls = error_class(spec.error)
        raise cls(error_message(cls, step_id))
    value = make_tensor(spec, step_id)
    return value, spec.dead


async def get_status(request: GetStatusRequest) -> GetStatusResponse:
    """The GetStatus handler: one CPU device whose incarnation is this process's pid."""
    response = GetStatusResponse()
    response.device_attributes.append(
        DeviceAttributes(name=PEER_DEVICE, device_type="CPU", incarnation=os.getpid())
    )
    return response


async def cleanup_graph(request: CleanupGraphRequest) -> CleanupGraphResponse:
    """The CleanupGraph handler: raises the OpError whose status code is the step id (0: succeeds)."""
    if request.step_id == 0:
        return CleanupGraphResponse()
    cls = errors.exception_type_from_error_code(int(request.step_id))
    raise cls(error_message(cls, request.step_id))


async def run_graph(request: RunGraphRequest | TensorRequest[RunGraphRequest]) -> EncodedMessage:
    """The RunGraph handler: sends every fed tensor back under its name (a large request
    comes as a `wire.TensorRequest`, as transports give it to the worker's handler)."""
    _, sends = await request_tensors(request, what="a RunGraph request")
    return await encode_off_loop(RunGraphResponse(), sends)


HANDLERS: dict[str, Callable[[Any], Awaitable[Any]]] = {
    "GetStatus": get_status,
    "CleanupGraph": cleanup_graph,
    "RunGraph": run_graph,
}


def load_transport(factory: str) -> Transport:
    """The transport ``module:name`` names: a class or factory (called with no arguments) or an instance."""
    module_name, _, attribute = factory.partition(":")
    obj = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    transport = obj() if callable(obj) and not isinstance(obj, Transport) else obj
    if not isinstance(transport, Transport):
        raise TypeError(f"{factory} is not a distserver Transport (got {type(transport).__name__})")
    return transport


async def serve(transport: Transport, host: str, grace: float) -> int:
    """Serve `HANDLERS` and `serve_tensor` over `transport` until SIGTERM/SIGINT."""
    listener = await transport.listen(f"{host}:0", {WORKER_SERVICE: HANDLERS}, serve_tensor)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await listener.start()
        _say(port=listener.port, pid=os.getpid(), transport=transport.name)
        await stop.wait()
    finally:
        await listener.stop(grace)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--transport",
        default="distserver.transports.grpc:GrpcTransport",
        help="module:name of the Transport (class, factory or instance) to serve over",
    )
    parser.add_argument("--host", default="localhost", help="host to bind (port 0)")
    parser.add_argument("--grace", type=float, default=1.0, help="seconds calls in flight get on stop")
    args = parser.parse_args(argv)
    die_with_parent()
    return run(serve(load_transport(args.transport), args.host, args.grace))


if __name__ == "__main__":
    sys.exit(main())
