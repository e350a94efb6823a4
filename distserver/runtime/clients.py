"""How the runtime and sessions talk to workers and masters, local or in other tasks.

`WorkerClient` and `MasterClient` are the interfaces; the in-process `Worker` and
`Master` implement them, and so do `RemoteWorker` and `RemoteMaster`, which reach a
task through a transport channel (numpy values in, numpy values out for steps), so
the runtime and sessions treat local and remote peers alike. They convert values to
and from protos and turn errors reported in response bodies back into OpErrors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

from google.protobuf.message import Message

from distserver import errors
from distserver.devices import RendezvousKey
from distserver.protos import master_pb2 as m
from distserver.protos import worker_pb2 as w
from distserver.protos.config_pb2 import RunMetadata, RunOptions
from distserver.protos.debug_pb2 import StepStats
from distserver.protos.services import MASTER_SERVICE, TENSOR_SERVICE, WORKER_SERVICE
from distserver.runtime.names import canonical_tensor_name
from distserver.tensors import from_tensor_proto
from distserver.wire import (
    ENCODE_IN_THREAD_BYTES,
    HAND_DECODED_MESSAGE_BYTES,
    EncodedMessage,
    MessageT,
    decode_tensor_message,
    encode_off_loop,
)


class ChannelLike(Protocol):
    """The part of `distserver.transports.Channel` the runtime uses."""

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
    ) -> bytes | memoryview: ...

    async def recv_tensor(
        self, step_id: int, key: RendezvousKey, *, timeout: float | None = None
    ) -> tuple[Any, bool]: ...


class WorkerClient(Protocol):
    """How a master (or a `_Recv`) talks to one task's worker, local or remote.

    The local worker is called directly; remote ones through a transport channel.
    Both behave identically, including errors.
    """

    async def call(
        self, method: str, request: Message, *, timeout: float | None = None, wait_for_ready: bool = False
    ) -> Message:
        """Run a control RPC (`method` from `WORKER_METHODS`) and return its response.

        `wait_for_ready` waits (up to `timeout`) for a task that is not up yet
        instead of failing at once.
        """
        ...

    async def run_graph(
        self,
        request: w.RunGraphRequest,
        sends: Mapping[str, Any],
        *,
        timeout: float | None = None,
        stats: StepStats | None = None,
    ) -> dict[str, Any]:
        """Run one step of a registered graph.

        Args:
            request: RunGraphRequest with session/graph handles, step id and `recv_key`;
                its `send` field is ignored in favour of `sends`.
            sends: Rendezvous key text -> numpy value to feed.
            stats: When given, the worker's per-node timings are added to it.

        Returns:
            Rendezvous key text -> numpy value for every `recv_key`.
        """
        ...

    async def recv_tensor(
        self, step_id: int, key: RendezvousKey, *, timeout: float | None = None
    ) -> tuple[Any, bool]:
        """Fetch the value sent under `key` in step `step_id` on that worker."""
        ...

    async def recv_tensors(
        self, step_id: int, keys: list[str], every: bool = False, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Some of the values sent under `keys` in step `step_id` on that worker: those
        sent by the time the first one is, or once every one is (`every`; see
        `distserver.runtime.batched_recv`).

        Raises:
            UnimplementedError: the worker has no such method (TensorFlow).
        """
        ...


class MasterClient(Protocol):
    """How a session talks to its master, local (`Master`) or remote (`RemoteMaster`)."""

    async def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        """Run a MasterService RPC (`method` from `MASTER_METHODS`) and return its response."""
        ...

    async def run_step(
        self,
        handle: str,
        feeds: Mapping[str, Any],
        fetches: Sequence[str],
        targets: Sequence[str],
        options: RunOptions | None = None,
        metadata: RunMetadata | None = None,
    ) -> dict[str, Any]:
        """Run one step of session `handle`: canonical fetch name ("x:0") -> value.

        `metadata`, when given, receives what `options` asks for: per-node timings
        (`trace_level`) and the partition graphs (`output_partition_graphs`).
        """
        ...

    async def run_callable(self, handle: str, callable_handle: int, feeds: Sequence[Any]) -> list[Any]:
        """Run a callable made by MakeCallable: its fetches' values, in order."""
        ...


# How much longer than the step's own timeout a client waits for the master's answer:
# the master reports its DeadlineExceededError itself; this bound is for a master that
# cannot (hung, stopped, its network cut).
RPC_DEADLINE_SLACK_SECONDS = 1.0


def rpc_deadline(options: RunOptions | None) -> float | None:
    """The RunStep RPC's deadline in seconds: the step's timeout plus a little; None without one."""
    if options is None or options.timeout_in_ms <= 0:
        return None
    return options.timeout_in_ms / 1000 * 1.05 + RPC_DEADLINE_SLACK_SECONDS


def _raise_body_error(code: int, message: str) -> None:
    if code != errors.OK:
        raise errors.from_status(code, message)


class RemoteWorker:
    """A `WorkerClient` for a worker in another task (or another process)."""

    def __init__(self, channel: ChannelLike) -> None:
        self.channel = channel

    async def call(
        self, method: str, request: Message, *, timeout: float | None = None, wait_for_ready: bool = False
    ) -> Message:
        return await self.channel.call(
            WORKER_SERVICE, method, request, timeout=timeout, wait_for_ready=wait_for_ready
        )

    async def run_graph(
        self,
        request: w.RunGraphRequest,
        sends: Mapping[str, Any],
        *,
        timeout: float | None = None,
        stats: StepStats | None = None,
    ) -> dict[str, Any]:
        full = w.RunGraphRequest()
        full.CopyFrom(request)
        full.store_errors_in_response_body = True
        full.exec_opts.record_timeline = stats is not None
        encoded = await encode_off_loop(full, list(sends.items()))
        data = await self.channel.call_serialized(WORKER_SERVICE, "RunGraph", encoded, timeout=timeout)
        recv, response = await _named_tensors(data, w.RunGraphResponse)
        _raise_body_error(response.status_code, response.status_error_message)
        if stats is not None:
            stats.dev_stats.extend(response.step_stats.dev_stats)
        return dict(recv)

    async def recv_tensor(
        self, step_id: int, key: RendezvousKey, *, timeout: float | None = None
    ) -> tuple[Any, bool]:
        return await self.channel.recv_tensor(step_id, key, timeout=timeout)

    async def recv_tensors(
        self, step_id: int, keys: list[str], every: bool = False, *, timeout: float | None = None
    ) -> dict[str, Any]:
        request = w.RunGraphRequest(step_id=step_id, recv_key=keys)
        method = "RecvAllTensors" if every else "RecvTensors"
        data = await self.channel.call_serialized(TENSOR_SERVICE, method, request, timeout=timeout)
        values, _ = await _named_tensors(data, w.RunGraphResponse, missing_ok=True)
        return dict(values)  # a value None: FETCH_SEPARATELY


class RemoteMaster:
    """The master of a task reached over RPC, with the in-process `Master`'s methods."""

    def __init__(self, channel: ChannelLike) -> None:
        self.channel = channel

    async def call(self, method: str, request: Message, *, timeout: float | None = None) -> Any:
        return await self.channel.call(MASTER_SERVICE, method, request, timeout=timeout)

    async def run_step(
        self,
        handle: str,
        feeds: Mapping[str, Any],
        fetches: Sequence[str],
        targets: Sequence[str],
        options: RunOptions | None = None,
        metadata: RunMetadata | None = None,
    ) -> dict[str, Any]:
        request = m.RunStepRequest(
            session_handle=handle,
            fetch=list(fetches),
            target=list(targets),
            store_errors_in_response_body=True,
        )
        if options is not None:
            request.options.CopyFrom(options)
        encoded = await encode_off_loop(request, list(feeds.items()))
        data = await self.channel.call_serialized(
            MASTER_SERVICE, "RunStep", encoded, timeout=rpc_deadline(options)
        )
        fetched, response = await _named_tensors(data, m.RunStepResponse)
        _raise_body_error(response.status_code, response.status_error_message)
        if metadata is not None:
            metadata.CopyFrom(response.metadata)
        return {canonical_tensor_name(name): value for name, value in fetched}

    async def run_callable(self, handle: str, callable_handle: int, feeds: Sequence[Any]) -> list[Any]:
        request = m.RunCallableRequest(session_handle=handle, handle=callable_handle)
        encoded = await encode_off_loop(request, list(feeds))
        data = await self.channel.call_serialized(MASTER_SERVICE, "RunCallable", encoded)
        fetched, _ = await _named_tensors(data, m.RunCallableResponse)
        return [value for _, value in fetched]


async def _named_tensors(
    data: bytes | memoryview, message_class: type[MessageT], *, missing_ok: bool = False
) -> tuple[list[tuple[str, Any]], MessageT]:
    """A serialized RunStep, RunGraph or RunCallable response's tensors (RunCallable's
    without names) and the rest of the message.

    An answer of `HAND_DECODED_MESSAGE_BYTES` or more is read by hand
    (`wire.decode_tensor_message`: plain numeric tensors of 16 KiB or more as numpy
    views over `data`, items whose heads it knows without protobuf); smaller answers,
    and answers with large tensors of other kinds, are parsed by protobuf (in a thread
    when large).
    `missing_ok`: a name without a tensor gives None (RecvTensors: fetch it separately).
    """
    if len(data) >= HAND_DECODED_MESSAGE_BYTES:  # (below, protobuf is as fast)
        decoded = decode_tensor_message(data, message_class, missing_ok=missing_ok)
        if decoded is not None:
            return decoded

    def value(item: Any) -> tuple[str, Any]:
        if not hasattr(item, "tensor"):  # RunCallable's bare TensorProto
            return "", from_tensor_proto(item)
        if missing_ok and not item.HasField("tensor"):
            return item.name, None
        return item.name, from_tensor_proto(item.tensor)

    def parse() -> tuple[list[tuple[str, Any]], MessageT]:
        response = cast(Any, message_class).FromString(data)  # protobuf takes a memoryview too
        field = response.DESCRIPTOR.fields_by_number[1].name  # "tensor", "recv" or "fetch"
        named = [value(item) for item in getattr(response, field)]
        response.ClearField(field)
        return named, response

    if len(data) < ENCODE_IN_THREAD_BYTES:
        return parse()
    return await asyncio.to_thread(parse)
