"""RunOptions(trace_level=FULL_TRACE, output_partition_graphs=True) from a TensorFlow client.

A step across ps and worker; the script returns what TensorFlow's own tools make of
the RunMetadata: the devices and node names in its step stats, a Chrome trace from
`timeline.Timeline`, and the partition graphs' devices.

Argument (JSON): {"cluster": {"ps": [a], "worker": [b]}}
"""

from __future__ import annotations

import json

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of
from tensorflow.python.client import timeline

tf1 = tf.compat.v1
tf1.disable_v2_behavior()

cluster = args()["cluster"]
checks = Checks()

graph = tf.Graph()
with graph.as_default():
    with tf1.device("/job:ps/task:0"):
        weights = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3), name="weights")
        scaled = tf.multiply(weights, 2.0, name="scaled")
    with tf1.device("/job:worker/task:0"):
        total = tf.reduce_sum(scaled, name="total")

with tf1.Session(target_of(cluster["worker"][0]), graph=graph) as sess:
    options = tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE, output_partition_graphs=True)
    metadata = tf1.RunMetadata()
    checks.run("value", lambda: sess.run(total, options=options, run_metadata=metadata))

    def stats() -> dict:
        return {d.device: sorted(n.node_name for n in d.node_stats) for d in metadata.step_stats.dev_stats}

    def chrome_trace() -> list:
        trace = json.loads(timeline.Timeline(metadata.step_stats).generate_chrome_trace_format())
        return sorted({event["args"]["name"] for event in trace["traceEvents"] if event.get("ph") == "X"})

    checks.run("step_stats", stats)
    checks.run("chrome_trace_nodes", chrome_trace)
    checks.run(
        "partition_devices", lambda: sorted({n.device for g in metadata.partition_graphs for n in g.node})
    )
    untraced = tf1.RunMetadata()
    sess.run(total, run_metadata=untraced)
    checks.run(
        "untraced_is_empty", lambda: [len(untraced.step_stats.dev_stats), len(untraced.partition_graphs)]
    )
checks.emit()
