"""Where one RecvTensor step's time goes: a timeline across the client, worker and ps.

Runs the RecvTensor benchmark graph (`_shared.build_recv_graph`: a variable on ps read
by ``x[0]`` on worker, master on worker) back to back for `--seconds` on a
`LocalCluster`, with every process recording timestamps (``time.perf_counter``, one
clock for all processes on Linux) at the entry and exit of a few runtime methods.
Prints, for each mark, the median time after the client started the step.

The marks wrap methods by name (`MARKS`); a renamed method makes this script fail
loudly rather than print a partial timeline.

    .venv/bin/python scripts/trace_step.py [--protocol grpc+verbs] [--size 16M] [--seconds 6]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The benchmarks' graph builders and timing helpers (`_shared`).
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _shared  # noqa: E402

import distserver as ds  # noqa: E402
from distserver.protos.config_pb2 import ConfigProto  # noqa: E402
from distserver.testing import LocalCluster  # noqa: E402

# (module, class, method, mark at entry, mark at exit); None: no mark.
MARKS = [
    (
        "distserver.runtime.clients",
        "RemoteMaster",
        "run_callable",
        "client sends RunCallable",
        "client has the result",
    ),
    (
        "distserver.runtime.master",
        "Master",
        "run_callable_rpc",
        "master handler starts",
        "master handler ends",
    ),
    (
        "distserver.runtime.clients",
        "RemoteWorker",
        "run_graph",
        "master sends RunGraph",
        "master has the RunGraph reply",
    ),
    (
        "distserver.runtime.clients",
        "RemoteWorker",
        "recv_tensor",
        "master asks for the tensor",
        "master has the tensor",
    ),
    (
        "distserver.runtime.worker",
        "Worker",
        "run_graph_rpc",
        "RunGraph handler starts",
        "RunGraph handler ends",
    ),
    ("distserver.runtime.worker", "Worker", "recv_tensor", "tensor request seen", "tensor handed over"),
    ("distserver.transports.verbs._qp", "QueuePair", "write", "verbs copy starts", "verbs copy done"),
]

TRACER = """
import atexit, functools, importlib, json, os, time
_events = []
def _wrap(module, cls, name, start, end):
    owner = getattr(importlib.import_module(module), cls)
    original = getattr(owner, name)
    @functools.wraps(original)
    async def wrapped(*args, **kwargs):
        if start:
            _events.append((start, time.perf_counter()))
        try:
            return await original(*args, **kwargs)
        finally:
            if end:
                _events.append((end, time.perf_counter()))
    setattr(owner, name, wrapped)
try:
    for _mark in json.loads(os.environ["DISTSERVER_TRACE_MARKS"]):
        _wrap(*_mark)
except Exception as exc:  # sitecustomize errors are only printed: leave a record
    with open(os.path.join(os.environ["DISTSERVER_TRACE_DIR"], f"{os.getpid()}.error"), "w") as f:
        f.write(f"{type(exc).__name__}: {exc}")
    raise
@atexit.register
def _dump():
    if _events:
        with open(os.path.join(os.environ["DISTSERVER_TRACE_DIR"], f"{os.getpid()}.json"), "w") as f:
            json.dump(_events, f)
"""

MiB = 1 << 20


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def run_steps(protocol: str, nbytes: int, seconds: float) -> None:
    """The traced child: a LocalCluster and back-to-back steps for `seconds`."""
    env = {"DISTSERVER_VERBS_STRICT": "1"} if protocol == "grpc+verbs" else {}
    with LocalCluster({"ps": 1, "worker": 1}, protocol=protocol, env=env) as cluster:
        pids = {
            "ps": cluster.process("ps").pid,
            "worker": cluster.process("worker").pid,
            "client": os.getpid(),
        }
        deadline = time.monotonic() + seconds + 120
        prepared = _shared.Prepared(
            ds,
            ConfigProto(operation_timeout_in_ms=60_000),
            cluster.target("worker"),
            "recv",
            nbytes=nbytes,
            warmup=20,
            pids=pids,
            deadline=deadline,
        )
        try:
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                prepared.block(50, deadline)
        finally:
            prepared.finish()


def timeline(trace_dir: Path) -> list[tuple[str, float, int]]:
    """(mark, median µs after the client's step start, steps seen) in time order."""
    events: list[tuple[str, float]] = []
    for path in trace_dir.glob("*.json"):
        events += [(mark, t) for mark, t in json.loads(path.read_text())]
    events.sort(key=lambda e: e[1])
    times = [t for _, t in events]
    starts = [t for mark, t in events if mark == MARKS[0][3]]
    ends = [t for mark, t in events if mark == MARKS[0][4]]
    if not starts:
        raise RuntimeError("no step was traced")
    offsets: dict[str, list[float]] = collections.defaultdict(list)
    for start, end in zip(starts[len(starts) // 4 :], ends[len(ends) // 4 :], strict=False):
        seen: set[str] = set()
        for i in range(bisect.bisect_left(times, start), bisect.bisect_right(times, end)):
            mark = events[i][0]
            if mark not in seen:  # the first of each mark within the step
                seen.add(mark)
                offsets[mark].append((events[i][1] - start) * 1e6)
    rows = [(mark, statistics.median(values), len(values)) for mark, values in offsets.items()]
    return sorted(rows, key=lambda row: row[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", default="grpc+verbs", choices=["grpc", "grpc+verbs"])
    parser.add_argument("--size", type=parse_size, default=16 * MiB, help="tensor bytes (16M)")
    parser.add_argument("--seconds", type=float, default=6.0, help="how long to run steps (6)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_steps(args.protocol, args.size, args.seconds)
        return
    if args.seconds <= 0 or args.size < 4:
        parser.error("--seconds must be > 0 and --size at least 4 bytes")
    with tempfile.TemporaryDirectory(prefix="distserver-trace-") as tmp:
        site, trace_dir = Path(tmp, "site"), Path(tmp, "events")
        site.mkdir()
        trace_dir.mkdir()
        (site / "sitecustomize.py").write_text(TRACER)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "DISTSERVER_TRACE_DIR": str(trace_dir),
            "DISTSERVER_TRACE_MARKS": json.dumps(MARKS),
        }
        command = [sys.executable, __file__, "--child", "--protocol", args.protocol, "--size", str(args.size)]
        subprocess.run(
            [*command, "--seconds", str(args.seconds)], env=env, check=True, timeout=args.seconds + 300
        )
        failures = [path.read_text() for path in trace_dir.glob("*.error")]
        if failures:
            raise SystemExit(f"could not install the marks (see MARKS): {failures[0]}")
        rows = timeline(trace_dir)
    print(f"RecvTensor step, {args.size:,} bytes over {args.protocol}: median time of each mark after the")
    print("client started the step (the last three quarters of the steps)\n")
    print("| µs | mark | steps |")
    print("|---:|---|---:|")
    for mark, offset, count in rows:
        print(f"| {offset:,.0f} | {mark} | {count} |")


if __name__ == "__main__":
    main()
