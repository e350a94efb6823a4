"""The MasterService of one task: sessions, and the steps that run their graphs.

A session holds a client's graph (grown by ExtendSession). The first time a step
with a given set of feeds, fetches and targets runs, the master builds its plan:
rewrite feeds/fetches and prune (`subgraph`), place every node (`placement`),
split by task (`partition`) and register each partition with its task's worker.
Every later step with the same signature reuses the plan: it picks a step id,
runs all partitions concurrently with RunGraph (the first error cancels the
others), collects the fetches and then tells the workers to clean the step up.

Errors keep TensorFlow's texts (reference §3.6 and §4): an unknown session is
`AbortedError("Session <h> is not found.")`, and so on.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distserver import errors
from distserver.devices import parse_rendezvous_key, task_of_device
from distserver.kernels import has_kernel
from distserver.kernels.ref_variables import REF_OUTPUT_OPS
from distserver.protos import master_pb2 as m
from distserver.protos import worker_pb2 as w
from distserver.protos.config_pb2 import CallableOptions, ConfigProto, RunOptions
from distserver.protos.device_attributes_pb2 import DeviceAttributes
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.services import MASTER_METHODS, snake_case
from distserver.runtime.clients import WorkerClient
from distserver.runtime.concurrency import gather_all
from distserver.runtime.names import canonical_tensor_name, parse_input
from distserver.runtime.partition import partition
from distserver.runtime.placement import place
from distserver.runtime.subgraph import move_client_endpoints, rewrite_for_step
from distserver.runtime.worker import Worker
from distserver.tensors import as_datatype, from_tensor_proto, to_tensor_proto

logger = logging.getLogger(__name__)

# How long CreateSession and ListDevices wait for a task that is not up yet, when
# the session config sets no operation timeout. TensorFlow waits forever; we fail.
DEFAULT_CONNECT_TIMEOUT = 60.0
_WAITING_LOG_INTERVAL = 10.0
_STEP_ID_MASK = ((1 << 56) - 1) | (1 << 56)


def new_step_id() -> int:
    """A random step id with the top 7 bits clear, as TensorFlow makes them."""
    return random.getrandbits(64) & _STEP_ID_MASK


@dataclass
class _Partition:
    task: str
    worker: WorkerClient
    graph_handle: str
    feed_keys: list[str]
    fetch_keys: list[str]
    # Values this (remote) partition sends to the master's task, returned in its
    # RunGraph response instead of fetched with RecvTensor (see `_push_plan`).
    pushed_keys: list[str] = field(default_factory=list)
    # Pushed keys whose values turned out too large for the response (learned).
    large_keys: set[str] = field(default_factory=set)


@dataclass
class _Plan:
    partitions: list[_Partition]
    feed_keys: dict[str, str]
    fetch_keys: dict[str, str]


@dataclass
class _Callable:
    feeds: list[str]
    fetches: list[str]
    targets: list[str]
    options: RunOptions


@dataclass
class MasterSession:
    handle: str
    config: ConfigProto
    tasks: list[str]
    devices: list[DeviceAttributes]
    nodes: dict[str, NodeDef] = field(default_factory=dict)
    version: int = 0
    plans: dict[tuple[Any, ...], asyncio.Future[_Plan]] = field(default_factory=dict)
    callables: dict[int, _Callable] = field(default_factory=dict)
    next_callable: int = 0
    steps: set[asyncio.Task[Any]] = field(default_factory=set)
    closed: bool = False


class Master:
    """One task's master. All methods run on the server's event loop."""

    def __init__(
        self,
        *,
        task_name: str,
        tasks: Sequence[str],
        local_worker: Worker,
        worker_client: Callable[[str], WorkerClient],
        default_session_config: ConfigProto | None = None,
    ) -> None:
        self.task_name = task_name
        self._tasks = list(tasks)
        self._local_worker = local_worker
        self._worker_client = worker_client
        self._default_config = default_session_config or ConfigProto()
        self._sessions: dict[str, MasterSession] = {}
        self._background: set[asyncio.Task[Any]] = set()

    # -- helpers --------------------------------------------------------------------

    def _worker(self, task: str) -> WorkerClient:
        return self._local_worker if task == self.task_name else self._worker_client(task)

    def _session(self, handle: str) -> MasterSession:
        session = self._sessions.get(handle)
        if session is None:
            raise errors.AbortedError(f"Session {handle} is not found.")
        if session.closed:
            raise errors.FailedPreconditionError("Session is closed.")
        return session

    def _filtered_tasks(self, device_filters: Sequence[str]) -> list[str]:
        if not device_filters:
            return list(self._tasks)
        from distserver.devices import DeviceSpec

        specs = [DeviceSpec.from_string(f) for f in device_filters]
        chosen = []
        for task in self._tasks:
            t = DeviceSpec.from_string(task)
            if task == self.task_name or any(
                (s.job is None or s.job == t.job) and (s.task is None or s.task == t.task) for s in specs
            ):
                chosen.append(task)
        return chosen

    async def _device_of(self, task: str, timeout: float) -> DeviceAttributes:
        """GetStatus of `task`, waiting (bounded) for it to come up."""
        worker = self._worker(task)
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            wait = min(_WAITING_LOG_INTERVAL, max(remaining, 0.0))
            try:
                response: Any = await worker.call(
                    "GetStatus", w.GetStatusRequest(), timeout=wait, wait_for_ready=True
                )
                return response.device_attributes[0]  # type: ignore[no-any-return]
            except (errors.DeadlineExceededError, errors.UnavailableError) as exc:
                if asyncio.get_running_loop().time() >= deadline:
                    raise errors.UnavailableError(
                        f"Task {task} did not answer within {timeout:g} s. Is it running, and is its "
                        f"address in the cluster right? Last error: {exc.message}"
                    ) from exc
                logger.info("CreateSession still waiting for response from worker: %s", task)

    async def _devices(self, tasks: Sequence[str], timeout: float) -> list[DeviceAttributes]:
        return await gather_all(self._device_of(task, timeout) for task in tasks)

    def _connect_timeout(self, config: ConfigProto) -> float:
        ms = config.operation_timeout_in_ms
        return ms / 1000 if ms > 0 else DEFAULT_CONNECT_TIMEOUT

    # -- sessions ---------------------------------------------------------------------

    async def create_session(self, request: m.CreateSessionRequest) -> m.CreateSessionResponse:
        config = ConfigProto()
        config.CopyFrom(request.config)
        config.MergeFrom(self._default_config)
        if config.use_per_session_threads or len(config.session_inter_op_thread_pool):
            raise errors.InvalidArgumentError(
                "Distributed session does not support session thread pool options."
            )
        if len(config.cluster_def.job):
            raise errors.UnimplementedError(
                "ClusterSpec propagation (ConfigProto.cluster_def) is not supported by distserver; "
                "start the servers with the full cluster instead."
            )
        _check_kernels(request.graph_def)
        tasks = self._filtered_tasks(list(config.device_filters))
        devices = await self._devices(tasks, self._connect_timeout(config))
        handle = f"{random.getrandbits(64):016x}"
        create = w.CreateWorkerSessionRequest(
            session_handle=handle, isolate_session_state=config.isolate_session_state
        )
        await gather_all(self._worker(task).call("CreateWorkerSession", create) for task in tasks)
        session = MasterSession(handle=handle, config=config, tasks=tasks, devices=devices)
        _extend_graph(session, request.graph_def)
        self._sessions[handle] = session
        return m.CreateSessionResponse(session_handle=handle, graph_version=session.version)

    async def extend_session(self, request: m.ExtendSessionRequest) -> m.ExtendSessionResponse:
        session = self._session(request.session_handle)
        if request.current_graph_version != session.version:
            raise errors.AbortedError(
                f"Current version is {session.version} but caller expected {request.current_graph_version}."
            )
        _check_kernels(request.graph_def)
        _extend_graph(session, request.graph_def)
        session.version += 1
        return m.ExtendSessionResponse(new_graph_version=session.version)

    async def close_session(self, request: m.CloseSessionRequest) -> m.CloseSessionResponse:
        session = self._sessions.pop(request.session_handle, None)
        if session is None:
            raise errors.AbortedError(
                f"Session {request.session_handle} is not found. Possibly, this master has restarted."
            )
        await self._close(session)
        return m.CloseSessionResponse()

    async def _close(self, session: MasterSession) -> None:
        session.closed = True
        for step in list(session.steps):
            step.cancel()
        if session.steps:
            await asyncio.wait(session.steps)
        for task in session.tasks:
            try:
                await asyncio.wait_for(
                    self._worker(task).call(
                        "DeleteWorkerSession", w.DeleteWorkerSessionRequest(session_handle=session.handle)
                    ),
                    timeout=10.0,
                )
            except (errors.OpError, TimeoutError) as exc:
                logger.warning("DeleteWorkerSession on %s failed: %s", task, exc)

    async def close(self) -> None:
        """Close every session (the server is stopping)."""
        sessions = list(self._sessions.values())
        self._sessions.clear()
        for session in sessions:
            session.closed = True
            for step in session.steps:
                step.cancel()
        for task in list(self._background):
            task.cancel()
        pending = [s for session in sessions for s in session.steps] + list(self._background)
        if pending:
            await asyncio.wait(pending)

    async def list_devices(self, request: m.ListDevicesRequest) -> m.ListDevicesResponse:
        response = m.ListDevicesResponse()
        if request.session_handle:
            session = self._sessions.get(request.session_handle)
            if session is None:
                raise errors.InvalidArgumentError(f"Session {request.session_handle} is not found.")
            response.local_device.extend(session.devices)
            return response
        devices = await self._devices(self._tasks, self._connect_timeout(self._default_config))
        for task, device in zip(self._tasks, devices, strict=True):
            (response.local_device if task == self.task_name else response.remote_device).append(device)
        return response

    async def reset(self, request: m.ResetRequest) -> m.ResetResponse:
        sessions = list(self._sessions.values())
        self._sessions.clear()
        for session in sessions:
            await self._close(session)
        tasks = self._filtered_tasks(list(request.device_filters))
        cleanup = w.CleanupAllRequest(container=request.container)
        await gather_all(self._worker(task).call("CleanupAll", cleanup) for task in tasks)
        return m.ResetResponse()

    # -- steps ------------------------------------------------------------------------

    async def run_step(
        self,
        handle: str,
        feeds: Mapping[str, Any],
        fetches: Sequence[str],
        targets: Sequence[str],
        options: RunOptions | None = None,
    ) -> dict[str, Any]:
        """Run one step. Returns fetch name (canonical "x:k") -> numpy value."""
        session = self._session(handle)
        options = options or RunOptions()
        timeout_ms = options.timeout_in_ms or session.config.operation_timeout_in_ms
        timeout = timeout_ms / 1000 if timeout_ms > 0 else None
        task = asyncio.current_task()
        assert task is not None
        session.steps.add(task)
        try:
            async with asyncio.timeout(timeout):
                return await self._run_step(session, feeds, fetches, targets)
        except TimeoutError as exc:
            raise errors.DeadlineExceededError(
                f"Timed out after {timeout_ms} ms waiting for the step to finish "
                "(RunOptions.timeout_in_ms / ConfigProto.operation_timeout_in_ms)"
            ) from exc
        except asyncio.CancelledError:
            if session.closed:
                raise errors.CancelledError("Step was cancelled: the session was closed") from None
            raise
        finally:
            session.steps.discard(task)

    async def _run_step(
        self,
        session: MasterSession,
        feeds: Mapping[str, Any],
        fetches: Sequence[str],
        targets: Sequence[str],
    ) -> dict[str, Any]:
        feed_values: dict[str, np.ndarray] = {}
        for name, value in feeds.items():
            tensor = canonical_tensor_name(name)
            if tensor in feed_values:
                raise errors.InvalidArgumentError(f"Duplicated feeds: {name}")
            feed_values[tensor] = value
        fetch_names = list(dict.fromkeys(canonical_tensor_name(f) for f in fetches))
        # A fetched feed is answered with the fed value; the graph never computes it.
        computed = [name for name in fetch_names if name not in feed_values]
        plan = await self._plan(session, feed_values, computed, list(targets))
        step_id = new_step_id()
        results: dict[str, Any] = {}
        failed = True
        try:
            runs = await gather_all(
                self._run_partition(p, session.handle, step_id, plan, feed_values) for p in plan.partitions
            )
            failed = False
        finally:
            self._cleanup_step(plan, step_id, failed)
        by_key = {}
        for run in runs:
            by_key.update(run)
        for name in fetch_names:
            results[name] = feed_values[name] if name in feed_values else by_key[plan.fetch_keys[name]]
        return results

    async def _run_partition(
        self,
        part: _Partition,
        handle: str,
        step_id: int,
        plan: _Plan,
        feeds: Mapping[str, Any],
    ) -> dict[str, Any]:
        # Values that were too large to ride in the response last time are fetched
        # with RecvTensor right away, alongside RunGraph, instead of after it.
        early_keys = [key for key in part.pushed_keys if key in part.large_keys]
        request = w.RunGraphRequest(
            session_handle=handle,
            create_worker_session_called=True,
            graph_handle=part.graph_handle,
            step_id=step_id,
            recv_key=[*part.fetch_keys, *(k for k in part.pushed_keys if k not in part.large_keys)],
            store_errors_in_response_body=True,
        )
        sends = {key: feeds[name] for name, key in plan.feed_keys.items() if key in part.feed_keys}
        early = {
            key: asyncio.ensure_future(part.worker.recv_tensor(step_id, parse_rendezvous_key(key)))
            for key in early_keys
        }
        try:
            results = await part.worker.run_graph(request, sends)
            for key in part.pushed_keys:
                value = results.pop(key, None)
                if key in early:
                    value, _ = await early[key]
                elif value is None:
                    # Withheld (too large to ride in the response): fetch it as usual.
                    part.large_keys.add(key)
                    value, _ = await part.worker.recv_tensor(step_id, parse_rendezvous_key(key))
                self._local_worker.deliver(step_id, parse_rendezvous_key(key), value)
            return results
        except errors.OpError as exc:
            if part.task == self.task_name:
                raise
            raise errors.from_status(
                exc.error_code, f"From {part.task}:\n{exc.message}", node_name=exc.node_name
            ) from exc
        finally:
            unfinished = [future for future in early.values() if not future.done()]
            for future in unfinished:
                future.cancel()
            if unfinished:
                await asyncio.wait(unfinished)
            for future in early.values():
                if not future.cancelled():
                    future.exception()  # seen here; the step's error is what is raised

    def _cleanup_step(self, plan: _Plan, step_id: int, failed: bool) -> None:
        # Workers drop a finished step's state themselves once every value another
        # task needs has been handed over; only after a failure does CleanupGraph free it.
        if failed:
            for part in plan.partitions:
                self._send_cleanup(part, step_id)

    def _send_cleanup(self, part: _Partition, step_id: int) -> None:
        request = w.CleanupGraphRequest(step_id=step_id)
        task = asyncio.get_running_loop().create_task(_quietly(part.worker.call("CleanupGraph", request)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _plan(
        self,
        session: MasterSession,
        feeds: Mapping[str, np.ndarray],
        fetches: list[str],
        targets: list[str],
    ) -> _Plan:
        feed_types = tuple(sorted((name, _datatype(value)) for name, value in feeds.items()))
        signature = (feed_types, tuple(fetches), tuple(sorted(targets)))
        future = session.plans.get(signature)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            session.plans[signature] = future
            try:
                future.set_result(await self._build_plan(session, feed_types, fetches, targets))
            except BaseException as exc:
                del session.plans[signature]
                future.set_exception(exc)
                future.exception()
                raise
        return await asyncio.shield(future)

    async def _build_plan(
        self,
        session: MasterSession,
        feed_types: Sequence[tuple[str, int]],
        fetches: list[str],
        targets: list[str],
    ) -> _Plan:
        client = self._local_device(session)
        step = rewrite_for_step(
            session.nodes,
            feeds=feed_types,
            fetches=fetches,
            targets=targets,
            client_device=client.name,
            client_incarnation=client.incarnation,
        )
        incarnations = {d.name: d.incarnation for d in session.devices}
        place(
            step.nodes,
            devices=list(incarnations),
            client_device=client.name,
            allow_soft_placement=session.config.allow_soft_placement,
        )
        _read_refs_late(step.nodes)
        move_client_endpoints(step, incarnations.__getitem__)
        parts = partition(step.nodes, incarnation=incarnations.__getitem__)
        pushed = _push_plan(parts, self.task_name)
        feed_keys = set(step.feed_keys.values())
        fetch_keys = set(step.fetch_keys.values())

        async def register(task: str, graph: GraphDef) -> _Partition:
            worker = self._worker(task)
            request = w.RegisterGraphRequest(
                session_handle=session.handle, create_worker_session_called=True, graph_def=graph
            )
            request.graph_options.CopyFrom(session.config.graph_options)
            response: Any = await worker.call("RegisterGraph", request)
            keys = {_sendrecv_key(node) for node in graph.node if node.attr["client_terminated"].b}
            return _Partition(
                task=task,
                worker=worker,
                graph_handle=response.graph_handle,
                feed_keys=sorted(keys & feed_keys),
                fetch_keys=sorted(keys & fetch_keys),
                pushed_keys=sorted(pushed.get(task, ())),
            )

        return _Plan(
            partitions=await gather_all(register(t, g) for t, g in parts.items()),
            feed_keys=step.feed_keys,
            fetch_keys=step.fetch_keys,
        )

    def _local_device(self, session: MasterSession) -> DeviceAttributes:
        for device in session.devices:
            if task_of_device(device.name) == self.task_name:
                return device
        raise errors.InternalError(f"The master's own task {self.task_name} is not in the session")

    # -- RPC handlers (proto in, proto out) --------------------------------------------

    def service_handlers(self) -> dict[str, Any]:
        handlers: dict[str, Any] = {}
        for method in MASTER_METHODS:
            fn = getattr(self, snake_case(method), None)
            if fn is not None:
                handlers[method] = fn
        handlers["RunStep"] = self.run_step_rpc
        return handlers

    async def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        handler = self.service_handlers().get(method)
        if handler is None:
            raise errors.UnimplementedError(f"MasterService/{method} is not implemented by distserver")
        return await handler(request)

    async def run_step_rpc(self, request: m.RunStepRequest) -> m.RunStepResponse:
        response = m.RunStepResponse()
        try:
            if request.partial_run_handle:
                raise errors.UnimplementedError("Partial runs are not supported by distserver")
            feeds = {}
            for named in request.feed:
                if named.name in feeds:
                    raise errors.InvalidArgumentError(f"Duplicated feeds: {named.name}")
                feeds[named.name] = from_tensor_proto(named.tensor)
            results = await self.run_step(
                request.session_handle, feeds, list(request.fetch), list(request.target), request.options
            )
            for name in request.fetch:
                if any(t.name == name for t in response.tensor):
                    continue
                named = response.tensor.add(name=name)
                named.tensor.CopyFrom(to_tensor_proto(results[canonical_tensor_name(name)]))
        except errors.OpError as exc:
            if not request.store_errors_in_response_body:
                raise
            del response.tensor[:]
            response.status_code, response.status_error_message = errors.to_status(exc)  # type: ignore[assignment]
        return response

    async def partial_run_setup(self, request: m.PartialRunSetupRequest) -> m.PartialRunSetupResponse:
        self._session(request.session_handle)
        raise errors.UnimplementedError(
            "Partial runs (Session.partial_run_setup / partial_run) are not supported by distserver; "
            "run each step with Session.run instead."
        )

    async def make_callable(self, request: m.MakeCallableRequest) -> m.MakeCallableResponse:
        session = self._session(request.session_handle)
        options: CallableOptions = request.options
        if len(options.tensor_connection):
            raise errors.UnimplementedError(
                "CallableOptions.tensor_connection is not supported by distserver"
            )
        handle = session.next_callable
        session.next_callable += 1
        session.callables[handle] = _Callable(
            feeds=list(options.feed),
            fetches=list(options.fetch),
            targets=list(options.target),
            options=options.run_options,
        )
        return m.MakeCallableResponse(handle=handle)

    async def run_callable_values(self, handle: str, callable_handle: int, feeds: Sequence[Any]) -> list[Any]:
        session = self._session(handle)
        spec = session.callables.get(callable_handle)
        if spec is None:
            raise errors.InvalidArgumentError(
                f"Attempted to run callable {callable_handle} that is not found."
            )
        if len(feeds) != len(spec.feeds):
            raise errors.InvalidArgumentError(
                f"Invalid number of feed values: expected {len(spec.feeds)}, got {len(feeds)}"
            )
        results = await self.run_step(
            handle, dict(zip(spec.feeds, feeds, strict=True)), spec.fetches, spec.targets, spec.options
        )
        return [results[canonical_tensor_name(f)] for f in spec.fetches]

    async def run_callable(self, request: m.RunCallableRequest) -> m.RunCallableResponse:
        feeds = [from_tensor_proto(t) for t in request.feed]
        values = await self.run_callable_values(request.session_handle, request.handle, feeds)
        response = m.RunCallableResponse()
        for value in values:
            response.fetch.add().CopyFrom(to_tensor_proto(value))
        return response

    async def release_callable(self, request: m.ReleaseCallableRequest) -> m.ReleaseCallableResponse:
        session = self._session(request.session_handle)
        session.callables.pop(request.handle, None)
        return m.ReleaseCallableResponse()


# Ops that call graph functions: what TF 2.x control flow (`tf.cond`/`tf.while_loop` with
# control flow v2) and `tf.function` put into a graph.
_FUNCTION_CALL_OPS = frozenset(
    {"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase", "PartitionedCall",
     "StatefulPartitionedCall", "SymbolicGradient", "RemoteCall"}
)  # fmt: skip
# Ops of TF 1.x control flow (tf.cond / tf.while_loop without control flow v2).
_CONTROL_FLOW_V1_OPS = frozenset(
    {"Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit", "RefExit", "NextIteration",
     "RefNextIteration", "LoopCond", "ControlTrigger"}
)  # fmt: skip
_MAX_LISTED_OPS = 10


def _check_kernels(graph_def: GraphDef) -> None:
    """Refuse a graph that uses an op distserver has no kernel for, naming the op and the node.

    TensorFlow would refuse an unknown op when the graph is imported (CreateSession or
    ExtendSession), and an op without a kernel when the step runs; distserver has one
    registry for both, so it refuses up front, before any worker is involved.

    Raises:
        UnimplementedError: listing every unsupported op type with a node that uses it.
    """
    unsupported: dict[str, list[str]] = {}
    for node in graph_def.node:
        if not has_kernel(node.op):
            unsupported.setdefault(node.op, []).append(node.name)
    if not unsupported:
        return
    parts = []
    for op, nodes in list(unsupported.items())[:_MAX_LISTED_OPS]:
        more = f" and {len(nodes) - 1} more" if len(nodes) > 1 else ""
        parts.append(f"'{op}' (node '{nodes[0]}'{more})")
    if len(unsupported) > _MAX_LISTED_OPS:
        parts.append(f"and {len(unsupported) - _MAX_LISTED_OPS} more op types")
    message = (
        f"distserver has no kernel for {'this op' if len(unsupported) == 1 else 'these ops'}: "
        f"{', '.join(parts)}. The supported ops are listed in docs/tf-compat.md "
        "(distserver.kernels.registered_ops())."
    )
    # distserver's FunctionDefLibrary keeps the functions as unknown fields only.
    if graph_def.library.ByteSize() or not _FUNCTION_CALL_OPS.isdisjoint(unsupported):
        message += (
            " Graph functions (tf.function, control flow v2) are not supported: build the graph "
            "with tf.compat.v1.disable_v2_behavior() (or disable_control_flow_v2())."
        )
    if not _CONTROL_FLOW_V1_OPS.isdisjoint(unsupported):
        message += " Control flow (tf.cond, tf.while_loop) is not supported."
    first_node = next(iter(unsupported.values()))[0]
    raise errors.UnimplementedError(message, node_name=first_node)


def _read_refs_late(nodes: list[NodeDef]) -> None:
    """Read a reference variable sent to another task only after the consumer's control inputs.

    A consumer of a reference (TF 1.x variable) reads the variable when it runs, so
    `with tf.control_dependencies([update]): v.read_value()` sees the update. When
    the consumer is on another task than the variable, the value crosses in a
    `_Send` that would otherwise read as soon as `VariableV2` has run. TensorFlow
    gets the late read from sending the variable's live buffer; distserver inserts
    an `Identity` next to the variable that waits for the consumer's control inputs,
    and sends its output instead. Pure; changes `nodes` in place.
    """
    by_name = {node.name: node for node in nodes}
    added: list[NodeDef] = []
    for position, node in enumerate(nodes):
        controls = [text for text in node.input if text.startswith("^")]
        if not controls:
            continue
        for i, text in enumerate(node.input):
            if text.startswith("^"):
                continue
            src = by_name.get(parse_input(text)[0])
            if src is None or src.op not in REF_OUTPUT_OPS:
                continue
            if task_of_device(src.device) == task_of_device(node.device):
                continue
            if nodes[position] is node:  # the session's own NodeDef: change a copy
                copy = NodeDef()
                copy.CopyFrom(node)
                nodes[position] = copy
            read = NodeDef(name=f"{node.name}/_late_read_{i}", op="Identity", device=src.device)
            read.input.extend([text, *controls])
            nodes[position].input[i] = read.name
            added.append(read)
    nodes.extend(added)


def _extend_graph(session: MasterSession, graph_def: GraphDef) -> None:
    for node in graph_def.node:
        if node.name in session.nodes:
            raise errors.InvalidArgumentError(
                f"Node '{node.name}' is already in the graph; ExtendSession may only add new nodes",
                node_name=node.name,
            )
    for node in graph_def.node:
        copy = NodeDef()
        copy.CopyFrom(node)
        session.nodes[node.name] = copy


def _push_plan(parts: Mapping[str, GraphDef], master_task: str) -> dict[str, set[str]]:
    """Which cross-task values ride back in RunGraph responses instead of RecvTensor.

    A remote partition that receives nothing from other tasks finishes on its own,
    so the values it sends to the master's task can come back with its RunGraph
    response (one RPC less per value, and no CleanupGraph). The master's `_Recv`
    nodes for them are marked `_recv_pushed` so they wait locally. A partition that
    does receive from other tasks keeps RecvTensor: it might wait, through another
    task, for a value the master's task computes only after receiving from it.
    """
    pushed: dict[str, set[str]] = {}
    for task, graph in parts.items():
        if task == master_task:
            continue
        receives = any(n.op == "_Recv" and not n.attr["client_terminated"].b for n in graph.node)
        if receives:
            continue
        keys = {
            _sendrecv_key(n)
            for n in graph.node
            if n.op == "_Send"
            and not n.attr["client_terminated"].b
            and task_of_device(n.attr["recv_device"].s.decode()) == master_task
        }
        if keys:
            pushed[task] = keys
    local = parts.get(master_task)
    all_pushed = set().union(*pushed.values()) if pushed else set()
    if local is not None and all_pushed:
        for node in local.node:
            if node.op == "_Recv" and _sendrecv_key(node) in all_pushed:
                node.attr["_recv_pushed"].b = True
    return pushed


def _datatype(value: Any) -> int:
    return (
        as_datatype(np.asarray(value).dtype)
        if not isinstance(value, np.ndarray)
        else as_datatype(value.dtype)
    )


def _sendrecv_key(node: NodeDef) -> str:
    from distserver.devices import rendezvous_key

    return rendezvous_key(
        node.attr["send_device"].s.decode(),
        node.attr["send_device_incarnation"].i,
        node.attr["recv_device"].s.decode(),
        node.attr["tensor_name"].s.decode(),
    )


async def _quietly(coro: Any) -> None:
    try:
        await coro
    except errors.OpError as exc:
        logger.debug("step cleanup failed: %s", exc)
