"""Training steps per second through the coordinator with 1, 2 and 3 workers, against TensorFlow.

The model is fixed and small: a softmax classifier (64 features, 10 classes, its
weights on ps 0 and its biases and global step on ps 1) whose step computes the
gradient of a fed batch of 32 rows on the worker and applies it on the ps tasks
(`assign_sub`, no locking: asynchronous training). It is built once with
distserver's graph API and both sides run the very same GraphDef:

* distserver: a `LocalCluster` (2 ps + 3 workers, one process each) and one
  `ds.ClusterCoordinator` over the first k workers (`max_in_flight_per_worker=2`);
  the coordinator schedules every step and joins.
* TensorFlow: 2 ps + 3 worker `tf.distribute.Server`s (one process each) and TF 1.x
  between-graph replication: one client per worker (a thread with its own
  `Session` on that worker and `device_filters`), each running its share of the
  steps (`tf_coordinator_side.py`, under TensorFlow's Python, in a network
  namespace: TensorFlow's servers bind 0.0.0.0).

Both feed the same batch each step. On a machine with few cores the tasks, the
clients and the coordinator share them, so adding workers mostly adds contention:
the scaling column says more about the CPU count than about either runtime.

    .venv/bin/python benchmarks/bench_coordinator.py [--steps 600] [--workers 1,2,3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import distserver as ds
from distserver.bench.sides import machine_info, netns_prefix
from distserver.bench.tfenv import TFUnavailable, find_or_create, quiet_tf_env
from distserver.testing import LocalCluster

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FEATURES, CLASSES, BATCH = 64, 10, 32


def build_graph() -> tuple[ds.Graph, dict[str, Any]]:
    """The model; the names both sides feed and fetch."""
    graph = ds.Graph()
    with graph.as_default():
        with ds.device(ds.replica_device_setter(ps_tasks=2, worker_device="/job:worker")):
            w = ds.Variable(np.zeros((FEATURES, CLASSES), np.float32), name="w")
            b = ds.Variable(np.zeros((CLASSES,), np.float32), name="b")
            step = ds.Variable(np.int64(0), name="global_step", trainable=False)
            x = ds.placeholder(ds.float32, shape=[BATCH, FEATURES], name="x")
            labels = ds.placeholder(ds.int64, shape=[BATCH], name="labels")
            probabilities = ds.softmax(ds.matmul(x, w) + b)
            delta = (probabilities - ds.one_hot(labels, CLASSES, dtype=ds.float32)) / float(BATCH)
            with ds.control_dependencies(
                [
                    w.assign_sub(ds.matmul(x, delta, transpose_a=True) * 0.1, read_value=False),
                    b.assign_sub(ds.reduce_sum(delta, axis=0) * 0.1, read_value=False),
                ]
            ):
                train = step.assign_add(np.int64(1), read_value=False)
        init = ds.global_variables_initializer()
    names = {
        "feeds": {"x:0": [[BATCH, FEATURES], "float32"], "labels:0": [[BATCH], "int64"]},
        "fetch": train.name,
        "init": init.name,
        "classes": CLASSES,
    }
    return graph, names


def run_ours(
    graph: ds.Graph, names: dict[str, Any], workers: list[int], steps: int, warmup: int
) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    feeds = {
        "x:0": rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
        "labels:0": rng.integers(0, CLASSES, size=BATCH).astype(np.int64),
    }
    results = {}
    with LocalCluster({"ps": 2, "worker": max(workers)}) as local:
        for k in workers:
            cluster = {"ps": local.cluster["ps"], "worker": local.cluster["worker"][:k]}
            with ds.ClusterCoordinator(cluster, graph) as coordinator:
                coordinator.schedule(names["init"]).fetch()
                for _ in range(warmup * k):
                    coordinator.schedule(names["fetch"], feed_dict=feeds)
                coordinator.join()
                started = time.perf_counter()
                for _ in range(steps):
                    coordinator.schedule(names["fetch"], feed_dict=feeds)
                coordinator.join()
                elapsed = time.perf_counter() - started
            results[str(k)] = {"steps": steps, "seconds": elapsed}
    return results


def run_tf(
    graph: ds.Graph, names: dict[str, Any], workers: list[int], steps: int, warmup: int
) -> dict[str, Any]:
    tf_env = find_or_create(REPO, create=False)
    prefix = netns_prefix()
    if prefix is None:
        raise TFUnavailable("TensorFlow's servers bind 0.0.0.0 and `unshare --net` is unavailable here")
    spec = {**names, "workers": workers, "steps": steps, "warmup": warmup}
    with tempfile.NamedTemporaryFile(suffix=".pb") as graph_file:
        graph_file.write(graph.as_graph_def().SerializeToString())
        graph_file.flush()
        command = [
            *prefix,
            tf_env.python,
            str(HERE / "tf_coordinator_side.py"),
            *("--graph", graph_file.name, "--spec", json.dumps(spec), "--netns"),
        ]
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=900, env=quiet_tf_env(), check=False
        )
    for line in proc.stdout.splitlines():
        if line.startswith("@@result "):
            report: dict[str, Any] = json.loads(line[len("@@result ") :])
            return report
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    raise RuntimeError(f"TensorFlow's side failed (exit {proc.returncode}):\n{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="timed steps per worker count")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per worker first")
    parser.add_argument("--workers", default="1,2,3")
    parser.add_argument("--no-tf", action="store_true", help="skip TensorFlow's side")
    args = parser.parse_args()
    workers = [int(k) for k in args.workers.split(",")]
    graph, names = build_graph()
    machine = machine_info()
    ours = run_ours(graph, names, workers, args.steps, args.warmup)
    tf_results: dict[str, Any] = {}
    tf_note = "not run (--no-tf)"
    if not args.no_tf:
        try:
            tf_report = run_tf(graph, names, workers, args.steps, args.warmup)
            tf_results = tf_report["results"]
            tf_note = f"TensorFlow {tf_report['tensorflow']}"
        except (TFUnavailable, RuntimeError, subprocess.TimeoutExpired) as exc:
            tf_note = f"not run: {exc}"
    with open("/proc/loadavg") as f:
        load_end = " ".join(f.read().split()[:3])
    print(f"Command: `.venv/bin/python benchmarks/bench_coordinator.py {' '.join(sys.argv[1:])}`".rstrip())
    print()
    print(
        f"Machine: {machine['nproc']} CPUs ({machine['cpu_model']}), os.cpu_count() {os.cpu_count()}, "
        f"load average {machine['loadavg_start']} at the start, {load_end} at the end; {tf_note}."
    )
    print()
    print(
        f"Softmax step ({FEATURES} features, {CLASSES} classes, batch {BATCH}), 2 ps, "
        f"{args.steps} timed steps per row:"
    )
    print()
    print(
        "| workers | distserver steps/s | TensorFlow steps/s | distserver / TF "
        "| distserver scaling | TF scaling |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    base = tf_base = None
    for k in workers:
        mine = ours[str(k)]["steps"] / ours[str(k)]["seconds"]
        base = base or mine
        theirs = tf_results.get(str(k))
        tf_rate = theirs["steps"] / theirs["seconds"] if theirs else None
        tf_base = tf_base or tf_rate
        cells = ["—", "—", "—"]
        if tf_rate and tf_base:
            cells = [f"{tf_rate:,.0f}", f"{mine / tf_rate:.2f}x", f"{tf_rate / tf_base:.2f}x"]
        print(f"| {k} | {mine:,.0f} | {cells[0]} | {cells[1]} | {mine / base:.2f}x | {cells[2]} |")


if __name__ == "__main__":
    main()
