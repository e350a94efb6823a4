"""distserver's own client in a plain training script, with and without malloc tuning.

A script that starts a local cluster, builds a training graph and runs it through
`ds.Session.make_callable` (one task, `distserver.bench.ds_side`'s workloads): the
median step, the client process's CPU time per step and its minor page faults per
step, with distserver's glibc malloc settings (`distserver/_malloc.py`) and without
them (`DISTSERVER_MALLOC_TUNING=0` for the client process only: the task keeps its
own setting). Each measurement is a fresh process; settings alternate within each
round, so both see the same machine.

    .venv/bin/python benchmarks/bench_client.py [--workloads mlp,embedding,small] \\
        [--steps 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CHILD_TIMEOUT_S = 600.0
SETTINGS = {"tuned": "1", "untuned": "0"}


def measure(workload: str, steps: int) -> dict[str, float]:
    """One run in this process (what `--child` prints)."""
    import distserver as ds
    from distserver.bench import ds_side
    from distserver.testing import LocalCluster

    graph, init, fetches, feeds, values = ds_side.build(workload, "one")
    # The task gets the tuning whatever this process has (`distserver serve` sets its own).
    task_env = {"DISTSERVER_MALLOC_TUNING": "1"}
    cluster = LocalCluster({"worker": 1}, env=task_env)
    with cluster, ds.Session(cluster.target("worker"), graph=graph) as session:
        session.run(init)
        run = session.make_callable(fetches, feed_list=feeds)
        for _ in range(20):
            run(*values)
        before = resource.getrusage(resource.RUSAGE_SELF)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            run(*values)
            times.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {
        "step_ms": statistics.median(times) * 1e3,
        "cpu_ms": cpu / steps * 1e3,
        "faults": (after.ru_minflt - before.ru_minflt) / steps,
    }


def run_child(workload: str, steps: int, tuning: str) -> dict[str, float]:
    env = {**os.environ, "DISTSERVER_MALLOC_TUNING": tuning}
    result = subprocess.run(
        [sys.executable, __file__, "--child", workload, "--steps", str(steps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"{workload} ({tuning=}) failed:\n{result.stderr[-2000:]}")
    found: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,embedding,small")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per run (300)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per workload and setting (3)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.steps)))
        return
    workloads = [w for w in args.workloads.split(",") if w]
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    total = args.rounds * len(workloads) * len(SETTINGS)
    done = 0
    for round_index in range(args.rounds):
        order = list(SETTINGS) if round_index % 2 == 0 else list(reversed(SETTINGS))
        for workload in workloads:
            for name in order:
                done += 1
                print(f"[{done}/{total}] {workload}, {name}", file=sys.stderr, flush=True)
                results.setdefault((workload, name), []).append(
                    run_child(workload, args.steps, SETTINGS[name])
                )
    print(f"\n{args.rounds} runs of {args.steps} steps per workload and setting; medians over the runs\n")
    print("| workload | setting | step ms | client CPU ms/step | client page faults/step | step vs untuned |")
    print("|---|---|---:|---:|---:|---:|")
    for workload in workloads:
        untuned = statistics.median(r["step_ms"] for r in results[(workload, "untuned")])
        for name in SETTINGS:
            runs = results[(workload, name)]
            step = statistics.median(r["step_ms"] for r in runs)
            cpu = statistics.median(r["cpu_ms"] for r in runs)
            faults = statistics.median(r["faults"] for r in runs)
            print(f"| {workload} | {name} | {step:.2f} | {cpu:.2f} | {faults:.0f} | {step / untuned:.2f}x |")


if __name__ == "__main__":
    main()
