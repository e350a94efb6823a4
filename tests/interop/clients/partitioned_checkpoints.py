"""Partitioned variables in checkpoints: a Saver on distserver and on TensorFlow alone.

Variables made with `fixed_size_partitioner` over two ps tasks (one reference, one
resource variable) are saved in slices; each side restores what the other wrote,
also into a graph partitioned differently. Then a partitioned embedding trained
with Adagrad under MonitoredTrainingSession is stopped and restarted from its
checkpoint, on distserver and on TensorFlow alone.

Argument (JSON): {"cluster": {...} (ps:2, worker:1, started with --checkpoint-root
<root>), "root": that directory, "local": a directory for TensorFlow alone}
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_v2_behavior()

arguments = args()
cluster = arguments["cluster"]
worker = target_of(cluster["worker"][0])
root, local = arguments["root"], arguments["local"]
checks = Checks()

SHAPES = {"emb": (10, 4), "w": (6, 3)}
OURS = {name: np.arange(np.prod(s), dtype=np.float32).reshape(s) * 0.5 + 1 for name, s in SHAPES.items()}
THEIRS = {name: -np.arange(np.prod(s), dtype=np.float32).reshape(s) for name, s in SHAPES.items()}


def build(distributed: bool, parts: int, sharded: bool) -> dict:
    if distributed:
        # Reference variables outlive sessions on the tasks: start from empty ones, so that
        # a graph partitioned differently gets partitions of its own shapes.
        tf1.Session.reset(worker)
    setter = tf1.train.replica_device_setter(cluster=cluster) if distributed else None
    nodes: dict = {"vars": {}, "set": {}}
    with tf1.device(setter):
        for name, shape in SHAPES.items():
            var = tf1.get_variable(
                name,
                shape=shape,
                initializer=tf1.zeros_initializer(),
                partitioner=tf1.fixed_size_partitioner(parts),
                use_resource=name == "w",
            )
            nodes["vars"][name] = var.as_tensor()
            values = tf1.placeholder(tf.float32, shape)
            nodes["set"][name] = (
                values,
                [
                    p.assign(s)
                    for p, s in zip(var, tf.split(values, [int(p.shape[0]) for p in var]), strict=True)
                ],
            )
    nodes["init"] = tf1.global_variables_initializer()
    nodes["saver"] = tf1.train.Saver(sharded=sharded)
    return nodes


def assign(sess, nodes, values) -> None:
    for name, (placeholder, ops) in nodes["set"].items():
        sess.run(ops, {placeholder: values[name]})


def exercise(sharded: bool) -> None:
    label = "sharded" if sharded else "plain"
    # (a) distserver writes, TensorFlow alone restores (same and different partitioning).
    with tf.Graph().as_default():
        nodes = build(distributed=True, parts=2, sharded=sharded)
        with tf1.Session(worker) as sess:
            sess.run(nodes["init"])
            assign(sess, nodes, OURS)
            ours = nodes["saver"].save(sess, os.path.join(root, label, "model"))
    for parts in (2, 3):
        with tf.Graph().as_default():
            nodes = build(distributed=False, parts=parts, sharded=sharded)
            with tf1.Session() as sess:
                nodes["saver"].restore(sess, ours)
                checks.run(
                    f"{label}/tf_restores_ours/{parts}",
                    lambda sess=sess, nodes=nodes: sess.run(nodes["vars"]),
                )
    reader = tf.train.load_checkpoint(ours)
    checks.run(f"{label}/tf_reader_keys", lambda: sorted(reader.get_variable_to_shape_map().items()))
    # (b) TensorFlow alone writes, distserver restores (same and different partitioning).
    with tf.Graph().as_default():
        nodes = build(distributed=False, parts=2, sharded=sharded)
        with tf1.Session() as sess:
            sess.run(nodes["init"])
            assign(sess, nodes, THEIRS)
            os.makedirs(os.path.join(root, f"tf_{label}"), exist_ok=True)
            theirs = nodes["saver"].save(sess, os.path.join(root, f"tf_{label}", "model"))
    for parts in (2, 3):
        with tf.Graph().as_default():
            nodes = build(distributed=True, parts=parts, sharded=sharded)
            with tf1.Session(worker) as sess:
                nodes["saver"].restore(sess, theirs)
                checks.run(
                    f"{label}/ours_restores_tf/{parts}",
                    lambda sess=sess, nodes=nodes: sess.run(nodes["vars"]),
                )


exercise(sharded=False)
exercise(sharded=True)

rng = np.random.default_rng(3)
IDS = rng.integers(0, 12, size=(16, 3)).astype(np.int64)
LABELS = rng.normal(size=16).astype(np.float32)
INITIAL = rng.uniform(-1, 1, size=(12, 2)).astype(np.float32)


def initial_rows(shape, dtype=None, partition_info=None):
    """The rows of INITIAL that a partition holds (random initializers differ from TensorFlow's)."""
    start = partition_info.var_offset[0] if partition_info is not None else 0
    return tf.constant(INITIAL[start : start + shape[0]], dtype=dtype)


def train(target: str, checkpoint_dir: str, last_step: int, remote: bool) -> dict:
    if remote:
        tf1.Session.reset(worker)  # the restart restores everything from the checkpoint
    setter = tf1.train.replica_device_setter(cluster=cluster) if remote else None
    with tf.Graph().as_default(), tf1.device(setter):
        step = tf1.train.get_or_create_global_step()
        emb = tf1.get_variable(
            "emb",
            shape=[12, 2],
            initializer=initial_rows,
            partitioner=tf1.fixed_size_partitioner(2),
        )
        features = tf.reduce_sum(tf.nn.embedding_lookup(emb, tf.constant(IDS)), axis=[1, 2])
        loss = tf.reduce_mean(tf.square(features - tf.constant(LABELS)))
        train_op = tf1.train.AdagradOptimizer(0.1).minimize(loss, global_step=step)
        losses = []
        with tf1.train.MonitoredTrainingSession(
            master=target,
            is_chief=True,
            checkpoint_dir=checkpoint_dir,
            hooks=[tf1.train.StopAtStepHook(last_step=last_step)],
            save_checkpoint_steps=4,
            save_summaries_steps=None,
            log_step_count_steps=0,
        ) as sess:
            for _ in range(50):  # bounded: the hook stops at last_step
                if sess.should_stop():
                    break
                losses.append(float(sess.run([train_op, loss])[1]))
    latest = tf1.train.latest_checkpoint(checkpoint_dir)
    reader = tf.train.load_checkpoint(latest)
    return {
        "losses": losses,
        "latest": os.path.basename(latest),
        "emb": reader.get_tensor("emb").tolist(),
        "accumulator": reader.get_tensor("emb/Adagrad").tolist(),
    }


def first_and_restarted(prefix: str, target: str, directory: str, remote: bool) -> None:
    checks.run(f"{prefix}/first", lambda: train(target, directory, 4, remote))
    checks.run(f"{prefix}/restarted", lambda: train(target, directory, 8, remote))


first_and_restarted("distserver", worker, os.path.join(root, "monitored"), True)
first_and_restarted("tensorflow", "", os.path.join(local, "monitored"), False)
checks.emit(ours=OURS, theirs=THEIRS)
