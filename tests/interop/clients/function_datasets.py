"""tf.data iterated inside tf.functions called from a v1 graph, on a distserver cluster and
on TensorFlow alone: `for x in dataset` (ReduceDataset over ScanDataset, TakeWhileDataset
for a `break`), `iter`/`next` (AnonymousIteratorV3, MakeIterator, IteratorGetNext),
`for x in iter(dataset)` (a While over IteratorGetNextAsOptional), a dataset made inside
the function, `next` past the end (OutOfRangeError), and a training step that takes
batches with `next` and updates variables on the ps until the data ends. A loop over
a dataset whose function updates a variable of another task is refused on distserver.

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
TARGETS = 3.0 * FEATURES + 1.0


def run_all(prefix: str, target: str, remote: bool) -> None:
    ps = "/job:ps/task:0" if remote else None
    wk = "/job:worker/task:0" if remote else None
    graph = tf.Graph()
    with graph.as_default():
        with tf1.device(ps):
            w = tf1.get_variable("w", initializer=tf.constant(0.5))
            b = tf1.get_variable("b", initializer=tf.constant(0.0))
        with tf1.device(wk):
            local = tf1.get_variable("local", initializer=tf.constant(0.0))
            doubled = tf.data.Dataset.from_tensor_slices(FEATURES).map(lambda x: x * 2.0).batch(3)
            pairs = tf.data.Dataset.from_tensor_slices((FEATURES, TARGETS)).batch(4)

            @tf.function
            def total():
                s = tf.constant(0.0)
                for x in doubled:
                    s += tf.reduce_sum(x)
                return s

            @tf.function
            def until_break():
                s = tf.constant(0.0)
                for x in doubled:
                    if tf.reduce_sum(x) > 20.0:
                        break
                    s += tf.reduce_sum(x)
                return s

            @tf.function
            def first_two():
                it = iter(doubled)
                return next(it), next(it)

            @tf.function
            def over_iterator():
                s = tf.constant(0.0)
                n = tf.constant(0)
                for x in iter(doubled):
                    s += tf.reduce_sum(x)
                    n += 1
                return s, n

            @tf.function
            def optional_at_end():
                it = iter(tf.data.Dataset.range(2))
                a, c = it.get_next_as_optional(), it.get_next_as_optional()
                d = it.get_next_as_optional()
                return a.has_value(), a.get_value(), c.get_value(), d.has_value()

            @tf.function
            def made_inside(n):
                s = tf.constant(0, tf.int64)
                for v in tf.data.Dataset.range(n).map(lambda v: v * v).filter(lambda v: tf.equal(v % 2, 0)):
                    s += v
                return s

            @tf.function
            def cached_inside(n):
                # CacheDatasetV2 with TF 2's DummyMemoryCache; the second epoch replays the first.
                s = tf.constant(0, tf.int64)
                for v in tf.data.Dataset.range(n).map(lambda v: v + 1).cache().repeat(2):
                    s = s * 3 + v
                return s

            @tf.function
            def past_end():
                it = iter(tf.data.Dataset.range(3))
                return [next(it) for _ in range(4)]

            @tf.function
            def local_epoch():
                # A training loop over the data with a variable of the dataset's task.
                for x in doubled:
                    local.assign_add(tf.reduce_mean(x))
                return local.read_value()

            @tf.function
            def ps_epoch():
                # The loop's function updates a variable of another task: refused on distserver.
                for x in doubled:
                    w.assign_add(tf.reduce_mean(x))
                return w.read_value()

            def train(steps):
                # `steps` batches by `next`, each a gradient step on the ps's w and b.
                @tf.function
                def run():
                    it = iter(pairs)
                    for _ in range(steps):
                        x, y = next(it)
                        with tf.GradientTape() as tape:
                            loss = tf.reduce_mean(tf.square(w * x + b - y))
                        gw, gb = tape.gradient(loss, [w, b])
                        w.assign_sub(0.01 * gw)
                        b.assign_sub(0.01 * gb)
                    return w.read_value(), b.read_value()

                return run()

            n = tf1.placeholder(tf.int64, [], name="n")
            outputs = {
                "total": total(),
                "until_break": until_break(),
                "first_two": first_two(),
                "over_iterator": over_iterator(),
                "optional_at_end": optional_at_end(),
                "made_inside": made_inside(n),
                "cached_inside": cached_inside(n),
            }
            ends = past_end()
            epoch = local_epoch()
            across = ps_epoch()
            train3, train4 = train(3), train(4)
        init = tf1.global_variables_initializer()
        ops = sorted({node.op for node in graph.as_graph_def().node})
        library_ops = sorted(
            {node.op for function in graph.as_graph_def().library.function for node in function.node_def}
        )
    with tf1.Session(target, graph=graph) as sess:
        sess.run(init)
        for name, fetch in outputs.items():
            checks.run(f"{prefix}/{name}", lambda fetch=fetch: sess.run(fetch, {n: 7}))
        checks.run(f"{prefix}/made_inside_empty", lambda: sess.run(outputs["made_inside"], {n: 0}))
        checks.run(f"{prefix}/past_end", lambda: sess.run(ends))
        checks.run(f"{prefix}/local_epoch", lambda: [sess.run(epoch), sess.run(epoch)])
        checks.run(f"{prefix}/train3", lambda: [sess.run(train3), sess.run(train3)])
        checks.run(f"{prefix}/train4", lambda: sess.run(train4))
        checks.run(f"{prefix}/ps_epoch", lambda: sess.run(across))
    checks.run(f"{prefix}/ops", lambda: [ops, library_ops])


run_all("distserver", worker, remote=True)
run_all("tensorflow", "", remote=False)
checks.emit()
