"""distserver: TensorFlow's distributed runtime server in pure, asyncio-native Python.

The public API:

* Servers: `AsyncServer` (asyncio) and `Server` (blocking, `tf.distribute.Server`).
* Sessions: `AsyncSession` and `Session` (`tf.compat.v1.Session`).
* Training over a cluster's workers: `AsyncClusterCoordinator` and `ClusterCoordinator`
  (TF 2's `ClusterCoordinator` for graphs: scheduling, failed workers, per-worker data).
* Clusters: `ClusterSpec`, `TFConfigClusterResolver`.
* Graph building, TF 1.x style: `Graph`, `placeholder`, `constant`, `matmul`,
  `Variable`, `device`, ... (also importable as `distserver.graph`).
* Training: `gradients` (autodiff) and `train` (TensorFlow's v1 optimizers,
  `get_or_create_global_step`).
* Security: `Security` (TLS, mutual TLS, a shared token).
* Errors: `distserver.errors` (`OpError` and TensorFlow's 16 subclasses).
"""

from distserver import (
    _grpc_env,  # noqa: F401 - must run before anything imports grpc
    _malloc,  # noqa: F401 - glibc malloc thresholds, before large buffers
)
from distserver import errors as errors
from distserver.cluster import ClusterSpec as ClusterSpec
from distserver.cluster import TFConfigClusterResolver as TFConfigClusterResolver
from distserver.coordinator import AsyncClusterCoordinator as AsyncClusterCoordinator
from distserver.coordinator import PerWorkerDataset as PerWorkerDataset
from distserver.coordinator import RemoteValue as RemoteValue
from distserver.facade import ClusterCoordinator as ClusterCoordinator
from distserver.facade import Server as Server
from distserver.facade import Session as Session
from distserver.graph import *  # noqa: F403 - the graph API is part of the top-level API
from distserver.graph import __all__ as _graph_all
from distserver.protos.config_pb2 import ConfigProto as ConfigProto
from distserver.protos.config_pb2 import RunMetadata as RunMetadata
from distserver.protos.config_pb2 import RunOptions as RunOptions
from distserver.security import Security as Security
from distserver.server import AsyncServer as AsyncServer
from distserver.session import AsyncSession as AsyncSession

__version__ = "0.1.0"

__all__ = sorted(
    [
        "AsyncClusterCoordinator",
        "AsyncServer",
        "AsyncSession",
        "ClusterCoordinator",
        "ClusterSpec",
        "ConfigProto",
        "PerWorkerDataset",
        "RemoteValue",
        "RunMetadata",
        "RunOptions",
        "Security",
        "Server",
        "Session",
        "TFConfigClusterResolver",
        "errors",
        *_graph_all,
    ]
)
