"""tf.data input pipelines in graph mode on a distserver cluster and on TensorFlow alone:
from_tensor_slices -> map -> shuffle -> batch -> repeat through one-shot and
initializable iterators, filter/take/skip/prefetch, zip of ranges, padded_batch, cache
(in memory), unbatch, flat_map, interleave, feeding a training loop on the worker until OutOfRangeError.
Shuffled orders differ from TensorFlow's; the multisets of elements and the batch
shapes must not.

Argument (JSON): {"cluster": {"ps": [a], "worker": [b]}}
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_eager_execution()
tf1.enable_resource_variables()

cluster = args()["cluster"]
worker = target_of(cluster["worker"][0])
checks = Checks()
FEATURES = np.arange(10, dtype=np.float32)
LABELS = np.arange(10, dtype=np.int64) % 3


def drain(sess, fetch, limit=100):
    out = []
    for _ in range(limit):  # bounded: every pipeline here ends
        try:
            out.append(sess.run(fetch))
        except tf.errors.OutOfRangeError:
            return out, "OutOfRangeError"
    return out, "no end"


def drain_errors(sess, fetch, limit=20):
    """Every element, or the class of the error a GetNext raised in its place, up to the end."""
    out = []
    for _ in range(limit):
        try:
            out.append(sess.run(fetch).tolist())
        except tf.errors.OutOfRangeError:
            return out
        except tf.errors.OpError as exc:
            out.append(type(exc).__name__)
    return out


def run_all(prefix: str, target: str, remote: bool) -> None:
    ps = "/job:ps/task:0" if remote else None
    wk = "/job:worker/task:0" if remote else None
    graph = tf.Graph()
    with graph.as_default():
        with tf1.device(ps):
            w = tf1.get_variable("w", initializer=tf.constant(0.0))
        with tf1.device(wk):
            pipeline = (
                tf.data.Dataset.from_tensor_slices((FEATURES, LABELS))
                .map(lambda x, y: (x * 2.0, y + 1))
                .shuffle(4, seed=3)
                .batch(3)
                .repeat(2)
            )
            one_shot = tf1.data.make_one_shot_iterator(pipeline).get_next()
            size = tf1.placeholder(tf.int64, [], name="size")
            filtered = (
                tf.data.Dataset.range(size).filter(lambda v: tf.equal(v % 2, 0)).skip(1).take(3).prefetch(1)
            )
            initializable = tf1.data.make_initializable_iterator(filtered)
            item = initializable.get_next()
            zipped = tf1.data.make_one_shot_iterator(
                tf.data.Dataset.zip((tf.data.Dataset.range(4), tf.data.Dataset.range(10, 13)))
            ).get_next()
            # Training from a pipeline: every batch's mean added into w on the ps.
            train_batch = tf1.data.make_one_shot_iterator(
                tf.data.Dataset.from_tensor_slices(FEATURES).batch(4)
            ).get_next()
            train = tf1.assign_add(w, tf.reduce_mean(train_batch))
            plain = tf1.data.make_one_shot_iterator(
                tf.data.Dataset.from_tensor_slices(FEATURES).batch(4)
            ).get_next()
            # Variable-length rows padded into batches, cached in memory over 2 epochs,
            # unbatched and batched again; a padded shape too small for an element.
            ragged = tf.data.Dataset.range(1, 6).map(lambda n: (tf.range(n) * 10, tf.fill([n, 2], n)))
            padded = tf1.data.make_one_shot_iterator(
                ragged.padded_batch(
                    2,
                    padded_shapes=([-1], [-1, 3]),
                    padding_values=(tf.constant(-1, tf.int64), tf.constant(7, tf.int64)),
                )
                .cache()
                .repeat(2)
            ).get_next()
            rebatched = tf1.data.make_one_shot_iterator(
                ragged.map(lambda a, b: a).padded_batch(2, padded_shapes=[5]).unbatch().batch(3)
            ).get_next()
            too_small = tf1.data.make_one_shot_iterator(
                tf.data.Dataset.range(1, 6).map(lambda n: tf.range(n)).padded_batch(2, padded_shapes=[3])
            ).get_next()
            # Prefetched elements of a parallel map that fails for some: errors in their places.
            prefetched = tf1.data.make_initializable_iterator(
                tf.data.Dataset.range(6)
                .map(
                    lambda v: tf.gather(tf.constant([10, 20, 30, 40], tf.int64), 3 - v) + v,
                    num_parallel_calls=tf.data.AUTOTUNE,
                )
                .prefetch(2)
            )
            prefetched_next = prefetched.get_next()
            # Datasets of datasets: flat_map, interleave (TensorFlow's order), and the
            # parallel interleave and batch.
            counts = tf.data.Dataset.range(1, 6)

            def spread(n):
                return tf.data.Dataset.range(n).map(lambda v: v + 10 * n)

            nested = {
                "flat_map": counts.flat_map(spread),
                "interleave": counts.interleave(spread, cycle_length=2, block_length=2),
                "parallel_interleave": counts.interleave(
                    lambda n: tf.data.Dataset.from_tensors(n).repeat(n), cycle_length=3, num_parallel_calls=2
                ),
                "parallel_batch": counts.batch(2, num_parallel_calls=2),
            }
            nested = {name: tf1.data.make_one_shot_iterator(d).get_next() for name, d in nested.items()}
        init = tf1.global_variables_initializer()
    with tf1.Session(target, graph=graph) as sess:
        sess.run(init)
        batches, end = drain(sess, one_shot)
        checks.run(f"{prefix}/one_shot_end", lambda: end)
        checks.run(f"{prefix}/one_shot_shapes", lambda: [list(b[0].shape) for b in batches])
        checks.run(
            f"{prefix}/one_shot_elements",
            lambda: sorted(
                zip(
                    np.concatenate([b[0] for b in batches]).tolist(),
                    np.concatenate([b[1] for b in batches]).tolist(),
                    strict=True,
                )
            ),
        )
        for n in (10, 3):
            sess.run(initializable.initializer, {size: n})
            checks.run(f"{prefix}/initializable_{n}", lambda: drain(sess, item))
        checks.run(f"{prefix}/zip", lambda: drain(sess, zipped))
        _, end = drain(sess, train)
        checks.run(f"{prefix}/train", lambda: [end, sess.run(w)])
        checks.run(f"{prefix}/in_order", lambda: drain(sess, plain))
        checks.run(f"{prefix}/padded_cached", lambda: drain(sess, padded))
        checks.run(f"{prefix}/unbatched", lambda: drain(sess, rebatched))
        checks.run(f"{prefix}/padded_too_small", lambda: drain(sess, too_small))
        for name, fetch in nested.items():
            checks.run(f"{prefix}/{name}", lambda fetch=fetch: drain(sess, fetch))
        for attempt in range(2):  # a new pass stops the old one's prefetching
            sess.run(prefetched.initializer)
            checks.run(f"{prefix}/prefetched_{attempt}", lambda: drain_errors(sess, prefetched_next))


run_all("distserver", worker, remote=True)
run_all("tensorflow", "", remote=False)
checks.emit()
