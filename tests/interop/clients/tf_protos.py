"""TensorFlow's protos in distserver's API, and TensorFlow-serialized protos for our parsers.

Runs in TensorFlow's Python with distserver importable (PYTHONPATH): builds
distserver servers from TF objects (`tf.train.ServerDef`, a `ClusterDef`,
`tf.compat.v1.ConfigProto`), runs a TF session against them, and prints the bytes
of messages TensorFlow serialized (GraphDefs of TF 1.x programs, ConfigProto,
RunOptions, CallableOptions, ServerDef) for the test to parse with distserver's
classes.
"""

from __future__ import annotations

import base64

import numpy as np
import tensorflow as tf
from _common import Checks
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

import distserver
from distserver.testing.cluster import free_ports

tf1 = tf.compat.v1
tf1.disable_v2_behavior()
checks = Checks()

ps_port, worker_port = free_ports(2)
spec = tf.train.ClusterSpec({"ps": [f"localhost:{ps_port}"], "worker": [f"localhost:{worker_port}"]})
config = tf1.ConfigProto(operation_timeout_in_ms=30000, allow_soft_placement=True)
server_def = tf.train.ServerDef(
    cluster=spec.as_cluster_def(), job_name="ps", task_index=0, protocol="grpc", default_session_config=config
)
ps = distserver.Server(server_def)
worker = distserver.Server(
    distserver.ClusterSpec(spec.as_cluster_def()), job_name="worker", task_index=0, config=config
)

checks.run(
    "server_from_tf_server_def",
    lambda: {
        "target": ps.target,
        "cluster": distserver.ClusterSpec(ps.server_def.cluster).as_dict(),
        "config": ps.server_def.default_session_config.operation_timeout_in_ms,
    },
)
checks.run(
    "cluster_spec_from_tf_cluster_def", lambda: distserver.ClusterSpec(spec.as_cluster_def()).as_dict()
)
checks.run("worker_default_config", lambda: worker.server_def.default_session_config.allow_soft_placement)


def tf_session_on_distserver():
    graph = tf.Graph()
    with graph.as_default():
        with tf1.device("/job:ps/task:0"):
            v = tf1.Variable([1.0, 2.0], name="v")
        with tf1.device("/job:worker/task:0/device:GPU:0"):  # soft placement: the CPU
            doubled = v * 2.0
        session_config = tf1.ConfigProto(
            allow_soft_placement=True, device_filters=["/job:ps", "/job:worker/task:0"]
        )
        with tf1.Session(worker.target, config=session_config) as session:
            session.run(v.initializer)
            return session.run(doubled)


checks.run("tf_session_on_servers_from_tf_protos", tf_session_on_distserver)


def distserver_session_with_tf_config():
    graph = distserver.Graph()
    with graph.as_default():
        total = distserver.constant(np.arange(4.0)).__add__(1.0)
    with distserver.Session(
        worker.target, graph=graph, config=tf1.ConfigProto(operation_timeout_in_ms=5000)
    ) as s:
        return s.run(total)


checks.run("distserver_session_with_tf_config", distserver_session_with_tf_config)
worker.stop()
ps.stop()


# --------------------------------------------------------------------------- TF-serialized messages


def encode(message) -> str:
    return base64.b64encode(message.SerializeToString(deterministic=True)).decode()


def training_graph(use_resource: bool) -> tf1.GraphDef:
    graph = tf.Graph()
    with graph.as_default(), tf1.device(tf1.train.replica_device_setter(ps_tasks=2)):
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        w1 = tf1.get_variable(
            "w1", [4, 8], initializer=tf1.glorot_uniform_initializer(), use_resource=use_resource
        )
        b1 = tf1.get_variable("b1", [8], initializer=tf1.zeros_initializer(), use_resource=use_resource)
        w2 = tf1.get_variable(
            "w2", [8, 3], initializer=tf1.truncated_normal_initializer(), use_resource=use_resource
        )
        hidden = tf.nn.sigmoid(tf.nn.relu(tf.matmul(x, w1) + b1))
        logits = tf.tanh(tf.matmul(hidden, w2))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        loss += tf1.losses.mean_squared_error(tf.one_hot(y, 3), logits)
        loss += tf1.losses.softmax_cross_entropy(tf.one_hot(y, 3), logits)
        step = tf1.train.get_or_create_global_step()
        for optimizer in (
            tf1.train.GradientDescentOptimizer(0.1),
            tf1.train.MomentumOptimizer(0.1, 0.9, use_nesterov=True),
            tf1.train.AdamOptimizer(),
            tf1.train.AdagradOptimizer(0.1),
            tf1.train.RMSPropOptimizer(0.1),
        ):
            optimizer.minimize(loss, global_step=step)
        embeddings = tf1.get_variable("embeddings", [10, 4], use_resource=use_resource)
        looked_up = tf.nn.embedding_lookup(embeddings, [1, 3])
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(looked_up))
        tf1.global_variables_initializer()
        tf1.report_uninitialized_variables()
    return graph.as_graph_def()


rich_config = tf1.ConfigProto(
    device_filters=["/job:ps", "/job:worker/task:1"],
    allow_soft_placement=True,
    log_device_placement=True,
    operation_timeout_in_ms=1234,
    isolate_session_state=True,
)
rich_config.graph_options.rewrite_options.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
rich_config.gpu_options.allow_growth = True
run_options = tf1.RunOptions(
    timeout_in_ms=500, trace_level=tf1.RunOptions.FULL_TRACE, output_partition_graphs=True
)
callable_options = config_pb2.CallableOptions(feed=["x:0"], fetch=["y:0", "z:1"], target=["train"])
callable_options.run_options.CopyFrom(run_options)

messages = {
    "GraphDef/ref": training_graph(False),
    "GraphDef/resource": training_graph(True),
    "ConfigProto": rich_config,
    "RunOptions": run_options,
    "CallableOptions": callable_options,
    "ServerDef": server_def,
    "ClusterDef": spec.as_cluster_def(),
}
checks.emit(
    messages={name: encode(message) for name, message in messages.items()},
    ops={
        name: sorted({node.op for node in message.node})
        for name, message in messages.items()
        if name.startswith("GraphDef")
    },
)
