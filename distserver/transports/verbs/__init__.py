"""RDMA-verbs semantics over same-host shared memory: the data plane of "grpc+verbs".

gRPC stays the control plane; this package moves tensor bytes between processes of
one host and one user the way an RDMA NIC would, with the objects of `ibverbs`:

* `ProtectionDomain` -- owns the registered memory and queue pairs of a process.
* `MemoryRegion` -- a sealed, pre-faulted anonymous `memfd` mapping with an id and an
  unguessable 128-bit key; `RegionPool` hands out `PoolSlice`s of pooled regions.
* `QueuePair` -- a connection to a peer process over a Unix socket (fds passed with
  `SCM_RIGHTS`, peer uid checked with `SO_PEERCRED`, EOF = peer death) with one-sided
  `write`/`read` into/from the peer's registered memory and small `send`/`recv`
  messages. `listen` / `connect` set them up.
* `CompletionQueue` -- `WorkCompletion`s the peer posts, delivered through a
  shared-memory ring and an eventfd watched by the event loop.
* `TensorEndpoint` / `TensorServer` -- the tensor path: the receiver allocates the
  destination in its pool, the sender writes the tensor into it with one copy.
* `host_identity` / `is_viable` -- whether a peer can use this path at all.

See docs/verbs.md for the design, the message flow and the failure handling.
"""

from distserver.transports.verbs._cq import (
    CompletionQueue,
    CompletionQueueStatistics,
    Opcode,
    WcStatus,
    WorkCompletion,
)
from distserver.transports.verbs._identity import (
    HOST_ID_OVERRIDE_ENV,
    HostIdentity,
    host_identity,
    is_viable,
    viability_problem,
)
from distserver.transports.verbs._memory import (
    ALIGNMENT,
    OFFLOAD_BYTES,
    MemoryRegion,
    PoolSlice,
    PoolStatistics,
    ProtectionDomain,
    RegionPool,
)
from distserver.transports.verbs._qp import (
    DEFAULT_CQ_DEPTH,
    ListenerStatistics,
    QueuePair,
    QueuePairAcceptor,
    QueuePairStatistics,
    connect,
    listen,
)
from distserver.transports.verbs._tensor import (
    DEFAULT_CLOSE_TIMEOUT,
    DEFAULT_INLINE_LIMIT,
    DEFAULT_MAX_BYTES_IN_FLIGHT,
    EndpointStatistics,
    ReceivedTensor,
    TensorEndpoint,
    TensorReply,
    TensorServer,
    TensorSource,
)
from distserver.transports.verbs._transport import VerbsTensorPath, VerbsTransport
from distserver.transports.verbs._wire import MAX_SEND_BYTES

__all__ = [
    "ALIGNMENT",
    "DEFAULT_CLOSE_TIMEOUT",
    "DEFAULT_CQ_DEPTH",
    "DEFAULT_INLINE_LIMIT",
    "DEFAULT_MAX_BYTES_IN_FLIGHT",
    "HOST_ID_OVERRIDE_ENV",
    "MAX_SEND_BYTES",
    "OFFLOAD_BYTES",
    "CompletionQueue",
    "CompletionQueueStatistics",
    "EndpointStatistics",
    "HostIdentity",
    "ListenerStatistics",
    "MemoryRegion",
    "Opcode",
    "PoolSlice",
    "PoolStatistics",
    "ProtectionDomain",
    "QueuePair",
    "QueuePairAcceptor",
    "QueuePairStatistics",
    "ReceivedTensor",
    "RegionPool",
    "TensorEndpoint",
    "TensorReply",
    "TensorServer",
    "TensorSource",
    "VerbsTensorPath",
    "VerbsTransport",
    "WcStatus",
    "WorkCompletion",
    "connect",
    "host_identity",
    "is_viable",
    "listen",
    "viability_problem",
]
