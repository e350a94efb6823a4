"""`AsyncSession`: run a graph on a server, TensorFlow 1.x `Session` style, with `await`.

A session talks to one master: in this process directly when its target is a
server of this process on the same event loop (no serialisation, identical
results and errors), otherwise over the target's transport. `target=""` runs on
an implicit in-process server that listens on no port.

The graph is sent lazily: the first `run` creates the master session with the
graph as it is then, and later runs send only the nodes added since
(ExtendSession), as TensorFlow's client does.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distserver import errors
from distserver.cluster import coerce_proto
from distserver.graph import Graph, Operation, Tensor, get_default_graph
from distserver.protos import master_pb2 as m
from distserver.protos.config_pb2 import ConfigProto, RunMetadata, RunOptions
from distserver.protos.device_attributes_pb2 import DeviceAttributes
from distserver.runtime.clients import MasterClient, RemoteMaster
from distserver.runtime.names import canonical_tensor_name
from distserver.security import Security, from_environment
from distserver.server import AsyncServer, find_local_server
from distserver.transports import Channel, get_transport

# One implicit in-process server per event loop, for target "".
_IMPLICIT_SERVERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncServer] = (
    weakref.WeakKeyDictionary()
)


async def _implicit_server() -> AsyncServer:
    loop = asyncio.get_running_loop()
    server = _IMPLICIT_SERVERS.get(loop)
    if server is None:
        server = AsyncServer({"localhost": ["localhost:0"]}, serve=False)
        _IMPLICIT_SERVERS[loop] = server
    await server.start()
    return server


def implicit_servers() -> list[AsyncServer]:
    """The implicit in-process server of the running event loop, if it made one."""
    server = _IMPLICIT_SERVERS.get(asyncio.get_running_loop())
    return [] if server is None else [server]


def _parse_target(target: str) -> tuple[str, str]:
    scheme, sep, address = target.partition("://")
    if not sep:
        raise ValueError(
            f"Session target {target!r} is not a server address; use 'grpc://host:port' "
            "(a server's .target) or '' for an in-process session."
        )
    return scheme, address


# -- fetch structures ------------------------------------------------------------------


@dataclass
class _FetchPlan:
    tensors: list[str]  # unique canonical tensor names
    targets: list[str]  # unique op names
    rebuild: Callable[[Mapping[str, Any]], Any]


def _plan_fetches(graph: Graph, fetches: Any) -> _FetchPlan:
    tensors: dict[str, None] = {}
    targets: dict[str, None] = {}

    def leaf(fetch: Any) -> Callable[[Mapping[str, Any]], Any]:
        element = _graph_element(graph, fetch)
        if isinstance(element, Operation):
            targets[element.name] = None
            return lambda values: None
        name = element.name
        tensors[name] = None
        return lambda values: values[name]

    def walk(fetch: Any) -> Callable[[Mapping[str, Any]], Any]:
        if isinstance(fetch, (list, tuple)) and not _is_graph_element(fetch):
            parts = [walk(f) for f in fetch]
            if hasattr(fetch, "_fields"):  # namedtuple
                kind = type(fetch)
                return lambda values: kind(*(p(values) for p in parts))
            container = type(fetch)
            return lambda values: container(p(values) for p in parts)
        if isinstance(fetch, Mapping):
            items = [(k, walk(v)) for k, v in fetch.items()]
            mapping_type: Any = type(fetch)
            return lambda values: mapping_type((k, p(values)) for k, p in items)
        return leaf(fetch)

    rebuild = walk(fetches)
    return _FetchPlan(list(tensors), list(targets), rebuild)


def _is_graph_element(value: Any) -> bool:
    return isinstance(value, (Tensor, Operation)) or hasattr(value, "_as_graph_element")


def _graph_element(graph: Graph, fetch: Any) -> Tensor | Operation:
    if hasattr(fetch, "_as_graph_element"):
        fetch = fetch._as_graph_element()
    if isinstance(fetch, (Tensor, Operation)):
        if fetch.graph is not graph:
            raise ValueError(f"Fetch {fetch.name!r} is not an element of this session's graph.")
        return fetch
    if isinstance(fetch, str):
        try:
            if ":" in fetch:
                return graph.get_tensor_by_name(fetch)
            return graph.get_operation_by_name(fetch)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"Fetch argument {fetch!r} cannot be interpreted: {exc}") from None
    if fetch is None:
        raise TypeError("Fetch argument None has invalid type <class 'NoneType'>")
    raise TypeError(
        f"Fetch argument {fetch!r} has invalid type {type(fetch)}, must be a string, Tensor or Operation, "
        "or a list, tuple, namedtuple or dict of them."
    )


def _feed_items(graph: Graph, feed_dict: Mapping[Any, Any] | None) -> dict[str, np.ndarray]:
    feeds: dict[str, np.ndarray] = {}
    for key, value in (feed_dict or {}).items():
        if hasattr(key, "_as_graph_element"):
            key = key._as_graph_element()
        if isinstance(key, str):
            try:
                key = graph.get_tensor_by_name(canonical_tensor_name(key))
            except (KeyError, ValueError) as exc:
                raise ValueError(f"Cannot interpret feed_dict key {key!r}: {exc}") from None
        if not isinstance(key, Tensor):
            raise TypeError(
                f"Cannot interpret feed_dict key {key!r} as a Tensor: it is a {type(key).__name__}."
            )
        if key.graph is not graph:
            raise ValueError(f"Feed key {key.name!r} is not an element of this session's graph.")
        dtype = key.dtype
        try:
            array = np.asarray(value, dtype=None if dtype is None or dtype.kind == "O" else dtype)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"Cannot feed {value!r} to {key.name} ({dtype}): {exc}") from exc
        if key.shape is not None and not _shape_matches(key.shape, array.shape):
            raise ValueError(
                f"Cannot feed value of shape {array.shape} for Tensor {key.name!r}, "
                f"which has shape {_shape_str(key.shape)}"
            )
        feeds[key.name] = array
    return feeds


def _shape_matches(static: Sequence[int | None], actual: tuple[int, ...]) -> bool:
    return len(static) == len(actual) and all(
        s is None or s == a for s, a in zip(static, actual, strict=True)
    )


def _shape_str(shape: Sequence[int | None]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


class AsyncSession:
    """Runs graphs on a server; every method is a coroutine.

    Args:
        target: `server.target` ("grpc://host:port"), or "" for an in-process session.
        graph: The graph to run; the default graph when None.
        config: A `ConfigProto` (TensorFlow's is accepted too).
        security: TLS and/or token (`distserver.Security`) for the channel to the
            master; None: plaintext, with `DISTSERVER_AUTH_TOKEN`'s token if it is set.

    Many `run` calls may be in flight at once. Use `async with` or `await close()`.
    """

    def __init__(
        self,
        target: str = "",
        graph: Graph | None = None,
        config: Any = None,
        *,
        security: Security | None = None,
    ) -> None:
        self.target = target
        self._security = from_environment(security)
        self._graph = graph if graph is not None else get_default_graph()
        self._config = coerce_proto(config, ConfigProto) if config is not None else ConfigProto()
        if target:
            _parse_target(target)
        self._master: MasterClient | None = None
        self._channel: Channel | None = None
        self._handle: str | None = None
        self._sent_version = 0
        self._graph_version = 0
        self._lock: asyncio.Lock | None = None
        self._closed = False

    @property
    def graph(self) -> Graph:
        return self._graph

    @property
    def session_handle(self) -> str | None:
        """The master's handle for this session, once created."""
        return self._handle

    async def _connect(self) -> MasterClient:
        if self._master is not None:
            return self._master
        if not self.target:
            server = await _implicit_server()
            assert server.master is not None
            self._master = server.master
            return self._master
        scheme, address = _parse_target(self.target)
        local = find_local_server(self.target)
        if (
            local is not None
            and local.loop is asyncio.get_running_loop()
            and not self._config.rpc_options.use_rpc_for_inprocess_master
        ):
            assert local.master is not None
            self._master = local.master
        else:
            self._channel = get_transport(scheme).connect(address, security=self._security)
            self._master = RemoteMaster(self._channel)
        return self._master

    async def _ensure_session(self) -> tuple[MasterClient, str]:
        if self._closed:
            raise RuntimeError("Attempted to use a closed Session.")
        if self._lock is None:
            self._lock = asyncio.Lock()
        master = await self._connect()
        if self._handle is not None and self._graph.version == self._sent_version:
            return master, self._handle
        async with self._lock:
            version = self._graph.version
            if self._handle is None:
                request = m.CreateSessionRequest(target=self.target)
                request.graph_def.CopyFrom(self._graph.as_graph_def())
                request.config.CopyFrom(self._config)
                response = await master.call("CreateSession", request)
                self._handle = response.session_handle
                self._graph_version = response.graph_version
                self._sent_version = version
            elif version != self._sent_version:
                request_extend = m.ExtendSessionRequest(
                    session_handle=self._handle, current_graph_version=self._graph_version
                )
                request_extend.graph_def.CopyFrom(self._graph.as_graph_def(from_version=self._sent_version))
                response_extend = await master.call("ExtendSession", request_extend)
                self._graph_version = response_extend.new_graph_version
                self._sent_version = version
            return master, self._handle

    async def run(
        self,
        fetches: Any,
        feed_dict: Mapping[Any, Any] | None = None,
        options: RunOptions | None = None,
        run_metadata: RunMetadata | None = None,
    ) -> Any:
        """Run one step and return the fetched values in the structure of `fetches`.

        Args:
            fetches: A Tensor, Operation or name, or a nested list/tuple/namedtuple/dict
                of them. Operations fetch as None.
            feed_dict: Tensor (or tensor name) -> value (numpy array, scalar, list).
            options: `RunOptions` (e.g. `timeout_in_ms`).
            run_metadata: A `RunMetadata` (ours or TensorFlow's) to fill: per-node
                timings of every task with `options.trace_level` SOFTWARE_TRACE or
                FULL_TRACE, the partition graphs with `options.output_partition_graphs`.

        Raises:
            OpError: the step failed (the error names the failing node).
            TypeError, ValueError: `fetches` or `feed_dict` are malformed.
        """
        plan = _plan_fetches(self._graph, fetches)
        feeds = _feed_items(self._graph, feed_dict)
        master, handle = await self._ensure_session()
        options = self._run_options(options)
        metadata = None if run_metadata is None else RunMetadata()
        values = await master.run_step(handle, feeds, plan.tensors, plan.targets, options, metadata)
        if run_metadata is not None:
            assert metadata is not None
            run_metadata.ParseFromString(metadata.SerializeToString())  # ours or TensorFlow's class
        return plan.rebuild(values)

    def _run_options(self, options: Any) -> RunOptions | None:
        """`options` as our RunOptions, with the session's operation timeout when it sets none
        (so the RPC gets a deadline too, see `clients.rpc_deadline`)."""
        run_options: RunOptions | None = None if options is None else coerce_proto(options, RunOptions)
        timeout_ms = self._config.operation_timeout_in_ms
        if timeout_ms > 0 and (run_options is None or run_options.timeout_in_ms <= 0):
            with_timeout = RunOptions()  # never change the caller's object
            if run_options is not None:
                with_timeout.CopyFrom(run_options)
            with_timeout.timeout_in_ms = timeout_ms
            run_options = with_timeout
        return run_options

    async def make_callable(self, fetches: Any, feed_list: Sequence[Any] | None = None) -> Callable[..., Any]:
        """A coroutine function `fn(*feed_values)` running `fetches` with `feed_list` fed.

        The plan is made once on the master (MakeCallable), so repeated calls skip
        the per-step name handling.
        """
        plan = _plan_fetches(self._graph, fetches)
        feed_names = [
            (self._graph.get_tensor_by_name(canonical_tensor_name(f)) if isinstance(f, str) else f).name
            for f in (feed_list or [])
        ]
        master, handle = await self._ensure_session()
        request = m.MakeCallableRequest(session_handle=handle)
        request.options.feed.extend(feed_names)
        request.options.fetch.extend(plan.tensors)
        request.options.target.extend(plan.targets)
        response = await master.call("MakeCallable", request)
        callable_handle = response.handle
        feed_tensors = [self._graph.get_tensor_by_name(n) for n in feed_names]

        async def run_callable(*values: Any) -> Any:
            if len(values) != len(feed_tensors):
                raise TypeError(f"This callable takes {len(feed_tensors)} feed values, got {len(values)}")
            arrays = [np.asarray(v, dtype=t.dtype) for v, t in zip(values, feed_tensors, strict=True)]
            results = await master.run_callable(handle, callable_handle, arrays)
            return plan.rebuild(dict(zip(plan.tensors, results, strict=True)))

        return run_callable

    async def list_devices(self) -> list[DeviceAttributes]:
        """The devices this session can use (creates the session if needed)."""
        master, handle = await self._ensure_session()
        response = await master.call("ListDevices", m.ListDevicesRequest(session_handle=handle))
        return [*response.local_device, *response.remote_device]

    async def close(self) -> None:
        """Close the session on the master and release the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._handle is not None and self._master is not None:
                try:
                    await self._master.call(
                        "CloseSession", m.CloseSessionRequest(session_handle=self._handle)
                    )
                except (errors.AbortedError, errors.UnavailableError):
                    pass  # the master restarted, was reset or is gone: nothing left to close
        finally:
            if self._channel is not None:
                await self._channel.close()

    @staticmethod
    async def reset(target: str, containers: Sequence[str] | None = None, config: Any = None) -> None:
        """Clear resource containers (variables) on every task and close all sessions."""
        session = AsyncSession(target, graph=Graph(), config=config)
        try:
            master = await session._connect()
            await master.call("Reset", m.ResetRequest(container=list(containers or [])))
        finally:
            await session.close()

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
