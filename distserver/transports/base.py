"""The transport contract: how a task serves RPCs and how it calls other tasks.

A `Transport` is chosen by `ServerDef.protocol` ("grpc", "grpc+verbs", ...). The
runtime never imports a transport; the server wires one in. Every transport serves
the same two services (MasterService, WorkerService) with the methods listed in
`distserver.protos.services`, so clients cannot tell transports apart except by
speed.

Two planes:

* Control: `Channel.call(service, method, request)` on the calling side, a
  `ServiceHandler` per service on the serving side; protobuf messages in and out (or
  a response already serialized, `wire.EncodedMessage`: the transports call
  `SerializeToString` on what a handler returns). Transports parse requests with
  `parse_handler_request`, so a handler of RunStep, RunCallable or RunGraph takes a
  `wire.TensorRequest` too (a large request, its tensors already read as views).
* Data: `Channel.recv_tensor(step_id, key)` on the calling side, a `TensorSource`
  on the serving side; numpy values in and out. How the bytes move (a gRPC
  RecvTensor, a chunked stream, shared memory) is the transport's business.

Concurrency: all objects are created and used on one asyncio event loop (grpc.aio
objects must not cross threads). Many calls may be in flight on one channel.

Errors: transports turn their native failures into `distserver.errors.OpError`
subclasses at their own boundary, chained with `from`: an unreachable or vanished
peer is `UnavailableError`, an expired deadline `DeadlineExceededError`, and an error
the remote handler raised comes back as the same class with the same message.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from google.protobuf.message import DecodeError, Message

from distserver import errors
from distserver.devices import RendezvousKey
from distserver.security import Security
from distserver.wire import (
    HAND_DECODED_REQUEST_BYTES,
    EncodedMessage,
    TensorRequest,
    decode_tensor_message,
    tensor_field,
)

# A service implementation: method name ("RunStep") -> coroutine taking the request
# message and returning the response message. Raising an OpError reports that status.
ServiceHandler = Mapping[str, Callable[[Any], Awaitable[Any]]]

# The data plane's serving side: `(step_id, key) -> (value, is_dead)`, the value a
# numpy array, available once the step's `_Send` for `key` has run (the source waits
# for it). A listener serves WorkerService's RecvTensor, and whatever faster paths
# its transport has, from this; each transport encodes the value its own way.
TensorSource = Callable[[int, RendezvousKey], Awaitable[tuple[Any, bool]]]

MessageT = TypeVar("MessageT", bound=Message)
T = TypeVar("T")


async def wait_for_answer(
    future: asyncio.Future[T], timeout: float | None, give_up: Callable[[], None], deadline_message: str
) -> T:
    """A call's answer (`future`), within `timeout`: when it passes, `give_up()` (tell the
    peer to cancel) and raise DeadlineExceededError(`deadline_message`); a cancelled
    caller gives up too. A DeadlineExceededError the answer itself carries passes as is."""
    timer = asyncio.timeout(timeout)
    try:
        async with timer:
            return await future
    except TimeoutError:
        if not timer.expired():
            raise  # the remote handler's own DeadlineExceededError
        give_up()
        raise errors.DeadlineExceededError(deadline_message) from None
    except asyncio.CancelledError:
        give_up()
        raise


def parse_request(request_cls: type[MessageT], data: bytes | memoryview) -> MessageT:
    """`request_cls` parsed from a peer's bytes; malformed bytes are the caller's error.

    Raises:
        InvalidArgumentError: naming the message type (a peer that sends garbage gets
            INVALID_ARGUMENT, as from TensorFlow, not an UNKNOWN with a logged traceback).
    """
    try:
        return request_cls.FromString(cast(bytes, data))  # FromString takes any buffer
    except DecodeError as exc:
        raise errors.InvalidArgumentError(f"Could not parse the {request_cls.__name__}: {exc}") from None


def parse_handler_request(
    request_cls: type[MessageT], data: bytes | memoryview
) -> MessageT | TensorRequest[MessageT]:
    """`parse_request` for a service handler: a RunStep, RunCallable or RunGraph request
    of `HAND_DECODED_REQUEST_BYTES` or more comes as a `wire.TensorRequest`, its large
    plain tensors numpy views over `data` rather than copies protobuf makes on the
    event loop (the handlers read both forms)."""
    if len(data) < HAND_DECODED_REQUEST_BYTES or tensor_field(request_cls) is None:
        return parse_request(request_cls, data)
    try:
        decoded = decode_tensor_message(data, request_cls, what=f"a {request_cls.__name__}")
    except errors.DataLossError as exc:
        raise errors.InvalidArgumentError(f"Could not parse the {request_cls.__name__}: {exc}") from None
    if decoded is None:
        return parse_request(request_cls, data)
    tensors, message = decoded
    return TensorRequest(message, tensors)


@dataclass(frozen=True)
class ChannelStatistics:
    """A snapshot of one channel's activity, for debugging and benchmarks.

    `tensor_bytes_received` counts the data plane (`recv_tensor`); `call_bytes_received`
    the serialized responses of control calls, where a worker's RunGraph response
    carries the values of 1 MiB or less it pushes (`runtime/push.py`).
    """

    target: str
    calls_started: int
    calls_failed: int
    tensors_received: int
    tensor_bytes_received: int
    data_path: str
    call_bytes_received: int = 0


class Listener(abc.ABC):
    """A bound (and later serving) endpoint of one task.

    Contract:
        * After `Transport.listen` returns, the port is bound (`port` is known) but
          no request is served until `start()`.
        * `start()` begins serving; calling it again does nothing.
        * `stop(grace)` stops accepting new calls at once, lets calls in flight finish
          for up to `grace` seconds (None: wait for them), then cancels the rest and
          releases the port. It is idempotent; after it returns a new listener can
          bind the same port.
    """

    @property
    @abc.abstractmethod
    def port(self) -> int:
        """The bound port (the real one when the address asked for port 0)."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self, grace: float | None) -> None: ...


class Channel(abc.ABC):
    """A client connection from this task to one remote task.

    Contract:
        * `call(service, method, request, timeout=...)` sends one control RPC and
          returns the response message; it never waits for an unreachable peer
          longer than `timeout` (None: fail as soon as the peer is known to be
          unreachable, unless `wait_for_ready` is true).
        * `call_serialized(...)` is `call` returning the response still serialized, for
          callers that read its tensors themselves (`wire.decode_tensor_message`);
          its request may be a `wire.EncodedMessage`, sent as it is. The default
          serializes what `call` parsed.
        * `recv_tensor(step_id, key, timeout=...)` fetches the value the peer's
          tensor source holds for `key` in step `step_id` and returns
          `(value, is_dead)` with `value` a numpy array (possibly a read-only view
          of transport memory). Errors the source raises arrive as the same class
          with the same message.
        * `close()` waits for calls in flight to end and releases the connection;
          `abort()` cancels them at once. Calls after either raise
          `UnavailableError`.
    """

    @abc.abstractmethod
    async def call(
        self,
        service: str,
        method: str,
        request: Message,
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> Message: ...

    async def call_serialized(
        self, service: str, method: str, request: Message | EncodedMessage, *, timeout: float | None = None
    ) -> bytes | memoryview:
        if isinstance(request, EncodedMessage):
            request = request.parse()
        response = await self.call(service, method, request, timeout=timeout)
        data: bytes = response.SerializeToString()
        return data

    @abc.abstractmethod
    async def recv_tensor(
        self, step_id: int, key: RendezvousKey, *, timeout: float | None = None
    ) -> tuple[Any, bool]: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None: ...

    @abc.abstractmethod
    def statistics(self) -> ChannelStatistics: ...


class Transport(abc.ABC):
    """A way for tasks to serve and call RPCs, registered under a protocol name."""

    name: str
    # Values of at most this many bytes that one distserver task receives from another
    # ride in a batched `RecvTensors` response (`runtime/batched_recv.py`); larger ones
    # go by the data plane (`Channel.recv_tensor`), which moves them better.
    batched_value_bytes: int = 1 << 20

    @abc.abstractmethod
    async def listen(
        self,
        address: str,
        services: Mapping[str, ServiceHandler],
        tensors: TensorSource | None = None,
        *,
        security: Security | None = None,
    ) -> Listener:
        """Bind `address` ("host:port", port 0 for any free port) and prepare to serve.

        Args:
            address: Where to listen. The host is bound as given ("localhost" means
                loopback only; "0.0.0.0" or "[::]" listen on every interface).
            services: Service name ("tensorflow.WorkerService") -> its handler.
                Methods a handler lacks answer `UnimplementedError`.
            tensors: Where RecvTensor (and any faster tensor path) takes its values;
                None: RecvTensor answers `UnimplementedError`.
            security: TLS (mutual with `require_client_cert`) on every way in, and
                its token required of every call (`UnauthenticatedError` without).
                A transport that cannot do what it asks raises `UnimplementedError`.

        Raises:
            UnknownError: the address cannot be bound (in use, not local); the message
                names the address.
            InvalidArgumentError: `security` cannot serve (TLS without a certificate).
        """

    @abc.abstractmethod
    def connect(self, address: str, *, security: Security | None = None) -> Channel:
        """A channel to the task at `address` ("host:port"). Connects lazily.

        With `security`, it uses TLS (presenting its certificate, when it has one) and
        sends the token with every call.
        """
