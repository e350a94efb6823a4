"""The RPC methods of TensorFlow's MasterService, WorkerService and EagerService, and
distserver's StatusService.

TensorFlow serves them at `/tensorflow.MasterService/<Method>`,
`/tensorflow.WorkerService/<Method>` (hand-registered paths; its .proto package is
`tensorflow.grpc`, which generated stubs would get wrong) and
`/tensorflow.eager.EagerService/<Method>`. Every transport builds its handlers and
stubs from these tables, so names and message types live in one place.

The tables list unary methods. `STREAMING_METHODS` names the bidirectional
streams, each served by the handler of a unary method, message by message
(EagerService/StreamingEnqueue is a stream of Enqueue calls).
"""

from __future__ import annotations

from google.protobuf import empty_pb2, wrappers_pb2
from google.protobuf.message import Message

from distserver.protos import eager_service_pb2 as e
from distserver.protos import master_pb2 as m
from distserver.protos import worker_pb2 as w

MASTER_SERVICE = "tensorflow.MasterService"
WORKER_SERVICE = "tensorflow.WorkerService"
EAGER_SERVICE = "tensorflow.eager.EagerService"

MethodTable = dict[str, tuple[type[Message], type[Message]]]

MASTER_METHODS: MethodTable = {
    "CreateSession": (m.CreateSessionRequest, m.CreateSessionResponse),
    "ExtendSession": (m.ExtendSessionRequest, m.ExtendSessionResponse),
    "PartialRunSetup": (m.PartialRunSetupRequest, m.PartialRunSetupResponse),
    "RunStep": (m.RunStepRequest, m.RunStepResponse),
    "CloseSession": (m.CloseSessionRequest, m.CloseSessionResponse),
    "ListDevices": (m.ListDevicesRequest, m.ListDevicesResponse),
    "Reset": (m.ResetRequest, m.ResetResponse),
    "MakeCallable": (m.MakeCallableRequest, m.MakeCallableResponse),
    "RunCallable": (m.RunCallableRequest, m.RunCallableResponse),
    "ReleaseCallable": (m.ReleaseCallableRequest, m.ReleaseCallableResponse),
}

WORKER_METHODS: MethodTable = {
    "GetStatus": (w.GetStatusRequest, w.GetStatusResponse),
    "CreateWorkerSession": (w.CreateWorkerSessionRequest, w.CreateWorkerSessionResponse),
    "DeleteWorkerSession": (w.DeleteWorkerSessionRequest, w.DeleteWorkerSessionResponse),
    "RegisterGraph": (w.RegisterGraphRequest, w.RegisterGraphResponse),
    "DeregisterGraph": (w.DeregisterGraphRequest, w.DeregisterGraphResponse),
    "RunGraph": (w.RunGraphRequest, w.RunGraphResponse),
    "CleanupGraph": (w.CleanupGraphRequest, w.CleanupGraphResponse),
    "CleanupAll": (w.CleanupAllRequest, w.CleanupAllResponse),
    "RecvTensor": (w.RecvTensorRequest, w.RecvTensorResponse),
    "MarkRecvFinished": (w.MarkRecvFinishedRequest, w.MarkRecvFinishedResponse),
    "Logging": (w.LoggingRequest, w.LoggingResponse),
    "Tracing": (w.TracingRequest, w.TracingResponse),
    "RecvBuf": (w.RecvBufRequest, w.RecvBufResponse),
    "GetStepSequence": (w.GetStepSequenceRequest, w.GetStepSequenceResponse),
    "CompleteGroup": (w.CompleteGroupRequest, w.CompleteGroupResponse),
    "CompleteInstance": (w.CompleteInstanceRequest, w.CompleteInstanceResponse),
}

EAGER_METHODS: MethodTable = {
    "CreateContext": (e.CreateContextRequest, e.CreateContextResponse),
    "UpdateContext": (e.UpdateContextRequest, e.UpdateContextResponse),
    "Enqueue": (e.EnqueueRequest, e.EnqueueResponse),
    "WaitQueueDone": (e.WaitQueueDoneRequest, e.WaitQueueDoneResponse),
    "RunComponentFunction": (e.RunComponentFunctionRequest, e.RunComponentFunctionResponse),
    "KeepAlive": (e.KeepAliveRequest, e.KeepAliveResponse),
    "CloseContext": (e.CloseContextRequest, e.CloseContextResponse),
}

# distserver's own: a task's counters (`AsyncServer.statistics()`) as JSON text, for
# `distserver status --stats`. TensorFlow has no such service.
STATUS_SERVICE = "distserver.StatusService"
STATUS_METHODS: MethodTable = {
    "GetStatistics": (empty_pb2.Empty, wrappers_pb2.StringValue),
}

# distserver's own: many RecvTensors of one step from one task in one call
# (`distserver.runtime.batched_recv`). The request is a RunGraphRequest of which only
# `step_id` and `recv_key` are read; the response's `recv` holds values that are ready
# (a NamedTensorProto with an unset dtype: ready, but fetch it with RecvTensor):
# RecvTensors answers with those sent by the time the first one is, RecvAllTensors
# once every one asked for is. TensorFlow servers answer UNIMPLEMENTED.
TENSOR_SERVICE = "distserver.TensorService"
TENSOR_METHODS: MethodTable = {
    "RecvTensors": (w.RunGraphRequest, w.RunGraphResponse),
    "RecvAllTensors": (w.RunGraphRequest, w.RunGraphResponse),
}

SERVICES: dict[str, MethodTable] = {
    MASTER_SERVICE: MASTER_METHODS,
    WORKER_SERVICE: WORKER_METHODS,
    STATUS_SERVICE: STATUS_METHODS,
    TENSOR_SERVICE: TENSOR_METHODS,
    EAGER_SERVICE: EAGER_METHODS,
}

# Bidirectional streams: (service, stream method) -> the unary method that serves each message.
STREAMING_METHODS: dict[tuple[str, str], str] = {(EAGER_SERVICE, "StreamingEnqueue"): "Enqueue"}


def snake_case(method: str) -> str:
    """`RunStep` -> `run_step`: the Python method that implements an RPC."""
    out = []
    for i, ch in enumerate(method):
        if ch.isupper() and i:
            out.append("_")
        out.append(ch.lower())
    return "".join(out)
