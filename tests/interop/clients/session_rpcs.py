"""A TF 1.x client exercising every MasterService RPC a `tf.compat.v1.Session` makes.

Argument (JSON): {"target": master address, "cluster": {job: [addresses]}}.
"""

from __future__ import annotations

import collections
import gc

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of
from tensorflow.core.protobuf import config_pb2

tf1 = tf.compat.v1
tf1.disable_v2_behavior()

config = args()
target = target_of(config["target"])
checks = Checks()
Pair = collections.namedtuple("Pair", ["first", "second"])

graph = tf.Graph()
with graph.as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    n = tf1.placeholder(tf.int32, [], name="n")
    words = tf1.placeholder(tf.string, [None], name="words")
    flag = tf1.placeholder(tf.bool, [], name="flag")
    y = tf.identity(x * 2.0 + 1.0, name="y")
    row_sums = tf.reduce_sum(y, axis=1, name="row_sums")
    gram = tf.matmul(x, x, transpose_b=True, name="gram")
    halves = tf.identity(n // 2, name="halves")
    remainder = tf.math.floormod(n, 3, name="remainder")
    shouted = tf.add(words, "!", name="shouted")
    negated = tf.logical_not(flag, name="negated")
    big = tf.constant(np.arange(100, dtype=np.float32).reshape(10, 10), name="big")  # > 64 bytes
    big_total = tf.reduce_sum(big, name="big_total")
    greeting = tf.constant(["hello", "wörld", ""], name="greeting")
    with tf1.Session(target) as sess:
        feed = {x: np.arange(6, dtype=np.float32).reshape(2, 3)}
        checks.run("arithmetic", lambda: sess.run([y, row_sums, gram], feed))
        checks.run("integers", lambda: sess.run([halves, remainder], {n: 7}))
        checks.run(
            "strings", lambda: sess.run([shouted, greeting], {words: np.array([b"a", b"\xc3\xa9t\xc3\xa9"])})
        )
        checks.run("booleans", lambda: sess.run(negated, {flag: True}))
        checks.run("big_constant", lambda: sess.run(big_total))
        checks.run(
            "nested_fetches",
            lambda: sess.run(
                {"a": y, "b": [row_sums, (big_total, {"c": halves})], "p": Pair(remainder, negated)},
                {x: np.ones((1, 3), np.float32), n: 5, flag: False},
            ),
        )
        checks.run("fetch_a_feed", lambda: sess.run(x, {x: np.full((1, 3), 4.0, np.float32)}))
        # Requests of 128 KiB and more: distserver reads plain feeds as views of the request,
        # and leaves a request with large strings to protobuf.
        large = np.arange(3 * 150_000, dtype=np.float32).reshape(-1, 3)
        checks.run("large_feed", lambda: sess.run([tf.reduce_sum(y), y[-1]], {x: large}))
        large_words = np.array([b"w" * 100] * 10_000)
        checks.run(
            "large_string_feed", lambda: sess.run([tf.size(shouted), y], {x: large[:1], words: large_words})
        )
        # New nodes after the first run: ExtendSession.
        tripled = tf.identity(y * 3.0, name="tripled")
        checks.run("extended", lambda: sess.run(tripled, {x: np.ones((1, 3), np.float32)}))
        checks.run("list_devices", lambda: sorted(d.name for d in sess.list_devices()))
        run_y = sess.make_callable(y, feed_list=[x])
        checks.run("make_callable_feed_list", lambda: run_y(np.ones((1, 3), np.float32)))
        checks.run("make_callable_large_feed", lambda: run_y(large)[-1])
        run_total = sess.make_callable(big_total)
        checks.run("make_callable_no_feeds", run_total)

        def callable_from_options():
            # What Keras' v1 backend does: MakeCallable, RunCallable (twice), ReleaseCallable.
            options = config_pb2.CallableOptions(feed=["x:0"], fetch=["row_sums:0", "gram:0"])
            function = sess._make_callable_from_options(options)
            first = function(np.ones((2, 3), np.float32))
            second = function(np.full((1, 3), 2.0, np.float32))
            del function
            gc.collect()
            return [first, second]

        checks.run("callable_options", callable_from_options)

        # Errors inside steps arrive as the right tf.errors class.
        loose = tf1.placeholder(tf.float32, name="loose")  # no static shape: the server checks
        checks.run("error_bad_reshape", lambda: sess.run(tf.reshape(loose, [5]), {loose: np.ones((2, 3))}))
        checks.run("error_missing_feed", lambda: sess.run(y))
        checks.run(
            "error_bad_matmul",
            lambda: sess.run(tf.matmul(x, x), {x: np.ones((2, 3), np.float32)}),
        )
        labels = tf1.placeholder(tf.int32, [None])
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=x)
        checks.run(
            "error_label_out_of_range",
            lambda: sess.run(xent, {x: np.ones((2, 3), np.float32), labels: [0, 7]}),
        )
        with tf1.device("/job:ps/task:0"):
            never_initialized = tf1.Variable([1.0, 2.0], name="never_initialized")
        checks.run("error_uninitialized", lambda: sess.run(never_initialized))
        queue = tf1.FIFOQueue(2, tf.float32, shapes=[], name="empty_queue")
        dequeue = queue.dequeue()
        checks.run(
            "error_deadline",
            lambda: sess.run(dequeue, options=tf1.RunOptions(timeout_in_ms=300)),
        )
        checks.run("error_partial_run", lambda: sess.partial_run_setup([y], [x]))
        checks.run("after_errors", lambda: sess.run(halves, {n: 9}))

# An op without a kernel: refused when the session is created...
unsupported = tf.Graph()
with unsupported.as_default():
    matrix = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    singular_values = tf.linalg.svd(matrix, compute_uv=False, name="svd")
    with tf1.Session(target) as sess:
        checks.run("error_unsupported_at_create", lambda: sess.run(singular_values))

# ...and when an existing session is extended, which keeps working for the rest.
extended = tf.Graph()
with extended.as_default():
    a = tf.constant(3.0, name="a")
    with tf1.Session(target) as sess:
        checks.run("before_unsupported", lambda: sess.run(a * 2))
        bad = tf.linalg.svd(tf.reshape(tf.range(4.0), [2, 2]), compute_uv=False, name="svd_later")
        checks.run("error_unsupported_at_extend", lambda: sess.run(bad))

# Control flow v2 (a function call) is refused with a hint.
cond_graph = tf.Graph()
with cond_graph.as_default():
    tf1.enable_control_flow_v2()
    p = tf1.placeholder(tf.bool, [])
    chosen = tf.cond(p, lambda: tf.constant(1.0), lambda: tf.constant(2.0))
    with tf1.Session(target) as sess:
        checks.run("control_flow_v2", lambda: sess.run(chosen, {p: True}))

checks.run("reset", lambda: tf1.Session.reset(target))
checks.emit()
