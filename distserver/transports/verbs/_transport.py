"""The "grpc+verbs" transport: gRPC control plane, shared-memory tensor path.

Everything the "grpc" transport serves is served unchanged (so every client,
TensorFlow's included, works as with "grpc"). In addition each server runs a
`TensorServer` on a Unix socket, announced over gRPC by
`/distserver.VerbsService/GetEndpoint` together with the server's host identity
(boot id, network namespace, uid).

A channel's first `recv_tensor` asks the peer for that endpoint and compares
identities. Same host, namespace and user: it connects a queue pair and every later
tensor is written by the sender straight into this process's registered memory
(one copy), arriving as a numpy view of that memory. Otherwise the channel uses the
gRPC data path, says so once in the log and in `statistics().data_path` -- or, when
the transport is strict (`VerbsTransport(strict=True)`, or `DISTSERVER_VERBS_STRICT=1`
for the registered one), fails with `FailedPreconditionError`. Tensors the verbs path
cannot carry (strings, resources) take the gRPC path one by one.

Once the queue pair is up (the channel's first WorkerService call or RecvTensor sets
it up), WorkerService calls to that peer ride it too (`_calls`): the peer's event
loop reads them, where a gRPC message passes through grpc's poller thread first.

Received arrays are zero-copy views that pin their slice of the pool until they are
garbage collected: right for values a step consumes (the common case), and the
kernels that keep values (variables) store their own copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from distserver import errors
from distserver.protos.services import WORKER_SERVICE
from distserver.protos.worker_pb2 import RecvTensorRequest
from distserver.transports.base import Channel, ChannelStatistics, Listener, ServiceHandler, TensorHandOver
from distserver.transports.grpc import GrpcChannel, GrpcListener, GrpcTransport, error_from_rpc
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


class VerbsChannel(GrpcChannel):
    """A gRPC channel whose RecvTensor goes through shared memory when the peer allows."""

    def __init__(self, address: str, *, strict: bool) -> None:
        super().__init__(address)
        self._strict = strict
        self._endpoint: TensorEndpoint | None = None
        self._pd: ProtectionDomain | None = None
        self._pool: RegionPool | None = None
        self._fallback: str | None = None
        self._calls_on_grpc = False
        self._setup: asyncio.Lock | None = None
        self._get_endpoint = self._channel.unary_unary(
            f"/{ENDPOINT_SERVICE}/{ENDPOINT_METHOD}", request_serializer=_raw, response_deserializer=_raw
        )

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
                raise error_from_rpc(exc, target=self.target, method=ENDPOINT_METHOD) from exc
            remote = HostIdentity.decode(reply["identity"].encode())
            problem = viability_problem(host_identity(), remote)
            if problem is not None:
                if self._strict:
                    raise errors.FailedPreconditionError(
                        f"grpc+verbs is strict and the task at {self.target} cannot use shared memory: "
                        f"{problem}"
                    )
                self._fallback = problem
                logger.warning("grpc+verbs: %s uses the gRPC data path: %s", self.target, problem)
                return None
            if self._pd is None:
                self._pd = ProtectionDomain()
                self._pool = RegionPool(self._pd)
            self._endpoint = await TensorEndpoint.connect(self._pd, reply["address"])
            return self._endpoint

    async def _call_framed(
        self, service: str, method: str, payload: bytes, timeout: float | None
    ) -> bytes | memoryview | None:
        # WorkerService calls ride the queue pair too (`_calls`).
        path = f"/{service}/{method}"
        if service == WORKER_SERVICE and len(path) + len(payload) <= MAX_CALL_BYTES:
            endpoint = await self._endpoint_for_calls(timeout)
            if endpoint is not None:
                name = f"{method} to {self.target}"
                return await endpoint.calls.call(path, payload, timeout=timeout, name=name)
        return await super()._call_framed(service, method, payload, timeout)

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

    async def _fetch_tensor(self, request: Any, timeout: float | None) -> tuple[Any, bool]:
        endpoint = await self._verbs_endpoint(timeout)
        if endpoint is None:
            return await super()._fetch_tensor(request, timeout)
        assert self._pool is not None
        key = request.rendezvous_key
        name = key.split(";")[3] if key.count(";") >= 4 else key
        try:
            got = await endpoint.recv_tensor_into(
                self._pool, request.SerializeToString(), cache_key=name, timeout=timeout
            )
        except errors.UnimplementedError:
            # Not plain memory (strings, resources): this one tensor goes over gRPC.
            return await super()._fetch_tensor(request, timeout)
        return got.value, got.meta == _DEAD

    async def _release(self) -> None:
        try:
            if self._endpoint is not None:
                await self._endpoint.close()
            if self._pd is not None:
                await self._pd.close()
        finally:
            await super()._release()

    def statistics(self) -> ChannelStatistics:
        stats = super().statistics()
        if self._endpoint is not None:
            path = "verbs"
        elif self._fallback is not None:
            path = f"grpc (fallback: {self._fallback})"
        else:
            path = "verbs (not connected yet)"
        return dataclasses.replace(stats, data_path=path)


class VerbsTransport(GrpcTransport):
    """Serves like "grpc"; moves tensors between same-host tasks through shared memory.

    Args:
        strict: Refuse (FailedPreconditionError) instead of falling back to the gRPC
            data path when a peer is on another host, namespace or user. Default:
            the `DISTSERVER_VERBS_STRICT` environment variable ("1" = strict).
    """

    name = "grpc+verbs"

    def __init__(self, *, strict: bool | None = None) -> None:
        self.strict = os.environ.get(STRICT_ENV) == "1" if strict is None else strict

    async def listen(self, address: str, services: Mapping[str, ServiceHandler]) -> Listener:
        fetch = services.get(WORKER_SERVICE, {}).get("RecvTensor")
        hand_over = None if fetch is None else TensorHandOver(fetch)
        if hand_over is not None:  # gRPC serves what verbs cannot, from the same hand-over
            services = {**services, WORKER_SERVICE: {**services[WORKER_SERVICE], "RecvTensor": hand_over}}
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
        listener = await self.bind_server(address, services, (handler,))
        calls = listener.calls

        async def serve_call(path: str, payload: bytes) -> bytes:
            # A peer's WorkerService call over the queue pair: served like one on the call stream.
            if calls.draining:
                raise errors.UnavailableError("the server is stopping")
            if not path.startswith(f"/{WORKER_SERVICE}/"):
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

    def connect(self, address: str) -> Channel:
        return VerbsChannel(address, strict=self.strict)


def _tensor_source(hand_over: TensorHandOver | None) -> Callable[[bytes], Awaitable[TensorReply]]:
    async def source(header: bytes) -> TensorReply:
        if hand_over is None:
            raise errors.UnimplementedError("this server has no WorkerService to serve tensors from")
        request = RecvTensorRequest.FromString(header)
        value, is_dead = await hand_over.fetch(request)
        if not is_plain(value):
            hand_over.park(request, value, is_dead)  # the receiver asks again over gRPC
            raise errors.UnimplementedError("tensors that are not plain memory go over gRPC")
        return TensorReply(value, meta=_DEAD if is_dead else _ALIVE)

    return source
