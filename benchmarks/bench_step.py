"""Median time of a trivial step (scalar add) through a Session.

Three placements of the server, measured in the same run:
  * remote:      the server is another OS process (gRPC over loopback);
  * rpc-local:   the server is in this process but the session uses real RPCs;
  * in-process:  the session calls the server's master directly.

    .venv/bin/python benchmarks/bench_step.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import distserver as ds
from distserver.protos.config_pb2 import ConfigProto
from distserver.testing import LocalCluster


def median_step_seconds(target: str, steps: int, config: ConfigProto | None = None) -> float:
    graph = ds.Graph()
    with graph.as_default():
        a = ds.placeholder(ds.float32, shape=[], name="a")
        total = a + 1.0
    with ds.Session(target, graph=graph, config=config) as session:
        run = session.make_callable(total, feed_list=[a])
        for _ in range(50):  # warm up: plan, channel, caches
            run(1.0)
        times = []
        for i in range(steps):
            started = time.perf_counter()
            run(float(i))
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    rows = []
    with LocalCluster({"worker": 1}) as cluster:
        rows.append(
            ("remote (other process, gRPC)", median_step_seconds(cluster.target("worker"), args.steps))
        )
    with ds.Server.create_local_server() as server:
        rpc = ConfigProto()
        rpc.rpc_options.use_rpc_for_inprocess_master = True
        rows.append(("rpc-local (same process, gRPC)", median_step_seconds(server.target, args.steps, rpc)))
        rows.append(("in-process (direct calls)", median_step_seconds(server.target, args.steps)))
    print(f"trivial step (scalar add), median of {args.steps} steps")
    print("| placement | median step |")
    print("|---|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e6:.0f} µs |")


if __name__ == "__main__":
    main()
