"""The blocking, TensorFlow-compatible API: `Server`, `Session` and `ClusterCoordinator`.

They hold no logic of their own: each call runs the matching `AsyncServer` /
`AsyncSession` coroutine on one process-wide event-loop thread (uvloop when
installed), so grpc.aio objects never cross threads. That thread is a daemon and
is shut down at exit: a server left running never keeps the interpreter alive.
Calls may come from any thread except the loop thread itself (there, use the
`Async*` classes with `await`). Ctrl-C interrupts a blocking call such as `join()`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from distserver._process import new_event_loop
from distserver.coordinator import AsyncClusterCoordinator, PerWorkerDataset, RemoteValue
from distserver.graph import Graph
from distserver.protos.config_pb2 import RunMetadata, RunOptions
from distserver.protos.device_attributes_pb2 import DeviceAttributes
from distserver.protos.tensorflow_server_pb2 import ServerDef
from distserver.runtime.master import DEFAULT_SESSION_GC_SECONDS
from distserver.security import Security
from distserver.server import AsyncServer, ServerStatistics
from distserver.session import AsyncSession, implicit_servers

T = TypeVar("T")


class _LoopThread:
    """The process-wide event loop that runs every blocking-API call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: weakref.WeakSet[AsyncServer] = weakref.WeakSet()
        self._shut_down = False

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._shut_down:
                raise RuntimeError(
                    "distserver's event-loop thread was shut down (at interpreter exit), so the "
                    "blocking API (Server, Session) can no longer run. Run AsyncServer / "
                    "AsyncSession on an event loop of your own instead."
                )
            if self._thread is not None and not self._thread.is_alive():
                raise RuntimeError("distserver's event-loop thread has died; the blocking API cannot run.")
            if self._loop is None:
                self._loop = new_event_loop()
                ready = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(self._loop, ready), name="distserver-loop", daemon=True
                )
                self._thread.start()
                ready.wait()
            return self._loop

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop thread and wait for its result."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "distserver's blocking API (Server, Session) was called from its own event-loop "
                "thread, which would deadlock. Inside async code use AsyncServer / AsyncSession "
                "and await them."
            )
        try:
            loop = self.loop()
        except RuntimeError:
            coro.close()
            raise
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result()
        except BaseException:
            # Ctrl-C (or any interruption of the wait): do not leave the call running.
            future.cancel()
            raise

    def track(self, server: AsyncServer) -> None:
        self._servers.add(server)

    def shutdown(self) -> None:
        """Stop every server still running, then the loop, and close it (at interpreter exit).

        Blocking calls after this raise RuntimeError instead of waiting for a loop
        that no longer runs.
        """
        with self._lock:
            self._shut_down = True
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or loop.is_closed() or not thread.is_alive():
            return

        async def stop_all() -> None:
            # The servers made here and the implicit one of in-process sessions (target "").
            servers = {*self._servers, *implicit_servers()}
            if servers:
                await asyncio.wait([asyncio.ensure_future(s.stop(grace=0)) for s in servers], timeout=5)
            # Anything still running (a call left behind): cancelled and given its
            # chance to end, not destroyed pending when the loop closes.
            rest = asyncio.all_tasks() - {asyncio.current_task()}
            for task in rest:
                task.cancel()
            if rest:
                await asyncio.wait(rest, timeout=5)

        try:
            asyncio.run_coroutine_threadsafe(stop_all(), loop).result(timeout=10)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.close()


_LOOP = _LoopThread()
atexit.register(_LOOP.shutdown)


async def _statistics_of(server: AsyncServer) -> ServerStatistics:
    return server.statistics()


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on distserver's loop thread from synchronous code."""
    return _LOOP.run(coro)


class Server:
    """An in-process server for one task of a cluster (`tf.distribute.Server`).

    Args:
        server_or_cluster_def: A `ServerDef`, `ClusterDef`, `ClusterSpec` or dict.
        job_name: This task's job (may be omitted when the cluster has one job).
        task_index: This task's index (may be omitted when the job has one task).
        protocol: "grpc" (default: TensorFlow's wire protocol) or "grpc+verbs" (gRPC
            for calls, shared memory for tensors between tasks on one host;
            docs/verbs.md).
        config: A `ConfigProto` merged into every session this server creates.
        start: Start serving at once (the port is bound in the constructor either way).
        listen_on_all_interfaces: Bind every interface, not just this task's host.
        session_gc_seconds: Close master sessions idle this long (0: never); one hour
            by default.
        security: TLS, mutual TLS and/or token (`distserver.Security`) for this server
            and its channels to its peers.
        checkpoint_root: The directory under which this task's checkpoint ops
            (`Saver`) may read and write; None (default) refuses them
            (docs/checkpoints.md).

    Unlike TensorFlow's, this server can be stopped (`stop(grace)`, also from another
    thread), releases its port when stopped, and `join(timeout)` can time out.
    """

    def __init__(
        self,
        server_or_cluster_def: Any,
        job_name: str | None = None,
        task_index: int | None = None,
        protocol: str | None = None,
        config: Any = None,
        start: bool = True,
        *,
        listen_on_all_interfaces: bool = False,
        session_gc_seconds: float = DEFAULT_SESSION_GC_SECONDS,
        security: Security | None = None,
        checkpoint_root: str | os.PathLike[str] | None = None,
    ) -> None:
        self._async = AsyncServer(
            server_or_cluster_def,
            job_name,
            task_index,
            protocol,
            config,
            listen_on_all_interfaces=listen_on_all_interfaces,
            session_gc_seconds=session_gc_seconds,
            security=security,
            checkpoint_root=checkpoint_root,
        )
        _LOOP.run(self._async.bind())
        _LOOP.track(self._async)
        if start:
            self.start()

    @staticmethod
    def create_local_server(config: Any = None, start: bool = True) -> Server:
        """A single-task server on localhost with an OS-chosen port (job "localhost")."""
        return Server({"localhost": ["localhost:0"]}, protocol="grpc", config=config, start=start)

    @property
    def server_def(self) -> ServerDef:
        return self._async.server_def

    @property
    def target(self) -> str:
        """`"grpc://<host>:<port>"` for `Session(target)`."""
        return self._async.target

    @property
    def async_server(self) -> AsyncServer:
        """The `AsyncServer` doing the work (use it only on distserver's loop)."""
        return self._async

    def statistics(self) -> ServerStatistics:
        """This server's counters so far (`AsyncServer.statistics()`), read on its event loop."""
        return _LOOP.run(_statistics_of(self._async))

    def start(self) -> None:
        """Start serving. Idempotent; raises FailedPreconditionError after a stop."""
        _LOOP.run(self._async.start())

    def join(self, timeout: float | None = None) -> bool:
        """Block until the server stops (a never-started server stops at once).

        Returns:
            True once stopped; False if `timeout` seconds passed first.
        """
        return _LOOP.run(self._async.join(timeout))

    def stop(self, grace: float | None = None) -> None:
        """Stop serving and release the port; calls in flight get `grace` seconds."""
        _LOOP.run(self._async.stop(grace))

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return repr(self._async).replace("AsyncServer", "Server", 1)


class Session:
    """Runs graphs on a server (`tf.compat.v1.Session`), blocking.

    Args:
        target: `server.target` ("grpc://host:port"), or "" for an in-process session.
        graph: The graph to run (the default graph when None).
        config: A `ConfigProto` (TensorFlow's is accepted too).
        security: TLS and/or token (`distserver.Security`) for the channel to the master.
    """

    def __init__(
        self,
        target: str = "",
        graph: Graph | None = None,
        config: Any = None,
        *,
        security: Security | None = None,
    ) -> None:
        self._async = AsyncSession(target, graph, config, security=security)

    @property
    def graph(self) -> Graph:
        return self._async.graph

    @property
    def target(self) -> str:
        return self._async.target

    def run(
        self,
        fetches: Any,
        feed_dict: Mapping[Any, Any] | None = None,
        options: RunOptions | None = None,
        run_metadata: RunMetadata | None = None,
    ) -> Any:
        """Run one step; see `AsyncSession.run`."""
        return _LOOP.run(self._async.run(fetches, feed_dict, options, run_metadata))

    def make_callable(self, fetches: Any, feed_list: Sequence[Any] | None = None) -> Callable[..., Any]:
        """A function `fn(*feed_values)` that runs `fetches`; see `AsyncSession.make_callable`."""
        run_async = _LOOP.run(self._async.make_callable(fetches, feed_list))

        def run_callable(*values: Any) -> Any:
            return _LOOP.run(run_async(*values))

        return run_callable

    def list_devices(self) -> list[DeviceAttributes]:
        return _LOOP.run(self._async.list_devices())

    def close(self) -> None:
        _LOOP.run(self._async.close())

    @staticmethod
    def reset(target: str, containers: Sequence[str] | None = None, config: Any = None) -> None:
        """Clear resource containers on every task of `target`'s cluster."""
        _LOOP.run(AsyncSession.reset(target, containers, config))

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _call(function: Callable[..., T], *args: Any) -> T:
    """Call a plain function of an async object on the loop thread."""
    return function(*args)


class ClusterCoordinator:
    """Schedules steps over a cluster's workers, blocking; see `AsyncClusterCoordinator`.

    The same arguments and behaviour as `AsyncClusterCoordinator`, whose methods run
    on distserver's loop thread; `schedule` returns a `RemoteValue` whose `fetch()`
    blocks until the step has run.
    """

    def __init__(
        self,
        cluster: Any,
        graph: Graph | None = None,
        *,
        protocol: str = "grpc",
        config: Any = None,
        security: Security | None = None,
        max_in_flight_per_worker: int = 2,
        step_timeout: float | None = 60.0,
        probe_timeout: float = 2.0,
        probe_interval: float = 1.0,
        worker_wait_timeout: float = 120.0,
    ) -> None:
        self._async = AsyncClusterCoordinator(
            cluster,
            graph,
            protocol=protocol,
            config=config,
            security=security,
            max_in_flight_per_worker=max_in_flight_per_worker,
            step_timeout=step_timeout,
            probe_timeout=probe_timeout,
            probe_interval=probe_interval,
            worker_wait_timeout=worker_wait_timeout,
        )

    @property
    def graph(self) -> Graph:
        return self._async.graph

    @property
    def num_workers(self) -> int:
        return self._async.num_workers

    @property
    def async_coordinator(self) -> AsyncClusterCoordinator:
        """The `AsyncClusterCoordinator` doing the work (use it only on distserver's loop)."""
        return self._async

    def available_workers(self) -> list[int]:
        return _LOOP.run(_call(self._async.available_workers))

    def schedule(
        self,
        fetches: Any,
        feed_dict: Mapping[Any, Any] | Callable[[int], Mapping[Any, Any]] | None = None,
    ) -> RemoteValue:
        """Queue one step and return its `RemoteValue` at once; see `AsyncClusterCoordinator.schedule`."""
        return _LOOP.run(_call(self._async.schedule, fetches, feed_dict))

    def done(self) -> bool:
        return _LOOP.run(_call(self._async.done))

    def join(self) -> None:
        """Block until every scheduled step has finished; see `AsyncClusterCoordinator.join`."""
        _LOOP.run(self._async.join())

    def run_on_every_worker(
        self, fetches: Any, feed_dict: Callable[[int], Mapping[Any, Any]] | None = None
    ) -> list[Any]:
        """See `AsyncClusterCoordinator.run_on_every_worker`."""
        return _LOOP.run(self._async.run_on_every_worker(fetches, feed_dict))

    def create_per_worker_dataset(
        self,
        arrays: Any,
        batch_size: int,
        *,
        shuffle_seed: int | None = 0,
        name: str = "per_worker_dataset",
    ) -> PerWorkerDataset:
        """See `AsyncClusterCoordinator.create_per_worker_dataset`."""
        return _LOOP.run(
            self._async.create_per_worker_dataset(arrays, batch_size, shuffle_seed=shuffle_seed, name=name)
        )

    def close(self) -> None:
        _LOOP.run(self._async.close())

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
