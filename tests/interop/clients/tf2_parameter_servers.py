"""A TensorFlow 2 `ParameterServerStrategy` + `ClusterCoordinator` program: the chief of a
cluster whose workers are TensorFlow servers and whose ps tasks are whatever the test started
(distserver, or TensorFlow for the baseline).

A dense model (8 -> 16 tanh -> 1) on fixed data, its variables spread over the ps tasks:

* "sgd": steps scheduled one at a time (`coordinator.schedule` then `join`), gradient
  descent by `assign_sub` on the ps (a learning rate passed as a tensor argument), each
  loss fetched (`RemoteValue.fetch`);
* "adam": then steps that update every variable and its two slot variables (made
  beside it on its ps) with `ResourceApplyAdam`, the step's bias corrections passed as
  tensor arguments;
* "weights": every variable read on the coordinator (`var.numpy()`), after those
  deterministic steps (the test compares them with the all-TensorFlow run);
* "keras": a Keras model (two Dense layers) trained by Keras's Adam inside
  `strategy.run`, steps one at a time; its weights and optimizer variables are
  compared too ("keras_weights");
* "concurrent": many steps scheduled at once, spread over the workers, and a step
  counter on a ps; the loss must fall (the order of asynchronous updates is not
  deterministic, so nothing is compared exactly);
* "dataset": steps that take their batches from a per-worker dataset
  (`coordinator.create_per_worker_dataset`) through an iterator argument.

Mode "kill_worker" (argument "kill": {"pid": worker 1's pid, "command": how to start it
again}): steps scheduled while worker 1 is SIGKILLed and later started again; every
scheduled step must finish (the coordinator reschedules a failed worker's steps and, once
the worker serves again, recreates its context and updates the ps's) and the loss must fall.

Argument (JSON): {"cluster": {job: [address, ...]}, "mode": "train" | "kill_worker", ...}
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf
from _common import Checks, args

FEATURES, HIDDEN = 8, 16
SGD_STEPS, ADAM_STEPS, KERAS_STEPS, CONCURRENT_STEPS, DATASET_STEPS = 12, 12, 8, 40, 8


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(7)
    x = rng.randn(64, FEATURES).astype(np.float32)
    y = np.tanh(x @ rng.randn(FEATURES, 1)).astype(np.float32)
    return x, y


def initial_values() -> dict[str, np.ndarray]:
    rng = np.random.RandomState(11)
    return {
        "w1": (rng.randn(FEATURES, HIDDEN) * 0.3).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.randn(HIDDEN, 1) * 0.3).astype(np.float32),
        "b2": np.zeros((), np.float32),
    }


def build(cluster: dict) -> tuple:
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        params = {name: tf.Variable(value, name=name) for name, value in initial_values().items()}
        slots = {}
        for name, var in params.items():
            with strategy.extended.colocate_vars_with(var):
                slots[name] = (
                    tf.Variable(tf.zeros_like(var), name=f"{name}/m"),
                    tf.Variable(tf.zeros_like(var), name=f"{name}/v"),
                )
        counter = tf.Variable(0, dtype=tf.int64, name="steps_taken")
    return strategy, coordinator, params, slots, counter


def build_keras(strategy) -> tuple:
    import keras

    with strategy.scope():
        # Keras's initializers run stateless random ops on the variable's ps; set_weights
        # below makes the start the same in every run (Keras draws fresh seeds).
        model = keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="tanh"), keras.layers.Dense(1)]
        )
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
    rng = np.random.RandomState(5)
    model.set_weights([(rng.randn(*w.shape) * 0.3).astype(np.float32) for w in model.get_weights()])
    return model, optimizer


def main() -> None:
    a = args()
    checks = Checks()
    strategy, coordinator, params, slots, counter = build(a["cluster"])
    x_np, y_np = data()
    names = sorted(params)

    def loss_of(x, y):
        hidden = tf.tanh(tf.matmul(x, params["w1"]) + params["b1"])
        return tf.reduce_mean(tf.square(tf.matmul(hidden, params["w2"]) + params["b2"] - y))

    @tf.function
    def sgd_step(x, y, learning_rate):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        grads = tape.gradient(loss, [params[n] for n in names])
        for name, grad in zip(names, grads, strict=True):
            params[name].assign_sub(learning_rate * grad)
        counter.assign_add(1)
        return loss

    @tf.function
    def adam_step(x, y, learning_rate, beta1_power, beta2_power):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        grads = tape.gradient(loss, [params[n] for n in names])
        for name, grad in zip(names, grads, strict=True):
            m, v = slots[name]
            tf.raw_ops.ResourceApplyAdam(
                var=params[name].handle, m=m.handle, v=v.handle, beta1_power=beta1_power,
                beta2_power=beta2_power, lr=learning_rate, beta1=tf.constant(0.9), beta2=tf.constant(0.999),
                epsilon=tf.constant(1e-7), grad=grad,
            )  # fmt: skip
        counter.assign_add(1)
        return loss

    @tf.function
    def evaluate(x, y):
        return loss_of(x, y)

    x, y = tf.constant(x_np), tf.constant(y_np)

    def batch(i: int) -> tuple[tf.Tensor, tf.Tensor]:
        start = (i * 16) % 64
        return tf.constant(x_np[start : start + 16]), tf.constant(y_np[start : start + 16])

    def placement():
        return {name: var.device for name, var in params.items()} | {"counter": counter.device}

    checks.run("placement", placement)

    def sequential_sgd():
        losses = []
        for i in range(SGD_STEPS):
            result = coordinator.schedule(sgd_step, args=(*batch(i), tf.constant(0.1)))
            coordinator.join()
            losses.append(float(result.fetch()))
        return losses

    def sequential_adam():
        losses = []
        for i in range(ADAM_STEPS):
            t = i + 1
            step_args = (*batch(i), tf.constant(0.01), tf.constant(0.9**t), tf.constant(0.999**t))
            result = coordinator.schedule(adam_step, args=step_args)
            coordinator.join()
            losses.append(float(result.fetch()))
        return losses

    def full_loss():
        result = coordinator.schedule(evaluate, args=(x, y))
        return float(result.fetch())

    def weights():
        values = {name: var.numpy() for name, var in params.items()}
        for name, (m, v) in slots.items():
            values[f"{name}/m"] = m.numpy()
            values[f"{name}/v"] = v.numpy()
        return values

    if a["mode"] == "train":
        checks.run("loss_before", full_loss)
        checks.run("sgd", sequential_sgd)
        checks.run("adam", sequential_adam)
        checks.run("weights", weights)
        checks.run("loss_after_sequential", full_loss)

        def concurrent():
            started = time.perf_counter()
            results = [
                coordinator.schedule(sgd_step, args=(*batch(i), tf.constant(0.05)))
                for i in range(CONCURRENT_STEPS)
            ]
            coordinator.join()
            seconds = time.perf_counter() - started  # reported, never asserted
            losses = [float(r.fetch()) for r in results]
            return {"losses": losses, "counter": int(counter.numpy()), "seconds": seconds}

        checks.run("concurrent", concurrent)
        checks.run("loss_after_concurrent", full_loss)

        def per_worker_dataset():
            def dataset_fn():
                return tf.data.Dataset.from_tensor_slices((x_np, y_np)).batch(16).repeat()

            iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

            @tf.function
            def step_from(iterator):
                xb, yb = next(iterator)
                return sgd_step(xb, yb, tf.constant(0.05))

            results = [coordinator.schedule(step_from, args=(iterator,)) for _ in range(DATASET_STEPS)]
            coordinator.join()
            return [float(r.fetch()) for r in results]

        checks.run("dataset", per_worker_dataset)
        checks.run("loss_after_dataset", full_loss)

        model, optimizer = build_keras(strategy)

        @tf.function
        def keras_step(x, y):
            def replica_step(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(x) - y))
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                return loss

            return strategy.run(replica_step, args=(x, y))

        def keras_training():
            losses = []
            for i in range(KERAS_STEPS):
                result = coordinator.schedule(keras_step, args=batch(i))
                coordinator.join()
                losses.append(float(result.fetch()))
            return losses

        checks.run("keras", keras_training)
        checks.run(
            "keras_weights",
            lambda: {v.path: v.numpy() for v in model.variables + optimizer.variables},
        )
    else:
        kill = a["kill"]
        checks.run("loss_before", full_loss)

        def train_through_a_worker_failure():
            results = [coordinator.schedule(sgd_step, args=(*batch(i), tf.constant(0.05))) for i in range(10)]
            coordinator.join()
            os.kill(kill["pid"], signal.SIGKILL)
            results += [
                coordinator.schedule(sgd_step, args=(*batch(i), tf.constant(0.05))) for i in range(10, 30)
            ]
            # The worker comes back at the same address while steps are still scheduled.
            print("killed; scheduled 30", flush=True, file=sys.stderr)
            time.sleep(2)
            restarted = subprocess.Popen(kill["command"], stdout=subprocess.PIPE, text=True)
            assert restarted.stdout is not None
            line = restarted.stdout.readline()
            if "serving at" not in line:
                raise RuntimeError(f"the restarted worker did not serve: {line!r}")
            print("restarted", flush=True, file=sys.stderr)
            results += [
                coordinator.schedule(sgd_step, args=(*batch(i), tf.constant(0.05))) for i in range(30, 50)
            ]
            coordinator.join()
            print("joined", flush=True, file=sys.stderr)
            losses = [float(r.fetch()) for r in results]
            done = int(counter.numpy())
            restarted.kill()
            restarted.wait()
            return {"losses": losses, "counter": done, "scheduled": len(results)}

        checks.run("recovery", train_through_a_worker_failure)
        checks.run("loss_after", full_loss)
        checks.emit()
        # After a worker failure, TensorFlow's coordinator threads keep the interpreter
        # from exiting (seen with an all-TensorFlow cluster too): leave without them.
        os._exit(0)
    checks.emit()


if __name__ == "__main__":
    main()
