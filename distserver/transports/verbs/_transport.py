"""The "grpc+verbs" transport: gRPC control plane, shared-memory tensor path.

Everything the "grpc" transport serves is served unchanged (so every client,
TensorFlow's included, works as with "grpc"). In addition each server runs a
`TensorServer` on a Unix socket, announced over gRPC by
`/distserver.VerbsService/GetEndpoint` together with the server's host identity
(boot id, network namespace, uid).

A channel is the gRPC transport's `GrpcChannel` with a `VerbsTensorPath` plugged in.
Its first `recv_tensor` (or WorkerService call) asks the peer for that endpoint and
compares identities. Same host, namespace and user: it connects a queue pair and every later
tensor is written by the sender straight into this process's registered memory
(one copy), arriving as a numpy view of that memory. Otherwise the channel uses the
gRPC data path, says so once in the log and in `statistics().data_path` -- or, when
the transport is strict (`VerbsTransport(strict=True)`, or `DISTSERVER_VERBS_STRICT=1`
for the registered one), fails with `FailedPreconditionError`. Tensors the verbs path
cannot carry (strings, resources) take the gRPC path one by one.

The channel's first WorkerService call or RecvTensor sets the queue pair up. Control
calls (WorkerService, TensorService) take the channel's direct TCP connection once it
is up, as "grpc"'s do (`transports/direct.py`: an answer is read straight into the
buffer it is decoded from); until then, and for good without one (DISTSERVER_DIRECT=0,
a direct port that cannot be reached), they ride the queue pair (`_calls`,
`VerbsTensorPath.carry_call`): either way the peer's event loop reads them, where a
gRPC message passes through grpc's poller thread first.

Received arrays are zero-copy views that pin their slice of the pool until they are
garbage collected: right for values a step consumes (the common case), and the
kernels that keep values (variables) store their own copy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
import grpc.aio

from distserver import errors
from distserver.devices import RendezvousKey, parse_rendezvous_key
from distserver.protos.services import TENSOR_SERVICE, WORKER_SERVICE
from distserver.protos.worker_pb2 import RecvTensorRequest
from distserver.security import Security
from distserver.transports.base import (
    Channel,
    Listener,
    ServiceHandler,
    TensorSource,
    Transport,
    parse_request,
)
from distserver.transports.direct import DirectLink
from distserver.transports.grpc import (
    GrpcChannel,
    GrpcListener,
    GrpcTensorPath,
    TensorHandOver,
    TensorPath,
    error_from_rpc,
    serve,
)
from distserver.transports.verbs._identity import HostIdentity, host_identity, viability_problem
from distserver.transports.verbs._memory import ProtectionDomain, RegionPool
from distserver.transports.verbs._tensor import TensorEndpoint, TensorReply, TensorServer
from distserver.transports.verbs._wire import MAX_CALL_BYTES
from distserver.wire import is_plain

logger = logging.getLogger(__name__)

ENDPOINT_SERVICE = "distserver.VerbsService"
ENDPOINT_METHOD = "GetEndpoint"
STRICT_ENV = "DISTSERVER_VERBS_STRICT"
_DEAD, _ALIVE = b"\1", b"\0"


def _raw(data: bytes) -> bytes:
    return data


# Services whose calls between distserver tasks ride the queue pair.
_QUEUE_PAIR_SERVICES = (WORKER_SERVICE, TENSOR_SERVICE)


class TaskListener(Listener):
    """The gRPC listener plus the shared-memory tensor server of one task."""

    def __init__(
        self, grpc_listener: GrpcListener, tensor_server: TensorServer, pd: ProtectionDomain
    ) -> None:
        self._grpc = grpc_listener
        self._tensor_server = tensor_server
        self._pd = pd

    @property
    def port(self) -> int:
        return self._grpc.port

    async def start(self) -> None:
        await self._grpc.start()

    async def stop(self, grace: float | None) -> None:
        try:
            await self._grpc.stop(grace)
        finally:
            await self._tensor_server.close()
            await self._pd.close()


class VerbsTensorPath(TensorPath):
    """A channel's tensor path through shared memory when the peer allows, else gRPC.

    Its queue pair also carries the channel's WorkerService calls while its direct
    connection does not (`carry_call`).
    """

    def __init__(
        self, channel: grpc.aio.Channel, target: str, direct_link: DirectLink, *, strict: bool
    ) -> None:
        self._target = target
        self._strict = strict
        self._grpc = GrpcTensorPath(channel, direct_link)
        self._get_endpoint = channel.unary_unary(
            f"/{ENDPOINT_SERVICE}/{ENDPOINT_METHOD}", request_serializer=_raw, response_deserializer=_raw
        )
        self._endpoint: TensorEndpoint | None = None
        self._pd: ProtectionDomain | None = None
        self._pool: RegionPool | None = None
        self._fallback: str | None = None
        self._calls_on_grpc = False
        self._setup: asyncio.Lock | None = None

    @property
    def endpoint(self) -> TensorEndpoint | None:
        """The queue pair's tensor endpoint once it is set up; None before, or on the gRPC path."""
        return self._endpoint

    async def _verbs_endpoint(self, timeout: float | None) -> TensorEndpoint | None:
        """The queue pair to the peer, set up on first use; None: use gRPC."""
        if self._endpoint is not None and not self._endpoint.closed:
            return self._endpoint
        if self._fallback is not None:
            return None
        if self._setup is None:
            self._setup = asyncio.Lock()
        async with self._setup:
            if self._endpoint is not None and not self._endpoint.closed:
                return self._endpoint
            if self._fallback is not None:
                return None
            try:
                reply = json.loads(await self._get_endpoint(b"", timeout=timeout))
            except grpc.aio.AioRpcError as exc:
                raise error_from_rpc(exc, target=self._target, method=ENDPOINT_METHOD) from exc
            remote = HostIdentity.decode(reply["identity"].encode())
            problem = viability_problem(host_identity(), remote)
            if problem is not None:
                if self._strict:
                    raise errors.FailedPreconditionError(
                        f"grpc+verbs is strict and the task at {self._target} cannot use shared memory: "
                        f"{problem}"
                    )
                self._fallback = problem
                logger.warning("grpc+verbs: %s uses the gRPC data path: %s", self._target, problem)
                return None
            if self._pd is None:
                self._pd = ProtectionDomain()
                self._pool = RegionPool(self._pd)
            self._endpoint = await TensorEndpoint.connect(self._pd, reply["address"])
            return self._endpoint

    async def carry_call(
        self, service: str, method: str, payload: bytes, timeout: float | None
    ) -> bytes | memoryview | None:
        # WorkerService calls, and batched receives, ride the queue pair (`_calls`).
        path = f"/{service}/{method}"
        if service not in _QUEUE_PAIR_SERVICES or len(path) + len(payload) > MAX_CALL_BYTES:
            return None
        endpoint = await self._endpoint_for_calls(timeout)
        if endpoint is None:
            return None
        return await endpoint.calls.call(path, payload, timeout=timeout, name=f"{method} to {self._target}")

    async def _endpoint_for_calls(self, timeout: float | None) -> TensorEndpoint | None:
        """The queue pair for control calls, set up by the first WorkerService call;
        None: calls use gRPC (no queue pair is possible; the data path says why)."""
        if self._endpoint is not None and not self._endpoint.closed:
            return self._endpoint
        if self._calls_on_grpc:
            return None
        try:
            return await self._verbs_endpoint(timeout)
        except (errors.UnavailableError, errors.DeadlineExceededError):
            return None  # the peer is down or slow: this call fails or waits over gRPC
        except errors.OpError:  # strict with a foreign peer, a peer without verbs, ...
            self._calls_on_grpc = True
            return None

    async def recv_tensor(self, step_id: int, key: RendezvousKey, timeout: float | None) -> tuple[Any, bool]:
        endpoint = await self._verbs_endpoint(timeout)
        if endpoint is None:
            return await self._grpc.recv_tensor(step_id, key, timeout)
        assert self._pool is not None
        header = RecvTensorRequest(step_id=step_id, rendezvous_key=key.text).SerializeToString()
        try:
            got = await endpoint.recv_tensor_into(
                self._pool, header, cache_key=key.tensor_name, timeout=timeout
            )
        except errors.UnimplementedError:
            # Not plain memory (strings, resources): this one tensor goes over gRPC.
            return await self._grpc.recv_tensor(step_id, key, timeout)
        return got.value, got.meta == _DEAD

    @property
    def data_path(self) -> str:
        if self._endpoint is not None:
            return "verbs"
        if self._fallback is not None:
            return f"grpc (fallback: {self._fallback})"
        return "verbs (not connected yet)"

    async def close(self) -> None:
        try:
            if self._endpoint is not None:
                await self._endpoint.close()
        finally:
            if self._pd is not None:
                await self._pd.close()


class VerbsTransport(Transport):
    """Serves like "grpc"; moves tensors between same-host tasks through shared memory.

    Built from the gRPC transport's parts: its server (`serve`) with one more
    service (the endpoint announcement) and a `TensorServer` beside it, and its
    channel (`GrpcChannel`) with a `VerbsTensorPath`.

    Args:
        strict: Refuse (FailedPreconditionError) instead of falling back to the gRPC
            data path when a peer is on another host, namespace or user. Default:
            the `DISTSERVER_VERBS_STRICT` environment variable ("1" = strict).
    """

    name = "grpc+verbs"
    # (`batched_value_bytes` as over grpc, 1 MiB: a batched answer of values up to that
    # size, over the queue pair's socket, reaches the peer sooner than each value's own
    # request and one-sided write; larger values go through shared memory.)

    def __init__(self, *, strict: bool | None = None) -> None:
        self.strict = os.environ.get(STRICT_ENV) == "1" if strict is None else strict

    async def listen(
        self,
        address: str,
        services: Mapping[str, ServiceHandler],
        tensors: TensorSource | None = None,
        *,
        security: Security | None = None,
    ) -> Listener:
        # gRPC serves what shared memory cannot carry, from the same hand-over.
        hand_over = None if tensors is None else TensorHandOver(tensors)
        announcement = b""  # set below, before the server starts

        async def get_endpoint(request: bytes, context: Any) -> bytes:
            return announcement

        handler = grpc.method_handlers_generic_handler(
            ENDPOINT_SERVICE,
            {
                ENDPOINT_METHOD: grpc.unary_unary_rpc_method_handler(
                    get_endpoint, request_deserializer=_raw, response_serializer=_raw
                )
            },
        )
        listener = await serve(address, services, hand_over, (handler,), security=security)
        calls = listener.calls

        async def serve_call(path: str, payload: bytes) -> bytes:
            # A peer's WorkerService call over the queue pair: served like one on the call stream.
            if calls.draining:
                raise errors.UnavailableError("the server is stopping")
            if path.split("/")[1] not in _QUEUE_PAIR_SERVICES:
                raise errors.UnimplementedError(f"{path} is not served over the verbs queue pair")
            return await calls.dispatch(path, payload)

        pd = ProtectionDomain()
        try:
            tensor_server = await TensorServer.start(pd, _tensor_source(hand_over), call_handler=serve_call)
            announcement = json.dumps(
                {"identity": host_identity().encode().decode(), "address": tensor_server.address}
            ).encode()
        except BaseException:
            await pd.close()
            await listener.stop(0)
            raise
        return TaskListener(listener, tensor_server, pd)

    def connect(self, address: str, *, security: Security | None = None) -> Channel:
        strict = self.strict
        return GrpcChannel(
            address,
            lambda channel, target, direct_link: VerbsTensorPath(channel, target, direct_link, strict=strict),
            security,
        )


def _tensor_source(hand_over: TensorHandOver | None) -> Callable[[bytes], Awaitable[TensorReply]]:
    async def source(header: bytes) -> TensorReply:
        if hand_over is None:
            raise errors.UnimplementedError("this server has no WorkerService to serve tensors from")
        request = parse_request(RecvTensorRequest, header)
        key = parse_rendezvous_key(request.rendezvous_key)
        value, is_dead = await hand_over.fetch(request.step_id, key)
        if not is_plain(value):
            hand_over.park(request.step_id, key, value, is_dead)  # the receiver asks again over gRPC
            raise errors.UnimplementedError("tensors that are not plain memory go over gRPC")
        return TensorReply(value, meta=_DEAD if is_dead else _ALIVE)

    return source
