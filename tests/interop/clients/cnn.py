"""A small CNN, and a tiny dense model per remaining optimizer, trained on ps:1 worker:1 and by TF alone.

The CNN: conv 3x3 (+bias) -> relu -> max pool 2x2 -> conv 3x3 -> relu -> avg pool
2x2 -> dense, on random 16x16x3 images, with TF 1.x optimizers. The "mirror" variant
strides its first convolution, pools with overlapping 3x3 windows and pads before a
VALID second convolution with `tf.pad(mode="REFLECT")`, so MirrorPad and its
gradient take part too. The worker's graph comes
from `replica_device_setter` (variables on the ps, computation on the worker); the
same program then runs in an in-process TensorFlow session. Initial values come from
numpy through constant initializers, so both runs start equal and must end equal up
to float32 rounding.

Argument (JSON): {"cluster": {"ps": [a], "worker": [b]},
                  "cnn": [[optimizer, variables, variant]], "dense": [[optimizer, variables]]}
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
rng = np.random.default_rng(0)

# --------------------------------------------------------------------------- models

CNN_STEPS = 8
CNN_BATCH = 16
CLASSES = 4
IMAGES = rng.normal(size=(64, 16, 16, 3)).astype(np.float32)
# Labels the network can learn: which quadrant of the image is brightest.
_QUADRANTS = IMAGES.reshape(64, 2, 8, 2, 8, 3).mean(axis=(2, 4, 5)).reshape(64, 4)
IMAGE_LABELS = _QUADRANTS.argmax(axis=1).astype(np.int32)


def _he(shape, fan_in):
    return (rng.normal(size=shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)


CNN_INITIAL = {
    "conv1/w": _he((3, 3, 3, 8), 27),
    "conv1/b": np.full(8, 0.01, np.float32),
    "conv2/w": _he((3, 3, 8, 16), 72),
    "conv2/b": np.zeros(16, np.float32),
    "dense/w": _he((4 * 4 * 16, CLASSES), 256) * 0.3,
    "dense/b": np.zeros(CLASSES, np.float32),
}

DENSE_STEPS = 10
DENSE_BATCH = 16
FEATURES = rng.normal(size=(80, 4)).astype(np.float32)
FEATURE_LABELS = (FEATURES[:, 0] > 0).astype(np.int32) + (FEATURES[:, 1] > 0.5).astype(np.int32)
DENSE_INITIAL = {
    "w1": rng.normal(size=(4, 8)).astype(np.float32) * 0.5,
    "b1": np.zeros(8, np.float32),
    "w2": rng.normal(size=(8, 3)).astype(np.float32) * 0.5,
    "b2": np.zeros(3, np.float32),
}

OPTIMIZERS = {
    "adam": lambda: tf1.train.AdamOptimizer(0.01),
    "momentum": lambda: tf1.train.MomentumOptimizer(0.05, 0.9),
    "adadelta": lambda: tf1.train.AdadeltaOptimizer(1.0, rho=0.9, epsilon=1e-6),
    "ftrl": lambda: tf1.train.FtrlOptimizer(
        0.2, l1_regularization_strength=0.01, l2_regularization_strength=0.01
    ),
    "ftrl_v2": lambda: tf1.train.FtrlOptimizer(
        0.2,
        learning_rate_power=-0.6,
        l1_regularization_strength=0.01,
        l2_regularization_strength=0.01,
        l2_shrinkage_regularization_strength=0.02,
    ),
    "centered_rmsprop": lambda: tf1.train.RMSPropOptimizer(0.01, momentum=0.5, centered=True),
    "proximal_adagrad": lambda: tf1.train.ProximalAdagradOptimizer(
        0.2, l1_regularization_strength=0.002, l2_regularization_strength=0.01
    ),
    "proximal_gd": lambda: tf1.train.ProximalGradientDescentOptimizer(
        0.2, l1_regularization_strength=0.002, l2_regularization_strength=0.01
    ),
}


def _variables(initial, variables):
    return {
        name: tf1.get_variable(name, initializer=tf.constant(value), use_resource=variables == "resource")
        for name, value in initial.items()
    }


def build_cnn(optimizer, variables, variant, device_fn=None):
    graph = tf.Graph()
    with graph.as_default(), tf1.device(device_fn):
        x = tf1.placeholder(tf.float32, [None, 16, 16, 3], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        w = _variables(CNN_INITIAL, variables)
        if variant == "mirror":
            # a strided SAME convolution of an even size (padding after only), overlapping
            # pooling windows (ties between the zeros relu makes), a reflected border and
            # a VALID convolution
            h = tf.nn.relu(tf.nn.bias_add(tf1.nn.conv2d(x, w["conv1/w"], [1, 2, 2, 1], "SAME"), w["conv1/b"]))
            h = tf1.nn.max_pool(h, [1, 3, 3, 1], [1, 1, 1, 1], "SAME")  # 8x8x8
            h = tf.pad(h, [[0, 0], [1, 1], [1, 1], [0, 0]], mode="REFLECT")  # 10x10x8
            h = tf1.nn.conv2d(h, w["conv2/w"], [1, 1, 1, 1], "VALID")  # 8x8x16
        else:
            h = tf.nn.relu(tf.nn.bias_add(tf1.nn.conv2d(x, w["conv1/w"], [1, 1, 1, 1], "SAME"), w["conv1/b"]))
            h = tf1.nn.max_pool(h, [1, 2, 2, 1], [1, 2, 2, 1], "SAME")  # 8x8x8
            h = tf1.nn.conv2d(h, w["conv2/w"], [1, 1, 1, 1], "SAME")  # 8x8x16
        h = tf.nn.relu(h + w["conv2/b"])
        h = tf1.nn.avg_pool(h, [1, 2, 2, 1], [1, 2, 2, 1], "SAME")  # 4x4x16
        flat = tf.reshape(h, [-1, 4 * 4 * 16])
        logits = tf.matmul(flat, w["dense/w"]) + w["dense/b"]
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        global_step = tf1.train.get_or_create_global_step()
        train = OPTIMIZERS[optimizer]().minimize(loss, global_step=global_step)
        init = tf1.global_variables_initializer()
    return graph, dict(
        x=x, y=y, loss=loss, train=train, init=init, step=global_step, weights=w, logits=logits
    )


def build_dense(optimizer, variables, device_fn=None):
    graph = tf.Graph()
    with graph.as_default(), tf1.device(device_fn):
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        w = _variables(DENSE_INITIAL, variables)
        hidden = tf.nn.relu(tf.matmul(x, w["w1"]) + w["b1"])
        logits = tf.matmul(hidden, w["w2"]) + w["b2"]
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        global_step = tf1.train.get_or_create_global_step()
        train = OPTIMIZERS[optimizer]().minimize(loss, global_step=global_step)
        init = tf1.global_variables_initializer()
    return graph, dict(
        x=x, y=y, loss=loss, train=train, init=init, step=global_step, weights=w, logits=logits
    )


# --------------------------------------------------------------------------- running


def train(session, model, inputs, labels, steps, batch):
    session.run(model["init"])
    losses = []
    for step in range(steps):
        start = (step * batch) % len(inputs)
        feed = {model["x"]: inputs[start : start + batch], model["y"]: labels[start : start + batch]}
        loss, _ = session.run([model["loss"], model["train"]], feed)
        losses.append(float(loss))
    final = session.run(model["weights"])
    return {"losses": losses, "weights": final, "global_step": int(session.run(model["step"]))}


def compare(build, inputs, labels, steps, batch):
    graph, model = build()
    with tf1.Session(graph=graph) as session:
        started = time.monotonic()
        alone = train(session, model, inputs, labels, steps, batch)
        tf_seconds = time.monotonic() - started

    spec = tf.train.ClusterSpec(cluster)
    target = target_of(cluster["worker"][0])
    tf1.Session.reset(target)  # fresh ps state: every run names its variables alike
    setter = tf1.train.replica_device_setter(cluster=spec, worker_device="/job:worker/task:0")
    graph, model = build(setter)
    ops = sorted({op.type for op in graph.get_operations()})
    with tf1.Session(target, graph=graph) as session:
        started = time.monotonic()
        distributed = train(session, model, inputs, labels, steps, batch)
        seconds = time.monotonic() - started
    devices = {name: variable.device for name, variable in model["weights"].items()}
    devices["compute"] = model["logits"].device
    return {
        "distserver": {**distributed, "seconds": seconds},
        "tensorflow": {**alone, "seconds": tf_seconds},
        "max_weight_difference": {
            name: float(np.max(np.abs(np.asarray(alone["weights"][name]) - np.asarray(value))))
            for name, value in distributed["weights"].items()
        },
        "devices": devices,
        "ops": ops,
    }


for optimizer, variables, variant in arguments.get("cnn", []):
    checks.run(
        f"cnn/{optimizer}/{variables}/{variant}",
        functools.partial(
            compare,
            functools.partial(build_cnn, optimizer, variables, variant),
            IMAGES,
            IMAGE_LABELS,
            CNN_STEPS,
            CNN_BATCH,
        ),
    )
for optimizer, variables in arguments.get("dense", []):
    checks.run(
        f"dense/{optimizer}/{variables}",
        functools.partial(
            compare,
            functools.partial(build_dense, optimizer, variables),
            FEATURES,
            FEATURE_LABELS,
            DENSE_STEPS,
            DENSE_BATCH,
        ),
    )
checks.emit()
