"""`AsyncServer`: one task of a cluster, serving TensorFlow's MasterService and WorkerService.

Lifecycle (one state machine)::

    NEW --bind()--> NEW(bound) --start()--> STARTED --stop()--> STOPPING --> STOPPED
      \\____________________________ join() / stop() before start ____________/

* The constructor only reads and checks the configuration (TensorFlow's errors).
* `bind()` binds the port (TensorFlow's `Server(...)` constructor does this).
* `start()` serves; it is idempotent, and after a stop it raises
  `FailedPreconditionError("Server has stopped.")`.
* `join()` on a server that never started stops it at once (TensorFlow's rule);
  on a started one it waits until someone stops it.
* `stop(grace)` stops accepting RPCs, lets those in flight finish for up to
  `grace` seconds, cancels the rest, closes every session and channel, and
  releases the port. It is idempotent and may be called from any coroutine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import json
import logging
import os
import random
import weakref
from dataclasses import dataclass
from typing import Any

from google.protobuf import empty_pb2, wrappers_pb2

from distserver import errors
from distserver._cpus import ComputePool
from distserver.cluster import ClusterSpec, local_address, make_server_def, validate_cluster
from distserver.devices import full_device_name, task_name
from distserver.kernels import _compiled
from distserver.kernels.resources import ResourceManager
from distserver.kernels.state import OPTIMIZER_UPDATES
from distserver.protos.cluster_pb2 import ClusterDef
from distserver.protos.device_attributes_pb2 import DeviceAttributes
from distserver.protos.services import (
    EAGER_SERVICE,
    MASTER_SERVICE,
    STATUS_SERVICE,
    TENSOR_SERVICE,
    WORKER_SERVICE,
)
from distserver.protos.tensorflow_server_pb2 import ServerDef
from distserver.runtime.clients import RemoteWorker, WorkerClient
from distserver.runtime.counters import StepCounters, StepStatistics
from distserver.runtime.eager import EagerService
from distserver.runtime.master import DEFAULT_SESSION_GC_SECONDS, Master
from distserver.runtime.worker import Worker
from distserver.security import Security, from_environment
from distserver.transports import Channel, ChannelStatistics, Listener, Transport, get_transport

logger = logging.getLogger(__name__)

# CPU devices report TensorFlow's ThreadPoolDevice memory limit.
_CPU_MEMORY_LIMIT = 256 << 20


class ServerState(enum.Enum):
    NEW = "new"
    STARTED = "started"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(frozen=True)
class ServerStatistics:
    """A snapshot of a server's activity (`AsyncServer.statistics()`, `distserver status --stats`).

    `peers` are this task's channels to the other tasks, by task name: calls made, and
    tensors and bytes received, with the data path each channel's tensors take
    ("grpc"; "verbs" when grpc+verbs moves them through shared memory).
    `optimizer_updates` counts the optimizer updates of this process (of every server
    in it) by how they were written: "in_place" into the variables' own arrays, or
    "copied" into new arrays because something still held the old ones.
    `compiled_kernels` says whether the process' hot kernels run compiled loops
    (`kernels._compiled.state()`: "unused", "compiling", "ready" or "off").
    """

    target: str
    state: str
    sessions: int
    channels: int
    steps: StepStatistics  # steps this task's master ran (its clients' Session.run)
    graphs: StepStatistics  # partition graphs this task's worker ran (RunGraph)
    peers: dict[str, ChannelStatistics]
    optimizer_updates: dict[str, int] = dataclasses.field(default_factory=dict)
    compiled_kernels: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): every field, and `in_flight` for steps and graphs."""
        data = dataclasses.asdict(self)
        data["steps"]["in_flight"] = self.steps.in_flight
        data["graphs"]["in_flight"] = self.graphs.in_flight
        return data

    def bytes_received_by_data_path(self) -> dict[str, int]:
        """Tensor bytes received from peers, summed by data path."""
        totals: dict[str, int] = {}
        for peer in self.peers.values():
            totals[peer.data_path] = totals.get(peer.data_path, 0) + peer.tensor_bytes_received
        return totals


# Servers of this process by target, for the in-process shortcut of sessions.
_LOCAL_SERVERS: weakref.WeakValueDictionary[str, AsyncServer] = weakref.WeakValueDictionary()


def find_local_server(target: str) -> AsyncServer | None:
    """The started server of this process whose target is `target`, if any."""
    server = _LOCAL_SERVERS.get(target)
    if server is not None and server.state is ServerState.STARTED:
        return server
    return None


class AsyncServer:
    """One task of a TensorFlow-style cluster, asyncio-native.

    Args:
        server_or_cluster_def: A `ServerDef`, a `ClusterDef`, a `ClusterSpec`, or a
            dict accepted by `ClusterSpec` (TensorFlow's protos are accepted too).
        job_name: This task's job; may be omitted when the cluster has one job.
        task_index: This task's index; may be omitted when the job has one task.
        protocol: "grpc" (default), "grpc+verbs" (gRPC for calls, shared memory for
            tensors between tasks on one host; docs/verbs.md), or another registered
            transport.
        config: A `ConfigProto` merged into every session this server's master creates.
        listen_on_all_interfaces: Bind every interface instead of the host named in
            this task's address (TensorFlow always binds every interface).
        serve: False builds a server that listens on no port: it serves only
            sessions of this process (what `Session("")` uses).
        session_gc_seconds: Close a master session that ran nothing for this long
            (its client most likely died without closing it); 0 keeps sessions
            until they are closed, as TensorFlow's servers do. Default: one hour.
        security: TLS, mutual TLS and/or a token (`distserver.Security`) for this
            server's port and for its channels to the other tasks. None: plaintext,
            and a token only when `DISTSERVER_AUTH_TOKEN` is set.
        checkpoint_root: An existing directory under which checkpoint ops (`SaveV2`,
            `RestoreV2`, `MergeV2Checkpoints`) may read and write; paths outside it
            (after resolving symlinks) are refused. None (default): every checkpoint
            op is refused (docs/checkpoints.md).

    Raises:
        TypeError, ValueError: the cluster or task is not given right (TF's messages).
        InternalError, InvalidArgumentError: this task is not in the cluster, or an
            address is malformed.
        NotFoundError: no transport serves `protocol`.
        ValueError: `checkpoint_root` is not an existing directory.
    """

    def __init__(
        self,
        server_or_cluster_def: Any,
        job_name: str | None = None,
        task_index: int | None = None,
        protocol: str | None = None,
        config: Any = None,
        *,
        listen_on_all_interfaces: bool = False,
        serve: bool = True,
        session_gc_seconds: float = DEFAULT_SESSION_GC_SECONDS,
        security: Security | None = None,
        checkpoint_root: str | os.PathLike[str] | None = None,
    ) -> None:
        if session_gc_seconds < 0:
            raise ValueError(f"session_gc_seconds must be >= 0 (0: never), got {session_gc_seconds}")
        self._session_gc_seconds = session_gc_seconds
        self._checkpoint_root = _checkpoint_root(checkpoint_root)
        self._security = from_environment(security)
        if self._security is not None and self._security.ca_file and not self._security.cert_file:
            raise ValueError(
                "Security for a server needs cert_file and key_file to serve TLS (ca_file alone "
                "only configures clients)"
            )
        self._server_def: ServerDef = make_server_def(
            server_or_cluster_def, job_name, task_index, protocol, config
        )
        self._transport: Transport = get_transport(self._server_def.protocol)
        self._host, self._requested_port = local_address(self._server_def)
        validate_cluster(self._server_def.cluster)
        self._listen_everywhere = listen_on_all_interfaces
        self._serve = serve
        self._cluster = ClusterSpec(self._server_def.cluster)
        self._task = task_name(self._server_def.job_name, self._server_def.task_index)
        self._state = ServerState.NEW
        self._listener: Listener | None = None
        self._channels: dict[str, Channel] = {}
        self._worker_clients: dict[str, WorkerClient] = {}
        # Tasks this server's cluster lacks, learned from TensorFlow 2 clients'
        # eager contexts (their ServerDef names the whole cluster): task -> address.
        self._learned_addresses: dict[str, str] = {}
        self._port: int | None = None
        self._bind_lock: asyncio.Lock | None = None
        self._stopped: asyncio.Event | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.worker: Worker | None = None
        self.master: Master | None = None
        self.eager: EagerService | None = None

    # -- properties -------------------------------------------------------------------

    @property
    def server_def(self) -> ServerDef:
        """The `ServerDef` this server was built from (port 0 stays 0, as in TF)."""
        return self._server_def

    @property
    def state(self) -> ServerState:
        return self._state

    @property
    def target(self) -> str:
        """`"grpc://<host>:<bound port>"`, the address sessions connect to."""
        if self._port is None:
            raise RuntimeError("The server has no port yet: await server.bind() or server.start() first.")
        return f"grpc://{self._host}:{self._port}"

    @property
    def task(self) -> str:
        """This task's name, `/job:<job>/replica:0/task:<index>`."""
        return self._task

    @property
    def checkpoint_root(self) -> str | None:
        """The resolved directory checkpoint ops may use; None when they are refused."""
        return self._checkpoint_root

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the server runs on (set by `bind()`)."""
        return self._loop

    def statistics(self) -> ServerStatistics:
        """Counters of this server so far (cheap: a copy of a few integers per peer)."""
        sessions = len(self.master._sessions) if self.master else 0
        empty = StepCounters().snapshot()
        return ServerStatistics(
            target=self.target if self._port is not None else "",
            state=self._state.value,
            sessions=sessions,
            channels=len(self._channels),
            steps=self.master.steps.snapshot() if self.master else empty,
            graphs=self.worker.graphs.snapshot() if self.worker else empty,
            peers={task: channel.statistics() for task, channel in self._channels.items()},
            optimizer_updates={"in_place": OPTIMIZER_UPDATES.in_place, "copied": OPTIMIZER_UPDATES.copied},
            compiled_kernels=_compiled.state(),
        )

    async def _get_statistics_rpc(self, request: empty_pb2.Empty) -> wrappers_pb2.StringValue:
        return wrappers_pb2.StringValue(value=json.dumps(self.statistics().as_dict()))

    # -- lifecycle ----------------------------------------------------------------------

    async def bind(self) -> None:
        """Bind the listening port and build the master and worker. Idempotent.

        Raises:
            UnknownError: the port cannot be bound (the message names the address).
            FailedPreconditionError: the server has stopped.
        """
        if self._state is not ServerState.NEW:
            if self._state is ServerState.STARTED:
                return
            raise errors.FailedPreconditionError("Server has stopped.")
        if self._bind_lock is None:
            self._bind_lock = asyncio.Lock()
        async with self._bind_lock:
            if self.master is not None:
                return
            self._loop = asyncio.get_running_loop()
            self._stopped = asyncio.Event()
            self._build_runtime()
            assert self.master is not None
            assert self.worker is not None
            assert self.eager is not None
            if not self._serve:
                return
            host = "[::]" if self._listen_everywhere else self._host
            self._listener = await self._transport.listen(
                f"{host}:{self._requested_port}",
                {
                    MASTER_SERVICE: self.master.service_handlers(),
                    WORKER_SERVICE: self.worker.service_handlers(),
                    EAGER_SERVICE: self.eager.service_handlers(),
                    STATUS_SERVICE: {"GetStatistics": self._get_statistics_rpc},
                    TENSOR_SERVICE: self.worker.tensor_handlers(),
                },
                self.worker.recv_tensor,
                security=self._security,
            )
            self._port = self._listener.port
            _LOCAL_SERVERS[self.target] = self

    def _build_runtime(self) -> None:
        config = self._server_def.default_session_config
        threads = config.inter_op_parallelism_threads or min(4, os.cpu_count() or 1)
        self._pool = ComputePool(threads, thread_name_prefix="distserver-compute")
        incarnation = random.getrandbits(64) or 1
        device = DeviceAttributes(
            name=full_device_name(self._server_def.job_name, self._server_def.task_index),
            device_type="CPU",
            memory_limit=_CPU_MEMORY_LIMIT,
            incarnation=incarnation,
        )
        self.worker = Worker(
            task_name=self._task,
            device=device,
            resources=ResourceManager(),
            pool=self._pool,
            worker_client=self._worker_client,
            batched_value_bytes=self._transport.batched_value_bytes,
            checkpoint_root=self._checkpoint_root,
        )
        self.eager = EagerService(worker=self.worker, on_cluster=self._learn_cluster)
        tasks = [
            task_name(job, index) for job in self._cluster.jobs for index in self._cluster.task_indices(job)
        ]
        self.master = Master(
            task_name=self._task,
            tasks=tasks,
            local_worker=self.worker,
            worker_client=self._worker_client,
            default_session_config=config,
            session_gc_seconds=self._session_gc_seconds,
        )

    def _worker_client(self, task: str) -> WorkerClient:
        """The client of `task`'s worker, over a channel made on first use."""
        client = self._worker_clients.get(task)
        if client is None:
            address = self._learned_addresses.get(task)
            if address is None:
                job, index = _split_task(task)
                address = self._cluster.task_address(job, index)
            channel = self._transport.connect(address, security=self._security)
            self._channels[task] = channel
            client = self._worker_clients[task] = RemoteWorker(channel)
        return client

    def _learn_cluster(self, cluster: ClusterDef) -> None:
        """Take the addresses of the tasks an eager context's cluster names and ours lacks.

        Raises:
            InvalidArgumentError: the context gives a task of our cluster another address
                (this server would reach a different process than its client does).
        """
        learned = {}
        for job in cluster.job:
            for index, address in job.tasks.items():
                task = task_name(job.name, index)
                if task == self._task:
                    continue
                known = self._learned_addresses.get(task)
                if (
                    known is None
                    and job.name in self._cluster.jobs
                    and index in self._cluster.task_indices(job.name)
                ):
                    known = self._cluster.task_address(job.name, index)
                if known is None:
                    learned[task] = address
                elif known != address:
                    raise errors.InvalidArgumentError(
                        f"The eager context's cluster gives {task} the address {address}, but this "
                        f"server ({self._task}) knows it as {known}: start the server with the same "
                        "cluster as the TensorFlow client's"
                    )
        self._learned_addresses.update(learned)

    async def start(self) -> None:
        """Bind (if needed) and start serving. Idempotent.

        Raises:
            FailedPreconditionError: the server has stopped ("Server has stopped.").
        """
        if self._state is ServerState.STARTED:
            return
        await self.bind()
        if self._state is not ServerState.NEW:
            raise errors.FailedPreconditionError("Server has stopped.")
        if self._listener is not None:
            await self._listener.start()
            logger.info("Started server with target: %s", self.target)
        self._state = ServerState.STARTED

    async def join(self, timeout: float | None = None) -> bool:
        """Wait until the server has stopped.

        A server that never started is stopped at once (and can no longer start),
        as in TensorFlow.

        Args:
            timeout: Seconds to wait; None waits until the server stops.

        Returns:
            True when the server has stopped, False when `timeout` expired first.
        """
        if self._state is ServerState.NEW:
            await self.stop()
            return True
        assert self._stopped is not None
        try:
            async with asyncio.timeout(timeout):
                await self._stopped.wait()
        except TimeoutError:
            return False
        return True

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving and release every resource, the port included. Idempotent.

        Args:
            grace: Seconds that RPCs in flight may take to finish before they are
                cancelled; None waits for them.
        """
        if self._state is ServerState.STOPPED:
            return
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop(grace))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float | None) -> None:
        self._state = ServerState.STOPPING
        try:
            if self._listener is not None:
                await self._listener.stop(grace)
            if self.master is not None:
                await self.master.close()
            if self.eager is not None:
                self.eager.close()
            if self.worker is not None:
                self.worker.abort_all_steps(errors.CancelledError("The server is stopping"))
            for channel in self._channels.values():
                await channel.close()
            self._channels.clear()
            self._worker_clients.clear()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
            if self._port is not None and _LOCAL_SERVERS.get(self.target) is self:
                del _LOCAL_SERVERS[self.target]
            self._state = ServerState.STOPPED
            if self._stopped is not None:
                self._stopped.set()
            logger.info("Stopped server %s", self._task)

    async def __aenter__(self) -> AsyncServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def __repr__(self) -> str:
        where = self.target if self._port is not None else f"{self._host}:{self._requested_port}"
        return f"<AsyncServer {self._task} {where} {self._state.value}>"


def _checkpoint_root(root: str | os.PathLike[str] | None) -> str | None:
    """`root` resolved (symlinks included); ValueError unless it is a directory."""
    if root is None:
        return None
    text = os.fspath(root)
    if not text:
        raise ValueError("checkpoint_root is empty: give a directory, or None to refuse checkpoint ops")
    resolved = os.path.realpath(text)
    if not os.path.isdir(resolved):
        raise ValueError(f"checkpoint_root {text!r} is not an existing directory")
    return resolved


def _split_task(task: str) -> tuple[str, int]:
    """`/job:ps/replica:0/task:1` -> ("ps", 1)."""
    parts = dict(part.split(":", 1) for part in task.strip("/").split("/"))
    return parts["job"], int(parts["task"])
