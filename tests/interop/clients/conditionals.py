"""TF 1.x conditionals (Switch/Merge, dead tensors) on a distserver cluster and on TensorFlow alone.

Every check runs twice: against the cluster ("distserver/<name>") and in an
in-process TensorFlow session ("tensorflow/<name>"); the test compares the two.

Argument (JSON): {"cluster": {"ps": [a], "worker": [b]}}
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_v2_behavior()

cluster = args()["cluster"]
worker = target_of(cluster["worker"][0])
checks = Checks()


def on(device: str | None):
    return tf1.device(device)


def build(remote: bool) -> tuple[tf.Graph, dict]:
    ps = "/job:ps/task:0" if remote else None
    wk = "/job:worker/task:0" if remote else None
    graph = tf.Graph()
    with graph.as_default():
        pred = tf1.placeholder(tf.bool, [], name="pred")
        x = tf1.placeholder(tf.float32, [3], name="x")
        with on(ps):
            weights = tf1.get_variable("w", initializer=tf.constant([1.0, 2.0, 3.0]))

        # A branch on each task: the false branch runs on ps, the true one on the worker.
        def true_branch():
            with on(wk):
                return tf.reduce_sum(x * weights) + 100.0

        def false_branch():
            with on(ps):
                return tf.reduce_sum(weights) - tf.reduce_sum(x)

        chosen = tf1.cond(pred, true_branch, false_branch)
        index = tf1.placeholder(tf.int32, [], name="index")
        case = tf1.case(
            [(tf.equal(index, 0), lambda: tf.constant(10.0)), (tf.equal(index, 1), lambda: x[0] * 2.0)],
            default=lambda: tf.reduce_max(x),
            exclusive=True,
        )
        step = tf1.train.get_or_create_global_step()
        with on(ps):
            bump = tf1.assign_add(step, 1)
        rate = tf1.train.piecewise_constant(step, [2, 4], [1.0, 0.5, 0.1])
        # Updating a variable on one branch only: the other branch must leave it alone.
        with on(ps):
            counter = tf1.get_variable("counter", initializer=tf.constant(0.0))
        update = tf1.cond(pred, lambda: tf1.assign_add(counter, 1.0), lambda: tf.identity(counter))
        # A float assertion: a cond around an Assert.
        checked = tf1.debugging.assert_less(x, 50.0, message="x too large")
        with tf1.control_dependencies([checked]):
            guarded = tf.identity(x)
        _, switch_true = tf1.raw_ops.Switch(data=x, pred=pred)
        init = tf1.global_variables_initializer()
    nodes = dict(
        pred=pred, x=x, chosen=chosen, index=index, case=case, bump=bump, rate=rate,
        update=update, counter=counter, guarded=guarded, switch_true=switch_true, init=init,
    )  # fmt: skip
    return graph, nodes


def run_all(prefix: str, target: str, remote: bool) -> None:
    graph, n = build(remote)
    xs = np.array([1.0, 2.0, 4.0], np.float32)
    with tf1.Session(target, graph=graph) as sess:
        sess.run(n["init"])
        for pred in (True, False):
            checks.run(
                f"{prefix}/cond_{pred}", lambda p=pred: sess.run(n["chosen"], {n["pred"]: p, n["x"]: xs})
            )
        for index in (0, 1, 2):
            checks.run(
                f"{prefix}/case_{index}", lambda i=index: sess.run(n["case"], {n["index"]: i, n["x"]: xs})
            )
        rates = []
        for _ in range(6):
            rates.append(float(sess.run(n["rate"])))
            sess.run(n["bump"])
        checks.run(f"{prefix}/piecewise_constant", lambda: rates)
        for pred in (True, True, False):
            sess.run(n["update"], {n["pred"]: pred})
        checks.run(f"{prefix}/one_branch_updates", lambda: sess.run(n["counter"]))
        checks.run(f"{prefix}/assert_passes", lambda: sess.run(n["guarded"], {n["x"]: xs}))
        checks.run(f"{prefix}/assert_fails", lambda: sess.run(n["guarded"], {n["x"]: xs * 100}))
        checks.run(f"{prefix}/fetch_dead", lambda: sess.run(n["switch_true"], {n["pred"]: False, n["x"]: xs}))
        checks.run(f"{prefix}/fetch_live", lambda: sess.run(n["switch_true"], {n["pred"]: True, n["x"]: xs}))


def monitored(prefix: str, target: str, remote: bool) -> list[int]:
    if remote:
        tf1.Session.reset(target)  # the checks above left variables (w, global_step) on the ps
    graph = tf.Graph()
    setter = tf1.train.replica_device_setter(cluster=cluster) if remote else None
    with graph.as_default(), tf1.device(setter):
        step = tf1.train.get_or_create_global_step()
        w = tf1.get_variable("w", initializer=tf.constant(1.0))
        train = tf.group(tf1.assign_add(w, 0.5), tf1.assign_add(step, 1))
        hooks = [tf1.train.StopAtStepHook(last_step=5)]
        seen = []
        with tf1.train.MonitoredTrainingSession(master=target, is_chief=True, hooks=hooks) as sess:
            for _ in range(20):  # bounded: the hook stops at step 5
                if sess.should_stop():
                    break
                _, now = sess.run([train, step])
                seen.append(int(now))
    return seen


run_all("distserver", worker, remote=True)
run_all("tensorflow", "", remote=False)
checks.run("distserver/monitored_session", lambda: monitored("distserver", worker, True))
checks.run("tensorflow/monitored_session", lambda: monitored("tensorflow", "", False))
checks.emit()
