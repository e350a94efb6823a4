"""`AsyncClusterCoordinator`: schedule steps over the workers of a cluster, and survive them.

TensorFlow 2's `tf.distribute.experimental.coordinator.ClusterCoordinator` for
distserver's TF 1.x-style graphs. The coordinator holds one `AsyncSession` per
worker task, whose master is that worker and whose `ConfigProto.device_filters`
name only that worker and the other jobs (`/job:ps`, ...): a node placed on the
partial device `/job:worker` runs on the worker that runs the step, as in TF 1.x
between-graph replication, while `/job:ps` variables are shared by every worker.

Scheduling: `schedule(fetches, feed_dict)` queues a step and returns a
`RemoteValue` at once; the step goes to an available worker with the fewest
steps in flight (at most `max_in_flight_per_worker` each; ties go to the worker
that was given a step longest ago, so steps spread over the workers).

Failures, and what is retried:

* A worker that dies or hangs: every step in flight on it fails (its RPC fails,
  or the step's deadline passes: each step runs with `RunOptions.timeout_in_ms`
  = `step_timeout`, and the RunStep RPC with a little more). The coordinator then
  probes the worker (`GetStatus`, at most `probe_timeout` seconds); a worker that
  does not answer, or that answers but lost the step's session (it restarted),
  is marked unavailable and its steps go back to the front of the queue for the
  other workers. Steps are therefore run **at least once**: a step that was cut
  off may already have updated variables on the ps (all, some or none of its
  updates) before it runs again elsewhere, and a hung worker that wakes up may
  still finish the steps it had. Asynchronous training tolerates this; a step
  that must not repeat needs its own guard (e.g. a step counter on the ps). A
  step whose worker failed 2 x (number of workers) times fails with the last
  error instead of going round again.
* An unavailable worker is probed every `probe_interval` seconds; once it
  answers it gets a new session, its per-worker set-up is run again (the
  shards of `create_per_worker_dataset`), and it takes steps again.
* A failure of another task (a ps: errors that say `From /job:ps/...`, or a
  worker that answers its probe) is the step's own error: it goes to the
  `RemoteValue` as the `OpError` it is (`UnavailableError` for a ps that is
  gone), and is not retried. So are the step's own errors
  (`InvalidArgumentError`, ...) and errors raised on the client (`ValueError`
  and `TypeError` for bad fetches or feeds, and whatever a feed function
  raises).
* When no worker has been available for `worker_wait_timeout` seconds, the
  queued steps fail with `UnavailableError` instead of waiting forever.

`join()` waits until every scheduled step has finished, then raises the first
error a step ended with since the previous `join()` (each step's own error is
also in its `RemoteValue`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distserver import errors
from distserver.cluster import ClusterSpec, coerce_proto
from distserver.graph import (
    Graph,
    GraphKeys,
    Operation,
    Tensor,
    Variable,
    cast,
    floormod,
    gather,
    get_default_graph,
    group,
    int64,
    name_scope,
    placeholder,
    shape,
)
from distserver.graph import range as graph_range
from distserver.protos import worker_pb2 as w
from distserver.protos.config_pb2 import ConfigProto, RunOptions
from distserver.runtime.clients import RemoteWorker
from distserver.runtime.concurrency import gather_all
from distserver.security import Security, from_environment
from distserver.session import AsyncSession
from distserver.transports import Channel, get_transport

logger = logging.getLogger("distserver.coordinator")

WORKER_JOB = "worker"

# Errors after which the worker itself may be at fault (it died, hung or restarted);
# the coordinator probes it to decide.
_MAYBE_WORKER_FAILURE = (
    errors.UnavailableError,
    errors.DeadlineExceededError,
    errors.AbortedError,
    errors.CancelledError,
)


# A step whose worker failed this many times per worker of the cluster fails with the
# last error instead of being rescheduled again.
_MAX_ATTEMPTS_PER_WORKER = 2


class RemoteValue:
    """The result of a scheduled step: `await value`, or `value.fetch()` from a thread.

    Attributes:
        worker: The index (in the cluster's "worker" job) of the worker that ran the
            step, once it has finished; None before, and when it failed.
        attempts: How many times the step was dispatched (more than 1 when a worker
            failed while running it).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._future: asyncio.Future[Any] = loop.create_future()
        self.worker: int | None = None
        self.attempts = 0

    def done(self) -> bool:
        """True once the step has a result or an error."""
        return self._future.done()

    def _set_result(self, result: Any, worker: int) -> None:
        if not self._future.done():
            self.worker = worker
            self._future.set_result(result)

    def _set_exception(self, exc: BaseException) -> None:
        if not self._future.done():
            self._future.set_exception(exc)
            self._future.exception()  # the error is also kept by the coordinator for join()

    async def _wait(self) -> Any:
        return await asyncio.shield(self._future)

    def __await__(self) -> Any:
        return self._wait().__await__()

    def fetch(self, timeout: float | None = None) -> Any:
        """Block until the step has run and return its fetched values (or raise its error).

        Call it from any thread but the coordinator's event loop (there, `await` the
        value instead).

        Raises:
            TimeoutError: `timeout` seconds passed first.
        """
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise RuntimeError(
                "RemoteValue.fetch() blocks, and was called on the coordinator's own event loop; "
                "use `await value` there."
            )
        future = asyncio.run_coroutine_threadsafe(self._wait(), self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"The step did not finish within {timeout} s.") from None

    def __repr__(self) -> str:
        if not self._future.done():
            state = "pending"
        elif self._future.exception() is not None:
            state = f"failed: {type(self._future.exception()).__name__}"
        else:
            state = f"done on worker {self.worker}"
        return f"<RemoteValue {state}>"


@dataclass
class _Step:
    fetches: Any
    feed_dict: Mapping[Any, Any] | Callable[[int], Mapping[Any, Any]] | None
    value: RemoteValue


@dataclass
class _Worker:
    index: int
    task: str  # "/job:worker/replica:0/task:<index>"
    address: str
    session: AsyncSession
    available: bool = True
    generation: int = 0  # bumped on each re-admission; steps of an older one are stale
    in_flight: int = 0
    last_dispatch: int = -1
    probe_channel: Channel | None = None
    sessions_to_close: list[AsyncSession] = field(default_factory=list)


# A per-worker set-up step: run on a worker's session when the coordinator starts
# using it and again each time the worker is re-admitted.
_SetUp = Callable[[AsyncSession, int], Coroutine[Any, Any, None]]


class AsyncClusterCoordinator:
    """Runs steps of one graph on the workers of a cluster, asynchronously, tolerating failures.

    Args:
        cluster: The cluster (`ClusterSpec`, dict, `ClusterDef`), with a "worker" job;
            its other jobs (e.g. "ps") are shared by every worker.
        graph: The graph whose steps are scheduled (the default graph when None).
        protocol: The transport of the coordinator's connections to the workers.
        config: A `ConfigProto` for every worker session; must not set
            `device_filters` (the coordinator sets them).
        security: TLS and/or token (`distserver.Security`) for those connections.
        max_in_flight_per_worker: At most this many steps run on a worker at once.
        step_timeout: Each step's deadline in seconds (`RunOptions.timeout_in_ms`):
            how long a hung worker can hold a step before it is probed. None: no
            deadline (a hung peer is then found by the channels' keepalive pings,
            ~10 s).
        probe_timeout: How long a worker may take to answer a probe (`GetStatus`).
        probe_interval: How often an unavailable worker is probed.
        worker_wait_timeout: Fail the queued steps with `UnavailableError` once no
            worker has been available for this many seconds.

    Create it and call its methods on one event loop; use `async with` or
    `await close()`. See the module docstring for what is retried.
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
        spec = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
        if WORKER_JOB not in spec.jobs:
            raise ValueError(
                f"The cluster has no {WORKER_JOB!r} job (jobs: {', '.join(spec.jobs) or 'none'}); "
                "the coordinator schedules steps on the tasks of the 'worker' job."
            )
        indices = spec.task_indices(WORKER_JOB)
        if indices != list(range(len(indices))):
            raise ValueError(
                f"The coordinator needs worker tasks 0..n-1; this cluster's are {indices}. "
                "List the workers as a list of addresses."
            )
        if max_in_flight_per_worker < 1:
            raise ValueError(f"max_in_flight_per_worker must be at least 1, got {max_in_flight_per_worker}.")
        if step_timeout is not None and step_timeout <= 0:
            raise ValueError(f"step_timeout must be positive or None, got {step_timeout}.")
        self._base_config = coerce_proto(config, ConfigProto) if config is not None else ConfigProto()
        if len(self._base_config.device_filters):
            raise ValueError(
                "config.device_filters is set by the coordinator (each worker session sees its own "
                "worker and the other jobs); leave it empty."
            )
        get_transport(protocol)  # NotFoundError naming the protocols there are
        self._spec = spec
        self._graph = graph if graph is not None else get_default_graph()
        self._protocol = protocol
        self._security = from_environment(security)
        self._shared_jobs = [job for job in spec.jobs if job != WORKER_JOB]
        self.max_in_flight_per_worker = max_in_flight_per_worker
        self.step_timeout = step_timeout
        self.probe_timeout = probe_timeout
        self.probe_interval = probe_interval
        self.worker_wait_timeout = worker_wait_timeout
        self._workers: list[_Worker] = []
        for index in spec.task_indices(WORKER_JOB):
            address = spec.task_address(WORKER_JOB, index)
            worker = _Worker(
                index,
                f"/job:{WORKER_JOB}/replica:0/task:{index}",
                address,
                self._new_session_for(index, address),
            )
            self._workers.append(worker)
        self._run_options: RunOptions | None = None
        if step_timeout is not None:
            self._run_options = RunOptions(timeout_in_ms=max(1, round(step_timeout * 1000)))
        self._pending: collections.deque[_Step] = collections.deque()
        self._in_flight = 0
        self._dispatch_count = itertools.count()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._set_ups: list[_SetUp] = []
        self._first_error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Event | None = None
        self._no_worker_since: float | None = None
        self._closed = False

    # -- public -----------------------------------------------------------------------

    @property
    def graph(self) -> Graph:
        return self._graph

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def available_workers(self) -> list[int]:
        """Indices of the workers that currently take steps."""
        return [worker.index for worker in self._workers if worker.available]

    def schedule(
        self,
        fetches: Any,
        feed_dict: Mapping[Any, Any] | Callable[[int], Mapping[Any, Any]] | None = None,
    ) -> RemoteValue:
        """Queue one step (as `Session.run(fetches, feed_dict)`) and return its `RemoteValue` at once.

        Args:
            fetches: What to fetch, as for `AsyncSession.run`.
            feed_dict: A feed dict, or a function `f(worker_index) -> feed dict` called
                (in a thread) when the step is dispatched, on each attempt.

        Must be called on the coordinator's event loop.
        """
        loop = self._check_loop()
        if self._closed:
            raise RuntimeError("The coordinator is closed; create a new one to schedule steps.")
        step = _Step(fetches, feed_dict, RemoteValue(loop))
        self._pending.append(step)
        self._state_changed()
        self._dispatch()
        return step.value

    def done(self) -> bool:
        """True when no scheduled step is queued or running."""
        return not self._pending and self._in_flight == 0

    async def join(self) -> None:
        """Wait until every scheduled step has finished; returns at once with nothing scheduled.

        Raises:
            The first error a step ended with since the previous `join()` (each step's
            error is also in its `RemoteValue`).
        """
        self._check_loop()
        assert self._idle is not None
        while not self.done():
            await self._idle.wait()
        error, self._first_error = self._first_error, None
        if error is not None:
            raise error

    async def run_on_every_worker(
        self, fetches: Any, feed_dict: Callable[[int], Mapping[Any, Any]] | None = None
    ) -> list[Any]:
        """Run one step on every available worker now (not queued); results by worker.

        Unavailable workers (and workers found lost during the call) get None; any
        other error is raised (and cancels the other workers' steps).
        """
        self._check_loop()
        workers = [worker for worker in self._workers if worker.available]

        async def run(worker: _Worker) -> Any:
            feed = None if feed_dict is None else await asyncio.to_thread(feed_dict, worker.index)
            try:
                return await worker.session.run(fetches, feed, options=self._run_options)
            except errors.OpError as exc:
                if await self._is_worker_failure(worker, worker.generation, exc):
                    self._lose_worker(worker, worker.generation, exc)
                    return None
                raise

        results: list[Any] = [None] * len(self._workers)
        values = await gather_all(run(worker) for worker in workers)
        for worker, value in zip(workers, values, strict=True):
            results[worker.index] = value
        return results

    async def create_per_worker_dataset(
        self,
        arrays: np.ndarray | Sequence[np.ndarray],
        batch_size: int,
        *,
        shuffle_seed: int | None = 0,
        name: str = "per_worker_dataset",
    ) -> PerWorkerDataset:
        """Give each worker its own shard of `arrays`, kept on that worker; see `PerWorkerDataset`.

        Args:
            arrays: One numpy array, or a sequence of arrays with the same first
                dimension (e.g. features and labels).
            batch_size: Rows per batch.
            shuffle_seed: Rows are shuffled once with this seed before sharding
                (None: keep their order).
            name: Name scope of the dataset's nodes.

        Returns:
            A `PerWorkerDataset`, whose `batch` tensors (one per array) read the next
            batch of the running worker's shard; use them in the model.
        """
        self._check_loop()
        dataset = PerWorkerDataset(self._graph, arrays, batch_size, self.num_workers, shuffle_seed, name)
        self._set_ups.append(dataset._fill)
        await asyncio.gather(*(self._set_up(worker) for worker in self._workers if worker.available))
        return dataset

    async def close(self) -> None:
        """Cancel what has not run (its `RemoteValue`s get `CancelledError`) and close the sessions."""
        if self._closed:
            return
        self._closed = True
        cancelled = errors.CancelledError("The coordinator was closed before this step finished.")
        while self._pending:
            self._pending.popleft().value._set_exception(cancelled)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sessions = [worker.session for worker in self._workers]
        sessions += [s for worker in self._workers for s in worker.sessions_to_close]
        await asyncio.gather(*(self._close_session(session) for session in sessions))
        await asyncio.gather(
            *(worker.probe_channel.close() for worker in self._workers if worker.probe_channel is not None),
            return_exceptions=True,
        )
        self._state_changed()

    async def __aenter__(self) -> AsyncClusterCoordinator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- scheduling -------------------------------------------------------------------

    def _check_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._idle = asyncio.Event()
        elif self._loop is not loop:
            raise RuntimeError(
                "The coordinator is used on one event loop only (the one it was first used on)."
            )
        return loop

    def _state_changed(self) -> None:
        if self._idle is None:
            return
        if self.done() or self._closed:
            self._idle.set()
        else:
            self._idle.clear()

    def _dispatch(self) -> None:
        while self._pending and not self._closed:
            idle = [
                worker
                for worker in self._workers
                if worker.available and worker.in_flight < self.max_in_flight_per_worker
            ]
            if not idle:
                return
            worker = min(idle, key=lambda wk: (wk.in_flight, wk.last_dispatch))
            step = self._pending.popleft()
            worker.in_flight += 1
            worker.last_dispatch = next(self._dispatch_count)
            self._in_flight += 1
            self._spawn(self._run(step, worker, worker.generation, worker.session))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, step: _Step, worker: _Worker, generation: int, session: AsyncSession) -> None:
        value = step.value
        value.attempts += 1
        requeued = False
        try:
            feed = step.feed_dict
            if callable(feed):
                feed = await asyncio.to_thread(feed, worker.index)
            result = await session.run(step.fetches, feed, options=self._run_options)
        except asyncio.CancelledError:
            value._set_exception(
                errors.CancelledError("The coordinator was closed before this step finished.")
            )
            raise
        except errors.OpError as exc:
            if await self._is_worker_failure(worker, generation, exc):
                self._lose_worker(worker, generation, exc)
                if value.attempts >= _MAX_ATTEMPTS_PER_WORKER * len(self._workers):
                    self._fail(value, exc)  # it brought down worker after worker: stop
                elif not self._closed:
                    self._pending.appendleft(step)  # at least once: it may have run in part
                    requeued = True
            else:
                self._fail(value, exc)
        except Exception as exc:  # the step's own error on the client: bad fetches, feeds, feed function
            self._fail(value, exc)
        else:
            value._set_result(result, worker.index)
        finally:
            worker.in_flight -= 1
            self._in_flight -= 1
            if requeued:
                logger.info("Rescheduling a step that %s did not finish", worker.task)
            if not self._closed:
                self._dispatch()
            self._state_changed()

    def _fail(self, value: RemoteValue, exc: BaseException) -> None:
        value._set_exception(exc)
        if self._first_error is None:
            self._first_error = exc

    # -- failures ---------------------------------------------------------------------

    async def _is_worker_failure(self, worker: _Worker, generation: int, exc: errors.OpError) -> bool:
        if not isinstance(exc, _MAYBE_WORKER_FAILURE):
            return False
        if exc.message.startswith("From /job:") and not exc.message.startswith(f"From {worker.task}:"):
            return False  # another task (a ps) failed: the step's own error
        if not worker.available or worker.generation != generation:
            return True  # the worker was already found lost while this step ran
        if not await self._probe(worker):
            return True
        # It answers. A lost session means it restarted: give it a new one.
        return isinstance(exc, errors.AbortedError)

    async def _probe(self, worker: _Worker) -> bool:
        if worker.probe_channel is None:
            worker.probe_channel = get_transport(self._protocol).connect(
                worker.address, security=self._security
            )
        try:
            await RemoteWorker(worker.probe_channel).call(
                "GetStatus", w.GetStatusRequest(), timeout=self.probe_timeout
            )
        except errors.OpError as exc:
            logger.debug("probe of %s failed: %s", worker.task, exc)
            return False
        return True

    def _lose_worker(self, worker: _Worker, generation: int, exc: BaseException) -> None:
        if not worker.available or worker.generation != generation or self._closed:
            return
        worker.available = False
        logger.warning(
            "Worker %s is unavailable (%s: %s); its steps go to the other workers",
            worker.task,
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        worker.sessions_to_close.append(worker.session)
        if not any(wk.available for wk in self._workers) and self._no_worker_since is None:
            self._no_worker_since = asyncio.get_running_loop().time()
        self._spawn(self._readmit(worker))

    async def _readmit(self, worker: _Worker) -> None:
        """Probe `worker` until it answers, then give it a new session and steps again."""
        loop = asyncio.get_running_loop()
        while not self._closed:
            await asyncio.sleep(self.probe_interval)
            self._fail_queue_if_no_worker(loop.time())
            if not await self._probe(worker):
                continue
            old_sessions, worker.sessions_to_close = worker.sessions_to_close, []
            for old in old_sessions:
                self._spawn(self._close_session(old))
            worker.session = self._new_session_for(worker.index, worker.address)
            worker.generation += 1
            try:
                await self._set_up(worker, raise_worker_failure=True)
            except errors.OpError as exc:
                logger.info("Worker %s answers but its set-up failed (%s); trying again", worker.task, exc)
                worker.sessions_to_close.append(worker.session)
                continue
            worker.available = True
            self._no_worker_since = None
            logger.warning("Worker %s is available again", worker.task)
            self._dispatch()
            self._state_changed()
            return

    def _fail_queue_if_no_worker(self, now: float) -> None:
        since = self._no_worker_since
        if since is None or now - since < self.worker_wait_timeout or not self._pending:
            return
        lost = ", ".join(worker.task for worker in self._workers)
        error = errors.UnavailableError(
            f"No worker has been available for {self.worker_wait_timeout:g} s ({lost} do not answer); "
            "the queued steps were not run."
        )
        while self._pending:
            self._fail(self._pending.popleft().value, error)
        self._state_changed()

    async def _set_up(self, worker: _Worker, *, raise_worker_failure: bool = False) -> None:
        """Run the per-worker set-up steps (dataset shards) on `worker`'s session."""
        generation = worker.generation
        for set_up in self._set_ups:
            try:
                await set_up(worker.session, worker.index)
            except errors.OpError as exc:
                if raise_worker_failure or not await self._is_worker_failure(worker, generation, exc):
                    raise
                self._lose_worker(worker, generation, exc)
                return

    def _new_session_for(self, index: int, address: str) -> AsyncSession:
        config = ConfigProto()
        config.CopyFrom(self._base_config)
        config.device_filters.extend([f"/job:{job}" for job in self._shared_jobs])
        config.device_filters.append(f"/job:{WORKER_JOB}/task:{index}")
        return AsyncSession(f"{self._protocol}://{address}", self._graph, config, security=self._security)

    async def _close_session(self, session: AsyncSession) -> None:
        # A hung worker would hold CloseSession forever; the server's session GC
        # closes what this leaves behind.
        try:
            await asyncio.wait_for(session.close(), timeout=self.probe_timeout)
        except (errors.OpError, TimeoutError, OSError):
            pass


class PerWorkerDataset:
    """Each worker's own shard of numpy arrays, stored in variables on that worker.

    The rows are (optionally) shuffled once, split into one contiguous shard per
    worker, and each shard is sent once to its worker, where it is kept in local
    variables (collection `local_variables`) placed on `/job:worker` — which, in the
    coordinator's sessions, is the worker running the step. A step that uses
    `batch` reads the next `batch_size` rows of its own worker's shard there (a
    cursor variable on the worker, advanced atomically, wrapping around at the end
    of the shard): no batch passes through the coordinator or a master's RunStep.
    A worker that is re-admitted after a failure gets its shard again (its
    cursor starts over). While a worker is unavailable its shard is not read.

    Attributes:
        batch: One batch tensor per array (a tuple; shape `[batch_size, ...]`).
        shard_sizes: Rows in each worker's shard.
    """

    def __init__(
        self,
        graph: Graph,
        arrays: np.ndarray | Sequence[np.ndarray],
        batch_size: int,
        num_workers: int,
        shuffle_seed: int | None,
        name: str,
    ) -> None:
        components = (
            [np.asarray(arrays)] if isinstance(arrays, np.ndarray) else [np.asarray(a) for a in arrays]
        )
        if not components or any(c.ndim == 0 for c in components):
            raise ValueError(
                "arrays must be a numpy array or a sequence of arrays with a first (row) dimension."
            )
        rows = len(components[0])
        if any(len(c) != rows for c in components):
            raise ValueError(
                f"Every array needs the same number of rows; got {[len(c) for c in components]}."
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        if rows < num_workers:
            raise ValueError(f"{rows} rows cannot be sharded over {num_workers} workers.")
        if shuffle_seed is not None:
            order = np.random.default_rng(shuffle_seed).permutation(rows)
            components = [c[order] for c in components]
        bounds = np.linspace(0, rows, num_workers + 1).astype(int)
        self._shards = [[c[bounds[i] : bounds[i + 1]] for c in components] for i in range(num_workers)]
        self.shard_sizes = [int(bounds[i + 1] - bounds[i]) for i in range(num_workers)]
        self.batch_size = batch_size
        with graph.as_default(), name_scope(name), graph.device(f"/job:{WORKER_JOB}"):
            self._feeds: list[Tensor] = []
            variables: list[Variable] = []
            for k, component in enumerate(components):
                feed = placeholder(component.dtype, shape=[None, *component.shape[1:]], name=f"shard_{k}")
                self._feeds.append(feed)
                variables.append(
                    Variable(
                        feed, name=f"component_{k}", trainable=False, collections=[GraphKeys.LOCAL_VARIABLES]
                    )
                )
            cursor = Variable(
                np.int64(0), name="cursor", trainable=False, collections=[GraphKeys.LOCAL_VARIABLES]
            )
            self._fill_op: Operation = group(
                *(v.initializer for v in variables), cursor.initializer, name="fill"
            )
            end = cursor.assign_add(np.int64(batch_size))
            rows_here = cast(shape(variables[0])[0], int64)
            indices = floormod(graph_range(batch_size, dtype=int64) + (end - batch_size), rows_here)
            self.batch: tuple[Tensor, ...] = tuple(
                gather(v, indices, name=f"batch_{k}") for k, v in enumerate(variables)
            )

    async def _fill(self, session: AsyncSession, worker_index: int) -> None:
        shard = self._shards[worker_index]
        await session.run(self._fill_op, dict(zip(self._feeds, shard, strict=True)))
