"""One worker of between-graph synchronous training with SyncReplicasOptimizer.

Two of these run at once (task 0 is the chief), each with its own graph
(replica_device_setter) and MonitoredTrainingSession with the optimizer's hook;
every global step averages one gradient from each worker (replicas_to_aggregate=2,
total_num_replicas=2). The model has a dense part (ConditionalAccumulator) and an
embedding (SparseConditionalAccumulator); each worker has its own data, so each
update is the mean of two different gradients.

num_tokens=0 makes the workers move in lockstep (a worker waits for the update
before its next step), so the result does not depend on timing. The non-chief starts
its session once the chief has created its own (`ready_file`), which saves the 30 s
TensorFlow's SessionManager would otherwise sleep between readiness checks.

Argument (JSON): {"cluster": {...}, "task": i, "last_step": n, "ready_file": path}
"""

from __future__ import annotations

import os
import time

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_v2_behavior()

arguments = args()
cluster, task = arguments["cluster"], arguments["task"]
is_chief = task == 0
checks = Checks()
rng = np.random.default_rng(5 + task)  # each worker its own batch
X = rng.normal(size=(16, 4)).astype(np.float32)
IDS = rng.integers(0, 6, size=(16, 2)).astype(np.int64)
Y = (X @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.3 * IDS.sum(axis=1)).astype(np.float32)


class ChiefReady(tf1.train.SessionRunHook):
    """Tells the other worker that the chief's session exists (the model is initialized)."""

    def after_create_session(self, session, coord):
        with open(arguments["ready_file"], "w") as f:
            f.write("ready")


def train() -> dict:
    graph = tf.Graph()
    setter = tf1.train.replica_device_setter(cluster=cluster, worker_device=f"/job:worker/task:{task}")
    with graph.as_default(), tf1.device(setter):
        step = tf1.train.get_or_create_global_step()
        w = tf1.get_variable("w", initializer=tf.zeros([4]))
        b = tf1.get_variable("b", initializer=tf.zeros([]))
        emb = tf1.get_variable("emb", initializer=tf.fill([6, 3], 0.1))
        features = tf.reduce_sum(tf.nn.embedding_lookup(emb, tf.constant(IDS)), axis=[1, 2])
        prediction = tf.linalg.matvec(tf.constant(X), w) + b + features
        loss = tf.reduce_mean(tf.square(prediction - tf.constant(Y)))
        optimizer = tf1.train.SyncReplicasOptimizer(
            tf1.train.GradientDescentOptimizer(0.02), replicas_to_aggregate=2, total_num_replicas=2
        )
        train_op = optimizer.minimize(loss, global_step=step)
        hooks = [
            optimizer.make_session_run_hook(is_chief, num_tokens=0),
            tf1.train.StopAtStepHook(last_step=arguments["last_step"]),
        ]
        if is_chief:
            hooks.append(ChiefReady())
        else:
            deadline = time.monotonic() + 120
            while not os.path.exists(arguments["ready_file"]) and time.monotonic() < deadline:
                time.sleep(0.1)
        target = target_of(cluster["worker"][task])
        losses, steps = [], []
        with tf1.train.MonitoredTrainingSession(
            master=target,
            is_chief=is_chief,
            hooks=hooks,
            log_step_count_steps=0,
            save_checkpoint_secs=None,
            save_summaries_steps=None,
            stop_grace_period_secs=3,
            max_wait_secs=90,  # the non-chief gives up if the chief never gets ready
        ) as sess:
            for _ in range(200):  # bounded: the hook stops at last_step
                if sess.should_stop():
                    break
                _, value, now = sess.run([train_op, loss, step])
                losses.append(float(value))
                steps.append(int(now))
        result = {"losses": losses, "steps": steps}
        if is_chief:
            # The variables live on the ps task beyond the training session.
            with tf1.Session(target) as plain:
                result.update(
                    zip(["w", "b", "emb", "global_step"], plain.run([w, b, emb, step]), strict=True)
                )
    return result


checks.run("train", train)
checks.emit()
