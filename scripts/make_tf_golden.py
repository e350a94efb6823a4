"""Write tests/data/tf_*.pb: messages serialized by a real TensorFlow.

Run with the Python of a venv that has TensorFlow (not distserver's venv):

    .tfenv/bin/python scripts/make_tf_golden.py      (.tfenv: scripts/interop-setup)

tests/test_protos.py parses each file with distserver's classes, checks the values
set here (keep both in sync) and that re-serializing gives the same bytes. Every
message is serialized with `deterministic=True` (map entries sorted by key), which
is what the test compares against. (TensorFlow's Python protobuf is upb, like
distserver's, so both order map entries the same way in that mode.)

Fields that distserver's protos do not define (GPUOptions.experimental,
GraphOptions.rewrite_options, DebugOptions.debug_tensor_watch_opts) are set on
purpose to prove that they survive as unknown fields. They are the highest-numbered
fields set in their message: protobuf writes unknown fields after the known ones,
so only then are the re-serialized bytes identical to TensorFlow's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf
from tensorflow.core.framework import device_attributes_pb2
from tensorflow.core.protobuf import (
    config_pb2,
    debug_pb2,
    device_filters_pb2,
    rewriter_config_pb2,
    tensorflow_server_pb2,
)

OUT = Path(__file__).resolve().parent.parent / "tests" / "data"


def cluster_def() -> tf.train.ClusterSpec:
    # Sparse worker indices {0, 3}, as ClusterSpec allows.
    return tf.train.ClusterSpec(
        {"ps": ["localhost:2222"], "worker": {0: "localhost:2223", 3: "localhost:2226"}}
    ).as_cluster_def()


def config_proto() -> config_pb2.ConfigProto:
    config = tf.compat.v1.ConfigProto(
        device_count={"CPU": 2, "GPU": 0},
        intra_op_parallelism_threads=4,
        inter_op_parallelism_threads=3,
        allow_soft_placement=True,
        log_device_placement=True,
        device_filters=["/job:ps", "/job:worker/task:0"],
        operation_timeout_in_ms=60000,
        isolate_session_state=True,
        share_cluster_devices_in_session=True,
    )
    config.gpu_options.allow_growth = True
    config.gpu_options.visible_device_list = "0,1"
    config.gpu_options.experimental.num_dev_to_dev_copy_streams = 2  # unknown to distserver
    config.rpc_options.use_rpc_for_inprocess_master = True
    config.rpc_options.compression_algorithm = "gzip"
    config.rpc_options.compression_level = 2
    config.rpc_options.cache_rpc_response = True
    config.rpc_options.num_channels_per_target = 4
    config.graph_options.optimizer_options.opt_level = config_pb2.OptimizerOptions.L0
    config.graph_options.optimizer_options.do_function_inlining = True
    config.graph_options.optimizer_options.global_jit_level = config_pb2.OptimizerOptions.ON_1
    config.graph_options.infer_shapes = True
    config.graph_options.build_cost_model = 5
    config.graph_options.timeline_step = 7
    rewrite = config.graph_options.rewrite_options  # unknown to distserver
    rewrite.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
    rewrite.min_graph_nodes = -1
    rewrite.optimizers.extend(["pruning", "constfold"])
    exp = config.experimental
    exp.collective_group_leader = "/job:worker/replica:0/task:0"
    exp.executor_type = "DEFAULT"
    exp.recv_buf_max_chunk = 4096
    exp.share_session_state_in_clusterspec_propagation = True
    exp.session_metadata.name = "golden"
    exp.session_metadata.version = 3
    exp.mlir_bridge_rollout = config_pb2.ConfigProto.Experimental.MLIR_BRIDGE_ROLLOUT_DISABLED
    exp.xla_fusion_autotuner_thresh = 9
    exp.disable_optimize_for_static_graph = True
    exp.stream_merge_threshold = 11
    exp.tf2xla_dump_dir = "/tmp/dump"
    exp.online_cost_analysis = True
    config.cluster_def.CopyFrom(cluster_def())
    return config


def server_def() -> tensorflow_server_pb2.ServerDef:
    filters = device_filters_pb2.ClusterDeviceFilters()
    job = filters.jobs.add(name="worker")
    job.tasks[0].device_filters.extend(["/job:ps", "/job:worker/task:0"])
    job.tasks[3].device_filters.append("/job:ps")
    default_config = tf.compat.v1.ConfigProto(allow_soft_placement=True, operation_timeout_in_ms=5000)
    default_config.rpc_options.use_rpc_for_inprocess_master = True
    return tensorflow_server_pb2.ServerDef(
        cluster=cluster_def(),
        job_name="worker",
        task_index=3,
        default_session_config=default_config,
        protocol="grpc",
        port=2226,
        cluster_device_filters=filters,
    )


def graph_def() -> tf.compat.v1.GraphDef:
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, shape=[None, 2], name="x")
        c = tf.constant([[1.0], [2.0]], dtype=tf.float32, name="c")
        with tf.device("/job:ps/task:0"):
            v = tf.compat.v1.Variable([[3.0], [4.0]], name="v", use_resource=True)
        tf.matmul(x, c, name="y")
        tf.matmul(x, v, name="z")
    return graph.as_graph_def()


def run_options() -> config_pb2.RunOptions:
    options = config_pb2.RunOptions(
        trace_level=config_pb2.RunOptions.FULL_TRACE,
        timeout_in_ms=1500,
        inter_op_thread_pool=1,
        output_partition_graphs=True,
        report_tensor_allocations_upon_oom=True,
    )
    # Only the field distserver lacks, so that the unknown field keeps its place.
    options.debug_options.debug_tensor_watch_opts.add(
        node_name="x", output_slot=0, debug_ops=["DebugIdentity"], debug_urls=["file:///tmp/dbg"]
    )
    options.experimental.collective_graph_key = 12
    options.experimental.use_run_handler_pool = True
    options.experimental.run_handler_pool_options.priority = 3
    return options


def device_attributes() -> device_attributes_pb2.DeviceAttributes:
    attrs = device_attributes_pb2.DeviceAttributes(
        name="/job:worker/replica:0/task:3/device:CPU:0",
        device_type="CPU",
        memory_limit=268435456,
        incarnation=0xFEDCBA9876543210,  # above 2**63: must stay an unsigned fixed64
        physical_device_desc="device: 0, name: golden",
        xla_global_id=-1,
    )
    attrs.locality.bus_id = 1
    attrs.locality.numa_node = 0
    attrs.locality.links.link.add(device_id=1, type="StreamExecutor", strength=1)
    return attrs


GOLDEN = {
    "tf_cluster_def.pb": cluster_def,
    "tf_server_def.pb": server_def,
    "tf_config_proto.pb": config_proto,
    "tf_graph_def.pb": graph_def,
    "tf_run_options.pb": run_options,
    "tf_device_attributes.pb": device_attributes,
}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, make in GOLDEN.items():
        message = make()
        data = message.SerializeToString(deterministic=True)
        (OUT / name).write_bytes(data)
        print(f"wrote tests/data/{name}: {type(message).__name__}, {len(data)} bytes")
    print(f"TensorFlow {tf.__version__}, debug_pb2 from {debug_pb2.__name__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
