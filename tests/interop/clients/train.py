"""A 2-layer dense classifier trained between-graph across 1 ps + 2 workers, and by TF alone.

Each worker builds its own graph with `replica_device_setter(worker_device=...)` (the
TF 1.x parameter-server recipe) and the two take turns: step k runs through worker
k % 2's session. The same program then runs in an in-process TensorFlow session. The
initial values come from numpy through constant initializers, so both runs start
equal and must end equal (up to float rounding).

Argument (JSON): {"cluster": {"ps": [...], "worker": [a, b]}, "configs": [[optimizer, loss, variables]]}
with variables "ref" (VariableV2) or "resource".
"""

from __future__ import annotations

import functools
import time

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_v2_behavior()

arguments = args()
cluster = arguments["cluster"]
checks = Checks()
STEPS = 24
BATCH = 16
rng = np.random.default_rng(0)
INITIAL = {
    "w1": rng.normal(size=(4, 16)).astype(np.float32) * 0.5,
    "b1": np.zeros(16, np.float32),
    "w2": rng.normal(size=(16, 3)).astype(np.float32) * 0.5,
    "b2": np.zeros(3, np.float32),
}
X = rng.normal(size=(96, 4)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32) + (X[:, 1] > 0.5).astype(np.int32)

OPTIMIZERS = {
    "gd": lambda: tf1.train.GradientDescentOptimizer(0.2),
    "momentum": lambda: tf1.train.MomentumOptimizer(0.05, 0.9),
    "adam": lambda: tf1.train.AdamOptimizer(0.02),
    "rmsprop": lambda: tf1.train.RMSPropOptimizer(0.01),
    "adagrad": lambda: tf1.train.AdagradOptimizer(0.2),
}


def build(optimizer: str, loss_kind: str, variables: str, device_fn=None) -> tuple[tf.Graph, dict]:
    graph = tf.Graph()
    with graph.as_default(), tf1.device(device_fn):
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        weights = {
            name: tf1.get_variable(name, initializer=tf.constant(value), use_resource=variables == "resource")
            for name, value in INITIAL.items()
        }
        hidden = tf.nn.relu(tf.matmul(x, weights["w1"]) + weights["b1"])
        logits = tf.nn.bias_add(tf.matmul(hidden, weights["w2"]), weights["b2"])
        if loss_kind == "sparse_xent":
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        elif loss_kind == "xent":
            loss = tf1.losses.softmax_cross_entropy(tf.one_hot(y, 3), logits)
        else:
            loss = tf1.losses.mean_squared_error(tf.one_hot(y, 3), logits)
        global_step = tf1.train.get_or_create_global_step()
        train = OPTIMIZERS[optimizer]().minimize(loss, global_step=global_step)
        accuracy = tf.reduce_mean(
            tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y), tf.float32)
        )
        init = tf1.global_variables_initializer()
    nodes = dict(x=x, y=y, loss=loss, train=train, init=init, accuracy=accuracy, step=global_step, **weights)
    return graph, nodes


def train(sessions, models) -> dict:
    sessions[0].run(models[0]["init"])
    losses = []
    for step in range(STEPS):
        worker = step % len(sessions)
        model = models[worker]
        start = (step * BATCH) % len(X)
        feed = {model["x"]: X[start : start + BATCH], model["y"]: Y[start : start + BATCH]}
        loss, _ = sessions[worker].run([model["loss"], model["train"]], feed)
        losses.append(float(loss))
    final = sessions[-1].run({name: models[-1][name] for name in INITIAL})
    accuracy = sessions[0].run(models[0]["accuracy"], {models[0]["x"]: X, models[0]["y"]: Y})
    return {
        "losses": losses,
        "weights": final,
        "accuracy": float(accuracy),
        "global_step": int(sessions[0].run(models[0]["step"])),
    }


def run_config(optimizer: str, loss_kind: str, variables: str) -> dict:
    graph, model = build(optimizer, loss_kind, variables)
    with tf1.Session(graph=graph) as session:
        started = time.monotonic()
        alone = train([session], [model])
        tf_seconds = time.monotonic() - started

    spec = tf.train.ClusterSpec(cluster)
    targets = [target_of(address) for address in cluster["worker"]]
    tf1.Session.reset(targets[0])  # fresh ps state: every config names its variables alike
    models, sessions = [], []
    for index, target in enumerate(targets):
        setter = tf1.train.replica_device_setter(cluster=spec, worker_device=f"/job:worker/task:{index}")
        graph, model = build(optimizer, loss_kind, variables, setter)
        models.append(model)
        sessions.append(tf1.Session(target, graph=graph))
    started = time.monotonic()
    distributed = train(sessions, models)
    seconds = time.monotonic() - started
    devices = {name: models[1][name].device for name in INITIAL}
    devices["compute"] = models[1]["loss"].device
    for session in sessions:
        session.close()
    return {
        "distserver": {**distributed, "seconds": seconds},
        "tensorflow": {**alone, "seconds": tf_seconds},
        "max_weight_difference": {
            name: float(
                np.max(np.abs(np.asarray(alone["weights"][name]) - np.asarray(distributed["weights"][name])))
            )
            for name in INITIAL
        },
        "devices": devices,
    }


for optimizer, loss_kind, variables in arguments["configs"]:
    checks.run(
        f"{optimizer}/{loss_kind}/{variables}", functools.partial(run_config, optimizer, loss_kind, variables)
    )
checks.emit()
