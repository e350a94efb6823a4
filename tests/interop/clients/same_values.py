"""Ops computed on a distserver task and by TensorFlow alone, for the test to compare.

Argument (JSON): {"cluster": {"ps": [a], "worker": [b]}}
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_v2_behavior()

cluster = args()["cluster"]
checks = Checks()
rng = np.random.default_rng(5)
X = rng.normal(size=(3, 8)).astype(np.float32)
X[1, 2] = X[1, 5]  # a tie
LABELS = np.array([1, 5, 7], np.int32)


def build(device: str | None) -> tuple[tf.Graph, dict]:
    graph = tf.Graph()
    with graph.as_default(), tf1.device(device):
        x = tf.constant(X)
        counter = tf1.get_variable("counter", initializer=tf.constant(0, tf.int64), use_resource=False)
        resource_counter = tf1.get_variable("rcounter", initializer=tf.constant(3), use_resource=True)
        ops = {
            "split": tf.split(x, 4, axis=1),
            "split_v": tf.split(x, [2, -1, 1], axis=1),
            "reverse": tf.reverse(x, axis=[0, 1]),
            "cumsum": tf.cumsum(x, axis=1),
            "cumsum_exclusive_reverse": tf.cumsum(x, axis=0, exclusive=True, reverse=True),
            "cumprod": tf.math.cumprod(x, axis=1, exclusive=True),
            "top_k": list(tf.nn.top_k(x, k=3)),
            "in_top_k": tf1.nn.in_top_k(x, LABELS, 3),
            "count_up_to": [tf1.count_up_to(counter, 2)],
            "resource_count_up_to": [resource_counter.count_up_to(5)],
        }
        words = tf1.lookup.StaticHashTable(
            tf1.lookup.KeyValueTensorInitializer(
                tf.constant(["a", "b", "c"]), tf.constant([0, 1, 2], tf.int64)
            ),
            -1,
        )
        weights = tf1.lookup.StaticHashTable(
            tf1.lookup.KeyValueTensorInitializer(tf.constant([4, 9], tf.int64), tf.constant([0.5, 2.0])), -1.0
        )
        text = tf.constant(["b a  z", "", "héllo c"])
        split = tf.strings.split(text)
        ops.update(
            words=words.lookup(split.values),
            weights=weights.lookup(tf.constant([[9, 1], [4, 4]], tf.int64)),
            table_size=weights.size(),
            bytes_length=tf.strings.length(text),
            char_length=tf.strings.length(text, unit="UTF8_CHAR"),
            numbers=tf.strings.to_number(tf.constant(["1.5", "-2", " 3e2"])),
            integers=tf.strings.to_number(tf.constant(["7", "-12"]), out_type=tf.int64),
            split_rows=split.row_lengths(),
            hash_buckets=tf.strings.to_hash_bucket_fast(
                tf.constant([bytes(range(n % 256)) * (1 + n // 256) for n in range(0, 300, 7)]), 2**40
            ),
            split_on_comma=tf.strings.split(tf.constant(["a,,b", "c"]), sep=",").values,
        )
        shuffle = tf.random.shuffle(tf.range(10), seed=1)
        init = tf.group(tf1.global_variables_initializer(), tf1.tables_initializer())
    return graph, {"ops": ops, "init": init, "shuffle": shuffle}


def values(target: str, device: str | None) -> dict:
    graph, parts = build(device)
    out = {}
    with tf1.Session(target, graph=graph) as sess:
        sess.run(parts["init"])
        for name, op in parts["ops"].items():
            out[name] = sess.run(op)
        out["count_up_to_again"] = [sess.run(parts["ops"]["count_up_to"])]
        try:
            sess.run(parts["ops"]["count_up_to"])
            out["count_up_to_limit"] = "no error"
        except tf.errors.OutOfRangeError as exc:
            out["count_up_to_limit"] = type(exc).__name__
        out["shuffle"] = sorted(sess.run(parts["shuffle"]).tolist())
    return out


ours = values(target_of(cluster["worker"][0]), "/job:ps/task:0")
theirs = values("", None)
for name in theirs:
    checks.run(f"ours/{name}", lambda name=name: ours[name])
    checks.run(f"theirs/{name}", lambda name=name: theirs[name])
checks.emit()
