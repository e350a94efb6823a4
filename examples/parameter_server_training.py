"""Asynchronous parameter-server training through the cluster coordinator.

A small neural network (one hidden layer) learns scikit-learn's bundled handwritten digits (8x8
images, 10 classes; `pip install 'distserver[examples]'`), or, with
`--dataset blobs`, a synthetic task: 20-dimensional Gaussian blobs, one per
class of 4, noisy enough to take a while.

* The model's variables are sharded over the `ps` tasks (`replica_device_setter`
  deals them out in turn: the weights on one, the biases on the other).
* `ds.ClusterCoordinator` runs the training steps on the `worker` tasks,
  asynchronously: each step reads the current variables from the ps, computes
  the gradients of its batch on its worker (`ds.gradients`, through
  `ds.train.GradientDescentOptimizer.minimize`) and applies them on the ps.
* Input: each worker keeps its own shard of the training set
  (`create_per_worker_dataset`); steps read their batches there, so no batch
  passes through this process.
* `--kill-worker-after N` kills worker 1 (SIGKILL) once N steps have run:
  its steps are rescheduled on the other workers and training goes on.

    python examples/parameter_server_training.py --local            # 2 ps + 3 workers, one process each
    python examples/parameter_server_training.py --local --kill-worker-after 100
    python examples/parameter_server_training.py --cluster '{"ps": ["h0:2222"], "worker": ["h1:2222"]}'
    TF_CONFIG='{"cluster": {...}}' python examples/parameter_server_training.py
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import distserver as ds
from distserver._process import exit_quietly_on_interrupt
from distserver.testing import LocalCluster
from distserver.transports import get_transport


@dataclass
class Data:
    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    classes: int


def load_digits() -> Data:
    """scikit-learn's bundled digits (1797 8x8 images), pixels scaled to [0, 1]; 20% held out."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise SystemExit(
            "The digits data set comes with scikit-learn: pip install 'distserver[examples]' "
            "(or run with --dataset blobs, a synthetic task)."
        ) from None
    digits = sklearn_digits()
    xs = (digits.data / 16.0).astype(np.float32)
    ys = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(xs))
    test, train = order[: len(xs) // 5], order[len(xs) // 5 :]
    return Data("digits", xs[train], ys[train], xs[test], ys[test], classes=10)


def make_blobs(samples: int = 4096, features: int = 20, classes: int = 4, seed: int = 0) -> Data:
    """Gaussian blobs, one per class: separable enough to learn, noisy enough to take a while."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=1.5, size=(classes, features))
    labels = rng.integers(0, classes, size=samples)
    xs = (centers[labels] + rng.normal(scale=2.0, size=(samples, features))).astype(np.float32)
    ys = labels.astype(np.int64)
    split = samples // 5
    return Data("blobs", xs[split:], ys[split:], xs[:split], ys[:split], classes)


@dataclass
class Model:
    train_step: ds.Operation
    batch_loss: ds.Tensor
    global_step: ds.Tensor
    x: ds.Tensor
    labels: ds.Tensor
    loss: ds.Tensor
    accuracy: ds.Tensor
    init: ds.Operation


def build_model(
    graph: ds.Graph,
    batch: Sequence[ds.Tensor],
    features: int,
    classes: int,
    ps_tasks: int,
    learning_rate: float,
    hidden: int,
) -> Model:
    """A one-hidden-layer network: variables on the ps tasks, computation on the worker running the step."""
    with graph.as_default():
        with ds.device(ds.replica_device_setter(ps_tasks=ps_tasks, worker_device="/job:worker")):
            rng = np.random.default_rng(0)
            limit = np.sqrt(6.0 / (features + hidden))
            w1 = ds.Variable(
                rng.uniform(-limit, limit, (features, hidden)).astype(np.float32), name="hidden/w"
            )
            b1 = ds.Variable(np.zeros((hidden,), np.float32), name="hidden/b")
            w2 = ds.Variable(np.zeros((hidden, classes), np.float32), name="softmax/w")
            b2 = ds.Variable(np.zeros((classes,), np.float32), name="softmax/b")
            global_step = ds.train.get_or_create_global_step()

            def logits_of(x: ds.Tensor) -> ds.Tensor:
                return ds.matmul(ds.relu(ds.matmul(x, w1) + b1), w2) + b2

            def loss_of(x: ds.Tensor, labels: ds.Tensor) -> tuple[ds.Tensor, ds.Tensor]:
                logits = logits_of(x)
                loss = ds.reduce_mean(
                    ds.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
                )
                return loss, logits

            batch_x, batch_y = batch
            batch_loss, _ = loss_of(batch_x, batch_y)
            # ds.gradients builds the backward pass on the worker; the updates run on the ps.
            optimizer = ds.train.GradientDescentOptimizer(learning_rate)
            train_step = optimizer.minimize(batch_loss, global_step=global_step)
            # Evaluation on data fed by this process.
            x = ds.placeholder(ds.float32, shape=[None, features], name="eval/x")
            labels = ds.placeholder(ds.int64, shape=[None], name="eval/labels")
            loss, logits = loss_of(x, labels)
            correct = ds.equal(ds.argmax(logits, axis=1), labels)
            accuracy = ds.reduce_mean(ds.cast(correct, ds.float32))
        init = ds.global_variables_initializer()
    return Model(train_step, batch_loss, global_step.value(), x, labels, loss, accuracy, init)


# Steps scheduled ahead of the one being waited for.
SCHEDULE_AHEAD = 1000


def train(
    cluster: Mapping[str, Sequence[str]],
    data: Data,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    log_every: int,
    hidden: int = 32,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[float, float]:
    """Train on `cluster` ({"ps": [...], "worker": [...]}); returns the test loss before and after."""
    graph = ds.Graph()
    with ds.ClusterCoordinator(cluster, graph, step_timeout=30) as coordinator:
        dataset = coordinator.create_per_worker_dataset(
            (data.train_x, data.train_y), batch_size, name="train_data"
        )
        model = build_model(
            graph,
            dataset.batch,
            data.train_x.shape[1],
            data.classes,
            len(cluster["ps"]),
            learning_rate,
            hidden,
        )
        coordinator.schedule(model.init).fetch()

        def evaluate() -> tuple[float, float]:
            loss, accuracy = coordinator.schedule(
                [model.loss, model.accuracy], feed_dict={model.x: data.test_x, model.labels: data.test_y}
            ).fetch()
            return float(loss), float(accuracy)

        initial, initial_accuracy = evaluate()
        print(
            f"{data.name}: {len(data.train_x)} training rows, shards of {dataset.shard_sizes} on "
            f"{coordinator.num_workers} workers; variables on {len(cluster['ps'])} ps tasks",
            flush=True,
        )
        print(f"initial test loss {initial:.4f}, accuracy {initial_accuracy:.3f}", flush=True)
        started = time.monotonic()
        ran_on: collections.Counter[int] = collections.Counter()
        rescheduled = 0
        done = 0
        while done < steps:
            chunk = min(log_every, steps - done)
            losses = []
            # Scheduled a window at a time: memory stays bounded however many steps run.
            for start in range(0, chunk, SCHEDULE_AHEAD):
                values = [
                    coordinator.schedule([model.train_step, model.batch_loss])
                    for _ in range(min(SCHEDULE_AHEAD, chunk - start))
                ]
                for finished, value in enumerate(values, start=done + start + 1):
                    losses.append(float(value.fetch()[1]))
                    if on_progress is not None:
                        on_progress(finished)  # while the rest of the window runs
                ran_on.update(value.worker for value in values if value.worker is not None)
                rescheduled += sum(value.attempts - 1 for value in values)
            coordinator.join()
            done += chunk
            global_step = int(coordinator.schedule(model.global_step).fetch())
            loss, accuracy = evaluate()
            print(
                f"  step {done:5d}  global step {global_step:5d}  batch loss {np.mean(losses):.4f}  "
                f"test loss {loss:.4f}  accuracy {accuracy:.3f}  "
                f"workers up {coordinator.available_workers()}",
                flush=True,
            )
        final, final_accuracy = evaluate()
    elapsed = time.monotonic() - started
    print(f"steps per worker: {dict(sorted(ran_on.items()))}; rescheduled after a failure: {rescheduled}")
    print(
        f"final loss {final:.4f} (from {initial:.4f}), test accuracy {final_accuracy:.3f}, "
        f"after {steps} steps in {elapsed:.1f} s",
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
    parser.add_argument("--local", action="store_true", help="start a local cluster (2 ps + 3 workers)")
    parser.add_argument("--cluster", help='JSON, e.g. {"ps": ["localhost:2222"], "worker": [...]}')
    parser.add_argument("--dataset", choices=["digits", "blobs"], default="digits")
    parser.add_argument("--steps", type=int, default=600, help="training steps in all")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=0.2)
    parser.add_argument("--hidden", type=int, default=32, help="units in the hidden layer")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument(
        "--kill-worker-after",
        type=int,
        metavar="N",
        help="with --local: SIGKILL worker 1 once N steps have run (training goes on without it)",
    )
    parser.add_argument(
        "--protocol", default="grpc", help='with --local: the servers\' transport ("grpc", "grpc+verbs")'
    )
    args = parser.parse_args()
    try:
        get_transport(args.protocol)
    except ds.errors.NotFoundError as exc:
        parser.error(exc.message)
    data = load_digits() if args.dataset == "digits" else make_blobs()
    options = {
        "steps": args.steps,
        "batch_size": args.batch,
        "learning_rate": args.learning_rate,
        "log_every": args.log_every,
        "hidden": args.hidden,
    }
    cluster = None if args.local else cluster_from_args(args)
    if cluster is not None:
        if args.kill_worker_after is not None:
            parser.error("--kill-worker-after needs --local (it kills a process of the local cluster)")
        train(cluster, data, **options)
        return

    with LocalCluster({"ps": 2, "worker": 3}, protocol=args.protocol) as local:
        for task, target in local.targets.items():
            print(f"{task} serving at {target} (pid {local.pids[task]})", flush=True)

        def kill_worker(done: int) -> None:
            if args.kill_worker_after is not None and done >= args.kill_worker_after:
                process = local.process("worker", 1)
                if process.poll() is None:
                    local.kill("worker", 1)
                    print(f"killed worker 1 (pid {process.pid}) after {done} steps", flush=True)

        train(local.cluster, data, on_progress=kill_worker, **options)
    print("cluster stopped")


if __name__ == "__main__":
    exit_quietly_on_interrupt(main)  # Ctrl-C: one line, no traceback
