"""The transport conformance suite: one set of checks for any transport.

Each ``check_*`` coroutine states one property of the `Channel`/`Listener` contract
(`distserver.transports.base`) and raises `AssertionError` (or the unexpected
error) when the `Transport` object it is given breaks it. The checks use a
transport exactly as the runtime does: the serving side is a separate OS process
(`ConformancePeer`, running `distserver.testing.conformance_peer`) that calls
``transport.listen("localhost:0", {"tensorflow.WorkerService": handlers}, source)``
and ``listener.start()``; this process calls ``transport.connect(f"localhost:{port}")``
and ``channel.recv_tensor`` / ``channel.call``. The transport need not be registered
under a protocol name, so a new one can be checked before it is.

Usage, from pytest (one test per check, see ``tests/transports/test_conformance.py``)::

    transport = MyTransport()
    async with ConformancePeer(transport) as peer:
        await check_dtypes(transport, peer)

or everything at once: ``await check_transport(transport)``.

Every await in a check has a timeout, so a broken transport fails a check rather
than hanging it. The checks only poll for conditions (the peer announces pending
receives on its stdout); none sleeps and hopes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

import numpy as np

import distserver
from distserver import errors
from distserver.devices import RendezvousKey
from distserver.protos.services import WORKER_SERVICE
from distserver.protos.worker_pb2 import (
    CleanupGraphRequest,
    CleanupGraphResponse,
    GetStatusRequest,
    GetStatusResponse,
    RunGraphRequest,
    RunGraphResponse,
)
from distserver.runtime.concurrency import gather_all
from distserver.tensors import from_tensor_proto, to_tensor_proto
from distserver.testing.cluster import free_ports
from distserver.testing.conformance_peer import (
    DTYPES,
    PEER_DEVICE,
    error_message,
    make_tensor,
    tensor_name,
)
from distserver.transports import Channel, ChannelStatistics, Transport

__all__ = [
    "CHECKS",
    "OWN_PEER_CHECKS",
    "ConformanceError",
    "ConformancePeer",
    "assert_same_tensor",
    "check_abort",
    "check_close",
    "check_concurrent_streams",
    "check_control_calls",
    "check_control_errors",
    "check_correlation",
    "check_dead_tensors",
    "check_deadline",
    "check_dtypes",
    "check_empty_and_scalar_tensors",
    "check_errors",
    "check_large_tensor",
    "check_listener_lifecycle",
    "check_peer_death",
    "check_received_values_are_stable",
    "check_shape_changes_under_one_name",
    "check_statistics",
    "check_transport",
    "check_unreachable_peer",
    "recv_key",
]

SRC_DEVICE = "/job:ps/replica:0/task:0/device:CPU:0"
DST_DEVICE = "/job:worker/replica:0/task:0/device:CPU:0"

# Generous bounds for one call: the checks are about correctness, not speed.
CALL_TIMEOUT = 30.0
LARGE_TIMEOUT = 120.0
# How long a failure that the transport can see (peer death, abort) may take to surface.
FAILURE_BOUND = 15.0

MiB = 1 << 20
ROOT = Path(distserver.__file__).resolve().parent.parent

Check = Callable[[Transport, "ConformancePeer"], Awaitable[None]]


class ConformanceError(AssertionError):
    """One or more checks of `check_transport` failed; the message lists them."""


# -- the peer process -----------------------------------------------------------------


class ConformancePeer:
    """A `conformance_peer` process serving over a transport, started and stopped by its owner.

    Args:
        transport: The transport the peer serves over. The peer process builds its
            own: it imports `factory` and calls it with no arguments.
        factory: ``"module:name"`` of a `Transport` class or factory (or of an
            instance); default: the class of `transport`.
        host: Host it binds (port 0) and that `address` names.
        start_timeout: Seconds `start()` waits for the peer to serve.
        env: Extra environment variables for the process.

    Use as a context manager (``with`` or ``async with``), or call `start()` and
    `stop()`. The process dies with this one (PR_SET_PDEATHSIG), so a crashed test
    leaves no peer behind. Its stdout (JSON lines) is read by a thread into
    `events`; its stderr goes to a file (`stderr()`).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        factory: str | None = None,
        host: str = "localhost",
        start_timeout: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.transport = transport
        self.factory = factory or f"{type(transport).__module__}:{type(transport).__qualname__}"
        self.host = host
        self.start_timeout = start_timeout
        self.env = dict(env or {})
        self.port = 0
        self.events: list[dict[str, Any]] = []
        self._process: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._changed = threading.Condition()
        self._eof = False

    @property
    def address(self) -> str:
        """``host:port`` to connect to."""
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the conformance peer is not running")
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def start(self) -> ConformancePeer:
        """Start the process and wait until it serves (blocks for up to `start_timeout`)."""
        if self._process is not None:
            raise RuntimeError("the conformance peer was already started")
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1", "DISTSERVER_PARENT_PID": str(os.getpid())}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        command = [sys.executable, "-m", "distserver.testing.conformance_peer", "--transport", self.factory]
        command += ["--host", self.host]
        self._process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr, env=env
        )
        self._reader = threading.Thread(target=self._read_stdout, name="conformance-peer-stdout", daemon=True)
        self._reader.start()
        try:
            ready = self.wait_for(lambda event: "port" in event, timeout=self.start_timeout)
        except BaseException:
            self.stop()
            raise
        self.port = int(ready["port"])
        return self

    def _read_stdout(self) -> None:
        assert self._process is not None
        assert self._process.stdout is not None
        for line in self._process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._changed:
                self.events.append(event)
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], *, timeout: float) -> dict[str, Any]:
        """The first event that matches `predicate`, waiting (blocking) up to `timeout` seconds.

        Raises:
            TimeoutError: No such event came in time.
            RuntimeError: The peer exited first; the message holds its stderr.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                if self._eof:
                    raise RuntimeError(
                        f"the {self.transport.name} conformance peer exited (status {self.returncode}):\n"
                        f"{self.stderr()}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no matching event from the conformance peer within {timeout} s")
                self._changed.wait(remaining)

    async def wait_for_event(
        self, predicate: Callable[[dict[str, Any]], bool], *, timeout: float
    ) -> dict[str, Any]:
        """`wait_for` without blocking the event loop (polls every 10 ms)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.wait_for(predicate, timeout=0)
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.01)

    async def wait_until_waiting(self, name: str, step_id: int, *, timeout: float = CALL_TIMEOUT) -> None:
        """Return once the peer has started waiting on the ``wait=`` receive of `name` in `step_id`."""
        await self.wait_for_event(_wait_event(("waiting",), name, step_id), timeout=timeout)

    async def wait_until_done(self, name: str, step_id: int, *, timeout: float = CALL_TIMEOUT) -> str:
        """Wait until the peer's handler for a ``wait=`` receive has answered or was cancelled; which one."""
        event = await self.wait_for_event(
            _wait_event(("answered", "cancelled"), name, step_id), timeout=timeout
        )
        return str(event["event"])

    def kill(self) -> None:
        """SIGKILL the peer (peer death) and reap it."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(timeout=30)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the peer, SIGKILL it after `timeout` seconds; its exit status. Idempotent."""
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._reader is not None:
            self._reader.join(timeout=10)
        if process.stdout is not None:
            process.stdout.close()
        return process.returncode

    def stderr(self) -> str:
        """What the peer wrote to stderr so far."""
        if self._stderr is None or self._stderr.closed:
            return ""
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def close(self) -> None:
        """Stop the peer and release its files."""
        self.stop()
        if self._stderr is not None:
            self._stderr.close()

    def __enter__(self) -> ConformancePeer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> ConformancePeer:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.close)


def _wait_event(kinds: tuple[str, ...], name: str, step_id: int) -> Callable[[dict[str, Any]], bool]:
    def matches(event: dict[str, Any]) -> bool:
        return event.get("event") in kinds and event.get("tensor") == name and event.get("step_id") == step_id

    return matches


# -- helpers --------------------------------------------------------------------------


_tags = itertools.count()


def _unique(what: str) -> str:
    """A tag that makes a tensor name unique in this process (peers remember waiting events)."""
    return f"{what}-{os.getpid()}-{next(_tags)}"


def recv_key(name: str) -> RendezvousKey:
    """The rendezvous key of tensor `name` sent from the peer's device to this one."""
    return RendezvousKey(SRC_DEVICE, 1, DST_DEVICE, name)


def _fail(message: str) -> NoReturn:
    raise AssertionError(message)


def assert_same_tensor(got: Any, expected: np.ndarray, what: str = "tensor") -> None:
    """Raise AssertionError unless `got` is a numpy array with `expected`'s dtype, shape and bytes.

    Numeric tensors are compared byte for byte, in 16 MiB slices (no full-size
    temporaries); strings element by element (each must be `bytes`).
    """
    if not isinstance(got, np.ndarray):
        _fail(f"{what}: expected a numpy array, got {type(got).__name__}")
    if got.dtype != expected.dtype:
        _fail(f"{what}: dtype {got.dtype} != {expected.dtype}")
    if got.shape != expected.shape:
        _fail(f"{what}: shape {got.shape} != {expected.shape}")
    if expected.dtype == object:
        for index, (a, b) in enumerate(zip(got.ravel().tolist(), expected.ravel().tolist(), strict=True)):
            if not isinstance(a, bytes) or a != b:
                _fail(f"{what}: element {index} is {repr(a)[:60]}, expected {repr(b)[:60]}")
        return
    mine = np.ascontiguousarray(got).reshape(-1).view(np.uint8)
    theirs = np.ascontiguousarray(expected).reshape(-1).view(np.uint8)
    for start in range(0, theirs.size, 16 * MiB):
        a, b = mine[start : start + 16 * MiB], theirs[start : start + 16 * MiB]
        if not np.array_equal(a, b):
            first = start + int(np.flatnonzero(a != b)[0])
            _fail(f"{what}: content differs from byte {first} of {theirs.size}")


async def _recv(channel: Channel, name: str, step_id: int, timeout: float = CALL_TIMEOUT) -> tuple[Any, bool]:
    async with asyncio.timeout(timeout + FAILURE_BOUND):
        return await channel.recv_tensor(step_id, recv_key(name), timeout=timeout)


async def _recv_checked(channel: Channel, name: str, step_id: int, timeout: float = CALL_TIMEOUT) -> Any:
    value, is_dead = await _recv(channel, name, step_id, timeout)
    if is_dead is not False:
        _fail(f"{name} (step {step_id}): is_dead is {is_dead!r}, expected False")
    assert_same_tensor(value, make_tensor(name, step_id), f"{name} (step {step_id})")
    return value


@contextlib.asynccontextmanager
async def _connected(transport: Transport, address: str) -> AsyncIterator[Channel]:
    channel = transport.connect(address)
    try:
        yield channel
    finally:
        async with asyncio.timeout(FAILURE_BOUND):
            await channel.close()


async def _raises(
    expected: type[BaseException] | tuple[type[BaseException], ...],
    call: Awaitable[Any],
    what: str,
    *,
    within: float = FAILURE_BOUND,
) -> BaseException:
    """The exception `call` raises, which must be `expected` and come within `within` seconds."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(within) as deadline:
            result = await call
    except BaseException as exc:
        if isinstance(exc, expected):
            return exc
        _reraise_if_we_are_cancelled(exc)
        if deadline.expired() and type(exc) is TimeoutError:
            raise AssertionError(f"{what}: still pending after {within} s") from exc
        raise AssertionError(
            f"{what}: raised {type(exc).__name__}({exc}), expected {_names(expected)}"
        ) from exc
    raise AssertionError(f"{what}: returned {type(result).__name__} after {time.monotonic() - started:.1f} s")


def _reraise_if_we_are_cancelled(exc: BaseException) -> None:
    """Let a cancellation of the checking task itself through (only the call's own errors are judged)."""
    task = asyncio.current_task()
    if isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling():
        raise exc


def _discard(task: asyncio.Future[Any] | None) -> None:
    """Cancel `task` if it still runs, else mark its outcome as seen (a failed check leaves no stray task)."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


def _names(classes: type[BaseException] | tuple[type[BaseException], ...]) -> str:
    return " or ".join(cls.__name__ for cls in (classes if isinstance(classes, tuple) else (classes,)))


def _nbytes(name: str, step_id: int = 0) -> int:
    return int(make_tensor(name, step_id).nbytes)


# -- checks: the data plane -----------------------------------------------------------


async def check_correlation(transport: Transport, peer: ConformancePeer) -> None:
    """Each of many concurrent receives gets its own tensor, whatever order answers come in.

    64 receives start at once. Half have names of their own, and the first of
    them waits longest at the sender, so their answers arrive in reverse. The
    other half share one tensor name and differ only in step id (the values
    depend on the step), so a transport that matches answers by name rather than
    by call, or reuses a buffer across calls, fails. Every value is checked again
    after all have arrived.
    """
    count = 64
    shared = tensor_name("float64", (3, 11), seed="step", wait=0.05, tag="corr")
    names = [
        tensor_name("int32", (5, 7), seed=i, wait=(count - i) * 0.005, tag="corr") if i % 2 else shared
        for i in range(count)
    ]
    async with _connected(transport, peer.address) as channel:
        values = await gather_all(_recv_checked(channel, n, 1000 + i) for i, n in enumerate(names))
        for i, (name, value) in enumerate(zip(names, values, strict=True)):
            assert_same_tensor(
                value, make_tensor(name, 1000 + i), f"{name} (step {1000 + i}) after the others"
            )


async def check_empty_and_scalar_tensors(transport: Transport, peer: ConformancePeer) -> None:
    """Tensors with no elements (0x3, 0, 3x0x2) and 0-d tensors keep their dtype and exact shape."""
    shapes: list[tuple[int, ...]] = [(0, 3), (0,), (3, 0, 2), ()]
    async with _connected(transport, peer.address) as channel:
        for dtype in ("float32", "int64", "bool", "bfloat16", "complex128", "string"):
            for shape in shapes:
                await _recv_checked(channel, tensor_name(dtype, shape, seed=3), 1)


async def check_dtypes(transport: Transport, peer: ConformancePeer) -> None:
    """Every dtype arrives bit-exact: bool, (u)int8..64, float16, bfloat16, float32/64,
    complex64/128 and strings (object arrays of bytes).

    Each numeric dtype is sent small (3x4) and as about 5 MiB with an odd element
    count (so chunked or pooled paths see a ragged tail); strings as 3x4 and as
    1000 elements of mixed lengths including empty and non-UTF-8 ones.
    """
    async with _connected(transport, peer.address) as channel:
        for dtype, np_dtype in DTYPES.items():
            if dtype == "string":
                sizes: list[tuple[int, ...]] = [(3, 4), (1000,)]
            else:
                sizes = [(3, 4), ((5 * MiB) // np_dtype.itemsize + 3,)]
            for shape in sizes:
                await _recv_checked(channel, tensor_name(dtype, shape, seed=11), 2)


async def check_large_tensor(transport: Transport, peer: ConformancePeer) -> None:
    """A 256 MiB tensor arrives intact (compared byte for byte against a rebuilt copy)."""
    name = tensor_name("float32", (8192, 8192), seed=256)
    async with _connected(transport, peer.address) as channel:
        value, is_dead = await _recv(channel, name, 3, timeout=LARGE_TIMEOUT)
        if is_dead is not False:
            _fail(f"256 MiB tensor: is_dead is {is_dead!r}")
        expected = make_tensor(name, 3)
        assert_same_tensor(value, expected, "256 MiB tensor")


async def check_concurrent_streams(transport: Transport, peer: ConformancePeer) -> None:
    """16 concurrent receives of mixed sizes (0-d to 24 MiB) each arrive intact, twice.

    The second round repeats the first round's names with new step ids, so paths
    that remember something per tensor name (size hints, "use the stream")
    are exercised concurrently as well.
    """
    sizes = [0, 1024, 64 * 1024, MiB, 4 * MiB + 1, 8 * MiB, 24 * MiB, 3]
    names = []
    for i in range(16):
        nbytes = sizes[i % len(sizes)]
        shape: tuple[int, ...] = () if nbytes == 0 else (nbytes,)
        names.append(tensor_name("uint8", shape, seed="step", tag=f"c{i}"))
    async with _connected(transport, peer.address) as channel:
        for round_ in range(2):
            steps = [100 * (round_ + 1) + i for i in range(len(names))]
            values = await gather_all(
                _recv_checked(channel, n, s, LARGE_TIMEOUT) for n, s in zip(names, steps, strict=True)
            )
            for name, step, value in zip(names, steps, values, strict=True):
                assert_same_tensor(value, make_tensor(name, step), f"{name} (step {step}) after the others")


async def check_received_values_are_stable(transport: Transport, peer: ConformancePeer) -> None:
    """A received array is never changed by later receives (no buffer reuse under the caller).

    The same names (64 KiB and 16 MiB, values that depend on the step) are
    received for 12 steps while every earlier value is kept; all are compared at
    the end.
    """
    names = [
        tensor_name("float32", (16 * 1024,), seed="step"),
        tensor_name("float32", (4 * MiB,), seed="step"),
    ]
    kept: list[tuple[str, int, Any]] = []
    async with _connected(transport, peer.address) as channel:
        for step in range(1, 13):
            for name in names:
                kept.append((name, step, await _recv_checked(channel, name, step, LARGE_TIMEOUT)))
    for name, step, value in kept:
        assert_same_tensor(value, make_tensor(name, step), f"{name} (step {step}) after later receives")


async def check_dead_tensors(transport: Transport, peer: ConformancePeer) -> None:
    """``is_dead=True`` from the sender arrives as True (small, 16 MiB and string tensors),
    and a live tensor of the same shape right after arrives as False."""
    async with _connected(transport, peer.address) as channel:
        for dtype, shape in (("float32", (3,)), ("float32", (2048, 2048)), ("string", (2,)), ("int8", ())):
            value, is_dead = await _recv(channel, tensor_name(dtype, shape, dead=True), 4)
            if is_dead is not True:
                _fail(f"dead {dtype}{list(shape)}: is_dead is {is_dead!r}, expected True")
            if not isinstance(value, np.ndarray):
                _fail(f"dead {dtype}{list(shape)}: value is {type(value).__name__}, expected a numpy array")
            await _recv_checked(channel, tensor_name(dtype, shape), 4)


async def check_errors(transport: Transport, peer: ConformancePeer) -> None:
    """An OpError the sender's RecvTensor handler raises arrives as the same class with the same message.

    Every OpError subclass (all 16 status codes) is raised once. Then an 8 MiB
    tensor fails only in one step: the steps before and after it get the tensor,
    so errors also travel on paths the transport picked for that name earlier.
    The channel stays usable after errors.
    """
    async with _connected(transport, peer.address) as channel:
        for code in range(1, 17):
            cls = errors.exception_type_from_error_code(code)
            name = tensor_name("float32", (2,), error=cls)
            exc = await _raises(
                errors.OpError, _recv(channel, name, code), f"RecvTensor raising {cls.__name__}"
            )
            _expect_error(exc, cls, error_message(cls, code), f"RecvTensor raising {cls.__name__}")
        name = tensor_name("float32", (2 * MiB,), error=errors.AbortedError, error_step=7)
        await _recv_checked(channel, name, 6)
        exc = await _raises(errors.OpError, _recv(channel, name, 7), "8 MiB RecvTensor failing in step 7")
        _expect_error(exc, errors.AbortedError, error_message(errors.AbortedError, 7), "8 MiB RecvTensor")
        await _recv_checked(channel, name, 8)


def _expect_error(exc: BaseException, cls: type[errors.OpError], message: str, what: str) -> None:
    if type(exc) is not cls:
        _fail(f"{what}: got {type(exc).__name__}({exc}), expected {cls.__name__}")
    if str(exc) != message:
        _fail(f"{what}: message {str(exc)!r}, expected {message!r}")


async def check_deadline(transport: Transport, peer: ConformancePeer) -> None:
    """A receive whose sender is slower than `timeout` fails with DeadlineExceededError soon
    after the deadline (not when the sender answers), and the abandoned answer never lands
    anywhere visible: receives of the same size made while, and after, the sender
    finishes the abandoned one all stay intact. The channel is still usable after.
    """
    async with _connected(transport, peer.address) as channel:
        await _recv_checked(channel, tensor_name("int8", (4,)), 1)
        started = time.monotonic()
        slow = tensor_name("int8", (4,), wait=20, tag=_unique("deadline"))
        await _raises(
            errors.DeadlineExceededError,
            channel.recv_tensor(5, recv_key(slow), timeout=0.5),
            "RecvTensor with timeout=0.5 against wait=20",
            within=10,
        )
        if time.monotonic() - started > 10:
            _fail("DeadlineExceededError came more than 10 s after a 0.5 s deadline")
        # An abandoned 8 MiB receive that the sender answers 1 s later, if it is not cancelled.
        late = tensor_name("uint8", (8 * MiB,), seed="step", wait=1, tag=_unique("late"))
        await _raises(
            errors.DeadlineExceededError,
            channel.recv_tensor(6, recv_key(late), timeout=0.3),
            "8 MiB RecvTensor with timeout=0.3 against wait=1",
            within=10,
        )
        # Receive the same size meanwhile, holding the last 8 values and checking each
        # again when it leaves the window (and all at the end).
        same_size = tensor_name("uint8", (8 * MiB,), seed="step")
        window: collections.deque[tuple[int, Any]] = collections.deque()
        done = asyncio.ensure_future(peer.wait_until_done(late, 6))
        try:
            step, after = 10, 0
            while after < 3:
                window.append((step, await _recv_checked(channel, same_size, step)))
                step += 1
                after += done.done()
                if len(window) > 8:
                    old_step, old_value = window.popleft()
                    assert_same_tensor(old_value, make_tensor(same_size, old_step), f"step {old_step}, held")
                if step > 1000:
                    _fail("the peer never finished the abandoned receive")
            done.result()
        finally:
            _discard(done)
        for old_step, old_value in window:
            assert_same_tensor(old_value, make_tensor(same_size, old_step), f"step {old_step}, held")
        await _recv_checked(channel, tensor_name("int8", (4,)), 7)


async def check_shape_changes_under_one_name(transport: Transport, peer: ConformancePeer) -> None:
    """One tensor name may carry different shapes in different steps (as a dynamic shape does in
    TensorFlow): whatever a transport remembers per name is only a hint, and each receive
    gets its own step's shape and values, sequentially and concurrently."""
    shapes = [(256,), (4 * MiB,), (0,), (3,), (4 * MiB + 5,), (16 * 1024,), (), (MiB,)]
    name = tensor_name("float32", shapes, seed="step")
    async with _connected(transport, peer.address) as channel:
        for step in range(2 * len(shapes)):
            await _recv_checked(channel, name, step, LARGE_TIMEOUT)
        steps = list(range(100, 100 + 2 * len(shapes)))
        values = await gather_all(_recv_checked(channel, name, s, LARGE_TIMEOUT) for s in steps)
        for step, value in zip(steps, values, strict=True):
            assert_same_tensor(value, make_tensor(name, step), f"{name} (step {step}) after the others")


# -- checks: control calls ------------------------------------------------------------


async def check_control_calls(transport: Transport, peer: ConformancePeer) -> None:
    """`call` returns the handler's response message, also for 8 MiB requests and responses."""
    async with _connected(transport, peer.address) as channel:
        async with asyncio.timeout(CALL_TIMEOUT + FAILURE_BOUND):
            status = await channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=CALL_TIMEOUT)
        if not isinstance(status, GetStatusResponse):
            _fail(f"GetStatus returned {type(status).__name__}")
        devices = [(d.name, d.incarnation) for d in status.device_attributes]
        if devices != [(PEER_DEVICE, peer.pid)]:
            _fail(f"GetStatus returned devices {devices}, expected {[(PEER_DEVICE, peer.pid)]}")
        big = make_tensor(tensor_name("float64", (MiB,), seed=8))
        request = RunGraphRequest(step_id=1)
        request.send.add(name="big").tensor.CopyFrom(to_tensor_proto(big))
        async with asyncio.timeout(CALL_TIMEOUT + FAILURE_BOUND):
            response = await channel.call(WORKER_SERVICE, "RunGraph", request, timeout=CALL_TIMEOUT)
        if not isinstance(response, RunGraphResponse):
            _fail(f"RunGraph returned {type(response).__name__}")
        if [r.name for r in response.recv] != ["big"]:
            _fail(f"RunGraph echo returned tensors {[r.name for r in response.recv]}, expected ['big']")
        assert_same_tensor(from_tensor_proto(response.recv[0].tensor), big, "8 MiB RunGraph echo")


async def check_control_errors(transport: Transport, peer: ConformancePeer) -> None:
    """An OpError a control handler raises arrives from `call` as the same class and message
    (all 16 status codes); a call that succeeds after them still works."""
    async with _connected(transport, peer.address) as channel:
        for code in range(1, 17):
            cls = errors.exception_type_from_error_code(code)
            call = channel.call(WORKER_SERVICE, "CleanupGraph", CleanupGraphRequest(step_id=code), timeout=10)
            exc = await _raises(errors.OpError, call, f"CleanupGraph raising {cls.__name__}")
            _expect_error(exc, cls, error_message(cls, code), f"CleanupGraph raising {cls.__name__}")
        async with asyncio.timeout(CALL_TIMEOUT):
            ok = await channel.call(
                WORKER_SERVICE, "CleanupGraph", CleanupGraphRequest(step_id=0), timeout=10
            )
        if not isinstance(ok, CleanupGraphResponse):
            _fail(f"CleanupGraph returned {type(ok).__name__}")


# -- checks: lifecycle and failures ---------------------------------------------------


async def check_close(transport: Transport, peer: ConformancePeer) -> None:
    """`close()` lets a call in flight finish, then every call raises UnavailableError.

    A receive that the sender answers after 0.5 s is pending when `close()` is
    called; it must return its tensor, `close()` must return within the bound,
    and `recv_tensor` and `call` afterwards raise UnavailableError at once.
    """
    channel = transport.connect(peer.address)
    closed = False
    pending: asyncio.Future[Any] | None = None
    try:
        await _recv_checked(channel, tensor_name("int16", (8,)), 1)
        name = tensor_name("int16", (8,), wait=0.5, tag=_unique("close"))
        pending = asyncio.ensure_future(_recv_checked(channel, name, 2))
        await peer.wait_until_waiting(name, 2)
        async with asyncio.timeout(FAILURE_BOUND):
            await channel.close()
        closed = True
        try:
            async with asyncio.timeout(FAILURE_BOUND) as deadline:
                await pending
        except AssertionError:
            raise
        except BaseException as exc:
            _reraise_if_we_are_cancelled(exc)
            if deadline.expired():
                raise AssertionError(
                    f"a receive in flight during close() still pending after {FAILURE_BOUND} s"
                ) from exc
            raise AssertionError(
                f"a receive in flight during close() failed with {type(exc).__name__}({exc}); "
                "close() must let calls in flight finish"
            ) from exc
    finally:
        _discard(pending)
        if not closed:
            async with asyncio.timeout(FAILURE_BOUND):
                await channel.close()
    await _expect_unavailable_after(channel, "close()")


async def _expect_unavailable_after(channel: Channel, what: str) -> None:
    await _raises(
        errors.UnavailableError,
        channel.recv_tensor(9, recv_key(tensor_name("int8", (1,))), timeout=5),
        f"recv_tensor after {what}",
        within=5,
    )
    await _raises(
        errors.UnavailableError,
        channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=5),
        f"call after {what}",
        within=5,
    )


async def check_abort(transport: Transport, peer: ConformancePeer) -> None:
    """`abort()` fails a call in flight at once (CancelledError or UnavailableError, both
    OpErrors) and every later call raises UnavailableError."""
    channel = transport.connect(peer.address)
    pending: asyncio.Future[Any] | None = None
    try:
        await _recv_checked(channel, tensor_name("int32", (8,)), 1)
        name = tensor_name("int32", (8,), wait=30, tag=_unique("abort"))
        pending = asyncio.ensure_future(channel.recv_tensor(2, recv_key(name), timeout=60))
        await peer.wait_until_waiting(name, 2)
        channel.abort()
        await _raises(
            (errors.CancelledError, errors.UnavailableError),
            pending,
            "a receive in flight during abort()",
            within=5,
        )
        await _expect_unavailable_after(channel, "abort()")
    finally:
        _discard(pending)
        async with asyncio.timeout(FAILURE_BOUND):
            await channel.close()


async def check_peer_death(transport: Transport, peer: ConformancePeer) -> None:
    """When the sender's process is killed (SIGKILL) during a receive, the receive fails
    with UnavailableError within 15 s instead of hanging, later calls fail the same way,
    and `close()` still returns. The peer is killed: give this check its own."""
    async with _connected(transport, peer.address) as channel:
        await _recv_checked(channel, tensor_name("float32", (MiB,)), 1)  # connected, data path set up
        name = tensor_name("float32", (4,), wait=30, tag=_unique("death"))
        pending = asyncio.ensure_future(channel.recv_tensor(2, recv_key(name), timeout=60))
        try:
            await peer.wait_until_waiting(name, 2)
            await asyncio.to_thread(peer.kill)
            started = time.monotonic()
            await _raises(errors.UnavailableError, pending, "a receive in flight when the peer died")
            elapsed = time.monotonic() - started
            if elapsed > FAILURE_BOUND:
                _fail(f"the receive took {elapsed:.1f} s to fail after the peer died")
        finally:
            _discard(pending)
        await _raises(
            errors.UnavailableError,
            channel.recv_tensor(3, recv_key(tensor_name("int8", (1,))), timeout=10),
            "recv_tensor after the peer died",
        )
        await _raises(
            errors.UnavailableError,
            channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=10),
            "call after the peer died",
        )


async def check_unreachable_peer(transport: Transport, peer: ConformancePeer) -> None:
    """Calls to an address where nothing listens raise UnavailableError, without waiting
    for their (generous) timeout."""
    (port,) = free_ports(1)
    async with _connected(transport, f"localhost:{port}") as channel:
        started = time.monotonic()
        await _raises(
            errors.UnavailableError,
            channel.recv_tensor(1, recv_key(tensor_name("int8", (1,))), timeout=CALL_TIMEOUT),
            "recv_tensor to a closed port",
        )
        await _raises(
            errors.UnavailableError,
            channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=CALL_TIMEOUT),
            "call to a closed port",
        )
        if time.monotonic() - started > FAILURE_BOUND:
            _fail("calls to a closed port took longer than 15 s to fail")


async def check_statistics(transport: Transport, peer: ConformancePeer) -> None:
    """`statistics()` returns a ChannelStatistics for the connected target whose counters count:
    calls started (at least one per `recv_tensor` and per `call`), calls failed (a receive
    that raised counts), tensors received and their bytes, and names a data path."""
    async with _connected(transport, peer.address) as channel:
        before = channel.statistics()
        if not isinstance(before, ChannelStatistics):
            _fail(f"statistics() returned {type(before).__name__}")
        names = [
            tensor_name("float32", (3, 4)),
            tensor_name("int64", (MiB,)),
            tensor_name("uint8", (6 * MiB,)),
        ]
        for name in names:
            await _recv_checked(channel, name, 1, LARGE_TIMEOUT)
        async with asyncio.timeout(CALL_TIMEOUT):
            await channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=10)
        await _raises(errors.OpError, _recv(channel, tensor_name(error=errors.NotFoundError), 1), "error")
        after = channel.statistics()
        checks: Sequence[tuple[str, bool]] = [
            ("target", after.target == peer.address),
            ("calls_started", after.calls_started - before.calls_started >= len(names) + 2),
            ("calls_failed", after.calls_failed - before.calls_failed >= 1),
            ("tensors_received", after.tensors_received - before.tensors_received == len(names)),
            (
                "tensor_bytes_received",
                after.tensor_bytes_received - before.tensor_bytes_received == sum(map(_nbytes, names)),
            ),
            ("data_path", isinstance(after.data_path, str) and bool(after.data_path)),
        ]
        wrong = [field for field, ok in checks if not ok]
        if wrong:
            _fail(f"statistics() fields {wrong} are wrong: before {before}, after {after}")


async def check_listener_lifecycle(transport: Transport, peer: ConformancePeer) -> None:
    """A listener (in this process) knows its port as soon as `listen` returns, serves after
    `start()`, tolerates a second `start()` and `stop()`, and releases its port on `stop()`."""
    handlers = {"GetStatus": _local_status}
    listener = await transport.listen("localhost:0", {WORKER_SERVICE: handlers})
    try:
        port = listener.port
        if not isinstance(port, int) or port <= 0:
            _fail(f"listen('localhost:0') gave port {port!r}")
        await listener.start()
        await listener.start()
        async with _connected(transport, f"localhost:{port}") as channel:
            async with asyncio.timeout(CALL_TIMEOUT):
                await channel.call(WORKER_SERVICE, "GetStatus", GetStatusRequest(), timeout=10)
    finally:
        async with asyncio.timeout(FAILURE_BOUND):
            await listener.stop(1.0)
            await listener.stop(1.0)
    again = await transport.listen(f"localhost:{port}", {WORKER_SERVICE: handlers})
    async with asyncio.timeout(FAILURE_BOUND):
        await again.stop(None)


async def _local_status(request: GetStatusRequest) -> GetStatusResponse:
    return GetStatusResponse()


# -- everything -----------------------------------------------------------------------

CHECKS: dict[str, Check] = {
    "correlation": check_correlation,
    "empty_and_scalar_tensors": check_empty_and_scalar_tensors,
    "dtypes": check_dtypes,
    "large_tensor": check_large_tensor,
    "concurrent_streams": check_concurrent_streams,
    "received_values_are_stable": check_received_values_are_stable,
    "dead_tensors": check_dead_tensors,
    "errors": check_errors,
    "deadline": check_deadline,
    "shape_changes_under_one_name": check_shape_changes_under_one_name,
    "control_calls": check_control_calls,
    "control_errors": check_control_errors,
    "close": check_close,
    "abort": check_abort,
    "unreachable_peer": check_unreachable_peer,
    "statistics": check_statistics,
    "listener_lifecycle": check_listener_lifecycle,
    "peer_death": check_peer_death,
}
"""Every check by name, in a sensible running order."""

OWN_PEER_CHECKS = frozenset({"peer_death"})
"""Checks that break their peer, so each needs a peer of its own."""


async def check_transport(transport: Transport, checks: Sequence[str] | None = None) -> dict[str, float]:
    """Run `checks` (default: all of `CHECKS`) against `transport`; seconds each took.

    The transport need not be registered: the peers build theirs from its class
    (see `ConformancePeer`).

    Raises:
        ConformanceError: Some checks failed; the message names each with its error.
    """
    durations: dict[str, float] = {}
    failures: list[str] = []
    async with ConformancePeer(transport) as shared:
        for name in checks or list(CHECKS):
            started = time.monotonic()
            try:
                if name in OWN_PEER_CHECKS:
                    async with ConformancePeer(transport) as own:
                        await CHECKS[name](transport, own)
                else:
                    await CHECKS[name](transport, shared)
            except Exception as exc:
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
            durations[name] = time.monotonic() - started
    if failures:
        raise ConformanceError(
            f"{transport.name} fails {len(failures)} conformance checks:\n" + "\n".join(failures)
        )
    return durations
