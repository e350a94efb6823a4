"""distserver's own client of `bench_training.py`: the training workloads built with
distserver's graph API (`ds.Graph`, `ds.gradients` through `ds.train`'s optimizers,
`ds.Session`) instead of TensorFlow's.

    python -m distserver.bench.ds_side

The workloads are those of `train_side.py`, node for node where it matters: the same
shapes, the same fed values (`train_side.feed_values`), the same initial values (each
variable's ``RandomUniform`` has TensorFlow's seeds for op seed ``len(name)``, so on a
distserver cluster both clients start from the same numbers), the same placement
(layout "cluster": variables and their slots on ``/job:ps/task:0`` through
`ds.replica_device_setter`, everything else on ``/job:worker/task:0``; the embedding
table in two shards of 25,000 rows, looked up with `ds.embedding_lookup`, each shard's
rows gathered on the ps) and the same optimizers. It speaks `train_side.py`'s protocol
(`train_side.serve`), so the orchestrator times both clients with the same code.

Its sessions ask for `isolate_session_state`: its variables are its own even when the
TensorFlow client trains variables of the same names on the same cluster.
"""

from __future__ import annotations

from typing import Any

import distserver as ds
from distserver.bench import train_side


def build(
    workload: str, layout: str, worker: int = 0
) -> tuple[ds.Graph, Any, list[Any], list[Any], list[Any]]:
    """(graph, initializer, [train_op, loss], feed placeholders, feed values), as
    `train_side.build` returns them for TensorFlow."""
    graph = ds.Graph()
    values = train_side.feed_values(workload)
    if layout == "cluster":
        device: Any = ds.replica_device_setter(ps_tasks=1, worker_device=f"/job:worker/task:{worker}")
    elif layout == "one":
        device = None
    else:
        raise ValueError(f"unknown layout {layout!r}")

    def variable(name: str, shape: list[int]) -> ds.Variable:
        # tf.compat.v1.random_uniform_initializer(-0.05, 0.05, seed=len(name)), as train_side.py.
        return ds.Variable(lambda: ds.random_uniform(shape, -0.05, 0.05, seed=len(name)), name=name)

    with graph.as_default(), ds.device(device):
        global_step = ds.train.get_or_create_global_step()
        if workload == "mlp":
            x = ds.placeholder(ds.float32, [256, 784], name="x")
            y = ds.placeholder(ds.int32, [256], name="y")
            hidden = ds.relu(ds.matmul(x, variable("w1", [784, 512])) + variable("b1", [512]))
            logits = ds.matmul(hidden, variable("w2", [512, 10])) + variable("b2", [10])
            loss = ds.reduce_mean(ds.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
            optimizer: ds.train.Optimizer = ds.train.AdamOptimizer(1e-3)
            feeds = [x, y]
        elif workload == "embedding":
            ids = ds.placeholder(ds.int64, [256, 8], name="ids")
            labels = ds.placeholder(ds.float32, [256], name="labels")
            # fixed_size_partitioner(2) of a 50,000-row table: table/part_0 and table/part_1,
            # each initialised as TensorFlow initialises a partition (the table's seed).
            with ds.name_scope("table"):
                shards = [
                    ds.Variable(
                        lambda: ds.random_uniform([25_000, 32], -0.05, 0.05, seed=len("table")),
                        name=f"part_{i}",
                    )
                    for i in range(2)
                ]
            rows = ds.embedding_lookup(shards, ids)  # [256, 8, 32]
            pooled = ds.reduce_mean(rows, axis=1)
            logit = ds.squeeze(ds.matmul(pooled, variable("w", [32, 1])), 1) + variable("b", [])
            loss = ds.reduce_mean(ds.sigmoid_cross_entropy_with_logits(labels=labels, logits=logit))
            optimizer = ds.train.AdagradOptimizer(0.05)
            feeds = [ids, labels]
        elif workload == "small":
            x = ds.placeholder(ds.float32, [64, 32], name="x")
            target = ds.placeholder(ds.float32, [64, 32], name="target")
            h = x
            for i in range(30):
                h = ds.tanh(ds.matmul(h, variable(f"w{i}", [32, 32])) + variable(f"b{i}", [32]))
            loss = ds.reduce_mean(ds.square(h - target))
            optimizer = ds.train.MomentumOptimizer(0.01, 0.9)
            feeds = [x, target]
        else:
            raise ValueError(f"unknown workload {workload!r}; choose from {list(train_side.WORKLOADS)}")
        train = optimizer.minimize(loss, global_step=global_step)
        init = ds.global_variables_initializer()
    return graph, init, [train, loss], feeds, values


def prepare(target: str, workload: str, layout: str, warmup: int, worker: int = 0) -> train_side.Trainer:
    graph, init, fetches, feeds, values = build(workload, layout, worker)
    config = ds.ConfigProto(
        operation_timeout_in_ms=train_side.OPERATION_TIMEOUT_MS, isolate_session_state=True
    )
    session = ds.Session(target, graph=graph, config=config)
    return train_side.Trainer(session, init, fetches, feeds, values, warmup)


def main() -> None:
    train_side.serve(ds.__version__, prepare)


if __name__ == "__main__":
    main()
