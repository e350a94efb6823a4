"""TensorFlow's side of `bench_coordinator.py`: TF 1.x between-graph replication; runs under TF's Python.

    tf_coordinator_side.py --graph FILE --spec JSON --netns

Starts 2 ps and 3 worker `tf.distribute.Server`s (one process each,
`distserver/bench/tf_side.py server`), imports the GraphDef that distserver built
(`FILE`), and for each worker count k in the spec runs the training step as TF
1.x between-graph replication does: one client per worker (a thread here;
`Session.run` releases the GIL), each with a `tf.compat.v1.Session` on its worker
whose `device_filters` name that worker and the ps job, so the graph's
`/job:worker` nodes run there. Prints one ``@@result {...}`` line: steps per
second for each k.

TensorFlow's server binds 0.0.0.0, so `bench_coordinator.py` starts this under
``unshare --net`` (a namespace with only ``lo``) and passes ``--netns``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

# distserver is not installed under TensorFlow's Python: its TF-side helpers are
# imported as plain modules from their directory.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distserver" / "bench"))
import tf_side  # type: ignore[import-not-found]

RESULT = "@@result "
START_TIMEOUT_S = 90.0


def start_servers(jobs: dict[str, int]) -> tuple[dict[str, list[str]], list[subprocess.Popen[str]]]:
    ports = iter(tf_side._free_ports(sum(jobs.values())))
    cluster = {job: [f"localhost:{next(ports)}" for _ in range(n)] for job, n in jobs.items()}
    procs = []
    for job, addresses in cluster.items():
        for task in range(len(addresses)):
            procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, tf_side.__file__, "server", "--cluster", json.dumps(cluster)),
                        *("--job", job, "--task", str(task)),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=tempfile.TemporaryFile("w+"),  # noqa: SIM115 - closed with the process
                    text=True,
                    preexec_fn=tf_side._die_with_parent,
                )
            )
    deadline = time.monotonic() + START_TIMEOUT_S
    for proc in procs:
        assert proc.stdout is not None
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError("a TF server did not start in time")
            line = proc.stdout.readline()
            if line.startswith(tf_side.READY):
                break
            if not line and proc.poll() is not None:
                raise RuntimeError(f"a TF server exited with status {proc.returncode}")
    return cluster, procs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", required=True, help="the serialized GraphDef")
    parser.add_argument("--spec", required=True, help="JSON: feeds, fetch, init, workers, warmup, steps")
    parser.add_argument("--netns", action="store_true")
    args = parser.parse_args()
    tf_side._die_with_parent()
    if args.netns:
        interfaces = tf_side._loopback_up()
        if interfaces != ["lo"]:
            raise RuntimeError(f"--netns but the namespace has interfaces {interfaces}")
    spec: dict[str, Any] = json.loads(args.spec)
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    graph_def = tf.compat.v1.GraphDef()
    with open(args.graph, "rb") as f:
        graph_def.ParseFromString(f.read())
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(shape).astype(dtype) for name, (shape, dtype) in spec["feeds"].items()}
    for name, (shape, dtype) in spec["feeds"].items():
        if dtype.startswith("int"):
            feeds[name] = rng.integers(0, spec["classes"], size=shape).astype(dtype)
    cluster, procs = start_servers({"ps": 2, "worker": max(spec["workers"])})
    results = {}
    try:
        sessions = [
            tf.compat.v1.Session(
                f"grpc://{address}",
                graph=graph,
                config=tf.compat.v1.ConfigProto(
                    device_filters=["/job:ps", f"/job:worker/task:{i}"], operation_timeout_in_ms=60_000
                ),
            )
            for i, address in enumerate(cluster["worker"])
        ]
        sessions[0].run(spec["init"])
        for workers in spec["workers"]:
            per_worker = spec["steps"] // workers
            barrier = threading.Barrier(workers + 1)
            failures: list[BaseException] = []

            def loop(
                session: Any,
                barrier: threading.Barrier = barrier,
                per_worker: int = per_worker,
                failures: list[BaseException] = failures,
            ) -> None:
                try:
                    for _ in range(spec["warmup"]):
                        session.run(spec["fetch"], feed_dict=feeds)
                    barrier.wait()
                    for _ in range(per_worker):
                        session.run(spec["fetch"], feed_dict=feeds)
                except BaseException as exc:
                    failures.append(exc)
                    barrier.abort()

            threads = [threading.Thread(target=loop, args=(s,)) for s in sessions[:workers]]
            for thread in threads:
                thread.start()
            barrier.wait()
            started = time.perf_counter()
            for thread in threads:
                thread.join()
            elapsed = time.perf_counter() - started
            if failures:
                raise failures[0]
            results[str(workers)] = {"steps": per_worker * workers, "seconds": elapsed}
        for session in sessions:
            session.close()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    sys.stdout.write(RESULT + json.dumps({"tensorflow": tf.__version__, "results": results}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
