"""A partitioned embedding + a dense head, trained by a TF 1.x program on 2 ps + 1 worker and by TF alone.

The embedding (VOCAB x DIM) is split in two by `fixed_size_partitioner(2)`, and
`replica_device_setter` puts the halves on the two ps tasks. Each example looks up
two ids (so a batch names rows repeatedly: the optimizer sums duplicate gradients
with Unique + UnsortedSegmentSum, then applies a SparseApply* update per half). The
same program then runs in an in-process TensorFlow session. Initial values come from
numpy through an initializer that slices them by partition, so both runs start
equal and must end equal (up to float rounding).

Argument (JSON): {"cluster": {"ps": [a, b], "worker": [c]}, "configs": [[optimizer, variables]]}
with variables "ref" (VariableV2, the TF 1.x default) or "resource".
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_v2_behavior()

arguments = args()
cluster = arguments["cluster"]
checks = Checks()
STEPS = 10
BATCH = 8
VOCAB, DIM, HIDDEN = 20, 4, 6
rng = np.random.default_rng(7)
INITIAL = {
    "embedding": rng.normal(size=(VOCAB, DIM)).astype(np.float32) * 0.3,
    "w1": rng.normal(size=(DIM, HIDDEN)).astype(np.float32) * 0.5,
    "b1": np.zeros(HIDDEN, np.float32),
    "w2": rng.normal(size=(HIDDEN, 1)).astype(np.float32) * 0.5,
    "b2": np.zeros(1, np.float32),
}
# Ids 16..19 are never looked up: their rows must keep their initial values.
IDS = rng.integers(0, 16, size=(STEPS * BATCH, 2)).astype(np.int64)
LABELS = ((IDS[:, 0] % 3 == 0) | (IDS[:, 1] % 4 == 1)).astype(np.float32)

OPTIMIZERS = {
    "adagrad": lambda: tf1.train.AdagradOptimizer(0.3),
    "momentum": lambda: tf1.train.MomentumOptimizer(0.1, 0.9),
    "nesterov": lambda: tf1.train.MomentumOptimizer(0.1, 0.9, use_nesterov=True),
    "ftrl": lambda: tf1.train.FtrlOptimizer(0.3, l1_regularization_strength=0.001),
    "rmsprop": lambda: tf1.train.RMSPropOptimizer(0.02),
}


def numpy_initializer(value: np.ndarray):
    """An initializer that gives each partition its rows of `value`."""

    def initialize(shape, dtype=None, partition_info=None):
        offset = partition_info.single_offset(shape) if partition_info is not None else 0
        return tf.constant(value[offset : offset + shape[0]])

    return initialize


def build(optimizer: str, variables: str, device_fn=None) -> tuple[tf.Graph, dict]:
    graph = tf.Graph()
    with graph.as_default(), tf1.device(device_fn):
        ids = tf1.placeholder(tf.int64, [None, 2], name="ids")
        labels = tf1.placeholder(tf.float32, [None], name="labels")
        use_resource = variables == "resource"
        embedding = tf1.get_variable(
            "embedding",
            shape=[VOCAB, DIM],
            initializer=numpy_initializer(INITIAL["embedding"]),
            partitioner=tf1.fixed_size_partitioner(2),
            use_resource=use_resource,
        )
        weights = {
            name: tf1.get_variable(name, initializer=tf.constant(INITIAL[name]), use_resource=use_resource)
            for name in ("w1", "b1", "w2", "b2")
        }
        looked_up = tf1.nn.embedding_lookup(embedding, ids, partition_strategy="div")  # [B, 2, DIM]
        features = tf.reduce_mean(looked_up, axis=1)
        hidden = tf.nn.relu(tf.matmul(features, weights["w1"]) + weights["b1"])
        logits = tf.squeeze(tf.matmul(hidden, weights["w2"]) + weights["b2"], axis=1)
        loss = tf.reduce_mean(tf.square(logits - labels))
        global_step = tf1.train.get_or_create_global_step()
        train = OPTIMIZERS[optimizer]().minimize(loss, global_step=global_step)
        full = tf.concat(list(embedding), axis=0)  # the whole table, both halves
        init = tf1.global_variables_initializer()
    parts = {f"embedding/part_{i}": part for i, part in enumerate(embedding)}
    nodes = dict(ids=ids, labels=labels, loss=loss, train=train, init=init, step=global_step, full=full)
    return graph, {**nodes, **weights, **parts}


def train(session, model) -> dict:
    session.run(model["init"])
    losses = []
    for step in range(STEPS):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        feed = {model["ids"]: IDS[batch], model["labels"]: LABELS[batch]}
        loss, _ = session.run([model["loss"], model["train"]], feed)
        losses.append(float(loss))
    final = session.run({name: model[name] for name in ("w1", "b1", "w2", "b2")})
    final["embedding"] = session.run(model["full"])
    return {"losses": losses, "weights": final, "global_step": int(session.run(model["step"]))}


def graph_ops(graph: tf.Graph) -> list[str]:
    return sorted({op.type for op in graph.get_operations()})


def run_config(optimizer: str, variables: str) -> dict:
    graph, model = build(optimizer, variables)
    with tf1.Session(graph=graph) as session:
        alone = train(session, model)

    target = target_of(cluster["worker"][0])
    tf1.Session.reset(target)  # fresh ps state: every config names its variables alike
    setter = tf1.train.replica_device_setter(
        cluster=tf.train.ClusterSpec(cluster), worker_device="/job:worker/task:0"
    )
    graph, model = build(optimizer, variables, setter)
    with tf1.Session(target, graph=graph) as session:
        distributed = train(session, model)
    devices = {name: model[name].device for name in ("embedding/part_0", "embedding/part_1", "w1")}
    devices["loss"] = model["loss"].device
    return {
        "distserver": distributed,
        "tensorflow": alone,
        "max_weight_difference": {
            name: float(np.max(np.abs(np.asarray(alone["weights"][name]) - distributed["weights"][name])))
            for name in INITIAL
        },
        "devices": devices,
        "ops": graph_ops(graph),
    }


for optimizer, variables in arguments["configs"]:
    checks.run(f"{optimizer}/{variables}", functools.partial(run_config, optimizer, variables))
checks.emit(initial_embedding=INITIAL["embedding"], unused_ids=list(range(16, VOCAB)))
