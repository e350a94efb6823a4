"""Graph functions in a TF 1.x-style graph (tf.function calls, control flow v2's tf.cond)
on a distserver cluster and on TensorFlow alone.

The graph is built in graph mode (`tf.compat.v1.Session`) with control flow v2 and
resource variables on, as TensorFlow 2 builds it: `tf.function` calls become
`StatefulPartitionedCall`s over the graph's function library, `tf.cond` an `If`.
Every check runs twice: against the cluster ("distserver/<name>", variables on the
ps) and in an in-process TensorFlow session ("tensorflow/<name>").

Argument (JSON): {"cluster": {"ps": [a], "worker": [b]}}
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_eager_execution()
tf1.enable_control_flow_v2()
tf1.enable_resource_variables()

cluster = args()["cluster"]
worker = target_of(cluster["worker"][0])
checks = Checks()


def build(remote: bool) -> tuple[tf.Graph, dict]:
    ps = "/job:ps/task:0" if remote else None
    wk = "/job:worker/task:0" if remote else None
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [3], name="x")
        pred = tf1.placeholder(tf.bool, [], name="pred")
        with tf1.device(ps):
            w = tf1.get_variable("w", initializer=tf.constant([1.0, 2.0, 3.0]))
            counter = tf1.get_variable("counter", initializer=tf.constant(0.0))

        @tf.function
        def affine(v):
            return tf.reduce_sum(v * w) + 1.0

        @tf.function
        def doubled(v):  # a function calling a function
            return affine(v) * 2.0

        @tf.function
        def update(v):  # a side effect on the ps, then the new value
            w.assign_sub(0.125 * v)
            return w.read_value()

        @tf.function
        def on_each_task(v):  # a body that spans tasks
            with tf.device(ps):
                near = tf.reduce_sum(w)
            with tf.device(wk):
                far = tf.reduce_max(v)
            return near * far

        with tf1.device(wk):
            y = affine(x)
            yy = doubled(x)
            spans = on_each_task(x)
            chosen = tf.cond(pred, lambda: tf.reduce_sum(x * w), lambda: tf.reduce_sum(x) - 1.0)
            grad_w = tf.gradients(chosen, w)[0]
            grad_fn = tf.gradients(affine(x), [x, w])
            loss = tf.square(affine(x))
            train = tf1.train.GradientDescentOptimizer(0.01).minimize(loss, var_list=[w])

            def bump():
                with tf1.device(ps):
                    bumped = counter.assign_add(1.0)
                with tf.control_dependencies([bumped]):
                    return tf.identity(x[0])

            one_branch = tf.cond(pred, bump, lambda: tf.identity(x[1]))
            index = tf1.placeholder(tf.int32, [], name="index")
            switched = tf.switch_case(
                index, [lambda: tf.reduce_sum(x * w), lambda: x[0] * 2.0, lambda: tf.reduce_max(x)]
            )
        updated = update(x)
        init = tf1.global_variables_initializer()
    nodes = dict(
        x=x, pred=pred, w=w, counter=counter, y=y, yy=yy, spans=spans, chosen=chosen,
        grad_w=grad_w, grad_fn=grad_fn, train=train, loss=loss, one_branch=one_branch,
        updated=updated, init=init, index=index, switched=switched,
    )  # fmt: skip
    return graph, nodes


def run_all(prefix: str, target: str, remote: bool) -> None:
    graph, n = build(remote)
    xs = np.array([1.0, 2.0, 4.0], np.float32)
    feed = {n["x"]: xs}
    with tf1.Session(target, graph=graph) as sess:
        sess.run(n["init"])
        checks.run(f"{prefix}/call", lambda: sess.run(n["y"], feed))
        checks.run(f"{prefix}/nested_call", lambda: sess.run(n["yy"], feed))
        checks.run(f"{prefix}/body_on_each_task", lambda: sess.run(n["spans"], feed))
        for pred in (True, False):
            checks.run(f"{prefix}/cond_{pred}", lambda p=pred: sess.run(n["chosen"], {**feed, n["pred"]: p}))
            checks.run(
                f"{prefix}/cond_grad_{pred}", lambda p=pred: sess.run(n["grad_w"], {**feed, n["pred"]: p})
            )
        for index in (-1, 0, 1, 2, 7):
            checks.run(
                f"{prefix}/switch_case_{index}",
                lambda i=index: sess.run(n["switched"], {**feed, n["index"]: i}),
            )
        checks.run(f"{prefix}/call_grad", lambda: sess.run(n["grad_fn"], feed))
        for pred in (True, True, False):
            sess.run(n["one_branch"], {**feed, n["pred"]: pred})
        checks.run(f"{prefix}/one_branch_updates", lambda: sess.run(n["counter"]))
        checks.run(f"{prefix}/update", lambda: [sess.run(n["updated"], feed) for _ in range(2)])
        checks.run(f"{prefix}/train", lambda: [sess.run([n["train"], n["loss"]], feed)[1] for _ in range(3)])
        checks.run(f"{prefix}/after_train", lambda: sess.run(n["w"]))


run_all("distserver", worker, remote=True)
run_all("tensorflow", "", remote=False)
checks.emit()
