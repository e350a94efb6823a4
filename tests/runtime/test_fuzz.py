"""Hostile bytes against every MasterService and WorkerService method of a live cluster.

A ps and a worker run as their own processes. Hypothesis sends each method random
bytes, mutations of well-formed requests, and well-formed requests whose tensors
claim odd dtypes and shapes. Whatever a call answers, the tasks must stay up and
answering (each batch ends with a GetStatus that must come back), their memory
must stay bounded, and afterwards a well-formed step must give the right value.
Derandomized and bounded in examples and per-call time, so it runs the same way in
CI every time.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import distserver as ds
from distserver.devices import RendezvousKey
from distserver.protos import master_pb2 as m
from distserver.protos import worker_pb2 as w
from distserver.protos.services import MASTER_SERVICE, SERVICES, WORKER_SERVICE
from distserver.protos.tensor_pb2 import TensorProto
from distserver.tensors import to_tensor_proto
from distserver.testing import LocalCluster
from distserver.transports import call_stream

pytestmark = pytest.mark.slow

CALL_SECONDS = 2.0  # a call may wait (a RecvTensor for a step that never runs does); the task must not
HEALTH_SECONDS = 10.0
RSS_LIMIT_BYTES = 1536 << 20  # each task, after everything: ~150 MiB idle, 256 MiB padding per message
EXAMPLES = 1000
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
PS = "/job:ps/replica:0/task:0/device:CPU:0"
WORKER = "/job:worker/replica:0/task:0/device:CPU:0"
CALLS: dict[str, int] = {}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster({"ps": 1, "worker": 1}) as running:
        yield running
        rss = {}
        for task, process in running.processes.items():
            assert process.poll() is None, f"{task} died:\n{running.stderr(task)}"
            rss[task] = _rss_bytes(process.pid)
            assert rss[task] < RSS_LIMIT_BYTES, f"{task} holds {rss[task] >> 20} MiB after fuzzing"
            # Every bad request was refused as what it is (an OpError naming the
            # problem), never as a bug: a handler's other exceptions are logged so.
            assert "unexpected error" not in running.stderr(task), running.stderr(task)
    print(f"calls fuzzed: {sum(CALLS.values())}; RSS after (MiB): { {t: b >> 20 for t, b in rss.items()} }")


@pytest.fixture(scope="module")
def channels(cluster: LocalCluster) -> Iterator[list[grpc.Channel]]:
    opened = [grpc.insecure_channel(target.removeprefix("grpc://")) for target in cluster.targets.values()]
    yield opened
    for channel in opened:
        channel.close()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _send(channel: grpc.Channel, path: str, payload: bytes) -> None:
    """One call; any status is fine, only the task's survival matters."""
    CALLS[path] = CALLS.get(path, 0) + 1
    call = channel.unary_unary(path)
    try:
        call(payload, timeout=CALL_SECONDS)
    except grpc.RpcError as exc:
        _refuse_unavailable(path, exc)


def _refuse_unavailable(path: str, exc: grpc.RpcError) -> None:
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        raise AssertionError(f"{path}: the task went away: {exc.details()}") from exc


def _still_answering(channels: list[grpc.Channel]) -> None:
    status = w.GetStatusRequest().SerializeToString()
    for channel in channels:
        channel.unary_unary(f"/{WORKER_SERVICE}/GetStatus")(status, timeout=HEALTH_SECONDS)


PATHS = [f"/{service}/{method}" for service, methods in SERVICES.items() for method in methods] + [
    "/distserver.WorkerService/RecvTensorChunks"
]


def _valid_requests() -> dict[str, bytes]:
    """One well-formed request per method that takes something worth mutating."""
    with ds.Graph().as_default() as graph:
        x = ds.placeholder(ds.float32, shape=[2], name="x")
        ds.identity(x * 2.0, name="y")
    tensor = to_tensor_proto(np.arange(6, dtype=np.float32).reshape(2, 3))
    run_step = m.RunStepRequest(session_handle="0123456789abcdef", fetch=["y:0"])
    run_step.feed.add(name="x:0").tensor.CopyFrom(tensor)
    run_graph = w.RunGraphRequest(graph_handle="0000000000000001", step_id=7, recv_key=["k"])
    run_graph.send.add(name=RendezvousKey(WORKER, 1, PS, "t").text).tensor.CopyFrom(tensor)
    return {
        f"/{MASTER_SERVICE}/CreateSession": m.CreateSessionRequest(graph_def=graph.as_graph_def()),
        f"/{MASTER_SERVICE}/ExtendSession": m.ExtendSessionRequest(graph_def=graph.as_graph_def()),
        f"/{MASTER_SERVICE}/RunStep": run_step,
        f"/{MASTER_SERVICE}/RunCallable": m.RunCallableRequest(feed=[tensor]),
        f"/{WORKER_SERVICE}/RegisterGraph": w.RegisterGraphRequest(graph_def=graph.as_graph_def()),
        f"/{WORKER_SERVICE}/RunGraph": run_graph,
        f"/{WORKER_SERVICE}/RecvTensor": w.RecvTensorRequest(
            step_id=3, rendezvous_key=RendezvousKey(PS, 1, WORKER, "t").text
        ),
    }


VALID = {path: request.SerializeToString() for path, request in _valid_requests().items()}


@st.composite
def mutated(draw: st.DrawFn, original: bytes) -> bytes:
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "varint"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete" and data:
            del data[at : at + draw(st.integers(1, 8))]
        elif kind == "truncate":
            del data[at:]
        else:  # a length or count made huge
            data[at:at] = b"\xff\xff\xff\xff\x07"
    return bytes(data)


@st.composite
def hostile_tensor(draw: st.DrawFn) -> TensorProto:
    proto = TensorProto(dtype=draw(st.integers(0, 125)))
    sizes = st.lists(st.integers(-2, 1 << 45), max_size=4)
    ranks_about_numpys_limit = st.integers(60, 70).map(lambda rank: [1] * rank)
    empty_but_huge = st.lists(st.sampled_from([0, 1 << 45]), min_size=2, max_size=4)
    for size in draw(st.one_of(sizes, ranks_about_numpys_limit, empty_but_huge)):
        proto.tensor_shape.dim.add(size=size)
    proto.tensor_shape.unknown_rank = draw(st.booleans()) and draw(st.booleans())
    proto.tensor_content = draw(st.binary(max_size=64))
    proto.float_val.extend(draw(st.lists(st.floats(width=32), max_size=4)))
    proto.int_val.extend(draw(st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=4)))
    proto.string_val.extend(draw(st.lists(st.binary(max_size=8), max_size=3)))
    proto.half_val.extend(draw(st.lists(st.integers(0, 0xFFFF), max_size=3)))
    proto.scomplex_val.extend(draw(st.lists(st.floats(width=32), max_size=3)))
    if draw(st.booleans()):
        proto.variant_val.add(type_name=draw(st.text(max_size=8)))
    return proto


@FUZZ_SETTINGS
@given(path=st.sampled_from(PATHS), payload=st.binary(max_size=256))
def test_random_bytes(channels, path, payload):
    for channel in channels:
        _send(channel, path, payload)
    _still_answering(channels)


@FUZZ_SETTINGS
@given(data=st.data(), path=st.sampled_from(sorted(VALID)))
def test_mutated_requests(channels, data, path):
    payload = data.draw(mutated(VALID[path]))
    for channel in channels:
        _send(channel, path, payload)
    _still_answering(channels)


def _float_tensor(sizes: list[int]) -> TensorProto:
    proto = TensorProto(dtype=to_tensor_proto(np.float32(0)).dtype)
    for size in sizes:
        proto.tensor_shape.dim.add(size=size)
    return proto


# Shapes numpy cannot hold, which once reached it (its ValueError answered as a bug).
MORE_DIMENSIONS_THAN_AN_ARRAY_HOLDS = _float_tensor([1] * 65)
EMPTY_BUT_NO_ARRAY_CAN_HOLD_IT = _float_tensor([0, 1 << 45, 1 << 45])


@FUZZ_SETTINGS
@given(
    tensors=st.lists(hostile_tensor(), min_size=1, max_size=3),
    where=st.sampled_from(["step", "graph", "callable"]),
)
@example(tensors=[MORE_DIMENSIONS_THAN_AN_ARRAY_HOLDS], where="step")
@example(tensors=[EMPTY_BUT_NO_ARRAY_CAN_HOLD_IT], where="graph")
def test_requests_whose_tensors_lie(channels, tensors, where):
    if where == "step":
        request = m.RunStepRequest(session_handle="nope")
        for i, tensor in enumerate(tensors):
            request.feed.add(name=f"x{i}:0").tensor.CopyFrom(tensor)
        path = f"/{MASTER_SERVICE}/RunStep"
    elif where == "graph":
        request = w.RunGraphRequest(graph_handle="nope", step_id=1)
        for i, tensor in enumerate(tensors):
            request.send.add(name=RendezvousKey(WORKER, 1, PS, f"t{i}").text).tensor.CopyFrom(tensor)
        path = f"/{WORKER_SERVICE}/RunGraph"
    else:
        request = m.RunCallableRequest(session_handle="nope", feed=tensors)
        path = f"/{MASTER_SERVICE}/RunCallable"
    for channel in channels:
        _send(channel, path, request.SerializeToString())
    _still_answering(channels)


@FUZZ_SETTINGS
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_call_stream_frames(channels, frames):
    for channel in channels:
        CALLS[call_stream.METHOD] = CALLS.get(call_stream.METHOD, 0) + 1
        stream = channel.stream_stream(call_stream.METHOD)(iter(frames), timeout=CALL_SECONDS)
        try:
            for _ in stream:
                pass
        except grpc.RpcError as exc:
            _refuse_unavailable(call_stream.METHOD, exc)
    _still_answering(channels)


def test_a_well_formed_step_still_gives_the_right_value(cluster, channels):
    # Runs after the fuzzing above (pytest keeps file order).
    _still_answering(channels)
    with ds.Graph().as_default() as graph:
        with ds.device("/job:ps/task:0"):
            v = ds.Variable(np.arange(4, dtype=np.float32), name="fuzz_survivor")
        with ds.device("/job:worker/task:0"):
            total = ds.reduce_sum(v.read_value() * 2.0)
    with ds.Session(cluster.target("worker"), graph=graph) as session:
        session.run(v.initializer)
        assert session.run(total) == 12.0
