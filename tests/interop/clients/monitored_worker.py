"""One worker of between-graph asynchronous training with MonitoredTrainingSession.

Each worker process builds its own graph (replica_device_setter) and trains until the
shared global step reaches `last_step`; the chief (task 0) initializes and checkpoints,
the other waits for the chief's variables.

Argument (JSON): {"cluster": {...}, "task": i, "checkpoint_dir": path, "last_step": n}
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_v2_behavior()

arguments = args()
cluster, task = arguments["cluster"], arguments["task"]
checks = Checks()
rng = np.random.default_rng(11)
X = rng.normal(size=(32, 4)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1).astype(np.float32)


def train() -> dict:
    graph = tf.Graph()
    setter = tf1.train.replica_device_setter(cluster=cluster, worker_device=f"/job:worker/task:{task}")
    with graph.as_default(), tf1.device(setter):
        step = tf1.train.get_or_create_global_step()
        w = tf1.get_variable("w", initializer=tf.zeros([4]))
        loss = tf.reduce_mean(tf.square(tf.linalg.matvec(tf.constant(X), w) - tf.constant(Y)))
        train_op = tf1.train.GradientDescentOptimizer(0.05).minimize(loss, global_step=step)
        hooks = [tf1.train.StopAtStepHook(last_step=arguments["last_step"])]
        losses, steps = [], []
        with tf1.train.MonitoredTrainingSession(
            master=target_of(cluster["worker"][task]),
            is_chief=task == 0,
            checkpoint_dir=arguments["checkpoint_dir"] if task == 0 else None,
            hooks=hooks,
            log_step_count_steps=0,
        ) as sess:
            for _ in range(500):  # bounded: the hook stops at last_step
                if sess.should_stop():
                    break
                _, value, now = sess.run([train_op, loss, step])
                losses.append(float(value))
                steps.append(int(now))
    return {"losses": losses, "steps": steps}


checks.run("train", train)
checks.emit()
