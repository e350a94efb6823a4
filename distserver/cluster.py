"""Cluster descriptions: `ClusterSpec`, `ServerDef` building, address checks, TF_CONFIG.

This module is the pure (no I/O) part of describing a cluster, with TensorFlow's
observable behaviour:

* `ClusterSpec` is `tf.train.ClusterSpec`: the same inputs, methods, equality and
  error messages.
* `make_server_def` is `tf.distribute.Server`'s `_make_server_def`: it turns a cluster
  (or a `ServerDef`) plus `job_name`/`task_index`/`protocol`/`config` into a `ServerDef`,
  inferring what TensorFlow infers.
* `parse_host_port`, `local_address` and `validate_cluster` are the checks TensorFlow's
  C++ gRPC server makes while it is constructed (`GetHostAndPort`, `ParseChannelSpec`,
  `ValidateHostPortPair`), raising the same `distserver.errors` classes with the same
  texts, so a server can fail exactly where and how TensorFlow fails.
* `TFConfigClusterResolver` reads the `TF_CONFIG` environment variable as
  `tf.distribute.cluster_resolver.TFConfigClusterResolver` does.

Everywhere a protocol buffer is accepted, TensorFlow's own message (for example a
`tf.train.ClusterDef` or `tf.compat.v1.ConfigProto` object) is accepted too: it is
converted to distserver's class through its serialized bytes (`coerce_proto`).

Example:
    >>> spec = ClusterSpec({"ps": ["ps0:2222"], "worker": ["w0:2222", "w1:2222"]})
    >>> spec.num_tasks("worker")
    2
    >>> server_def = make_server_def(spec, job_name="worker", task_index=1)
    >>> local_address(server_def)
    ('w1', 2222)
"""

from __future__ import annotations

import json
import operator
import os
import re
from collections.abc import Mapping
from typing import Any, SupportsIndex, TypeAlias, TypeVar

from google.protobuf import message as _message
from google.protobuf import text_encoding

from distserver import errors
from distserver.protos import cluster_pb2, config_pb2, tensorflow_server_pb2

__all__ = [
    "ClusterLike",
    "ClusterSpec",
    "TFConfigClusterResolver",
    "coerce_proto",
    "local_address",
    "make_server_def",
    "parse_host_port",
    "validate_cluster",
]

_MessageT = TypeVar("_MessageT", bound=_message.Message)

# TensorFlow's protos live in package "tensorflow"; ours in "distserver" (so both can be
# imported in one process). Field names and numbers are identical, so bytes convert.
_TF_PACKAGE = "tensorflow"

ClusterLike: TypeAlias = "ClusterSpec | cluster_pb2.ClusterDef | Mapping[Any, Any] | _message.Message"
"""Anything `ClusterSpec` accepts: a mapping of job names to task addresses, a
`ClusterDef` (distserver's or TensorFlow's), or another `ClusterSpec`."""


def coerce_proto(message: object, our_cls: type[_MessageT]) -> _MessageT:
    """Return `message` as an instance of distserver's protobuf class `our_cls`.

    An instance of `our_cls` is returned as is (the same object). A protobuf message of
    TensorFlow's corresponding type (same name in package `tensorflow`, for example
    `tensorflow.ServerDef` for `distserver.ServerDef`) is converted through its
    serialized bytes into a new `our_cls` object; unknown fields are kept.

    Args:
        message: The message to convert.
        our_cls: The distserver message class wanted, e.g. `cluster_pb2.ClusterDef`.

    Returns:
        `message` itself, or a new `our_cls` holding the same data.

    Raises:
        TypeError: `message` is neither an `our_cls` nor TensorFlow's equivalent.
    """
    if isinstance(message, our_cls):
        return message
    ours = our_cls.DESCRIPTOR.full_name
    theirs = _tensorflow_full_name(our_cls)
    if isinstance(message, _message.Message) and message.DESCRIPTOR.full_name in (ours, theirs):
        converted = our_cls()
        converted.ParseFromString(message.SerializeToString())
        return converted
    kind = type(message)
    raise TypeError(
        f"Expected a `{ours}` or `{theirs}` protocol buffer, got {kind.__module__}.{kind.__qualname__}"
    )


# Short name used inside this module.
_coerce = coerce_proto


def _tensorflow_full_name(our_cls: type[_message.Message]) -> str:
    descriptor = our_cls.DESCRIPTOR
    package = descriptor.file.package
    # "distserver.ConfigProto.Experimental" -> "tensorflow.ConfigProto.Experimental";
    # "distserver.error.Code" -> "tensorflow.error.Code".
    _, dot, sub_package = package.partition(".")
    relative = descriptor.full_name[len(package) + 1 :]
    return f"{_TF_PACKAGE}{dot}{sub_package}.{relative}"


def _is_tensorflow_message(value: object, our_cls: type[_message.Message]) -> bool:
    return isinstance(value, _message.Message) and value.DESCRIPTOR.full_name == _tensorflow_full_name(
        our_cls
    )


def _as_bytes(value: object) -> bytes:
    # tensorflow.python.util.compat.as_bytes: bytes-like or text, nothing else.
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError(f"Expected binary or unicode string, got {value!r}")


def _task_index(job_name: object, key: object) -> int:
    # Newer TensorFlow applies int() to sparse task keys so that TF_CONFIG's JSON
    # (whose object keys are always strings) works: {"worker": {"1": "w1:2222"}}.
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            pass
    elif isinstance(key, SupportsIndex):
        return operator.index(key)
    raise TypeError(
        f"Task index {key!r} in job {job_name!r} must be an integer, or a string holding one "
        f'(as in TF_CONFIG JSON: {{"1": "host:port"}})'
    )


class ClusterSpec:
    """Represents a cluster as a set of "tasks", organized into "jobs".

    This is `tf.train.ClusterSpec`. A job is a named set of tasks; a task is one
    process, identified by its job name and task index and reached at a
    `"host:port"` address. Task indices may be sparse.

    Args:
        cluster: One of

            * a dictionary mapping each job name to a list (or tuple) of network
              addresses, or to a dictionary from task index to address (indices may
              be sparse; string keys such as `"1"` from TF_CONFIG JSON are converted
              with `int()`);
            * a `ClusterDef` protocol buffer, distserver's or TensorFlow's (a
              distserver `ClusterDef` is kept, not copied: `as_cluster_def()` returns
              that very object);
            * another `ClusterSpec` (copied).

    Raises:
        TypeError: `cluster` is none of the above, or holds a job name, task index or
            task address of the wrong type. The messages are TensorFlow's.

    Example:
        >>> spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"], "ps": {3: "ps3:2222"}})
        >>> spec.jobs
        ['worker', 'ps']
        >>> spec.as_dict()
        {'worker': ['w0:2222', 'w1:2222'], 'ps': {3: 'ps3:2222'}}
        >>> spec == {"worker": {0: "w0:2222", 1: "w1:2222"}, "ps": {3: "ps3:2222"}}
        True
    """

    # `__eq__` compares with plain dictionaries too, so a ClusterSpec cannot be hashed
    # consistently; TensorFlow's is unhashable as well.
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, cluster: ClusterLike) -> None:
        # job name -> {task index -> address}, jobs in input order.
        self._cluster_spec: dict[Any, dict[int, Any]]
        self._cluster_def: cluster_pb2.ClusterDef
        if isinstance(cluster, Mapping):
            self._cluster_spec = {}
            for job_name, tasks in cluster.items():
                if isinstance(tasks, (list, tuple)):
                    job_tasks = dict(enumerate(tasks))
                elif isinstance(tasks, Mapping):
                    job_tasks = {_task_index(job_name, i): task for i, task in tasks.items()}
                else:
                    raise TypeError(
                        f"The tasks for job {job_name!r} must be a list or a dictionary "
                        "from integers to strings."
                    )
                self._cluster_spec[job_name] = job_tasks
            self._cluster_def = self._make_cluster_def()
        elif isinstance(cluster, cluster_pb2.ClusterDef):
            self._cluster_def = cluster
            self._cluster_spec = self._spec_from_cluster_def(cluster)
        elif isinstance(cluster, ClusterSpec):
            self._cluster_def = cluster_pb2.ClusterDef()
            self._cluster_def.MergeFrom(cluster.as_cluster_def())
            self._cluster_spec = self._spec_from_cluster_def(self._cluster_def)
        elif _is_tensorflow_message(cluster, cluster_pb2.ClusterDef):
            self._cluster_def = _coerce(cluster, cluster_pb2.ClusterDef)
            self._cluster_spec = self._spec_from_cluster_def(self._cluster_def)
        else:
            raise TypeError(
                "`cluster` must be a dictionary mapping one or more job names to lists "
                "of network addresses, or a `ClusterDef` protocol buffer"
            )

    @staticmethod
    def _spec_from_cluster_def(cluster_def: cluster_pb2.ClusterDef) -> dict[Any, dict[int, Any]]:
        # A repeated job name keeps its last JobDef, as in TensorFlow.
        return {job_def.name: dict(sorted(job_def.tasks.items())) for job_def in cluster_def.job}

    def _make_cluster_def(self) -> cluster_pb2.ClusterDef:
        cluster_def = cluster_pb2.ClusterDef()
        # Jobs and tasks sorted, so that equal dictionaries give identical protobufs.
        for job_name, tasks in sorted(self._cluster_spec.items()):
            try:
                name = _as_bytes(job_name)
            except TypeError:
                raise TypeError(f"Job name {job_name!r} must be bytes or unicode") from None
            job_def = cluster_def.job.add()
            job_def.name = name  # type: ignore[assignment]
            for i, task_address in sorted(tasks.items()):
                try:
                    address = _as_bytes(task_address)
                except TypeError:
                    raise TypeError(f"Task address {task_address!r} must be bytes or unicode") from None
                job_def.tasks[i] = address  # type: ignore[assignment]
        return cluster_def

    def __bool__(self) -> bool:
        """Whether the cluster has at least one job."""
        return bool(self._cluster_spec)

    def __eq__(self, other: object) -> bool:
        """Compare the `{job: {task_index: address}}` dictionaries.

        `other` may be another `ClusterSpec` or a plain dictionary of that shape
        (task lists are *not* equal to it: compare with `as_dict()` for those).
        """
        return self._cluster_spec == other

    def __ne__(self, other: object) -> bool:
        return self._cluster_spec != other

    def __repr__(self) -> str:
        key_values = self.as_dict()
        items = [repr(job) + ": " + repr(key_values[job]) for job in sorted(key_values)]
        return "ClusterSpec({" + ", ".join(items) + "})"

    def as_dict(self) -> dict[str, list[str | None] | dict[int, str]]:
        """Return the cluster as a dictionary from job name to its tasks.

        A job whose task indices are exactly `0 .. n-1` maps to the list of its
        addresses; a job with sparse indices maps to a `{task_index: address}`
        dictionary; a job with no tasks maps to `{}`.

        Returns:
            A new dictionary, jobs in `jobs` order. `ClusterSpec(spec.as_dict())`
            equals `spec`.
        """
        result: dict[str, list[str | None] | dict[int, str]] = {}
        for job in self.jobs:
            task_indices = self.task_indices(job)
            if not task_indices:
                result[job] = {}
            elif task_indices[0] == 0 and task_indices[-1] + 1 == len(task_indices):
                # TensorFlow tests only `max + 1 == len`, which also holds for some
                # negative indices (e.g. [-1, 1]) and then loses tasks; those stay sparse.
                result[job] = self.job_tasks(job)
            else:
                result[job] = {i: self.task_address(job, i) for i in task_indices}
        return result

    def as_cluster_def(self) -> cluster_pb2.ClusterDef:
        """Return the cluster as a `ClusterDef` protocol buffer.

        For dictionary input, jobs and tasks are sorted. The same object is returned on
        every call (and for `ClusterDef` input it is the object given): copy it before
        changing it.
        """
        return self._cluster_def

    @property
    def jobs(self) -> list[str]:
        """The job names, in the order of the input (not sorted)."""
        return list(self._cluster_spec.keys())

    def _job(self, job_name: str) -> dict[int, Any]:
        try:
            return self._cluster_spec[job_name]
        except KeyError:
            raise ValueError(f"No such job in cluster: {job_name!r}") from None

    def num_tasks(self, job_name: str) -> int:
        """Return the number of tasks in job `job_name`.

        Raises:
            ValueError: There is no such job.
        """
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """Return the sorted task indices of job `job_name`.

        Raises:
            ValueError: There is no such job.
        """
        return sorted(self._job(job_name).keys())

    def task_address(self, job_name: str, task_index: int) -> str:
        """Return the address of task `task_index` of job `job_name`.

        Raises:
            ValueError: There is no such job, or no such task in it.
        """
        job = self._job(job_name)
        try:
            address: str = job[task_index]
        except KeyError:
            raise ValueError(f"No task with index {task_index!r} in job {job_name!r}") from None
        return address

    def job_tasks(self, job_name: str) -> list[str | None]:
        """Return the addresses of job `job_name`'s tasks, indexed by task index.

        The list has `max(task_indices) + 1` entries; indices with no task (sparse
        jobs) hold `None`.

        Raises:
            ValueError: There is no such job, or the job has no tasks.
        """
        job = self._job(job_name)
        result: list[str | None] = [None for _ in range(max(job.keys()) + 1)]
        for i, task in job.items():
            result[i] = task
        return result


def make_server_def(
    server_or_cluster_def: tensorflow_server_pb2.ServerDef | ClusterLike,
    job_name: str | None = None,
    task_index: int | None = None,
    protocol: str | None = None,
    config: config_pb2.ConfigProto | _message.Message | None = None,
) -> tensorflow_server_pb2.ServerDef:
    """Build the `ServerDef` for one task, as `tf.distribute.Server` does.

    Given a `ServerDef`, it is copied and each argument that is not `None` overrides
    its field; nothing is checked and no protocol is defaulted. Given anything
    `ClusterSpec` accepts, the missing arguments are inferred: `job_name` when the
    cluster has exactly one job, `task_index` when that job has exactly one task (its
    index, which need not be 0), and `protocol` defaults to `"grpc"`. The `port` and
    `cluster_device_filters` fields are never set.

    Args:
        server_or_cluster_def: A `ServerDef` (distserver's or TensorFlow's), or a
            cluster in any form `ClusterSpec` accepts.
        job_name: This task's job.
        task_index: This task's index in its job.
        protocol: The transport protocol, e.g. `"grpc"` or `"grpc+verbs"`.
        config: A `ConfigProto` (distserver's or TensorFlow's) merged into the
            `default_session_config`.

    Returns:
        A new `ServerDef`.

    Raises:
        TypeError: `server_or_cluster_def` is neither a `ServerDef` nor a cluster, or
            `config` is not a `ConfigProto`.
        ValueError: `job_name` or `task_index` is needed but cannot be inferred, or
            `job_name` names no job of the cluster while `task_index` is `None`.
    """
    server_def = tensorflow_server_pb2.ServerDef()
    if isinstance(server_or_cluster_def, tensorflow_server_pb2.ServerDef) or _is_tensorflow_message(
        server_or_cluster_def, tensorflow_server_pb2.ServerDef
    ):
        server_def.MergeFrom(_coerce(server_or_cluster_def, tensorflow_server_pb2.ServerDef))
        if job_name is not None:
            server_def.job_name = job_name
        if task_index is not None:
            server_def.task_index = task_index
        if protocol is not None:
            server_def.protocol = protocol
    else:
        try:
            cluster_spec = ClusterSpec(server_or_cluster_def)
        except TypeError as exc:
            raise TypeError(
                "Could not convert `server_or_cluster_def` to a "
                "`tf.train.ServerDef` or `tf.train.ClusterSpec`."
            ) from exc
        if job_name is None:
            if len(cluster_spec.jobs) == 1:
                job_name = cluster_spec.jobs[0]
            else:
                raise ValueError("Must specify an explicit `job_name`.")
        if task_index is None:
            task_indices = cluster_spec.task_indices(job_name)
            if len(task_indices) == 1:
                task_index = task_indices[0]
            else:
                raise ValueError("Must specify an explicit `task_index`.")
        if protocol is None:
            protocol = "grpc"
        server_def = tensorflow_server_pb2.ServerDef(
            cluster=cluster_spec.as_cluster_def(),
            job_name=job_name,
            task_index=task_index,
            protocol=protocol,
        )
    if config is not None:
        server_def.default_session_config.MergeFrom(_coerce(config, config_pb2.ConfigProto))
    return server_def


# C's isspace() in the "C" locale, and ASCII digits only (str.isdigit accepts more).
_UINT_TEXT = re.compile(r"[ \t\n\v\f\r]*([0-9]+)[ \t\n\v\f\r]*")
_INT_TEXT = re.compile(r"[ \t\n\v\f\r]*(-?[0-9]+)[ \t\n\v\f\r]*")
_UINT32_MAX = 2**32 - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _parse_uint32(text: str) -> int | None:
    # TensorFlow's strings::safe_strtou32: surrounding spaces allowed, no sign.
    match = _UINT_TEXT.fullmatch(text)
    if match is None:
        return None
    value = int(match.group(1))
    return value if value <= _UINT32_MAX else None


def _parse_int32(text: str) -> int | None:
    # TensorFlow's strings::safe_strto32: surrounding spaces and a '-' allowed, no '+'.
    match = _INT_TEXT.fullmatch(text)
    if match is None:
        return None
    value = int(match.group(1))
    return value if _INT32_MIN <= value <= _INT32_MAX else None


def parse_host_port(address: str) -> tuple[str, int]:
    """Split a task address into host and port, accepting what TensorFlow accepts.

    The rules are those of TensorFlow's `ValidateHostPortPair`: the text after the
    *last* `":"` must be an unsigned 32-bit decimal number (surrounding whitespace
    allowed), and the text before it must not contain `"/"`. Hosts are not checked
    further, so an IPv6 address in brackets keeps them: `"[::1]:2222"` gives
    `("[::1]", 2222)`. An address without a colon is all port: `"2222"` gives
    `("", 2222)`. The port is not range-checked beyond 32 bits.

    Args:
        address: A task address such as `"localhost:2222"`.

    Returns:
        `(host, port)`.

    Raises:
        distserver.errors.InvalidArgumentError: `Could not interpret "<address>" as a
            host-port pair.`
    """
    host, _, port_text = address.rpartition(":")
    port = _parse_uint32(port_text)
    if port is None or "/" in host:
        raise errors.InvalidArgumentError(f'Could not interpret "{address}" as a host-port pair.')
    return host, port


def local_address(server_def: tensorflow_server_pb2.ServerDef | _message.Message) -> tuple[str, int]:
    """Return the host name and requested port of the task `server_def` describes.

    This is TensorFlow's `GrpcServer::GetHostAndPort`, the first check a server makes.
    The task is looked up in the first job named `server_def.job_name`. When
    `server_def.port` is not 0 it is the port and the host is `"localhost"`;
    otherwise both come from the task's address: the port is the text after the last
    `":"` (a signed 32-bit decimal number), the host the non-empty text before it, or
    `"localhost"`. Port 0 asks the OS to choose. The port is not range-checked, so a
    caller binding it must handle failure (TensorFlow reports
    `UnknownError("Could not start gRPC server")`).

    Finally a server's task must belong to a named job: an empty `job_name` is
    rejected as TensorFlow's `WorkerCacheFactory` rejects it. (TensorFlow makes that
    check after binding the port; it can only be reached with a job named `""`.)

    Args:
        server_def: A `ServerDef`, distserver's or TensorFlow's.

    Returns:
        `(host, port)`; `target` is then `f"grpc://{host}:{bound_port}"`.

    Raises:
        distserver.errors.InternalError: `Task <i> was not defined in job "<job>"`, or
            `Job "<job>" was not defined in cluster` (also when the port is -1, as in
            TensorFlow, which uses -1 to mean "not found").
        distserver.errors.InvalidArgumentError: `Could not parse port for local
            server from "<address>".`, or `The master (current machine) is not
            included in the provided cluster_def. ...` for an empty job name.
    """
    server_def = _coerce(server_def, tensorflow_server_pb2.ServerDef)
    host = "localhost"
    port = -1
    for job in server_def.cluster.job:
        if job.name != server_def.job_name:
            continue
        if server_def.task_index not in job.tasks:
            raise errors.InternalError(
                f'Task {server_def.task_index} was not defined in job "{server_def.job_name}"'
            )
        if server_def.port != 0:
            port = server_def.port
        else:
            address = job.tasks[server_def.task_index]
            before, colon, port_text = address.rpartition(":")
            parsed = _parse_int32(port_text)
            if parsed is None:
                raise errors.InvalidArgumentError(f'Could not parse port for local server from "{address}".')
            port = parsed
            if colon and before:
                host = before
        break
    if port == -1:
        raise errors.InternalError(f'Job "{server_def.job_name}" was not defined in cluster')
    if not server_def.job_name:
        raise errors.InvalidArgumentError(
            "The master (current machine) is not included in the provided cluster_def. "
            + _debug_string(server_def.cluster)
        )
    return host, port


def _debug_string(cluster_def: cluster_pb2.ClusterDef) -> str:
    # C++ Message::DebugString(): like Python's text format, except that map entries
    # always print both key and value (Python's omits a proto3 key of 0).
    def quoted(text: str) -> str:
        return '"' + text_encoding.CEscape(text.encode("utf-8"), False) + '"'

    lines: list[str] = []
    for job in cluster_def.job:
        lines.append("job {")
        if job.name:
            lines.append(f"  name: {quoted(job.name)}")
        for index, address in sorted(job.tasks.items()):
            lines += ["  tasks {", f"    key: {index}", f"    value: {quoted(address)}", "  }"]
        lines.append("}")
    return "".join(line + "\n" for line in lines)


def validate_cluster(
    cluster_def: cluster_pb2.ClusterDef | _message.Message,
    local_task: tuple[str, int, str] | None = None,
) -> dict[str, dict[int, str]]:
    """Check every job and address of a cluster, as a TensorFlow server does.

    This is TensorFlow's `ParseChannelSpec` (and `GrpcChannelSpec::AddHostPortsJob`):
    jobs are checked in order; a job name seen before is rejected; then each address
    of the job, in task order, must pass `parse_host_port`. The server's own address
    is first replaced by the address it really serves on, given as `local_task`, so
    its written address is never checked (a `ServerDef.port` may stand in for it).

    Args:
        cluster_def: A `ClusterDef`, distserver's or TensorFlow's.
        local_task: `(job_name, task_index, "host:bound_port")` of the server doing the
            check, or `None` to check every address as written.

    Returns:
        The channel specification: `{job_name: {task_index: address}}`, jobs in
        `cluster_def` order, tasks sorted, with the server's own address replaced.

    Raises:
        distserver.errors.InvalidArgumentError: `Duplicate job ID in cluster
            specification: <job>`, or `Could not interpret "<address>" as a host-port
            pair.`
    """
    cluster_def = _coerce(cluster_def, cluster_pb2.ClusterDef)
    channel_spec: dict[str, dict[int, str]] = {}
    for job in cluster_def.job:
        host_ports: dict[int, str] = {}
        for task_index, address in sorted(job.tasks.items()):
            if local_task is not None and (job.name, task_index) == local_task[:2]:
                address = local_task[2]
            host_ports[task_index] = address
        if job.name in channel_spec:
            raise errors.InvalidArgumentError(f"Duplicate job ID in cluster specification: {job.name}")
        for address in host_ports.values():
            parse_host_port(address)
        channel_spec[job.name] = host_ports
    return channel_spec


_TF_CONFIG_ENV = "TF_CONFIG"
_SESSION_MASTER_KEY = "session_master"
_RPC_LAYER_KEY = "rpc_layer"
_TASK_KEY = "task"


def _load_tf_config() -> dict[str, Any]:
    config: dict[str, Any] = json.loads(os.environ.get(_TF_CONFIG_ENV, "{}"))
    return config


def _get_value_in_tf_config(key: str, default: Any = None) -> Any:
    return _load_tf_config().get(key, default)


def _format_master_url(master: str, rpc_layer: str | None = None) -> str:
    return f"{rpc_layer}://{master}" if rpc_layer else master


class TFConfigClusterResolver:
    """Read the cluster and this task's identity from the `TF_CONFIG` variable.

    This is `tf.distribute.cluster_resolver.TFConfigClusterResolver`. `TF_CONFIG`
    holds JSON such as::

        {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
         "task": {"type": "worker", "index": 1},
         "rpc_layer": "grpc",
         "session_master": "grpc://host0:2222"}

    The variable is read again on every property access and method call (nothing is
    cached), and values given to the constructor or the setters take precedence.

    Args:
        task_type: This task's job name; overrides `TF_CONFIG["task"]["type"]`.
        task_id: This task's index; overrides `TF_CONFIG["task"]["index"]`.
        rpc_layer: Protocol prefix for `master()`; overrides `TF_CONFIG["rpc_layer"]`.
        environment: Returned by the `environment` property (not read from TF_CONFIG).

    Raises:
        json.JSONDecodeError: (on access) `TF_CONFIG` is set but is not valid JSON.
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
    ) -> None:
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @property
    def task_type(self) -> str | None:
        """This task's job name, or `None` when neither given nor in TF_CONFIG."""
        if self._task_type is not None:
            return str(self._task_type)
        task_info = _get_value_in_tf_config(_TASK_KEY, {})
        return str(task_info["type"]) if "type" in task_info else None

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """This task's index, or `None` when neither given nor in TF_CONFIG."""
        if self._task_id is not None:
            return int(self._task_id)
        task_info = _get_value_in_tf_config(_TASK_KEY, {})
        return int(task_info["index"]) if "index" in task_info else None

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        """The protocol prefix for `master()` (e.g. `"grpc"`), or `None`."""
        if self._rpc_layer is not None:
            return self._rpc_layer
        rpc_layer: str | None = _get_value_in_tf_config(_RPC_LAYER_KEY)
        return rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str | None:
        """The `environment` given to the constructor (TF_CONFIG's is not read)."""
        return self._environment

    def cluster_spec(self) -> ClusterSpec:
        """Return `TF_CONFIG["cluster"]` as a `ClusterSpec` (empty when absent)."""
        tf_config = _load_tf_config()
        if "cluster" not in tf_config:
            return ClusterSpec({})
        return ClusterSpec(tf_config["cluster"])

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """Return the session target for a task of the cluster.

        In order: `TF_CONFIG["session_master"]` verbatim when set; `""` when the
        cluster has no jobs, or one job with a single task (run in-process); else
        the address of task (`task_type`, `task_id`), prefixed by `"<rpc_layer>://"`
        when there is an RPC layer. Arguments default to the resolver's own values.

        Raises:
            ValueError: The task is not in the cluster.
        """
        session_master: str | None = _get_value_in_tf_config(_SESSION_MASTER_KEY)
        if session_master is not None:
            return session_master
        cluster_spec = self.cluster_spec()
        jobs = cluster_spec.jobs
        if not jobs or (len(jobs) == 1 and len(cluster_spec.job_tasks(jobs[0])) == 1):
            return ""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        rpc_layer = rpc_layer if rpc_layer is not None else self.rpc_layer
        return _format_master_url(
            cluster_spec.task_address(task_type, task_id),  # type: ignore[arg-type]
            rpc_layer,
        )

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: config_pb2.ConfigProto | None = None,
    ) -> dict[str, int]:
        """Return the number of accelerators per device type of a task.

        distserver runs on CPUs only, so this is always `{}` (TensorFlow leaves CPUs
        out of the count too).
        """
        return {}
