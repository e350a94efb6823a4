"""The MasterService of one task: sessions, and the steps that run their graphs.

A session holds a client's graph (grown by ExtendSession). The first time a step
with a given set of feeds, fetches and targets runs, the master plans it
(`plan.build_plan`, pure) and registers each partition with its task's worker.
Every later step with the same signature reuses the registered plan: it picks a
step id and runs all partitions concurrently with RunGraph (the first error
cancels the others); values pushed to this task ride the RunGraph responses
(`push`). Workers free a finished step themselves; only after a failed step does
the master send CleanupGraph (in the background).

Errors keep TensorFlow's texts: an unknown session is
`AbortedError("Session <h> is not found.")`, and so on.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import Message

from distserver import call_deadline, errors
from distserver.devices import DeviceSpec, RendezvousKey, parse_rendezvous_key, task_of_device
from distserver.protos import master_pb2 as m
from distserver.protos import worker_pb2 as w
from distserver.protos.config_pb2 import CallableOptions, ConfigProto, RunMetadata, RunOptions
from distserver.protos.debug_pb2 import StepStats
from distserver.protos.device_attributes_pb2 import DeviceAttributes
from distserver.protos.function_pb2 import FunctionDef
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.runtime.clients import WorkerClient
from distserver.runtime.concurrency import gather_all, request_tensors
from distserver.runtime.counters import StepCounters
from distserver.runtime.functions import function_attrs, index_library
from distserver.runtime.names import canonical_tensor_name
from distserver.runtime.plan import build_plan, import_graph
from distserver.runtime.worker import Worker
from distserver.tensors import as_datatype
from distserver.wire import EncodedMessage, TensorRequest, encode_off_loop

logger = logging.getLogger(__name__)

# How long CreateSession and ListDevices wait for a task that is not up yet, when
# the session config sets no operation timeout. TensorFlow waits forever; we fail.
DEFAULT_CONNECT_TIMEOUT = 20.0
# A session that runs nothing for this long is closed (its client died without closing
# it, most likely): TensorFlow's session GC, on by default here.
DEFAULT_SESSION_GC_SECONDS = 3600.0
_WAITING_LOG_INTERVAL = 10.0
# Fetched values of this many bytes or more are encoded in a thread (as the executor
# moves a kernel of this size off the loop, `executor.OFFLOAD_BYTES`).
_STEP_ID_MASK = ((1 << 56) - 1) | (1 << 56)


def new_step_id() -> int:
    """A random step id with the top 7 bits clear, as TensorFlow makes them."""
    return random.getrandbits(64) & _STEP_ID_MASK


@dataclass
class _Partition:
    """One task's part of a registered plan."""

    task: str
    worker: WorkerClient
    graph_handle: str
    graph: GraphDef  # as registered (RunOptions.output_partition_graphs)
    feed_keys: list[str]
    fetch_keys: list[str]
    # Values this (remote) partition pushes to the master's task (`push`).
    pushed_keys: list[RendezvousKey] = field(default_factory=list)
    # Pushed keys whose values turned out too large for the response (learned).
    large_keys: set[str] = field(default_factory=set)


@dataclass
class _RegisteredPlan:
    """A step plan whose partitions the workers hold."""

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
    functions: dict[str, FunctionDef] = field(default_factory=dict)
    """The graph's function library so far (calls are inlined when a graph arrives)."""
    calls_functions: bool = False
    """Some node calls functions at run time (a While, a dataset op): partitions get the library."""
    version: int = 0
    plans: dict[tuple[Any, ...], asyncio.Future[_RegisteredPlan]] = field(default_factory=dict)
    callables: dict[int, _Callable] = field(default_factory=dict)
    next_callable: int = 0
    steps: set[asyncio.Task[Any]] = field(default_factory=set)
    closed: bool = False
    last_used: float = 0.0  # loop time of the last call that named this session


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
        session_gc_seconds: float = DEFAULT_SESSION_GC_SECONDS,
    ) -> None:
        self.task_name = task_name
        self._tasks = list(tasks)
        self._local_worker = local_worker
        self._worker_client = worker_client
        self._default_config = default_session_config or ConfigProto()
        self._sessions: dict[str, MasterSession] = {}
        self.steps = StepCounters()  # the steps this master ran
        self._background: set[asyncio.Task[Any]] = set()
        self._session_gc_seconds = session_gc_seconds
        self._session_gc: asyncio.Task[None] | None = None
        # Workers drop the sessions of this master's earlier incarnations (a restart).
        self.incarnation = random.getrandbits(63) or 1
        # MasterService method -> proto-in, proto-out handler (RunStep and RunCallable
        # answer an `EncodedMessage`). Methods not listed answer UnimplementedError.
        self._handlers: dict[str, Callable[[Any], Awaitable[Message | EncodedMessage]]] = {
            "CreateSession": self.create_session,
            "ExtendSession": self.extend_session,
            "PartialRunSetup": self.partial_run_setup,
            "RunStep": self.run_step_rpc,
            "CloseSession": self.close_session,
            "ListDevices": self.list_devices,
            "Reset": self.reset,
            "MakeCallable": self.make_callable,
            "RunCallable": self.run_callable_rpc,
            "ReleaseCallable": self.release_callable,
        }

    # -- helpers --------------------------------------------------------------------

    def _worker(self, task: str) -> WorkerClient:
        return self._local_worker if task == self.task_name else self._worker_client(task)

    def _session(self, handle: str) -> MasterSession:
        session = self._sessions.get(handle)
        if session is None:
            raise errors.AbortedError(f"Session {handle} is not found.")
        if session.closed:
            raise errors.FailedPreconditionError("Session is closed.")
        session.last_used = asyncio.get_running_loop().time()
        return session

    def _start_session_gc(self) -> None:
        if self._session_gc is None and self._session_gc_seconds > 0:
            self._session_gc = asyncio.get_running_loop().create_task(self._collect_idle_sessions())

    async def _collect_idle_sessions(self) -> None:
        """Close sessions that ran nothing for `session_gc_seconds` (TensorFlow's session GC)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(self._session_gc_seconds / 4, 0.01))
            now = loop.time()
            for handle, session in list(self._sessions.items()):
                if not session.steps and now - session.last_used > self._session_gc_seconds:
                    del self._sessions[handle]
                    logger.info(
                        "Closing session %s: idle for %g s (its client is gone?)",
                        handle,
                        self._session_gc_seconds,
                    )
                    await self._close(session)

    def _filtered_tasks(self, device_filters: Sequence[str]) -> list[str]:
        if not device_filters:
            return list(self._tasks)
        specs = [DeviceSpec.from_string(f) for f in device_filters]
        chosen = []
        for task in self._tasks:
            t = DeviceSpec.from_string(task)
            if task == self.task_name or any(
                (s.job is None or s.job == t.job) and (s.task is None or s.task == t.task) for s in specs
            ):
                chosen.append(task)
        return chosen

    async def _device_of(self, task: str, timeout: float, caller: str) -> DeviceAttributes:
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
                        f"Task {task} did not answer within {timeout:.3g} s. Is it running, and is its "
                        f"address in the cluster right? Last error: {exc.message}"
                    ) from exc
                logger.info("%s still waiting for response from worker: %s", caller, task)

    async def _devices(self, tasks: Sequence[str], timeout: float, caller: str) -> list[DeviceAttributes]:
        """Each task's device, waiting up to `timeout` (or less, if our own caller waits less).

        Raises:
            UnavailableError: naming every task that did not answer in time.
        """
        left = call_deadline.time_left()
        if left is not None:
            timeout = min(timeout, left)
        if len(tasks) == 1:
            return [await self._device_of(tasks[0], timeout, caller)]
        results = await asyncio.gather(
            *(self._device_of(task, timeout, caller) for task in tasks), return_exceptions=True
        )
        missing: list[tuple[str, errors.UnavailableError]] = []
        for task, result in zip(tasks, results, strict=True):
            if isinstance(result, errors.UnavailableError):
                missing.append((task, result))
            elif isinstance(result, BaseException):
                raise result
        if len(missing) == 1:
            raise missing[0][1]
        if missing:
            names = ", ".join(task for task, _ in missing)
            raise errors.UnavailableError(
                f"{len(missing)} of {len(tasks)} tasks did not answer within {timeout:.3g} s: {names}. "
                f"Are they running, and are their addresses in the cluster right? "
                f"Last error: {missing[-1][1].message}"
            )
        return results  # type: ignore[return-value]  # no exceptions left

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
        functions, nodes = await asyncio.to_thread(_import, request.graph_def, {}, {})
        tasks = self._filtered_tasks(list(config.device_filters))
        devices = await self._devices(tasks, self._connect_timeout(config), "CreateSession")
        handle = f"{random.getrandbits(64):016x}"
        create = w.CreateWorkerSessionRequest(
            session_handle=handle,
            isolate_session_state=config.isolate_session_state,
            master_task=self.task_name,
            master_incarnation=self.incarnation,
        )
        await gather_all(self._worker(task).call("CreateWorkerSession", create) for task in tasks)
        session = MasterSession(
            handle=handle,
            config=config,
            tasks=tasks,
            devices=devices,
            nodes=nodes,
            functions=functions,
            calls_functions=any(function_attrs(node) for node in nodes.values()),
            last_used=asyncio.get_running_loop().time(),
        )
        self._sessions[handle] = session
        self._start_session_gc()
        return m.CreateSessionResponse(session_handle=handle, graph_version=session.version)

    async def extend_session(self, request: m.ExtendSessionRequest) -> m.ExtendSessionResponse:
        session = self._session(request.session_handle)
        if request.current_graph_version != session.version:
            raise errors.AbortedError(
                f"Current version is {session.version} but caller expected {request.current_graph_version}."
            )
        version = session.version
        functions, nodes = await asyncio.to_thread(
            _import, request.graph_def, session.nodes, session.functions
        )
        if session.version != version:  # another ExtendSession came first
            raise errors.AbortedError(
                f"Current version is {session.version} but caller expected {request.current_graph_version}."
            )
        session.nodes.update(nodes)
        session.functions = functions
        session.calls_functions = session.calls_functions or any(
            function_attrs(node) for node in nodes.values()
        )
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
        if self._session_gc is not None:
            self._session_gc.cancel()
            self._background.add(self._session_gc)
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
        devices = await self._devices(self._tasks, self._connect_timeout(self._default_config), "ListDevices")
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
        metadata: RunMetadata | None = None,
    ) -> dict[str, Any]:
        """Run one step. Returns fetch name (canonical "x:k") -> numpy value.

        With `metadata`: per-node timings of every partition when `options.trace_level`
        asks (SOFTWARE_TRACE and up), the partition graphs with
        `options.output_partition_graphs`.
        """
        session = self._session(handle)
        options = options or RunOptions()
        timeout_ms = options.timeout_in_ms or session.config.operation_timeout_in_ms
        timeout = timeout_ms / 1000 if timeout_ms > 0 else None
        task = asyncio.current_task()
        assert task is not None
        session.steps.add(task)
        began = self.steps.start()
        error: BaseException | None = None
        try:
            async with asyncio.timeout(timeout):
                return await self._run_step(session, feeds, fetches, targets, options, metadata)
        except TimeoutError as exc:
            error = errors.DeadlineExceededError(
                f"Timed out after {timeout_ms} ms waiting for the step to finish "
                "(RunOptions.timeout_in_ms / ConfigProto.operation_timeout_in_ms)"
            )
            raise error from exc
        except asyncio.CancelledError as exc:
            error = exc
            if session.closed:
                error = errors.CancelledError("Step was cancelled: the session was closed")
                raise error from None
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.steps.finish(began, error)
            session.steps.discard(task)
            session.last_used = asyncio.get_running_loop().time()

    async def _run_step(
        self,
        session: MasterSession,
        feeds: Mapping[str, Any],
        fetches: Sequence[str],
        targets: Sequence[str],
        options: RunOptions,
        metadata: RunMetadata | None,
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
        stats = None
        if metadata is not None:
            if options.trace_level >= RunOptions.SOFTWARE_TRACE:
                stats = metadata.step_stats
            if options.output_partition_graphs:
                metadata.partition_graphs.extend(part.graph for part in plan.partitions)
        step_id = new_step_id()
        results: dict[str, Any] = {}
        failed = True
        try:
            runs = await gather_all(
                self._run_partition(p, session.handle, step_id, plan, feed_values, stats)
                for p in plan.partitions
            )
            failed = False
        finally:
            self._cleanup_step(plan, step_id, failed)
        by_key = {}
        for run in runs:
            by_key.update(run)
        for name in fetch_names:
            if name in feed_values:
                results[name] = feed_values[name]
            elif plan.fetch_keys[name] in by_key:
                results[name] = by_key[plan.fetch_keys[name]]
            else:  # workers leave dead values out of their responses
                raise errors.InvalidArgumentError(
                    f"The tensor returned for {name} was not valid: it is dead (on the branch of a "
                    "conditional that did not run)."
                )
        return results

    async def _run_partition(
        self,
        part: _Partition,
        handle: str,
        step_id: int,
        plan: _RegisteredPlan,
        feeds: Mapping[str, Any],
        stats: StepStats | None,
    ) -> dict[str, Any]:
        # The push protocol (`push`): pushed values come back in the response, except
        # those that were too large last time, which are fetched right away, alongside.
        request = w.RunGraphRequest(
            session_handle=handle,
            create_worker_session_called=True,
            graph_handle=part.graph_handle,
            step_id=step_id,
            recv_key=[*part.fetch_keys, *(k.text for k in part.pushed_keys if k.text not in part.large_keys)],
            store_errors_in_response_body=True,
        )
        sends = {key: feeds[name] for name, key in plan.feed_keys.items() if key in part.feed_keys}
        early = {
            key.text: asyncio.ensure_future(part.worker.recv_tensor(step_id, key))
            for key in part.pushed_keys
            if key.text in part.large_keys
        }
        try:
            results = await part.worker.run_graph(request, sends, stats=stats)
            for key in part.pushed_keys:
                value = results.pop(key.text, None)
                is_dead = False
                if key.text in early:
                    value, is_dead = await early[key.text]
                elif value is None:
                    # Withheld (too large to ride in the response, or dead): fetch it as usual.
                    value, is_dead = await part.worker.recv_tensor(step_id, key)
                    if not is_dead:
                        part.large_keys.add(key.text)
                self._local_worker.deliver(step_id, key, value, is_dead)
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

    def _cleanup_step(self, plan: _RegisteredPlan, step_id: int, failed: bool) -> None:
        # Workers drop a finished step's state themselves once every value another
        # task needs has been handed over; only after a failure does CleanupGraph free it.
        if failed:
            for part in plan.partitions:
                self._send_cleanup(part, step_id)

    def _send_cleanup(self, part: _Partition, step_id: int) -> None:
        request = w.CleanupGraphRequest(step_id=step_id)
        task = asyncio.get_running_loop().create_task(_clean_up_quietly(part.worker, request))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _plan(
        self,
        session: MasterSession,
        feeds: Mapping[str, np.ndarray],
        fetches: list[str],
        targets: list[str],
    ) -> _RegisteredPlan:
        feed_types = tuple(sorted((name, _datatype(value)) for name, value in feeds.items()))
        signature = (feed_types, tuple(fetches), tuple(sorted(targets)))
        future = session.plans.get(signature)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            session.plans[signature] = future
            try:
                future.set_result(await self._register_plan(session, feed_types, fetches, targets))
            except BaseException as exc:
                del session.plans[signature]
                future.set_exception(exc)
                future.exception()
                raise
        if future.done():  # (a signature planned before: most steps; shield costs ~10 us)
            return future.result()
        return await asyncio.shield(future)

    async def _register_plan(
        self,
        session: MasterSession,
        feed_types: Sequence[tuple[str, int]],
        fetches: list[str],
        targets: list[str],
    ) -> _RegisteredPlan:
        # Planning is O(graph) several times over (0.75 s for 53,000 nodes): off the loop,
        # on a snapshot of the graph (ExtendSession may add nodes meanwhile).
        plan = await asyncio.to_thread(
            build_plan,
            dict(session.nodes),
            feeds=feed_types,
            fetches=fetches,
            targets=targets,
            incarnations={d.name: d.incarnation for d in session.devices},
            client_device=self._local_device(session).name,
            master_task=self.task_name,
            allow_soft_placement=session.config.allow_soft_placement,
            functions=session.functions if session.calls_functions else None,
        )
        feed_keys = set(plan.feed_keys.values())
        fetch_keys = set(plan.fetch_keys.values())

        async def register(task: str, graph: GraphDef) -> _Partition:
            worker = self._worker(task)
            request = w.RegisterGraphRequest(
                session_handle=session.handle, create_worker_session_called=True, graph_def=graph
            )
            request.graph_options.CopyFrom(session.config.graph_options)
            response: Any = await worker.call("RegisterGraph", request)
            keys = plan.client_keys(task)
            return _Partition(
                task=task,
                worker=worker,
                graph_handle=response.graph_handle,
                graph=graph,
                feed_keys=sorted(keys & feed_keys),
                fetch_keys=sorted(keys & fetch_keys),
                pushed_keys=[parse_rendezvous_key(k) for k in sorted(plan.pushed_keys.get(task, ()))],
            )

        partitions = await gather_all(register(t, g) for t, g in plan.graphs.items())
        # This task's own partition last: a step starts the partitions in this order, and
        # the local one runs its first kernels before it yields, the remote ones only send
        # their RunGraph call (a ps's reads then start ~0.35 ms sooner in `small`).
        partitions.sort(key=lambda part: part.task == self.task_name)
        return _RegisteredPlan(
            partitions=partitions,
            feed_keys=plan.feed_keys,
            fetch_keys=plan.fetch_keys,
        )

    def _local_device(self, session: MasterSession) -> DeviceAttributes:
        for device in session.devices:
            if task_of_device(device.name) == self.task_name:
                return device
        raise errors.InternalError(f"The master's own task {self.task_name} is not in the session")

    # -- RPC handlers (proto in, proto out) --------------------------------------------

    def service_handlers(self) -> dict[str, Callable[[Any], Awaitable[Message | EncodedMessage]]]:
        """MasterService method name -> handler, for transports."""
        return dict(self._handlers)

    async def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        handler = self._handlers.get(method)
        if handler is None:
            raise errors.UnimplementedError(f"MasterService/{method} is not implemented by distserver")
        response = await handler(request)
        return response.parse() if isinstance(response, EncodedMessage) else response

    async def run_step_rpc(
        self, request: m.RunStepRequest | TensorRequest[m.RunStepRequest]
    ) -> m.RunStepResponse | EncodedMessage:
        response = m.RunStepResponse()
        message = request.message if isinstance(request, TensorRequest) else request
        try:
            if message.partial_run_handle:
                raise errors.UnimplementedError("Partial runs are not supported by distserver")
            _, fed = await request_tensors(request, what="a RunStep request")
            feeds: dict[str, Any] = {}
            for name, value in fed:
                if name in feeds:
                    raise errors.InvalidArgumentError(f"Duplicated feeds: {name}")
                feeds[name] = value
            results = await self.run_step(
                message.session_handle,
                feeds,
                list(message.fetch),
                list(message.target),
                message.options,
                response.metadata,
            )
            fetched = [(name, results[canonical_tensor_name(name)]) for name in dict.fromkeys(message.fetch)]
            return await encode_off_loop(response, fetched)
        except errors.OpError as exc:
            if not message.store_errors_in_response_body:
                raise
            del response.tensor[:]
            response.ClearField("metadata")
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

    async def run_callable(self, handle: str, callable_handle: int, feeds: Sequence[Any]) -> list[Any]:
        """Run a callable made by MakeCallable: its fetches' values, in order."""
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

    async def run_callable_rpc(
        self, request: m.RunCallableRequest | TensorRequest[m.RunCallableRequest]
    ) -> EncodedMessage:
        message, feeds = await request_tensors(request, what="a RunCallable request")
        values = await self.run_callable(message.session_handle, message.handle, [v for _, v in feeds])
        return await encode_off_loop(m.RunCallableResponse(), values)

    async def release_callable(self, request: m.ReleaseCallableRequest) -> m.ReleaseCallableResponse:
        session = self._session(request.session_handle)
        session.callables.pop(request.handle, None)
        return m.ReleaseCallableResponse()


def _import(
    graph_def: GraphDef, nodes: Mapping[str, NodeDef], functions: Mapping[str, FunctionDef]
) -> tuple[dict[str, FunctionDef], dict[str, NodeDef]]:
    """The session's library with the graph's added, and the graph's nodes (`import_graph`)."""
    library = index_library([*functions.values(), *graph_def.library.function])
    return library, import_graph(graph_def, nodes, library)


def _datatype(value: Any) -> int:
    return (
        as_datatype(np.asarray(value).dtype)
        if not isinstance(value, np.ndarray)
        else as_datatype(value.dtype)
    )


async def _clean_up_quietly(worker: WorkerClient, request: w.CleanupGraphRequest) -> None:
    # The call is made here, not by the caller: a task cancelled before it starts
    # (the server stopping) would otherwise leave that coroutine never awaited.
    try:
        await worker.call("CleanupGraph", request)
    except errors.OpError as exc:
        logger.debug("step cleanup failed: %s", exc)
