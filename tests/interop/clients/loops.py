"""Control flow v2 loops in a graph-mode session (tf.while_loop and its gradient,
map_fn, a cond inside a loop, nested loops, a loop updating a variable) on a
distserver cluster and on TensorFlow alone.

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
        n = tf1.placeholder(tf.int32, [], name="n")
        with tf1.device(ps):
            counter = tf1.get_variable("counter", initializer=tf.constant(0.0))
            w = tf1.get_variable("w", initializer=tf.constant([[0.5, -0.25], [0.125, 0.75]]))
        sequence = tf1.placeholder(tf.float32, [None, 2], name="sequence")
        with tf1.device(wk):
            # x * 1.5^n by a loop, and its gradient with respect to x.
            _, powered = tf.while_loop(lambda i, v: i < n, lambda i, v: (i + 1, v * 1.5), [0, x])
            grad = tf.gradients(tf.reduce_sum(powered * powered), x)[0]

            # A loop with a cond inside and a nested loop.
            def body(i, total):
                inner = tf.while_loop(lambda j, s: j < i, lambda j, s: (j + 1, s + 1.0), [0, 0.0])[1]
                step = tf.cond(tf.equal(i % 2, 0), lambda: inner, lambda: -inner)
                return i + 1, total + step

            _, alternating = tf.while_loop(lambda i, t: i < n, body, [0, 0.0])
            mapped = tf.map_fn(lambda v: v * v + 1.0, x)
            squares = tf.map_fn(lambda v: tf.reduce_sum(tf.range(v)), tf.range(5))

            # A TensorArray written in a loop.
            def write(i, ta):
                return i + 1, ta.write(i, tf.cast(i, tf.float32) * x[0])

            _, array = tf.while_loop(lambda i, ta: i < n, write, [0, tf.TensorArray(tf.float32, size=n)])
            stacked = array.stack()
        with tf1.device(ps):
            # A loop on the ps that updates a variable there each iteration.
            def bump(i):
                with tf.control_dependencies([counter.assign_add(2.0)]):
                    return i + 1

            bumped = tf.while_loop(lambda i: i < n, bump, [0])
        with tf1.device(wk):
            # A loop updating a variable on the ps and one on the worker each iteration:
            # its body spans both tasks.
            local_counter = tf1.get_variable("local_counter", initializer=tf.constant(0.0))

            def bump_both(i):
                with tf.control_dependencies([counter.assign_add(1.0), local_counter.assign_add(3.0)]):
                    return i + 1

            bumped_both = tf.while_loop(lambda i: i < n, bump_both, [0], parallel_iterations=1)
        with tf1.device(wk):
            # A small RNN unrolled by a loop with its weights on the ps, trained.
            def cell(i, h):
                return i + 1, tf.tanh(tf.linalg.matvec(w, h) + sequence[i])

            steps = tf.shape(sequence)[0]
            _, state = tf.while_loop(lambda i, h: i < steps, cell, [0, tf.zeros([2])])
            rnn_loss = tf.reduce_sum(tf.square(state - 0.5))
            rnn_train = tf1.train.GradientDescentOptimizer(0.5).minimize(rnn_loss, var_list=[w])
        init = tf1.global_variables_initializer()
    nodes = dict(
        x=x, n=n, powered=powered, grad=grad, alternating=alternating, mapped=mapped,
        squares=squares, stacked=stacked, bumped=bumped, counter=counter, init=init,
        bumped_both=bumped_both, local_counter=local_counter,
        w=w, sequence=sequence, rnn_loss=rnn_loss, rnn_train=rnn_train,
    )  # fmt: skip
    return graph, nodes


def run_all(prefix: str, target: str, remote: bool) -> None:
    graph, g = build(remote)
    xs = np.array([1.0, 2.0, 4.0], np.float32)
    with tf1.Session(target, graph=graph) as sess:
        sess.run(g["init"])
        for count in (0, 3):
            feed = {g["x"]: xs, g["n"]: count}
            checks.run(f"{prefix}/while_{count}", lambda f=feed: sess.run(g["powered"], f))
            checks.run(f"{prefix}/while_grad_{count}", lambda f=feed: sess.run(g["grad"], f))
            checks.run(f"{prefix}/nested_with_cond_{count}", lambda f=feed: sess.run(g["alternating"], f))
            checks.run(f"{prefix}/tensor_array_{count}", lambda f=feed: sess.run(g["stacked"], f).tolist())
        checks.run(f"{prefix}/map_fn", lambda: sess.run(g["mapped"], {g["x"]: xs}))
        checks.run(f"{prefix}/map_fn_ints", lambda: sess.run(g["squares"]))
        seq = np.array([[1.0, 0.0], [0.5, -1.0], [0.0, 2.0], [1.5, 0.5]], np.float32)
        checks.run(
            f"{prefix}/rnn_training",
            lambda: [sess.run([g["rnn_train"], g["rnn_loss"]], {g["sequence"]: seq})[1] for _ in range(4)],
        )
        checks.run(f"{prefix}/rnn_weights", lambda: sess.run(g["w"]))
        checks.run(
            f"{prefix}/loop_on_ps",
            lambda: [float(sess.run(g["bumped"], {g["n"]: 4})[0]), sess.run(g["counter"])],
        )
        checks.run(
            f"{prefix}/loop_on_two_tasks",
            lambda: [
                float(sess.run(g["bumped_both"], {g["n"]: 5})[0]),
                *sess.run([g["counter"], g["local_counter"]]),
            ],
        )


run_all("distserver", worker, remote=True)
run_all("tensorflow", "", remote=False)
checks.emit()
