"""Wire compatibility of distserver's protos with TensorFlow's (no TensorFlow needed).

(a) Hand-built byte vectors, written from the protobuf encoding rules (tag =
    field_number << 3 | wire_type; varints; little-endian fixed64; length-delimited
    submessages, strings and packed repeated scalars; map entries as submessages with
    key = 1 and value = 2), checked in both directions.
    Golden files tests/data/tf_*.pb were serialized by a real TensorFlow 2.21 with
    scripts/make_tf_golden.py (keep the expected values below in sync with it).
(b) The generated *_pb2 modules match their .proto sources (gen_protos.py --check).
(c) Error codes equal TensorFlow's (and gRPC's) 0..16.

scripts/compare_protos_with_tf.py (run under a TensorFlow venv) checks the schemas
themselves field by field against TensorFlow's descriptors.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from google.protobuf import unknown_fields
from google.protobuf.message import Message

from distserver.protos import (
    cluster_pb2,
    config_pb2,
    device_attributes_pb2,
    error_codes_pb2,
    graph_pb2,
    master_pb2,
    named_tensor_pb2,
    tensor_pb2,
    tensor_shape_pb2,
    tensorflow_server_pb2,
    types_pb2,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"

VARINT, I64, LEN, I32 = 0, 1, 2, 5
M = TypeVar("M", bound=Message)


# --------------------------------------------------------------------------- encoding helpers


def varint(n: int) -> bytes:
    """Base-128 varint; negative int32/int64 values are their 64-bit two's complement."""
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def f_varint(number: int, value: int) -> bytes:
    return tag(number, VARINT) + varint(value)


def f_len(number: int, payload: bytes | str) -> bytes:
    if isinstance(payload, str):
        payload = payload.encode()
    return tag(number, LEN) + varint(len(payload)) + payload


def f_fixed64(number: int, value: int) -> bytes:
    return tag(number, I64) + struct.pack("<Q", value)


def map_entry(number: int, key: bytes, value: bytes) -> bytes:
    """One map entry: an embedded message with key = 1 and value = 2 (both always written)."""
    return f_len(number, key + value)


def split_fields(data: bytes) -> list[bytes]:
    """The raw top-level fields of a message (tag included), in wire order."""
    chunks, pos = [], 0
    while pos < len(data):
        start, key = pos, 0
        for shift in range(0, 70, 7):  # the tag varint
            byte = data[pos]
            pos += 1
            key |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
        wire_type = key & 7
        if wire_type == VARINT:
            while data[pos] & 0x80:
                pos += 1
            pos += 1
        elif wire_type in (I64, I32):
            pos += 8 if wire_type == I64 else 4
        else:
            assert wire_type == LEN
            length, shift = 0, 0
            while True:
                byte = data[pos]
                pos += 1
                length |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            pos += length
        chunks.append(data[start:pos])
    assert pos == len(data)
    return chunks


def check_both_ways(message: Message, expected: bytes, *, any_map_order: bool = False) -> None:
    """`message` encodes to `expected` and `expected` decodes to `message`.

    With `any_map_order`, the order of top-level map entries may differ: the order of
    map entries on the wire is unspecified (TensorFlow's C++ writes them in hash order,
    upb's deterministic mode does not use ascending key order either).
    """
    encoded = message.SerializeToString(deterministic=True)
    if any_map_order:
        assert sorted(split_fields(encoded)) == sorted(split_fields(expected))
    else:
        assert encoded == expected
    parsed = type(message).FromString(expected)
    assert parsed == message
    assert parsed.SerializeToString(deterministic=True) == encoded


def test_varint_helper() -> None:
    assert varint(0) == b"\x00"
    assert varint(150) == b"\x96\x01"
    assert varint(-1) == b"\xff" * 9 + b"\x01"
    assert tag(16, LEN) == b"\x82\x01"


# --------------------------------------------------------------------------- (a) hand-built bytes


def test_jobdef_map_entries() -> None:
    job = cluster_pb2.JobDef(name="worker", tasks={0: "localhost:2223", 3: "localhost:2226"})
    expected = (
        f_len(1, "worker")
        # map<int32, string> tasks = 2: entries sorted by key; key 0 is still written.
        + map_entry(2, f_varint(1, 0), f_len(2, "localhost:2223"))
        + map_entry(2, f_varint(1, 3), f_len(2, "localhost:2226"))
    )
    assert expected[:8] == b"\x0a\x06worker"
    assert expected[8:12] == b"\x12\x12\x08\x00"
    check_both_ways(job, expected, any_map_order=True)
    assert split_fields(expected)[1] == b"\x12\x12\x08\x00\x12\x0elocalhost:2223"
    assert dict(cluster_pb2.JobDef.FromString(expected).tasks) == {0: "localhost:2223", 3: "localhost:2226"}
    # Entries in any order parse to the same map.
    reordered = b"".join(reversed(split_fields(expected)))
    assert cluster_pb2.JobDef.FromString(reordered) == job


def _cluster() -> tuple[cluster_pb2.ClusterDef, bytes]:
    cluster = cluster_pb2.ClusterDef()
    cluster.job.add(name="ps", tasks={0: "localhost:2222"})
    cluster.job.add(name="worker", tasks={1: "h:1"})
    encoded = f_len(1, f_len(1, "ps") + map_entry(2, f_varint(1, 0), f_len(2, "localhost:2222"))) + f_len(
        1, f_len(1, "worker") + map_entry(2, f_varint(1, 1), f_len(2, "h:1"))
    )
    return cluster, encoded


def test_clusterdef() -> None:
    cluster, expected = _cluster()
    check_both_ways(cluster, expected)


def test_serverdef() -> None:
    cluster, cluster_bytes = _cluster()
    server = tensorflow_server_pb2.ServerDef(
        cluster=cluster,
        job_name="worker",
        task_index=1,
        default_session_config=config_pb2.ConfigProto(allow_soft_placement=True),
        protocol="grpc",
        port=2224,
    )
    expected = (
        f_len(1, cluster_bytes)
        + f_len(2, "worker")
        + f_varint(3, 1)
        + f_len(4, f_varint(7, 1))
        + f_len(5, "grpc")
        + f_varint(6, 2224)
    )
    assert f_varint(6, 2224) == b"\x30\xb0\x11"
    check_both_ways(server, expected)


def test_configproto_several_fields() -> None:
    config = config_pb2.ConfigProto(
        device_count={"CPU": 2},
        intra_op_parallelism_threads=2,
        inter_op_parallelism_threads=5,
        device_filters=["/job:ps"],
        allow_soft_placement=True,
        operation_timeout_in_ms=60000,
        isolate_session_state=True,
        share_cluster_devices_in_session=True,
    )
    config.graph_options.infer_shapes = True
    config.graph_options.optimizer_options.opt_level = config_pb2.OptimizerOptions.L0
    config.rpc_options.use_rpc_for_inprocess_master = True
    config.rpc_options.compression_algorithm = "deflate"
    config.experimental.collective_group_leader = "/job:worker/replica:0/task:0"
    config.experimental.mlir_bridge_rollout = config_pb2.ConfigProto.Experimental.MLIR_BRIDGE_ROLLOUT_ENABLED
    config.experimental.disable_optimize_for_static_graph = True
    expected = (
        map_entry(1, f_len(1, "CPU"), f_varint(2, 2))
        + f_varint(2, 2)
        + f_len(4, "/job:ps")
        + f_varint(5, 5)
        + f_varint(7, 1)
        # GraphOptions: optimizer_options = 3 {opt_level = 3: L0 = -1}, infer_shapes = 5.
        + f_len(10, f_len(3, f_varint(3, -1)) + f_varint(5, 1))
        + f_varint(11, 60000)
        + f_len(13, f_varint(1, 1) + f_len(2, "deflate"))
        + f_varint(15, 1)
        + f_len(16, f_len(1, "/job:worker/replica:0/task:0") + f_varint(17, 1) + f_varint(24, 1))
        + f_varint(17, 1)
    )
    assert f_varint(11, 60000) == b"\x58\xe0\xd4\x03"
    assert f_varint(17, 1) == b"\x88\x01\x01"  # two-byte tag
    check_both_ways(config, expected)


def test_configproto_keeps_unknown_fields() -> None:
    # ConfigProto.Experimental.coordination_config (23) is not defined by distserver; it
    # survives a round trip, written after the known fields.
    unknown = f_len(23, f_len(1, "standalone"))
    known_before, known_after = f_varint(22, 1), f_varint(24, 1)
    experimental = config_pb2.ConfigProto.Experimental.FromString(known_before + unknown + known_after)
    assert experimental.xla_prefer_single_graph_cluster
    assert experimental.disable_optimize_for_static_graph
    assert experimental.SerializeToString() == known_before + known_after + unknown


def _named_tensor() -> tuple[named_tensor_pb2.NamedTensorProto, bytes]:
    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_FLOAT,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[
                tensor_shape_pb2.TensorShapeProto.Dim(size=-1),
                tensor_shape_pb2.TensorShapeProto.Dim(size=2),
            ]
        ),
        float_val=[1.0, 2.5],
        int64_val=[-2, 300],
    )
    named = named_tensor_pb2.NamedTensorProto(name="x:0", tensor=tensor)
    shape = f_len(2, f_varint(1, -1)) + f_len(2, f_varint(1, 2))
    floats = struct.pack("<2f", 1.0, 2.5)
    int64s = varint(-2) + varint(300)
    tensor_bytes = (
        f_varint(1, 1)  # dtype DT_FLOAT
        + f_len(2, shape)
        + f_len(5, floats)  # packed float_val: one LEN field of fixed32s
        + f_len(10, int64s)  # packed int64_val: one LEN field of varints
    )
    return named, f_len(1, "x:0") + f_len(2, tensor_bytes)


def test_named_tensor_proto() -> None:
    named, expected = _named_tensor()
    assert expected.startswith(b"\x0a\x03x:0\x12")
    check_both_ways(named, expected)


def test_tensor_content_and_unpacked_input() -> None:
    content = struct.pack("<3i", 1, -2, 3)
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_INT32, tensor_content=content)
    check_both_ways(tensor, f_varint(1, 3) + f_len(4, content))
    # Parsers must accept repeated scalars unpacked too (as TensorFlow's do).
    unpacked = f_varint(7, 5) + f_varint(7, 6)
    assert list(tensor_pb2.TensorProto.FromString(unpacked).int_val) == [5, 6]


def test_run_step_request() -> None:
    named, named_bytes = _named_tensor()
    request = master_pb2.RunStepRequest(
        session_handle="0123456789abcdef",
        feed=[named],
        fetch=["y:0", "z:0"],
        target=["init"],
        options=config_pb2.RunOptions(timeout_in_ms=1000, trace_level=config_pb2.RunOptions.FULL_TRACE),
        partial_run_handle="p",
        store_errors_in_response_body=True,
        request_id=-1,
    )
    expected = (
        f_len(1, "0123456789abcdef")
        + f_len(2, named_bytes)
        + f_len(3, "y:0")
        + f_len(3, "z:0")
        + f_len(4, "init")
        + f_len(5, f_varint(1, 3) + f_varint(2, 1000))
        + f_len(6, "p")
        + f_varint(7, 1)
        + f_varint(8, -1)  # negative int64: ten-byte varint
    )
    assert expected.endswith(b"\x40" + b"\xff" * 9 + b"\x01")
    check_both_ways(request, expected)


def test_device_attributes_fixed64_incarnation() -> None:
    attrs = device_attributes_pb2.DeviceAttributes(
        name="/job:worker/replica:0/task:0/device:CPU:0",
        device_type="CPU",
        memory_limit=268435456,
        incarnation=0x1F2E3D4C5B6A7988,
    )
    attrs.locality.bus_id = 1
    expected = (
        f_len(1, "/job:worker/replica:0/task:0/device:CPU:0")
        + f_len(2, "CPU")
        + f_varint(4, 268435456)
        + f_len(5, f_varint(1, 1))
        + tag(6, I64)
        + bytes.fromhex("88796a5b4c3d2e1f")  # fixed64, little-endian
    )
    assert tag(6, I64) == b"\x31"
    check_both_ways(attrs, expected)
    big = device_attributes_pb2.DeviceAttributes(incarnation=2**64 - 2)
    assert f_fixed64(6, 2**64 - 2) == b"\x31\xfe" + b"\xff" * 7
    check_both_ways(big, f_fixed64(6, 2**64 - 2))


# --------------------------------------------------------------------------- (a) TensorFlow goldens


def load_golden(name: str, cls: type[M]) -> tuple[M, bytes]:
    data = (DATA / name).read_bytes()
    message = cls.FromString(data)
    # Same bytes back: all known fields re-encode identically and unknown fields are kept.
    assert message.SerializeToString(deterministic=True) == data
    return message, data


def unknown_numbers(message: Message) -> list[int]:
    """Field numbers of the unknown fields of `message` (kept from the wire)."""
    unknown = unknown_fields.UnknownFieldSet(message)
    return [unknown[i].field_number for i in range(len(unknown))]


def test_golden_cluster_def() -> None:
    cluster, _ = load_golden("tf_cluster_def.pb", cluster_pb2.ClusterDef)
    jobs = {job.name: dict(job.tasks) for job in cluster.job}
    assert jobs == {"ps": {0: "localhost:2222"}, "worker": {0: "localhost:2223", 3: "localhost:2226"}}


def test_golden_server_def() -> None:
    server, _ = load_golden("tf_server_def.pb", tensorflow_server_pb2.ServerDef)
    assert [job.name for job in server.cluster.job] == ["ps", "worker"]
    assert dict(server.cluster.job[1].tasks) == {0: "localhost:2223", 3: "localhost:2226"}
    assert (server.job_name, server.task_index, server.protocol, server.port) == ("worker", 3, "grpc", 2226)
    assert server.replica == 0
    config = server.default_session_config
    assert config.allow_soft_placement
    assert config.operation_timeout_in_ms == 5000
    assert config.rpc_options.use_rpc_for_inprocess_master
    [job] = server.cluster_device_filters.jobs
    assert job.name == "worker"
    assert list(job.tasks[0].device_filters) == ["/job:ps", "/job:worker/task:0"]
    assert list(job.tasks[3].device_filters) == ["/job:ps"]


def test_golden_config_proto() -> None:
    config, _ = load_golden("tf_config_proto.pb", config_pb2.ConfigProto)
    assert dict(config.device_count) == {"CPU": 2, "GPU": 0}
    assert config.intra_op_parallelism_threads == 4
    assert config.inter_op_parallelism_threads == 3
    assert config.allow_soft_placement
    assert config.log_device_placement
    assert list(config.device_filters) == ["/job:ps", "/job:worker/task:0"]
    assert config.operation_timeout_in_ms == 60000
    assert config.isolate_session_state
    assert config.share_cluster_devices_in_session
    assert config.gpu_options.allow_growth
    assert config.gpu_options.visible_device_list == "0,1"
    rpc = config.rpc_options
    assert rpc.use_rpc_for_inprocess_master
    assert rpc.cache_rpc_response
    assert (rpc.compression_algorithm, rpc.compression_level, rpc.num_channels_per_target) == ("gzip", 2, 4)
    graph = config.graph_options
    assert graph.optimizer_options.opt_level == config_pb2.OptimizerOptions.L0
    assert graph.optimizer_options.do_function_inlining
    assert graph.optimizer_options.global_jit_level == config_pb2.OptimizerOptions.ON_1
    assert graph.infer_shapes
    assert (graph.build_cost_model, graph.timeline_step) == (5, 7)
    exp = config.experimental
    assert exp.collective_group_leader == "/job:worker/replica:0/task:0"
    assert exp.executor_type == "DEFAULT"
    assert exp.recv_buf_max_chunk == 4096
    assert exp.share_session_state_in_clusterspec_propagation
    assert (exp.session_metadata.name, exp.session_metadata.version) == ("golden", 3)
    assert exp.mlir_bridge_rollout == config_pb2.ConfigProto.Experimental.MLIR_BRIDGE_ROLLOUT_DISABLED
    assert exp.xla_fusion_autotuner_thresh == 9
    assert exp.disable_optimize_for_static_graph
    assert exp.stream_merge_threshold == 11
    assert exp.tf2xla_dump_dir == "/tmp/dump"
    assert exp.online_cost_analysis
    assert [job.name for job in config.cluster_def.job] == ["ps", "worker"]
    # Fields distserver does not define are kept as unknown fields.
    assert unknown_numbers(graph) == [10]  # GraphOptions.rewrite_options
    assert b"constfold" in graph.SerializeToString()
    assert unknown_numbers(config.gpu_options) == [9]  # GPUOptions.experimental
    assert unknown_numbers(config) == unknown_numbers(exp) == []


def test_golden_graph_def() -> None:
    graph, _ = load_golden("tf_graph_def.pb", graph_pb2.GraphDef)
    nodes = {node.name: node for node in graph.node}
    assert graph.versions.producer > 0
    assert {"x", "c", "v", "y", "z"} <= nodes.keys()
    assert {node.op for node in graph.node} >= {
        "Placeholder",
        "Const",
        "VarHandleOp",
        "AssignVariableOp",
        "ReadVariableOp",
        "MatMul",
    }
    x = nodes["x"]
    assert x.op == "Placeholder"
    assert x.attr["dtype"].type == types_pb2.DT_FLOAT
    assert [d.size for d in x.attr["shape"].shape.dim] == [-1, 2]
    value = nodes["c"].attr["value"].tensor
    assert value.dtype == types_pb2.DT_FLOAT
    assert [d.size for d in value.tensor_shape.dim] == [2, 1]
    assert struct.unpack("<2f", value.tensor_content) == (1.0, 2.0)
    v = nodes["v"]
    assert v.op == "VarHandleOp"
    assert v.device == "/job:ps/task:0"
    assert v.attr["shared_name"].s == b"v"
    assert v.attr["dtype"].type == types_pb2.DT_FLOAT
    assert [d.size for d in v.attr["shape"].shape.dim] == [2, 1]
    assert list(v.attr["_class"].list.s) == [b"loc:@v"]
    y = nodes["y"]
    assert (y.op, list(y.input)) == ("MatMul", ["x", "c"])
    assert y.attr["T"].type == types_pb2.DT_FLOAT
    assert y.attr["transpose_a"].WhichOneof("value") == "b"
    z = nodes["z"]
    assert z.op == "MatMul"
    assert nodes[z.input[1]].op == "ReadVariableOp"
    assert list(nodes[z.input[1]].input) == ["v"]


def test_golden_run_options() -> None:
    options, _ = load_golden("tf_run_options.pb", config_pb2.RunOptions)
    assert options.trace_level == config_pb2.RunOptions.FULL_TRACE
    assert options.timeout_in_ms == 1500
    assert options.inter_op_thread_pool == 1
    assert options.output_partition_graphs
    assert options.report_tensor_allocations_upon_oom
    assert options.experimental.collective_graph_key == 12
    assert options.experimental.use_run_handler_pool
    assert options.experimental.run_handler_pool_options.priority == 3
    # DebugOptions.debug_tensor_watch_opts (4) is unknown to distserver but kept.
    assert unknown_numbers(options.debug_options) == [4]
    debug = options.debug_options.SerializeToString()
    assert debug.startswith(tag(4, LEN))
    assert b"DebugIdentity" in debug
    assert b"file:///tmp/dbg" in debug


def test_golden_device_attributes() -> None:
    attrs, data = load_golden("tf_device_attributes.pb", device_attributes_pb2.DeviceAttributes)
    assert attrs.name == "/job:worker/replica:0/task:3/device:CPU:0"
    assert attrs.device_type == "CPU"
    assert attrs.memory_limit == 268435456
    assert attrs.incarnation == 0xFEDCBA9876543210
    assert tag(6, I64) + struct.pack("<Q", 0xFEDCBA9876543210) in data
    assert attrs.physical_device_desc == "device: 0, name: golden"
    assert attrs.xla_global_id == -1
    assert (attrs.locality.bus_id, attrs.locality.numa_node) == (1, 0)
    [link] = attrs.locality.links.link
    assert (link.device_id, link.type, link.strength) == (1, "StreamExecutor", 1)


# --------------------------------------------------------------------------- (b) generated code


def test_generated_code_matches_protos() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- (c) error codes

TF_ERROR_CODES = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
]


@pytest.mark.parametrize(("number", "name"), list(enumerate(TF_ERROR_CODES)))
def test_error_code_values(number: int, name: str) -> None:
    assert error_codes_pb2.Code.Value(name) == number
    assert error_codes_pb2.Code.Name(number) == name


def test_error_codes_complete_and_match_grpc() -> None:

    values = {v.name: v.number for v in error_codes_pb2.Code.DESCRIPTOR.values}
    assert values.pop("DO_NOT_USE_RESERVED_FOR_FUTURE_EXPANSION_USE_DEFAULT_IN_SWITCH_INSTEAD_") == 20
    assert values == {name: number for number, name in enumerate(TF_ERROR_CODES)}
    for name, number in values.items():
        assert grpc.StatusCode[name].value[0] == number
    # RunStepResponse.status_code is this enum, a varint on the wire.
    response = master_pb2.RunStepResponse(status_code=error_codes_pb2.UNAUTHENTICATED)
    assert response.SerializeToString() == f_varint(3, 16)
