"""MonitoredTrainingSession with a checkpoint directory, StopAtStepHook and summaries,
over ps:2 + worker:2, stopped and restarted from its checkpoint; then the same program
on TensorFlow alone.

Argument (JSON): {"cluster": {...}, "checkpoint_dir": path (inside the servers'
checkpoint root), "local_dir": path (for TensorFlow alone)}
"""

from __future__ import annotations

import glob
import os

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_v2_behavior()

arguments = args()
cluster = arguments["cluster"]
checks = Checks()
rng = np.random.default_rng(11)
X = rng.normal(size=(32, 4)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1).astype(np.float32)


def train(target: str, checkpoint_dir: str, last_step: int, remote: bool) -> dict:
    graph = tf.Graph()
    setter = tf1.train.replica_device_setter(cluster=cluster) if remote else None
    with graph.as_default(), tf1.device(setter):
        step = tf1.train.get_or_create_global_step()
        w = tf1.get_variable("w", initializer=tf.zeros([4]))
        b = tf1.get_variable("b", initializer=tf.zeros([]))
        loss = tf.reduce_mean(tf.square(tf.linalg.matvec(tf.constant(X), w) + b - tf.constant(Y)))
        tf1.summary.scalar("loss", loss)
        tf1.summary.histogram("w", w)
        train_op = tf1.train.GradientDescentOptimizer(0.05).minimize(loss, global_step=step)
        hooks = [tf1.train.StopAtStepHook(last_step=last_step)]
        steps = []
        with tf1.train.MonitoredTrainingSession(
            master=target,
            is_chief=True,
            checkpoint_dir=checkpoint_dir,
            hooks=hooks,
            save_checkpoint_steps=5,
            save_summaries_steps=2,
            log_step_count_steps=0,
        ) as sess:
            for _ in range(100):  # bounded: the hook stops at last_step
                if sess.should_stop():
                    break
                _, now = sess.run([train_op, step])
                steps.append(int(now))
            weights = sess.run([w, b]) if not sess.should_stop() else None
    latest = tf1.train.latest_checkpoint(checkpoint_dir)
    reader = tf1.train.load_checkpoint(latest)
    return {
        "steps": steps,
        "latest": os.path.basename(latest),
        "w": reader.get_tensor("w").tolist(),
        "b": float(reader.get_tensor("b")),
        "events": len(glob.glob(os.path.join(checkpoint_dir, "events.out.tfevents.*"))),
        "unused": weights,
    }


def run(prefix: str, target: str, checkpoint_dir: str, remote: bool) -> None:
    checks.run(f"{prefix}/first", lambda: train(target, checkpoint_dir, 10, remote))
    checks.run(f"{prefix}/restarted", lambda: train(target, checkpoint_dir, 15, remote))


run("distserver", target_of(cluster["worker"][0]), arguments["checkpoint_dir"], True)
run("tensorflow", "", arguments["local_dir"], False)
checks.emit()
