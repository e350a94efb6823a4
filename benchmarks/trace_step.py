"""Where a cluster training step's time goes: a median timeline across the processes.

Starts a ps and a worker (`LocalCluster`, one OS process each), runs a training
workload of `bench_training.py` from distserver's own client, and records the entry
and exit of the runtime methods listed in `_step_trace.POINTS` in every process
(client included). For each event it prints the median of its offset from the
client's call, over the timed steps (the n-th occurrence of an event in a step is
its own row, `#n`), then the median step. Offsets from different processes compare
because they share the host's clock.

    .venv/bin/python benchmarks/trace_step.py --workload mlp --protocol grpc+verbs

Wrapping costs ~1 us a call, so a traced step is a little slower than a plain one;
read the gaps between events, not the absolute step time.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _step_trace  # noqa: E402

import distserver as ds  # noqa: E402
from distserver.bench import ds_side, train_side  # noqa: E402
from distserver.testing import LocalCluster  # noqa: E402

_SITECUSTOMIZE = """\
import os
if os.environ.get("DISTSERVER_TRACE_STEP_DIR"):
    import _step_trace
    _step_trace.instrument(os.environ["DISTSERVER_TRACE_STEP_DIR"])
"""


def _events(directory: Path, names: dict[int, str]) -> list[tuple[float, str]]:
    events = []
    for path in directory.glob("*.txt"):
        who = names.get(int(path.stem), f"pid {path.stem}")
        for line in path.read_text().splitlines():
            when, label = line.split(" ", 1)
            events.append((float(when), f"{who}: {label}"))
    events.sort()
    return events


def _timeline(events: list[tuple[float, str]], steps: list[tuple[float, float]]) -> list[tuple[float, str]]:
    """(median offset in us, event) of the events seen in most steps, in time order."""
    times = [when for when, _ in events]
    offsets: dict[str, list[float]] = collections.defaultdict(list)
    for started, ended in steps:
        seen: collections.Counter[str] = collections.Counter()
        for when, label in events[bisect.bisect_left(times, started) : bisect.bisect_right(times, ended)]:
            seen[label] += 1
            offsets[f"{label} #{seen[label]}"].append((when - started) * 1e6)
    common = len(steps) // 2
    return sorted((statistics.median(v), k) for k, v in offsets.items() if len(v) > common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=train_side.WORKLOADS, default="mlp")
    parser.add_argument("--protocol", default="grpc+verbs", help="grpc or grpc+verbs (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=300, help="timed steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps first (default: %(default)s)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="trace-step-") as scratch:
        site, out = Path(scratch, "site"), Path(scratch, "events")
        site.mkdir()
        (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        path = os.pathsep.join(p for p in (str(site), str(HERE), os.environ.get("PYTHONPATH", "")) if p)
        env = {"PYTHONPATH": path, "DISTSERVER_TRACE_STEP_DIR": str(out)}
        cluster = LocalCluster({"ps": 1, "worker": 1}, protocol=args.protocol, env=env).start()
        names = {os.getpid(): "client"}
        try:
            names.update({cluster.process(job).pid: job for job in ("ps", "worker")})
            graph, init, fetches, feeds, values = ds_side.build(args.workload, "cluster")
            session = ds.Session(cluster.target("worker"), graph=graph)
            session.run(init)
            step = session.make_callable(fetches, feed_list=feeds)
            for _ in range(args.warmup):
                step(*values)
            flush = _step_trace.instrument(str(out))  # the client too, from here on
            steps = []
            for _ in range(args.steps):
                started = time.time()
                step(*values)
                steps.append((started, time.time()))
            session.close()
        finally:
            cluster.stop()  # the tasks write their events as they exit
        flush()
        events = _events(out, names)

    print(f"{args.workload} over {args.protocol}: median offset from the client's call, {len(steps)} steps")
    for offset, label in _timeline(events, steps):
        print(f"{offset:9.0f} us  {label}")
    print(f"median step: {statistics.median(e - s for s, e in steps) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
