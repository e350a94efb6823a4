"""Loops of control flow v1 (Enter/Exit/NextIteration/LoopCond, what tf.while_loop builds
under disable_control_flow_v2) on a distserver cluster and on TensorFlow alone.

Every check runs twice: against the cluster ("distserver/<name>") and in an in-process
TensorFlow session ("tensorflow/<name>"); the test compares the two.

Argument (JSON): {"cluster": {"ps": [a], "worker": [b]}}
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_v2_behavior()
tf1.disable_control_flow_v2()

cluster = args()["cluster"]
worker = target_of(cluster["worker"][0])
checks = Checks()


def build(remote: bool) -> tuple[tf.Graph, dict]:
    ps = "/job:ps/task:0" if remote else None
    wk = "/job:worker/task:0" if remote else None
    graph = tf.Graph()
    with graph.as_default():
        n = tf1.placeholder(tf.int32, [], name="n")
        x = tf1.placeholder(tf.float32, [3], name="x")
        pred = tf1.placeholder(tf.bool, [], name="pred")
        with tf1.device(ps):
            scale_on_ps = tf1.get_variable("scale_on_ps", initializer=tf.constant(2.0), use_resource=False)
            counter = tf1.get_variable("counter", initializer=tf.constant(0.0), use_resource=False)
            w_rnn = tf1.get_variable(
                "w_rnn",
                initializer=tf.constant([[0.5, -0.2, 0.1], [0.3, 0.4, -0.5], [-0.1, 0.2, 0.3]]),
                use_resource=True,
            )
            u_rnn = tf1.get_variable(
                "u_rnn",
                initializer=tf.constant([[0.2, 0.1, -0.3], [0.0, 0.5, 0.2], [0.4, -0.1, 0.1]]),
                use_resource=True,
            )
            total_ps = tf1.get_variable("total_ps", initializer=tf.constant(0.0), use_resource=True)
        with tf1.device(wk):
            scale = tf1.get_variable("scale", initializer=tf.constant(0.5), use_resource=False)
            # The counting loop, and a loop carrying a vector (x * 1.5^n).
            count = tf.while_loop(lambda i: i < n, lambda i: i + 1, [0])
            _, powered = tf.while_loop(lambda i, v: i < n, lambda i, v: (i + 1, v * 1.5), [0, x])
            # Its gradient: a second loop popping the first one's values off stacks.
            _, squared = tf.while_loop(lambda i, v: i < n, lambda i, v: (i + 1, v * v * 0.5), [0, x])
            grad = tf.gradients(tf.reduce_sum(squared), x)[0]

            # TensorArrays: written in a loop of n iterations, and an RNN over the rows of
            # `x` (unstacked into an array, outputs stacked from another) with its gradient.
            def write(i, ta):
                return i + 1, ta.write(i, tf.cast(i, tf.float32) * x[0])

            written = tf.while_loop(lambda i, ta: i < n, write, [0, tf.TensorArray(tf.float32, size=n)])[1]
            stacked = written.stack()
            rows = tf.reshape(tf.tile(x, [4]), [4, 3]) * tf.constant([[1.0], [0.5], [-1.0], [2.0]])
            inputs = tf.TensorArray(tf.float32, size=4).unstack(rows)

            def rnn_step(i, h, outputs):
                h = tf.tanh(h * 0.5 + inputs.read(i))
                return i + 1, h, outputs.write(i, h)

            rnn_outputs = tf.while_loop(
                lambda i, h, o: i < 4, rnn_step, [0, tf.zeros([3]), tf.TensorArray(tf.float32, size=4)]
            )[2].stack()
            rnn_grad = tf.gradients(tf.reduce_sum(rnn_outputs * rnn_outputs), x)[0]
            serial = tf.while_loop(
                lambda i, v: i < n, lambda i, v: (i + 1, v * 1.5 + 1.0), [0, x], parallel_iterations=1
            )[1]

            # Nested loops with a cond inside the outer body.
            def outer(i, total):
                inner = tf.while_loop(lambda j, s: j < i, lambda j, s: (j + 1, s + 1.0), [0, 0.0])[1]
                step = tf.cond(tf.equal(i % 2, 0), lambda: inner, lambda: -inner)
                return i + 1, total + step

            alternating = tf.while_loop(lambda i, t: i < n, outer, [0, 0.0])[1]
            # A loop inside a cond: dead on the branch not taken.
            in_cond = tf.cond(
                pred,
                lambda: tf.while_loop(lambda i, v: i < n, lambda i, v: (i + 1, v + 2.0), [0, x])[1],
                lambda: x - 1.0,
            )
            # A loop reading a variable of its own task in its body, and one of the ps
            # read before the loop (a loop invariant).
            local_read = tf.while_loop(lambda i, v: i < n, lambda i, v: (i + 1, v * scale), [0, x])[1]
            ps_value = tf.identity(scale_on_ps)
            ps_invariant = tf.while_loop(lambda i, v: i < n, lambda i, v: (i + 1, v * ps_value), [0, x])[1]
            # A loop whose body reads the ps variable itself (the loop takes its value in
            # once, through an Enter: the read is outside the loop).
            ps_read_in_body = tf.while_loop(
                lambda i, v: i < n, lambda i, v: (i + 1, v * scale_on_ps), [0, x]
            )[1]

            # A loop whose body updates a variable on the ps each iteration: the body
            # spans two tasks.
            def bump(i):
                with tf1.device(ps):
                    update = tf1.assign_add(counter, 1.0)
                with tf.control_dependencies([update]):
                    return i + 1

            bumped = tf.while_loop(lambda i: i < n, bump, [0])

            # An RNN whose weights (resource variables on the ps) are read in the body at
            # every step, trained by gradient descent: the loop and its gradient loop run
            # on both tasks.
            sequence = tf.reshape(tf.tile(x, [4]), [4, 3]) * tf.constant([[1.0], [0.5], [-1.0], [2.0]])

            def ps_rnn_step(i, h):
                row = tf.reshape(sequence[i], [1, 3])
                return i + 1, tf.tanh(tf.matmul(h, w_rnn) + tf.matmul(row, u_rnn))

            h_final = tf.while_loop(lambda i, h: i < 4, ps_rnn_step, [0, tf.zeros([1, 3])])[1]
            rnn_loss = tf.reduce_sum(tf.square(h_final - 0.5))
            rnn_train = tf1.train.GradientDescentOptimizer(0.05).minimize(rnn_loss)

            # Nested loops whose inner body updates a variable on the ps.
            def outer_bump(i):
                def inner_bump(j):
                    with tf1.device(ps):
                        update = total_ps.assign_add(1.0)
                    with tf.control_dependencies([update]):
                        return j + 1

                inner = tf.while_loop(lambda j: j < i, inner_bump, [0])[0]
                with tf.control_dependencies([inner]):
                    return i + 1

            nested_bumped = tf.while_loop(lambda i: i < n, outer_bump, [0])
            # A loop spanning tasks on a branch of a cond: dead when not taken.
            ps_in_cond = tf.cond(
                pred,
                lambda: tf.while_loop(
                    lambda i, v: i < n, lambda i, v: (i + 1, tf.matmul(v, w_rnn)), [0, tf.ones([1, 3])]
                )[1],
                lambda: tf.zeros([1, 3]),
            )
        init = tf1.global_variables_initializer()
    nodes = dict(
        n=n, x=x, pred=pred, count=count, grad=grad, stacked=stacked,
        rnn_outputs=rnn_outputs, rnn_grad=rnn_grad, powered=powered, serial=serial, alternating=alternating,
        in_cond=in_cond, local_read=local_read, ps_invariant=ps_invariant, ps_read_in_body=ps_read_in_body,
        bumped=bumped, counter=counter, w_rnn=w_rnn, u_rnn=u_rnn, rnn_loss=rnn_loss, rnn_train=rnn_train,
        total_ps=total_ps, nested_bumped=nested_bumped, ps_in_cond=ps_in_cond,
        init=init,
    )  # fmt: skip
    return graph, nodes


def run_all(prefix: str, target: str, remote: bool) -> None:
    graph, g = build(remote)
    xs = np.array([1.0, 2.0, 4.0], np.float32)
    with tf1.Session(target, graph=graph) as sess:
        sess.run(g["init"])
        for count in (0, 1, 5):
            feed = {g["x"]: xs, g["n"]: count}
            checks.run(f"{prefix}/count_{count}", lambda f=feed: sess.run(g["count"], f))
            checks.run(f"{prefix}/powered_{count}", lambda f=feed: sess.run(g["powered"], f))
            checks.run(f"{prefix}/grad_{count}", lambda f=feed: sess.run(g["grad"], f))
            checks.run(f"{prefix}/tensor_array_{count}", lambda f=feed: sess.run(g["stacked"], f))
            checks.run(f"{prefix}/serial_{count}", lambda f=feed: sess.run(g["serial"], f))
            checks.run(f"{prefix}/alternating_{count}", lambda f=feed: sess.run(g["alternating"], f))
            checks.run(f"{prefix}/local_read_{count}", lambda f=feed: sess.run(g["local_read"], f))
            checks.run(f"{prefix}/ps_invariant_{count}", lambda f=feed: sess.run(g["ps_invariant"], f))
            for taken in (True, False):
                checks.run(
                    f"{prefix}/in_cond_{taken}_{count}",
                    lambda f=feed, t=taken: sess.run(g["in_cond"], {**f, g["pred"]: t}),
                )
            checks.run(f"{prefix}/ps_read_in_body_{count}", lambda f=feed: sess.run(g["ps_read_in_body"], f))
        checks.run(f"{prefix}/rnn_outputs", lambda: sess.run(g["rnn_outputs"], {g["x"]: xs}))
        checks.run(f"{prefix}/rnn_grad", lambda: sess.run(g["rnn_grad"], {g["x"]: xs}))
        checks.run(
            f"{prefix}/ps_updates_in_body",
            lambda: np.hstack(sess.run([g["bumped"], g["counter"]], {g["n"]: 3})),
        )
        for taken in (True, False):
            feed = {g["n"]: 3, g["pred"]: taken}
            checks.run(f"{prefix}/ps_in_cond_{taken}", lambda f=feed: sess.run(g["ps_in_cond"], f))
        checks.run(
            f"{prefix}/nested_ps_updates",
            # The variable is read in a step of its own: a resource variable's read in the
            # loop's step is not ordered after the loop, in TensorFlow either.
            lambda: np.hstack([sess.run(g["nested_bumped"], {g["n"]: 4}), sess.run(g["total_ps"])]),
        )
        losses = [sess.run([g["rnn_train"], g["rnn_loss"]], {g["x"]: xs})[1] for _ in range(4)]
        checks.run(f"{prefix}/ps_rnn_losses", lambda: losses)
        checks.run(f"{prefix}/ps_rnn_weights", lambda: sess.run([g["w_rnn"], g["u_rnn"]]))


run_all("distserver", worker, remote=True)
run_all("tensorflow", "", remote=False)
checks.emit()
