"""TensorArray split/concat (TensorArraySplitV3/TensorArrayConcatV3) and their gradients,
in a loop of control flow v1 and with a weight on the ps, TensorArrayGradWithShape, and
TensorFlow's errors for bad lengths, scalars and shapes; on a distserver cluster and on
TensorFlow alone.

Argument (JSON): {"cluster": {"ps": [a], "worker": [b]}}
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_eager_execution()
tf1.disable_control_flow_v2()
tf1.enable_resource_variables()

cluster = args()["cluster"]
worker = target_of(cluster["worker"][0])
checks = Checks()
VALUE = np.arange(12, dtype=np.float32).reshape(6, 2) / 4.0


def build(remote: bool):
    ps = "/job:ps/task:0" if remote else None
    wk = "/job:worker/task:0" if remote else None
    graph = tf.Graph()
    with graph.as_default():
        with tf1.device(ps):
            w = tf1.get_variable("w", initializer=tf.constant([[1.0, -1.0], [0.5, 2.0]]))
        with tf1.device(wk):
            value = tf1.placeholder(tf.float32, [None, 2], name="value")
            lengths = tf1.placeholder(tf.int64, [None], name="lengths")
            # Pieces of different lengths: the array cannot infer one element shape.
            pieces = tf1.TensorArray(tf.float32, size=tf.size(lengths), infer_shape=False).split(
                value, lengths
            )
            middle = pieces.read(1)
            joined = pieces.concat()
            loss = tf.reduce_sum(tf.tanh(tf.matmul(tf.reshape(joined, [-1, 2]), w)))
            grads = tf.gradients(loss, [value, w])  # Concat's gradient splits, Split's concats
            train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, var_list=[w])

            # Rows grown in a while loop (a dynamic array), concatenated, and the gradient.
            n = tf1.placeholder(tf.int32, [], name="n")
            seed = tf1.placeholder(tf.float32, [2], name="seed")

            def grow(i, ta):
                rows = tf.tile(tf.expand_dims(seed * tf.cast(i + 1, tf.float32), 0), [i + 1, 1])
                return i + 1, ta.write(i, rows)

            grown = tf.while_loop(
                lambda i, ta: i < n,
                grow,
                [0, tf1.TensorArray(tf.float32, size=0, dynamic_size=True, infer_shape=False)],
            )[1]
            grown_rows = grown.concat()
            grown_grad = tf.gradients(tf.reduce_sum(tf.square(grown_rows)), seed)[0]

            # The gradient array of a [3]-element array for elements of shape [2, 3].
            handle, flow = tf.raw_ops.TensorArrayV3(
                size=2, dtype=tf.float32, element_shape=[3], identical_element_shapes=True
            )
            flow = tf.raw_ops.TensorArrayWriteV3(handle=handle, index=0, value=[1.0, 2.0, 3.0], flow_in=flow)
            grad_handle, grad_flow = tf.raw_ops.TensorArrayGradWithShape(
                handle=handle, flow_in=flow, shape_to_prepend=[2], source="g"
            )
            block = tf.reshape(tf.range(6, dtype=tf.float32), [2, 3])
            grad_flow = tf.raw_ops.TensorArrayWriteV3(
                handle=grad_handle, index=1, value=block, flow_in=grad_flow
            )
            grad_flow = tf.raw_ops.TensorArrayWriteV3(
                handle=grad_handle, index=1, value=block, flow_in=grad_flow
            )
            with_shape = tf.raw_ops.TensorArrayGatherV3(
                handle=grad_handle, indices=[0, 1], flow_in=grad_flow, dtype=tf.float32
            )

            scalar_handle, scalar_flow = tf.raw_ops.TensorArrayV3(size=1, dtype=tf.float32)
            scalar_flow = tf.raw_ops.TensorArrayWriteV3(
                handle=scalar_handle, index=0, value=1.0, flow_in=scalar_flow
            )
            scalars = tf.raw_ops.TensorArrayConcatV3(
                handle=scalar_handle, flow_in=scalar_flow, dtype=tf.float32
            )
            fixed = tf1.TensorArray(tf.float32, size=3, infer_shape=True).split(value, lengths)
            too_small = tf1.TensorArray(tf.float32, size=2).split(value, lengths)
        init = tf1.global_variables_initializer()
    nodes = dict(
        value=value, lengths=lengths, middle=middle, joined=joined, grads=grads, train=train, w=w, n=n,
        seed=seed, grown_rows=grown_rows, grown_grad=grown_grad, with_shape=with_shape, scalars=scalars,
        fixed=fixed.flow, too_small=too_small.flow, init=init,
    )  # fmt: skip
    return graph, nodes


def run_all(prefix: str, target: str, remote: bool) -> None:
    graph, g = build(remote)
    feed = {g["value"]: VALUE, g["lengths"]: [1, 3, 2]}
    with tf1.Session(target, graph=graph) as sess:
        sess.run(g["init"])
        checks.run(f"{prefix}/split_concat", lambda: sess.run(g["joined"], feed))
        checks.run(f"{prefix}/split_read", lambda: sess.run(g["middle"], feed))
        checks.run(f"{prefix}/gradients", lambda: sess.run(g["grads"], feed))
        checks.run(
            f"{prefix}/trained", lambda: [sess.run(g["train"], feed) for _ in range(3)] and sess.run(g["w"])
        )
        for count in (1, 3):
            f = {g["n"]: count, g["seed"]: [1.0, -2.0]}
            checks.run(f"{prefix}/grown_{count}", lambda f=f: sess.run([g["grown_rows"], g["grown_grad"]], f))
        checks.run(f"{prefix}/with_shape", lambda: sess.run(g["with_shape"]))
        checks.run(
            f"{prefix}/bad_sum", lambda: sess.run(g["joined"], {g["value"]: VALUE, g["lengths"]: [1, 1, 1]})
        )
        checks.run(f"{prefix}/bad_size", lambda: sess.run(g["too_small"], feed))
        checks.run(f"{prefix}/scalars", lambda: sess.run(g["scalars"]))
        checks.run(f"{prefix}/inferred_shape", lambda: sess.run(g["fixed"], feed))


run_all("distserver", worker, remote=True)
run_all("tensorflow", "", remote=False)
checks.emit()
