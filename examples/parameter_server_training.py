"""Asynchronous parameter-server training of a softmax classifier.

The model's variables live on the `ps` tasks (spread by `replica_device_setter`).
Each worker runs its own training loop, concurrently with the others: it runs a
step on its task that reads the current variables from the ps and computes the
class probabilities of a mini-batch, computes the gradient in numpy, and applies
it on the ps with `assign_sub` (no locking between workers, as in asynchronous
PS training). The loss on the whole data set goes down as they train.

    python examples/parameter_server_training.py --local            # 1 ps + 2 workers, one process each
    python examples/parameter_server_training.py --cluster '{"ps": ["h0:2222"], "worker": ["h1:2222"]}'
    TF_CONFIG='{"cluster": {...}}' python examples/parameter_server_training.py
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import distserver as ds
from distserver._process import exit_quietly_on_interrupt
from distserver.testing import LocalCluster
from distserver.transports import get_transport

FEATURES, CLASSES = 20, 4


@dataclass
class Model:
    graph: ds.Graph
    x: ds.Tensor
    probabilities: ds.Tensor
    loss: ds.Tensor
    labels: ds.Tensor
    grad_w: ds.Tensor
    grad_b: ds.Tensor
    apply: ds.Operation
    init: ds.Operation


def make_data(samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs, one per class: separable enough to learn, noisy enough to take a while."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=1.5, size=(CLASSES, FEATURES))
    labels = rng.integers(0, CLASSES, size=samples)
    xs = centers[labels] + rng.normal(scale=2.0, size=(samples, FEATURES))
    return xs.astype(np.float32), labels.astype(np.int64)


def build_model(ps_tasks: int, learning_rate: float) -> Model:
    graph = ds.Graph()
    with graph.as_default(), ds.device(ds.replica_device_setter(ps_tasks=ps_tasks, worker_device="")):
        w = ds.Variable(np.zeros((FEATURES, CLASSES), np.float32), name="softmax/w")
        b = ds.Variable(np.zeros((CLASSES,), np.float32), name="softmax/b")
        x = ds.placeholder(ds.float32, shape=[None, FEATURES], name="x")
        labels = ds.placeholder(ds.int64, shape=[None], name="labels")
        probabilities = ds.softmax(ds.matmul(x, w) + b)
        picked = ds.reduce_sum(probabilities * ds.one_hot(labels, CLASSES, dtype=ds.float32), axis=1)
        loss = -ds.reduce_mean(ds.log(picked + 1e-7))
        grad_w = ds.placeholder(ds.float32, shape=[FEATURES, CLASSES], name="grad_w")
        grad_b = ds.placeholder(ds.float32, shape=[CLASSES], name="grad_b")
        apply = ds.group(
            w.assign_sub(grad_w * learning_rate, read_value=False),
            b.assign_sub(grad_b * learning_rate, read_value=False),
            name="apply_gradients",
        )
        init = ds.global_variables_initializer()
    return Model(graph, x, probabilities, loss, labels, grad_w, grad_b, apply, init)


def train_worker(
    index: int,
    target: str,
    model: Model,
    xs: np.ndarray,
    ys: np.ndarray,
    steps: int,
    batch: int,
    log_every: int,
) -> None:
    rng = np.random.default_rng(100 + index)
    with ds.Session(target, graph=model.graph) as session:
        for step in range(steps):
            chosen = rng.choice(len(xs), size=batch, replace=False)
            bx, by = xs[chosen], ys[chosen]
            probabilities, loss = session.run(
                [model.probabilities, model.loss], feed_dict={model.x: bx, model.labels: by}
            )
            # d(cross-entropy)/d(logits) = p - onehot(y), averaged over the batch.
            delta = probabilities.copy()
            delta[np.arange(batch), by] -= 1.0
            delta /= batch
            session.run(model.apply, feed_dict={model.grad_w: bx.T @ delta, model.grad_b: delta.sum(axis=0)})
            if step % log_every == 0 or step == steps - 1:
                print(f"  worker {index}  step {step:4d}  batch loss {loss:.4f}", flush=True)


def train(
    cluster: Mapping[str, Sequence[str]], steps: int, batch: int, learning_rate: float, log_every: int
) -> tuple[float, float]:
    """Train on `cluster` ({"ps": [...], "worker": [...]}); returns the loss before and after."""
    workers = [f"grpc://{address}" for address in cluster["worker"]]
    model = build_model(len(cluster["ps"]), learning_rate)
    xs, ys = make_data(4096)
    with ds.Session(workers[0], graph=model.graph) as session:
        session.run(model.init)
        initial = float(session.run(model.loss, feed_dict={model.x: xs, model.labels: ys}))
    print(f"{len(workers)} workers, {len(cluster['ps'])} ps; initial loss {initial:.4f}", flush=True)
    started = time.monotonic()
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            train_worker(index, workers[index], model, xs, ys, steps, batch, log_every)
        except BaseException as exc:  # reported once every worker has stopped
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"worker-{i}") for i in range(len(workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    with ds.Session(workers[-1], graph=model.graph) as session:
        final = float(session.run(model.loss, feed_dict={model.x: xs, model.labels: ys}))
    elapsed = time.monotonic() - started
    total_steps = steps * len(workers)
    print(
        f"final loss {final:.4f} (from {initial:.4f}) after {total_steps} steps in {elapsed:.1f} s",
        flush=True,
    )
    return initial, final


def cluster_from_args(args: argparse.Namespace) -> dict[str, list[str]] | None:
    if args.cluster:
        cluster: dict[str, list[str]] = json.loads(args.cluster)
        return cluster
    spec = ds.TFConfigClusterResolver().cluster_spec()
    if spec:
        return {job: [a for a in spec.job_tasks(job) if a is not None] for job in spec.jobs}
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", action="store_true", help="start a local cluster (1 ps + 2 workers)")
    parser.add_argument("--cluster", help='JSON, e.g. {"ps": ["localhost:2222"], "worker": [...]}')
    parser.add_argument("--steps", type=int, default=150, help="steps per worker")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument(
        "--protocol", default="grpc", help='with --local: the servers\' transport ("grpc", "grpc+verbs")'
    )
    args = parser.parse_args()
    try:
        get_transport(args.protocol)
    except ds.errors.NotFoundError as exc:
        parser.error(exc.message)
    cluster = None if args.local else cluster_from_args(args)
    if cluster is not None:
        train(cluster, args.steps, args.batch, args.learning_rate, args.log_every)
        return

    with LocalCluster({"ps": 1, "worker": 2}, protocol=args.protocol) as local:
        for task, target in local.targets.items():
            print(f"{task} serving at {target} (pid {local.pids[task]})", flush=True)
        train(local.cluster, args.steps, args.batch, args.learning_rate, args.log_every)
    print("cluster stopped")


if __name__ == "__main__":
    exit_quietly_on_interrupt(main)  # Ctrl-C: one line, no traceback
