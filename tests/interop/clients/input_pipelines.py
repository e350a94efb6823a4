"""TF 1.x input pipelines with queue runners on a distserver cluster and on TensorFlow alone.

`slice_input_producer` (RandomShuffle, epochs counted by CountUpTo) feeding
`shuffle_batch` (RandomShuffleQueueV2, QueueDequeueManyV2) and `batch` with
`allow_smaller_final_batch` (QueueDequeueUpToV2), driven by `start_queue_runners`
until OutOfRangeError. Orders differ between the two (random); the multisets of
examples and the batch sizes must not.

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
EXAMPLES = np.arange(20, dtype=np.int64)


def drain(target: str, device: str | None, pipeline: str) -> dict:
    graph = tf.Graph()
    with graph.as_default(), tf1.device(device):
        (example,) = tf1.train.slice_input_producer([tf.constant(EXAMPLES)], num_epochs=2, seed=7)
        if pipeline == "shuffle_batch":
            batch = tf1.train.shuffle_batch(
                [example],
                batch_size=6,
                capacity=12,
                min_after_dequeue=4,
                seed=3,
                allow_smaller_final_batch=True,
            )
        else:
            batch = tf1.train.batch([example], batch_size=6, capacity=8, allow_smaller_final_batch=True)
        init = tf.group(tf1.global_variables_initializer(), tf1.local_variables_initializer())
    sizes, seen = [], []
    with tf1.Session(target, graph=graph) as sess:
        sess.run(init)
        coordinator = tf1.train.Coordinator()
        threads = tf1.train.start_queue_runners(sess, coord=coordinator)
        try:
            for _ in range(50):  # bounded: 2 epochs of 20 examples in batches of 6
                values = sess.run(batch)
                sizes.append(len(values))
                seen.extend(values.tolist())
        except tf.errors.OutOfRangeError:
            pass
        finally:
            coordinator.request_stop()
            coordinator.join(threads, stop_grace_period_secs=10)
    return {"sizes": sizes, "examples": sorted(seen)}


for pipeline in ("shuffle_batch", "batch"):
    checks.run(
        f"ours/{pipeline}", lambda p=pipeline: drain(target_of(cluster["worker"][0]), "/job:ps/task:0", p)
    )
    checks.run(f"theirs/{pipeline}", lambda p=pipeline: drain("", None, p))
checks.emit()
