"""The WorkerService of one task: worker sessions, registered graphs, RunGraph, RecvTensor.

The master (of this task or of another) drives it: it creates a worker session per
master session, registers each graph partition once (getting a graph handle),
then runs steps with RunGraph, feeding and fetching through the step's rendezvous
by rendezvous key. The worker drops a step's rendezvous itself once the RunGraph has
ended and every value for another task has been handed over (in the response or by
RecvTensor); CleanupGraph (after a failed step, or from TensorFlow's protocol)
drops it too.

Variables and other resources live in the task's `ResourceManager`, so they
outlive sessions (as on a TensorFlow parameter server), unless the session asked
for `isolate_session_state`, in which case it gets resources of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message

from distserver import errors
from distserver.devices import RendezvousKey, parse_rendezvous_key
from distserver.kernels.registry import OpKernel
from distserver.kernels.resources import ResourceManager
from distserver.protos import worker_pb2 as w
from distserver.protos.debug_pb2 import StepStats
from distserver.protos.device_attributes_pb2 import DeviceAttributes
from distserver.protos.graph_pb2 import GraphDef
from distserver.runtime import batched_recv
from distserver.runtime.clients import WorkerClient
from distserver.runtime.concurrency import request_tensors
from distserver.runtime.counters import StepCounters
from distserver.runtime.executor import Executor, StepContext
from distserver.runtime.fusion import (
    fuse_deduplicated_sparse_updates,
    fuse_dense_layers,
    group_variable_reads,
    group_variable_updates,
)
from distserver.runtime.push import PUSH_LIMIT_BYTES, worker_returns
from distserver.runtime.rendezvous import RendezvousTable, StepRendezvous
from distserver.tensors import tensor_nbytes
from distserver.wire import EncodedMessage, TensorRequest, encode_off_loop

logger = logging.getLogger(__name__)


@dataclass
class WorkerSession:
    handle: str
    resources: ResourceManager
    graphs: dict[str, Executor] = field(default_factory=dict)
    # Stateful kernels by node name, shared by every graph the session registers (see
    # `Executor`), as TensorFlow's sessions share them.
    stateful_kernels: dict[str, OpKernel] = field(default_factory=dict)
    # Held while a graph of the session is being built (`Worker.register_graph`).
    registering: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The master that made it ("" and 0 for masters that do not say, like TF before 2.2).
    master_task: str = ""
    master_incarnation: int = 0


def _build_executor(graph_def: GraphDef, task_name: str, stateful_kernels: dict[str, OpKernel]) -> Executor:
    """The executor of a partition registered with a worker of `task_name`, its dense
    layers and its sparse updates of repeated rows fused (`fuse_dense_layers`,
    `fuse_deduplicated_sparse_updates`), its variable updates and reads grouped
    (`group_variable_updates`, `group_variable_reads`)."""
    for node in graph_def.node:
        if node.device and not node.device.startswith(task_name + "/"):
            raise errors.InvalidArgumentError(
                f"Node '{node.name}' is placed on {node.device}, which is not a device of "
                f"this task ({task_name})",
                node_name=node.name,
            )
    return Executor(
        group_variable_reads(
            group_variable_updates(fuse_deduplicated_sparse_updates(fuse_dense_layers(graph_def)))
        ),
        stateful_kernels,
    )


# How long the first call to a peer may take (it is up: a RecvTensor to it follows).
_MEET_PEER_SECONDS = 30.0

# What to do about a session a restarted worker no longer knows.
_RECREATE = (
    "What the session held on this task (variables, queues) is gone: close the session and "
    "create a new one (MonitoredSession does so on AbortedError)."
)


class Worker:
    """One task's worker. All methods run on the server's event loop."""

    def __init__(
        self,
        *,
        task_name: str,
        device: DeviceAttributes,
        resources: ResourceManager,
        pool: concurrent.futures.Executor,
        worker_client: Callable[[str], WorkerClient] | None = None,
        recv_timeout: float | None = None,
        checkpoint_root: str | None = None,
        batched_value_bytes: int = PUSH_LIMIT_BYTES,
    ) -> None:
        self.task_name = task_name
        # The resolved directory checkpoint kernels may use (None: they refuse).
        self.checkpoint_root = checkpoint_root
        self.device = device
        self.resources = resources
        self._pool = pool
        self.graphs = StepCounters()  # the partition graphs this worker ran (RunGraph)
        self._worker_client = worker_client
        self._recv_timeout = recv_timeout
        self._sessions: dict[str, WorkerSession] = {}
        # Sessions of masters that never call CreateWorkerSession (and TF 1.x
        # clients' legacy path) share the task's resources.
        self._legacy_session = WorkerSession("", resources)
        self._graph_ids = itertools.count(1)
        # Tasks this worker has called once (see `_fetch_remote`).
        self._peers_met: set[str] = set()
        # Remote values are fetched in batches per step and task (`batched_recv`).
        self._batched = batched_recv.BatchedReceiver(self._batch_call, self._fetch_remote)
        # Larger values are answered "fetch by RecvTensor" (the transport's choice).
        self._batched_value_bytes = min(batched_value_bytes, PUSH_LIMIT_BYTES)
        self._rendezvous = RendezvousTable(task_name, self._batched.fetch_soon if worker_client else None)
        # WorkerService method -> proto-in, proto-out handler. RecvTensor is the data
        # plane: transports serve it from `recv_tensor` (the task's tensor source).
        self._handlers: dict[str, Callable[[Any], Awaitable[Message | EncodedMessage]]] = {
            "GetStatus": self.get_status,
            "CreateWorkerSession": self.create_worker_session,
            "DeleteWorkerSession": self.delete_worker_session,
            "RegisterGraph": self.register_graph,
            "DeregisterGraph": self.deregister_graph,
            "RunGraph": self.run_graph_rpc,
            "CleanupGraph": self.cleanup_graph,
            "CleanupAll": self.cleanup_all,
        }

    def step_context(
        self, step_id: int, rendezvous: StepRendezvous, resources: ResourceManager
    ) -> StepContext:
        """What the kernels of a step on this worker see (a graph's step, an eager op, a
        component function)."""
        return StepContext(
            step_id=step_id,
            device=self.device.name,
            device_incarnation=self.device.incarnation,
            rendezvous=rendezvous,
            resources=resources,
            pool=self._pool,
            checkpoint_root=self.checkpoint_root,
        )

    @property
    def pool(self) -> concurrent.futures.Executor:
        """The thread pool kernels with large inputs run in."""
        return self._pool

    def service_handlers(self) -> dict[str, Callable[[Any], Awaitable[Message | EncodedMessage]]]:
        """WorkerService method name -> handler, for transports; `recv_tensor` is the tensor source."""
        return dict(self._handlers)

    # -- WorkerClient (the in-process path) ----------------------------------------

    async def call(
        self, method: str, request: Message, *, timeout: float | None = None, wait_for_ready: bool = False
    ) -> Message:
        handler = self._handlers.get(method)
        if handler is None:
            raise errors.UnimplementedError(f"WorkerService/{method} is not implemented by distserver")
        response = await handler(request)
        return response.parse() if isinstance(response, EncodedMessage) else response

    # -- control RPCs -------------------------------------------------------------

    async def get_status(self, request: w.GetStatusRequest) -> w.GetStatusResponse:
        response = w.GetStatusResponse()
        response.device_attributes.add().CopyFrom(self.device)
        return response

    async def create_worker_session(
        self, request: w.CreateWorkerSessionRequest
    ) -> w.CreateWorkerSessionResponse:
        handle = request.session_handle
        if not handle:
            raise errors.InvalidArgumentError("CreateWorkerSession needs a session_handle")
        if request.master_task:
            self._drop_sessions_of_old_masters(request.master_task, request.master_incarnation)
        if handle not in self._sessions:
            resources = ResourceManager() if request.isolate_session_state else self.resources
            self._sessions[handle] = WorkerSession(
                handle,
                resources,
                master_task=request.master_task,
                master_incarnation=request.master_incarnation,
            )
        return w.CreateWorkerSessionResponse()

    def _drop_sessions_of_old_masters(self, master_task: str, incarnation: int) -> None:
        """A master that restarted (same task, new incarnation) will never close the
        sessions its old incarnation made here: drop them, as TensorFlow's workers do."""
        for handle, session in list(self._sessions.items()):
            if session.master_task == master_task and session.master_incarnation != incarnation:
                del self._sessions[handle]
                logger.info(
                    "Dropped worker session %s of %s: that master restarted (incarnation %d -> %d)",
                    handle,
                    master_task,
                    session.master_incarnation,
                    incarnation,
                )

    async def delete_worker_session(
        self, request: w.DeleteWorkerSessionRequest
    ) -> w.DeleteWorkerSessionResponse:
        self._sessions.pop(request.session_handle, None)
        return w.DeleteWorkerSessionResponse()

    def _session(self, handle: str, create_worker_session_called: bool) -> WorkerSession:
        if not create_worker_session_called and not handle:
            return self._legacy_session
        session = self._sessions.get(handle)
        if session is None:
            if not create_worker_session_called:
                return self._legacy_session
            raise errors.AbortedError(
                f"Session handle is not found: {handle}. Possibly this worker "
                f'("{self.task_name}") just restarted. {_RECREATE}'
            )
        return session

    async def register_graph(self, request: w.RegisterGraphRequest) -> w.RegisterGraphResponse:
        session = self._session(request.session_handle, request.create_worker_session_called)
        # Building an executor takes ~40 us a node (30,000 nodes: ~1.3 s), so it runs in
        # a thread, not on the event loop; one at a time per session, as the session's
        # graphs share their stateful kernels.
        async with session.registering:
            executor = await asyncio.to_thread(
                _build_executor, request.graph_def, self.task_name, session.stateful_kernels
            )
        handle = f"{next(self._graph_ids):016x}"
        session.graphs[handle] = executor
        return w.RegisterGraphResponse(graph_handle=handle)

    async def deregister_graph(self, request: w.DeregisterGraphRequest) -> w.DeregisterGraphResponse:
        session = self._session(request.session_handle, request.create_worker_session_called)
        session.graphs.pop(request.graph_handle, None)
        return w.DeregisterGraphResponse()

    async def cleanup_graph(self, request: w.CleanupGraphRequest) -> w.CleanupGraphResponse:
        self._rendezvous.cleanup(request.step_id)
        return w.CleanupGraphResponse()

    async def cleanup_all(self, request: w.CleanupAllRequest) -> w.CleanupAllResponse:
        self.resources.clear(list(request.container))
        for session in self._sessions.values():
            if session.resources is not self.resources:
                session.resources.clear(list(request.container))
        return w.CleanupAllResponse()

    # -- RunGraph -----------------------------------------------------------------

    async def run_graph(
        self,
        request: w.RunGraphRequest,
        sends: Mapping[str, Any],
        *,
        timeout: float | None = None,
        stats: StepStats | None = None,
    ) -> dict[str, Any]:
        began = self.graphs.start()
        try:
            results = await self._run_graph(request, sends, timeout, stats)
        except BaseException as exc:
            self.graphs.finish(began, exc)
            raise
        self.graphs.finish(began, None)
        return results

    async def _run_graph(
        self,
        request: w.RunGraphRequest,
        sends: Mapping[str, Any],
        timeout: float | None,
        stats: StepStats | None,
    ) -> dict[str, Any]:
        session = self._session(request.session_handle, request.create_worker_session_called)
        executor = session.graphs.get(request.graph_handle)
        if executor is None:
            raise errors.AbortedError(
                f"Graph handle is not found: {request.graph_handle}. Possibly, this worker just restarted. "
                + _RECREATE
            )
        step_id = request.step_id
        rendezvous = self._rendezvous.start(step_id)
        ctx = self.step_context(step_id, rendezvous, session.resources)
        try:
            for text, value in sends.items():
                rendezvous.send(parse_rendezvous_key(text), value)
            async with asyncio.timeout(timeout):
                await executor.run(
                    ctx, None if stats is None else stats.dev_stats.add(device=self.device.name)
                )
                results = {}
                for text in request.recv_key:
                    key = parse_rendezvous_key(text)
                    value, is_dead = await rendezvous.recv_local(key)
                    if is_dead or (
                        key.dst_task != self.task_name and not worker_returns(tensor_nbytes(value))
                    ):
                        # Dead (a response cannot say so), or too large for the response: it
                        # waits for a RecvTensor (`push`); a fetch missing from the response is
                        # a dead fetch to the master.
                        continue
                    results[text] = value
            self._rendezvous.release_if_done(step_id, set(results))
        except TimeoutError as exc:
            error = errors.DeadlineExceededError(
                "Timed out waiting for the step to finish on " + self.task_name
            )
            self._rendezvous.failed(step_id, error)
            raise error from exc
        except errors.OpError as exc:
            self._rendezvous.failed(step_id, exc)
            raise
        except asyncio.CancelledError:
            self._rendezvous.failed(step_id, errors.CancelledError("Step was cancelled"))
            raise
        return results

    async def run_graph_rpc(
        self, request: w.RunGraphRequest | TensorRequest[w.RunGraphRequest]
    ) -> w.RunGraphResponse | EncodedMessage:
        response = w.RunGraphResponse()
        message = request.message if isinstance(request, TensorRequest) else request
        try:
            _, sends = await request_tensors(request, what="a RunGraph request")
            stats = response.step_stats if message.exec_opts.record_timeline else None
            results = await self.run_graph(message, dict(sends), stats=stats)
            # Written by hand: each value's bytes copied once, off the loop when large.
            return await encode_off_loop(response, list(results.items()))
        except errors.OpError as exc:
            if not message.store_errors_in_response_body:
                raise
            del response.recv[:]
            response.ClearField("step_stats")
            response.status_code, response.status_error_message = errors.to_status(exc)  # type: ignore[assignment]
        return response

    # -- RecvTensor ---------------------------------------------------------------

    def tensor_handlers(self) -> dict[str, Callable[[Any], Awaitable[Message | EncodedMessage]]]:
        """TENSOR_SERVICE method name -> handler (distserver peers' batched receives)."""
        return {
            "RecvTensors": functools.partial(self.recv_tensors_rpc, every=False),
            "RecvAllTensors": functools.partial(self.recv_tensors_rpc, every=True),
        }

    async def recv_tensors_rpc(
        self, request: w.RunGraphRequest | TensorRequest[w.RunGraphRequest], every: bool = False
    ) -> EncodedMessage:
        """Some of the values of `request.recv_key` this task sent in `request.step_id`:
        those sent by the time the first one is (RecvTensors), or once every one is
        (`every`: RecvAllTensors; `batched_recv.answer`), written by hand (a key whose
        value is to be fetched separately: a name without a tensor). (A request of
        `wire.HAND_DECODED_REQUEST_BYTES` or more, many long keys, comes read by hand:
        its message is the same.)"""
        message = request.message if isinstance(request, TensorRequest) else request
        values = await self._batched_values(message, every)
        return await encode_off_loop(w.RunGraphResponse(), list(values.items()))

    async def _batched_values(self, request: w.RunGraphRequest, every: bool) -> dict[str, Any]:
        if not request.recv_key or len(request.recv_key) > batched_recv.MAX_BATCH_KEYS:
            method = "RecvAllTensors" if every else "RecvTensors"
            raise errors.InvalidArgumentError(
                f"{method} asks for {len(request.recv_key)} keys; ask for 1 to "
                f"{batched_recv.MAX_BATCH_KEYS} per call"
            )
        keys = [parse_rendezvous_key(text) for text in request.recv_key]
        for key in keys:
            self._check_source(key)
        step_id = request.step_id
        values = await batched_recv.answer(
            self._rendezvous.find_or_create(step_id), keys, self._batched_value_bytes, every
        )
        for text, value in values.items():
            if value is not batched_recv.FETCH_SEPARATELY:
                self._rendezvous.served(step_id, parse_rendezvous_key(text))
        return values

    def _batch_call(self, task: str) -> batched_recv.BatchCall:
        assert self._worker_client is not None
        client = self._worker_client(task)

        async def call(step_id: int, keys: list[str], every: bool) -> dict[str, Any]:
            return await client.recv_tensors(step_id, keys, every, timeout=self._recv_timeout)

        return call

    async def recv_tensors(
        self, step_id: int, keys: list[str], every: bool = False, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """`WorkerClient.recv_tensors` in process."""
        async with asyncio.timeout(timeout):
            return await self._batched_values(w.RunGraphRequest(step_id=step_id, recv_key=keys), every)

    def _check_source(self, key: RendezvousKey) -> None:
        """Raise unless `key` names a value this task (this incarnation) sends."""
        if key.src_task != self.task_name:
            raise errors.InvalidArgumentError(f"Invalid rendezvous key (src): {key.text} @ {self.task_name}")
        if key.src_incarnation != self.device.incarnation:
            raise errors.AbortedError(
                f"RecvTensor expects a different device incarnation: {key.src_incarnation} vs. "
                f'{self.device.incarnation}. Your worker job ("{self.task_name}") was probably restarted. '
                "Check your worker job for the reason why it was restarted."
            )

    async def recv_tensor(
        self, step_id: int, key: RendezvousKey, *, timeout: float | None = None
    ) -> tuple[Any, bool]:
        """The value this task sent under `key` in step `step_id`, once its `_Send` ran.

        This is the task's tensor source: transports serve RecvTensor from it.
        """
        self._check_source(key)
        rendezvous = self._rendezvous.find_or_create(step_id)
        async with asyncio.timeout(timeout):
            value = await rendezvous.recv_local(key)
        self._rendezvous.served(step_id, key)
        return value

    def deliver(self, step_id: int, key: RendezvousKey, value: Any, is_dead: bool = False) -> None:
        """Put a value another task sent into this task's rendezvous (pushed values)."""
        self._rendezvous.find_or_create(step_id).send(key, value, is_dead)

    # -- steps of other runtimes (EagerService component functions) -------------

    def start_step(self, step_id: int) -> StepRendezvous:
        """The rendezvous of step `step_id`, kept while the step runs here.

        For steps that are not RunGraphs (a component function's `func_step_id`):
        values they `_Send` to other tasks are served by this worker's RecvTensor,
        and their `_Recv`s fetch from other tasks as RunGraph's do. End the step with
        `step_finished` or `step_failed`; `cleanup_step` drops it at once.
        """
        return self._rendezvous.start(step_id)

    def step_finished(self, step_id: int) -> None:
        """The step ran to its end; it is dropped once every value for another task is served."""
        self._rendezvous.release_if_done(step_id, set())

    def step_failed(self, step_id: int, error: errors.OpError) -> None:
        """The step failed: its pending and future receives get `error`."""
        self._rendezvous.failed(step_id, error)

    def cleanup_step(self, step_id: int) -> None:
        """Drop the step now (TensorFlow's CleanupGraph / CleanupFunctionOp)."""
        self._rendezvous.cleanup(step_id)

    async def _fetch_remote(self, step_id: int, key: RendezvousKey) -> tuple[Any, bool]:
        assert self._worker_client is not None
        client = self._worker_client(key.src_task)
        if key.src_task not in self._peers_met:
            # Meet the peer with a control call first: from it the channel learns whether
            # the peer is TensorFlow, whose servers end a connection that pings while a
            # call waits silently, and a RecvTensor may wait long for a value not yet
            # computed (the gradient a TensorFlow 2 worker computes for this ps).
            # Best effort: the fetch below reports a peer that is really gone, and a first
            # call to a TensorFlow server can fail on its call stream (it has none).
            try:
                await client.call("GetStatus", w.GetStatusRequest(), timeout=_MEET_PEER_SECONDS)
                self._peers_met.add(key.src_task)
            except errors.OpError as exc:
                logger.debug("GetStatus to %s before its first RecvTensor failed: %s", key.src_task, exc)
        return await client.recv_tensor(step_id, key, timeout=self._recv_timeout)

    def abort_all_steps(self, error: errors.OpError) -> None:
        """Fail every pending receive (the server is stopping)."""
        self._rendezvous.abort_all(error)
