"""TensorFlow's side of tests/interop/test_ds_train.py.

1. Trains the test's model with `tf.compat.v1.train` optimizers in TensorFlow alone,
   from the initial values and batches the test passes, and reports losses and final
   variables (and TF's own gradients at the initial values).
2. Imports the GraphDefs distserver's `ds.gradients`/`ds.train` built (placed on
   /job:ps and /job:worker), runs them on a TensorFlow cluster of two
   `tf.distribute.Server`s and reports the same numbers; and runs a gradient graph
   of many ops on a local TensorFlow server.

Argument (JSON): {"initial": {name: values}, "batches": [{"ids", "x", "labels"}],
"optimizers": {key: [class name, kwargs]}, "graphs": {key: {"path", "names"}},
"ops_graph": {"path", "feed", "x", "fetch"}}.
"""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import tensorflow as tf
from _common import Checks, args

tf1 = tf.compat.v1

arguments = args()
checks = Checks()
INITIAL = {name: np.array(value, np.float32) for name, value in arguments["initial"].items()}
BATCHES = [
    {
        "ids": np.array(b["ids"], np.int32),
        "x": np.array(b["x"], np.float32),
        "labels": np.array(b["labels"], np.int32),
    }
    for b in arguments["batches"]
]
server = tf.distribute.Server.create_local_server()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return int(probe.getsockname()[1])


# A TensorFlow cluster shaped like the test's distserver cluster: 1 ps + 1 worker.
tf_cluster = tf.train.ClusterSpec(
    {"ps": [f"localhost:{_free_port()}"], "worker": [f"localhost:{_free_port()}"]}
)
tf_servers = [tf.distribute.Server(tf_cluster, job_name=job, task_index=0) for job in ("ps", "worker")]


def build_model(graph: tf.Graph) -> dict:
    with graph.as_default():
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        labels = tf1.placeholder(tf.int32, [None], name="labels")
        variables = {name: tf1.Variable(value, name=name) for name, value in INITIAL.items()}
        hidden = tf.tanh(tf.concat([tf.gather(variables["emb"], ids), x], 1))
        logits = tf.matmul(hidden, variables["w"]) + variables["b"]
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    return {"ids": ids, "x": x, "labels": labels, "variables": variables, "loss": loss}


def dense(value) -> np.ndarray:
    if hasattr(value, "indices") and hasattr(value, "dense_shape"):  # IndexedSlicesValue
        result = np.zeros(value.dense_shape, value.values.dtype)
        np.add.at(result, value.indices, value.values)
        return result
    return np.asarray(value)


def train_in_tensorflow(key: str) -> dict:
    class_name, kwargs = arguments["optimizers"][key]
    graph = tf.Graph()
    model = build_model(graph)
    with graph.as_default():
        step = tf1.train.get_or_create_global_step()
        train_op = getattr(tf1.train, class_name)(**kwargs).minimize(model["loss"], global_step=step)
        init = tf1.global_variables_initializer()
    losses = []
    with tf1.Session(graph=graph) as session:
        session.run(init)
        for batch in BATCHES:
            feed = {model[k]: v for k, v in batch.items()}
            losses.append(float(session.run(model["loss"], feed)))
            session.run(train_op, feed)
        final = {name: session.run(v) for name, v in model["variables"].items()}
        return {"losses": losses, "final": final, "global_step": int(session.run(step))}


def tensorflow_gradients() -> dict:
    graph = tf.Graph()
    model = build_model(graph)
    with graph.as_default():
        names = sorted(model["variables"])
        grads = tf1.gradients(model["loss"], [model["variables"][n] for n in names])
        init = tf1.global_variables_initializer()
    with tf1.Session(graph=graph) as session:
        session.run(init)
        feed = {model[k]: v for k, v in BATCHES[0].items()}
        return {name: dense(value) for name, value in zip(names, session.run(grads, feed), strict=True)}


def import_graph(path: str) -> tf.Graph:
    graph_def = tf1.GraphDef.FromString(Path(path).read_bytes())
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    return graph


def run_our_graph_on_tensorflow(key: str) -> dict:
    spec = arguments["graphs"][key]
    names = spec["names"]
    graph = import_graph(spec["path"])
    losses = []
    with tf1.Session(tf_servers[1].target, graph=graph) as session:
        session.run(names["init"])
        for batch in BATCHES:
            feed = {names["feeds"][k]: v for k, v in batch.items()}
            losses.append(float(session.run(names["loss"], feed)))
            session.run(names["train"], feed)
        final = {name: session.run(tensor) for name, tensor in names["variables"].items()}
        return {"losses": losses, "final": final, "global_step": int(session.run(names["global_step"]))}


def run_ops_graph_on_tensorflow() -> list:
    spec = arguments["ops_graph"]
    graph = import_graph(spec["path"])
    with tf1.Session(server.target, graph=graph) as session:
        return session.run(spec["fetch"], {spec["x"]: np.array(spec["feed"], np.float32)})


checks.run("tf_gradients", tensorflow_gradients)
for key in arguments["optimizers"]:
    checks.run(f"tf/{key}", lambda key=key: train_in_tensorflow(key))
for key in arguments["graphs"]:
    checks.run(f"ours_in_tf/{key}", lambda key=key: run_our_graph_on_tensorflow(key))
checks.run("ops_graph", run_ops_graph_on_tensorflow)
checks.emit()
