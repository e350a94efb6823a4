"""Variables on parameter servers, placed as TF 1.x programs place them, used from workers.

Argument (JSON): {"cluster": {job: [addresses]}} with 2 ps and 2 worker tasks.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_v2_behavior()

cluster = args()["cluster"]
worker0, worker1 = (target_of(a) for a in cluster["worker"])
checks = Checks()


def build(use_resource: bool) -> dict:
    """Variables on ps tasks, updates and reads issued from a worker."""
    suffix = "res" if use_resource else "ref"
    nodes: dict = {}
    with tf1.device("/job:ps/task:0"):
        nodes["counter"] = tf1.get_variable(
            f"counter_{suffix}", initializer=tf.constant([1.0, 2.0]), use_resource=use_resource
        )
    with tf1.device("/job:ps/task:1"):
        nodes["table"] = tf1.get_variable(
            f"table_{suffix}",
            initializer=tf.constant(np.arange(6.0).reshape(3, 2)),
            use_resource=use_resource,
        )
    counter, table = nodes["counter"], nodes["table"]
    with tf1.device("/job:worker/task:0"):
        nodes["increment"] = counter.assign_add([10.0, 20.0])
        nodes["replace"] = table.assign(tf.ones([3, 2], tf.float64))
        with tf1.control_dependencies([nodes["increment"]]):
            nodes["read_after_increment"] = counter.read_value()
        nodes["rows"] = tf.gather(table, [2, 0])
        nodes["total"] = tf.reduce_sum(counter) + tf.cast(tf.reduce_sum(table), tf.float32)
    nodes["init"] = tf1.variables_initializer([counter, table])
    nodes["uninitialized"] = tf1.report_uninitialized_variables([counter, table])
    return nodes


def exercise(flavour: str, use_resource: bool) -> None:
    graph = tf.Graph()
    with graph.as_default():
        nodes = build(use_resource)
        with tf1.Session(worker0) as sess:
            checks.run(f"{flavour}_uninitialized_before", lambda: sess.run(nodes["uninitialized"]))
            checks.run(f"{flavour}_read_uninitialized", lambda: sess.run(nodes["total"]))
            checks.run(f"{flavour}_init", lambda: sess.run(nodes["init"]))
            checks.run(f"{flavour}_uninitialized_after", lambda: sess.run(nodes["uninitialized"]))
            checks.run(f"{flavour}_increment", lambda: sess.run(nodes["increment"]))
            checks.run(f"{flavour}_read_after_increment", lambda: sess.run(nodes["read_after_increment"]))
            checks.run(f"{flavour}_rows", lambda: sess.run(nodes["rows"]))
        # Another session, through another task's master: the ps state is shared.
        with tf1.Session(worker1) as sess:
            checks.run(f"{flavour}_seen_from_worker1", lambda: sess.run([nodes["counter"], nodes["total"]]))
            sess.run(nodes["replace"])
            checks.run(f"{flavour}_replaced", lambda: sess.run(nodes["table"]))


exercise("resource", use_resource=True)
exercise("ref", use_resource=False)

# replica_device_setter(ps_tasks=2): variables round-robin over the ps tasks, compute on workers.
graph = tf.Graph()
with graph.as_default():
    with tf1.device(tf1.train.replica_device_setter(ps_tasks=2)):
        weights = [
            tf1.get_variable(f"w{i}", [40, 30], initializer=tf1.random_normal_initializer(seed=i + 1))
            for i in range(4)
        ]
        uniform = tf1.get_variable("u", [100, 100], initializer=tf1.random_uniform_initializer(-2, 2, seed=7))
        truncated = tf1.get_variable("t", [100, 100], initializer=tf1.truncated_normal_initializer(seed=8))
        step = tf1.train.get_or_create_global_step()
        bump = tf1.assign_add(step, 1)
        init = tf1.global_variables_initializer()
    checks.run("setter_devices", lambda: [v.device for v in weights] + [step.device])
    with tf1.Session(worker1) as sess:
        sess.run(init)
        first = sess.run([*weights, uniform, truncated])
        checks.run("setter_bumps", lambda: [sess.run(bump) for _ in range(3)])
    with tf1.Session(worker0) as sess:
        sess.run(init)  # same seeds, a new session: the same values
        second = sess.run([*weights, uniform, truncated])
        checks.run("setter_step_after_reinit", lambda: sess.run(step))
    checks.run(
        "seeded_initializers_repeat",
        lambda: [bool(np.array_equal(a, b)) for a, b in zip(first, second, strict=True)],
    )
    checks.run(
        "initializer_statistics",
        lambda: {
            "normal": [float(np.mean(first[0])), float(np.std(first[0]))],
            "uniform": [float(first[4].min()), float(first[4].max()), float(first[4].mean())],
            "truncated": [float(np.abs(first[5]).max()), float(np.std(first[5]))],
            "distinct": not np.array_equal(first[0], first[1]),
        },
    )

# A queue without shared_name: each run below registers a different graph (other
# fetches), and TensorFlow's session still uses one queue for the node.
graph = tf.Graph()
with graph.as_default(), tf1.device("/job:ps/task:1"):
    unshared = tf1.FIFOQueue(capacity=4, dtypes=[tf.float32], shapes=[[]], name="unshared")
    put = unshared.enqueue_many([tf.constant([1.0, 2.0, 3.0])])
    take = unshared.dequeue()
    size = unshared.size()
with tf1.Session(worker0, graph=graph) as sess:
    sess.run(put)
    bounded = tf1.RunOptions(timeout_in_ms=10000)  # an empty (other) queue would block
    checks.run(
        "unshared_queue_across_runs", lambda: [float(sess.run(take, options=bounded)), int(sess.run(size))]
    )

checks.run("reset", lambda: tf1.Session.reset(worker0))
graph = tf.Graph()
with graph.as_default():
    with tf1.device("/job:ps/task:0"):
        survivor = tf1.get_variable("counter_res", [2], use_resource=True)
    with tf1.Session(worker0) as sess:
        checks.run("after_reset", lambda: sess.run(survivor))
checks.emit()
