"""A/B of two distserver source trees on a training step from TensorFlow's client.

Starts one one-task server per tree (`LocalCluster`, its process importing distserver
from that tree), then one TensorFlow client (`tf.compat.v1.Session`, the TF Python of
`distserver.bench.tfenv.find_installed`) that builds a workload of
`distserver/bench/train_side.py` on both and times blocks of `--steps` steps that
alternate between them (A B, B A, ...; `--settle` untimed steps before each). Prints
each tree's median block median and the median of the rounds' B/A ratios.

`scripts/ab_trees.py` A/B's the RecvTensor step with distserver's own client; this
is for the one-task rows of `benchmarks/bench_training.py` with TensorFlow's client,
where a change worth 1-2% hides in the noise between benchmark runs. The same code
as A and B gave B/A 0.99-1.01 (rounds 0.97-1.03) on a 2-vCPU VM: run both orders.

    git worktree add /tmp/base HEAD~1
    .venv/bin/python scripts/ab_tf_client.py /tmp/base . [--workload small] [--rounds 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from distserver.bench import tfenv
from distserver.bench.train_side import WORKLOADS
from distserver.bench.training import warm_compiled_loops
from distserver.testing import LocalCluster

BENCH = Path(__file__).resolve().parent.parent / "distserver" / "bench"
CLIENT_TIMEOUT_S = 1800

# Run by TensorFlow's interpreter: argv[1] is a JSON of the options.
CLIENT = """
import json, statistics, sys, time
options = json.loads(sys.argv[1])
sys.path.insert(0, options["bench"])
import tensorflow as tf
tf.compat.v1.disable_eager_execution()
import train_side
steps = []
for target in options["targets"]:
    graph, init, fetches, feeds, values = train_side.build(tf, options["workload"], "one")
    session = tf.compat.v1.Session(target, graph=graph)
    session.run(init)
    step = session.make_callable(fetches, feed_list=feeds)
    for _ in range(options["warmup"]):
        step(*values)
    steps.append((step, values))
medians = [[], []]
for block in range(options["rounds"]):
    for which in ((0, 1) if block % 2 == 0 else (1, 0)):
        step, values = steps[which]
        for _ in range(options["settle"]):
            step(*values)
        times = []
        for _ in range(options["steps"]):
            started = time.perf_counter()
            step(*values)
            times.append(time.perf_counter() - started)
        medians[which].append(statistics.median(times))
print(json.dumps(medians))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree_a", type=Path, help="source tree A (holds distserver/)")
    parser.add_argument("tree_b", type=Path, help="source tree B")
    parser.add_argument("--workload", default="mlp", choices=WORKLOADS)
    parser.add_argument("--rounds", type=int, default=16, help="blocks per tree (16)")
    parser.add_argument("--steps", type=int, default=150, help="timed steps per block (150)")
    parser.add_argument("--settle", type=int, default=15, help="untimed steps before each block (15)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed steps after initialisation (200)")
    parser.add_argument("--tf-python", help="an interpreter with tensorflow (else $DISTSERVER_TF_PYTHON)")
    args = parser.parse_args()
    trees = [args.tree_a.resolve(), args.tree_b.resolve()]
    for name, tree in zip("AB", trees, strict=True):
        if not (tree / "distserver" / "__init__.py").is_file():
            parser.error(f"tree {name} ({tree}) has no distserver/ package")
    if min(args.rounds, args.steps) < 1 or min(args.settle, args.warmup) < 0:
        parser.error("--rounds and --steps must be at least 1, --settle and --warmup at least 0")
    try:
        tf_python = tfenv.find_installed(args.tf_python).python
    except tfenv.TFUnavailable as exc:
        parser.error(str(exc))

    # `python -m distserver` puts its working directory first on sys.path: run the
    # tasks from an empty one, or a tree in the current directory would shadow PYTHONPATH.
    here = os.getcwd()
    clusters: list[LocalCluster] = []
    try:
        with tempfile.TemporaryDirectory(prefix="distserver-ab-") as empty:
            os.chdir(empty)
            try:
                for tree in trees:
                    warm_compiled_loops(tree)
                for tree in trees:
                    clusters.append(LocalCluster({"worker": 1}, env={"PYTHONPATH": str(tree)}).start())
            finally:
                os.chdir(here)
        options = {
            "bench": str(BENCH),
            "targets": [cluster.target("worker") for cluster in clusters],
            **{name: getattr(args, name) for name in ("workload", "rounds", "steps", "settle", "warmup")},
        }
        done = subprocess.run(
            [tf_python, "-c", CLIENT, json.dumps(options)],
            capture_output=True,
            text=True,
            env=tfenv.quiet_tf_env(),
            timeout=CLIENT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        limit = f"TensorFlow's client took over {CLIENT_TIMEOUT_S} s"
        raise SystemExit(f"{limit}: ask for fewer --rounds or --steps") from None
    finally:
        for cluster in clusters:
            cluster.stop()
    if done.returncode != 0:
        raise SystemExit(f"TensorFlow's client failed:\n{done.stderr[-4000:]}")
    medians = json.loads(done.stdout.strip().splitlines()[-1])
    ratios = sorted(b / a for a, b in zip(*medians, strict=True))
    for name, tree, values in zip("AB", trees, medians, strict=True):
        print(f"{name} {tree}: median step {sorted(values)[len(values) // 2] * 1e3:.3f} ms")
    print(
        f"B/A = {ratios[len(ratios) // 2]:.3f} (rounds {ratios[0]:.3f}-{ratios[-1]:.3f}; "
        f"{args.workload}, one task, TensorFlow's client)"
    )


if __name__ == "__main__":
    main()
