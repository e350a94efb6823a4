"""The TensorFlow client of `bench_training.py`; runs under TensorFlow's Python.

    python train_side.py

Builds the training workloads with `tf.compat.v1` (the TF 1.x parameter-server recipe)
and runs them through `tf.compat.v1.Session(target)` against any cluster the
orchestrator names: a distserver cluster or a TensorFlow one, so every runtime is
driven by the same real TensorFlow client and the same timing code. `ds_side.py`,
distserver's own client, builds the same workloads with distserver's graph API and
speaks the same protocol (`serve`, `Trainer`). It announces itself with
``@@result {"ok": true, "result": {"version": ...}}`` and answers one JSON command per
stdin line with one ``@@result {...}`` line on stdout:

* ``{"op": "prepare", "id", "target", "workload", "layout", "warmup"[, "worker"]}``:
  build the graph (layout "cluster": computing on worker task ``worker``, 0 by
  default), open a session, initialise, run the warm-up steps; the result has the
  first loss and the initialisation time.
* ``{"op": "block", "id", "repeat"}``: time that many steps; the result has the step
  times (seconds), the loss of every step and the last loss.
* ``{"op": "close", "id"}``, ``{"op": "quit"}``.

Workloads (`layout` "cluster": variables on ``/job:ps/task:0`` through
`replica_device_setter`, compute on ``/job:worker/task:<worker>``, the session's target
that worker; layout "one": a one-task cluster, everything on it):

* ``mlp``: 784-512-10 dense classifier, batch 256, Adam, a global step.
* ``embedding``: a 50,000 x 32 embedding split in two shards, 256 x 8 ids per step,
  mean of the rows -> one logit, sigmoid cross-entropy, Adagrad (sparse updates).
* ``small``: 30 dense 32x32 layers (60 variables of 4 KiB and 128 B), batch 64,
  Momentum.
"""

from __future__ import annotations

import ctypes
import json
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

RESULT = "@@result "
MAX_COMMANDS = 10_000
OPERATION_TIMEOUT_MS = 60_000
WORKLOADS = ("mlp", "embedding", "small")


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _emit(payload: dict[str, Any]) -> None:
    sys.stdout.write(RESULT + json.dumps(payload) + "\n")
    sys.stdout.flush()


def feed_values(workload: str) -> list[np.ndarray]:
    """The values fed every step, in the order of the workload's placeholders (the same
    for every client: `ds_side.py` builds the workloads with distserver's graph API)."""
    rng = np.random.default_rng(0)
    if workload == "mlp":
        return [
            rng.normal(size=(256, 784)).astype(np.float32),
            rng.integers(0, 10, 256).astype(np.int32),
        ]
    if workload == "embedding":
        return [
            rng.integers(0, 50_000, (256, 8)).astype(np.int64),
            rng.integers(0, 2, 256).astype(np.float32),
        ]
    if workload == "small":
        return [
            rng.normal(size=(64, 32)).astype(np.float32),
            rng.normal(size=(64, 32)).astype(np.float32),
        ]
    raise ValueError(f"unknown workload {workload!r}; choose from {list(WORKLOADS)}")


def build(
    tf: Any, workload: str, layout: str, worker: int = 0
) -> tuple[Any, Any, list[Any], list[Any], list[Any]]:
    """(graph, initializer, [train_op, loss], feed placeholders, feed values); layout
    "cluster" computes on worker task `worker`."""
    tf1 = tf.compat.v1
    graph = tf.Graph()
    values = feed_values(workload)
    if layout == "cluster":
        device: Any = tf1.train.replica_device_setter(ps_tasks=1, worker_device=f"/job:worker/task:{worker}")
    elif layout == "one":
        device = None
    else:
        raise ValueError(f"unknown layout {layout!r}")

    def variable(name: str, shape: list[int], **kwargs: Any) -> Any:
        # Op seed len(name): the same seeds in every client (see ds_side.py).
        init = tf1.random_uniform_initializer(-0.05, 0.05, seed=len(name))
        return tf1.get_variable(name, shape, initializer=init, use_resource=True, **kwargs)

    with graph.as_default(), tf1.device(device):
        global_step = tf1.train.get_or_create_global_step()
        if workload == "mlp":
            x = tf1.placeholder(tf.float32, [256, 784], name="x")
            y = tf1.placeholder(tf.int32, [256], name="y")
            hidden = tf.nn.relu(tf.matmul(x, variable("w1", [784, 512])) + variable("b1", [512]))
            logits = tf.matmul(hidden, variable("w2", [512, 10])) + variable("b2", [10])
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
            optimizer = tf1.train.AdamOptimizer(1e-3)
            feeds = [x, y]
        elif workload == "embedding":
            ids = tf1.placeholder(tf.int64, [256, 8], name="ids")
            labels = tf1.placeholder(tf.float32, [256], name="labels")
            table = variable("table", [50_000, 32], partitioner=tf1.fixed_size_partitioner(2))
            rows = tf.nn.embedding_lookup(table, ids)  # [256, 8, 32]
            pooled = tf.reduce_mean(rows, axis=1)
            logit = tf.squeeze(tf.matmul(pooled, variable("w", [32, 1])), 1) + variable("b", [])
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logit))
            optimizer = tf1.train.AdagradOptimizer(0.05)
            feeds = [ids, labels]
        elif workload == "small":
            x = tf1.placeholder(tf.float32, [64, 32], name="x")
            target = tf1.placeholder(tf.float32, [64, 32], name="target")
            h = x
            for i in range(30):
                h = tf.tanh(tf.matmul(h, variable(f"w{i}", [32, 32])) + variable(f"b{i}", [32]))
            loss = tf.reduce_mean(tf.square(h - target))
            optimizer = tf1.train.MomentumOptimizer(0.01, 0.9)
            feeds = [x, target]
        else:
            raise ValueError(f"unknown workload {workload!r}")
        train = optimizer.minimize(loss, global_step=global_step)
        init = tf1.global_variables_initializer()
    return graph, init, [train, loss], feeds, values


class Trainer:
    """A workload ready to time: an initialised session (TensorFlow's or distserver's:
    both have `run`, `make_callable` and `close`), warmed up."""

    def __init__(
        self, session: Any, init: Any, fetches: list[Any], feeds: list[Any], values: list[Any], warmup: int
    ) -> None:
        self.session, self.values = session, values
        started = time.perf_counter()
        session.run(init)
        self.init_s = time.perf_counter() - started
        self.step = session.make_callable(fetches, feed_list=feeds)
        self.first_loss = float(self.step(*values)[1])
        if not np.isfinite(self.first_loss):
            raise AssertionError(f"the first loss is {self.first_loss}")
        for _ in range(warmup):
            self.step(*values)

    def block(self, repeat: int) -> dict[str, Any]:
        times = []
        losses = []
        for _ in range(repeat):
            started = time.perf_counter()
            loss = self.step(*self.values)[1]
            times.append(time.perf_counter() - started)
            losses.append(float(loss))
        return {"times": times, "loss": losses[-1] if losses else 0.0, "losses": losses}

    def close(self) -> None:
        self.session.close()


def serve(version: str, prepare: Callable[[str, str, str, int, int], Trainer]) -> None:
    """Answer the orchestrator's commands on stdin (see the module docstring);
    `prepare(target, workload, layout, warmup, worker)` builds, initialises and warms up."""
    _die_with_parent()
    trainers: dict[str, Trainer] = {}
    _emit({"ok": True, "result": {"version": version}})
    for _ in range(MAX_COMMANDS):
        line = sys.stdin.readline()
        if not line:
            break
        command = json.loads(line)
        op = command.get("op")
        try:
            if op == "quit":
                _emit({"ok": True})
                break
            if op == "prepare":
                trainer = prepare(
                    command["target"],
                    command["workload"],
                    command["layout"],
                    command["warmup"],
                    command.get("worker", 0),
                )
                trainers[command["id"]] = trainer
                result: Any = {"init_s": trainer.init_s, "first_loss": trainer.first_loss}
            elif op == "block":
                result = trainers[command["id"]].block(command["repeat"])
            elif op == "close":
                closing = trainers.pop(command["id"], None)
                if closing is not None:
                    closing.close()
                result = {}
            else:
                raise ValueError(f"unknown op {op!r}")
            _emit({"ok": True, "result": result})
        except Exception as exc:
            _emit({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            traceback.print_exc()
    for trainer in trainers.values():
        trainer.close()


def main() -> None:
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()

    def prepare(target: str, workload: str, layout: str, warmup: int, worker: int) -> Trainer:
        graph, init, fetches, feeds, values = build(tf, workload, layout, worker)
        config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=OPERATION_TIMEOUT_MS)
        session = tf.compat.v1.Session(target, graph=graph, config=config)
        return Trainer(session, init, fetches, feeds, values, warmup)

    serve(tf.__version__, prepare)


if __name__ == "__main__":
    main()
