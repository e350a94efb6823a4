"""A/B of two distserver source trees on the RecvTensor step, in one process.

Starts one `LocalCluster` (ps + worker) per tree, its task processes importing
distserver from that tree (PYTHONPATH), opens a session on each from here, then times
blocks of steps that alternate between the two (A B, B A, ...; each block after
`--settle-ms` of untimed steps). Prints each tree's median step and B/A.

Small changes hide in run-to-run noise; side by side they do not. Run it in both
orders: which cluster started second was worth 2-3% on its own on a 2-vCPU VM. The
task processes run each tree's code; this process (the client) runs the installed
distserver for both.

    git worktree add /tmp/base HEAD~1
    .venv/bin/python scripts/ab_trees.py /tmp/base . [--size 16M] [--protocol grpc+verbs]
    .venv/bin/python scripts/ab_trees.py . /tmp/base ...
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The benchmarks' graph builders and timing helpers (`_shared`).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import _shared
from trace_step import parse_size

import distserver as ds
from distserver.protos.config_pb2 import ConfigProto
from distserver.testing import LocalCluster


def measure(args: argparse.Namespace, trees: dict[str, Path]) -> dict[str, list[float]]:
    """Step times of each tree, in alternating blocks."""
    deadline = time.monotonic() + 600
    clusters, sessions, steps = [], [], {}
    try:
        for name, tree in trees.items():
            env = {"DISTSERVER_VERBS_STRICT": "1", "PYTHONPATH": str(tree)}
            cluster = LocalCluster({"ps": 1, "worker": 1}, protocol=args.protocol, env=env).start()
            clusters.append(cluster)
            graph, init, fetch = _shared.build_recv_graph(ds, args.size)
            session = ds.Session(
                cluster.target("worker"), graph=graph, config=ConfigProto(operation_timeout_in_ms=60_000)
            )
            sessions.append(session)
            session.run(init)
            steps[name] = session.make_callable(fetch)
            for _ in range(30):
                steps[name]()
        times: dict[str, list[float]] = {name: [] for name in trees}
        for block in range(args.blocks):
            for name in ("A", "B") if block % 2 == 0 else ("B", "A"):
                step = steps[name]
                _shared.settle(step, args.settle_ms, deadline)
                for _ in range(args.steps):
                    _shared.check_deadline(deadline)
                    started = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - started)
        return times
    finally:
        for session in sessions:
            session.close()
        for cluster in clusters:
            cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree_a", type=Path, help="source tree A (holds distserver/)")
    parser.add_argument("tree_b", type=Path, help="source tree B")
    parser.add_argument("--size", type=parse_size, default=16 << 20, help="tensor bytes (16M)")
    parser.add_argument("--protocol", default="grpc+verbs", choices=["grpc", "grpc+verbs"])
    parser.add_argument("--blocks", type=int, default=20, help="blocks per tree (20)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per block (40)")
    parser.add_argument("--settle-ms", type=float, default=50.0, help="untimed steps before each block")
    args = parser.parse_args()
    trees = {"A": args.tree_a.resolve(), "B": args.tree_b.resolve()}
    for name, tree in trees.items():
        if not (tree / "distserver" / "__init__.py").is_file():
            parser.error(f"tree {name} ({tree}) has no distserver/ package")
    if args.blocks < 1 or args.steps < 1:
        parser.error("--blocks and --steps must be at least 1")

    # `python -m distserver` puts its working directory first on sys.path: run the
    # tasks from an empty one, or a tree in the current directory would shadow PYTHONPATH.
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="distserver-ab-") as empty:
        os.chdir(empty)
        try:
            times = measure(args, trees)
        finally:
            os.chdir(here)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, tree in trees.items():
        print(f"{name} {tree}: median step {medians[name] * 1e6:,.0f} µs")
    print(f"B/A = {medians['B'] / medians['A']:.3f}  ({args.size:,} bytes over {args.protocol})")


if __name__ == "__main__":
    main()
