"""Where one step's time goes: a timeline across the client, worker and ps.

Runs a step back to back for `--seconds` on a `LocalCluster` (ps + worker), with every
process recording timestamps (``time.perf_counter``, one clock for all processes on
Linux) at the entry and exit of a few runtime methods (`MARKS`). Prints, for each
mark, the process it was seen in and the median time after the client started the
step; a mark seen more than once in a step is one row per occurrence ("2nd", ...).

`--workload recv` (the default) is the RecvTensor benchmark graph
(`_shared.build_recv_graph`: a variable on ps read by ``x[0]`` on worker, master on
worker) with a tensor of `--size`; `mlp`, `embedding` and `small` are the training
steps of `benchmarks/bench_training.py`, from distserver's own client, on a ps and a
worker (`--layout cluster`) or on one task (`--layout one`).

`--client tf` drives a training step with TensorFlow's own client (`train_side.py`
under TensorFlow's Python: $DISTSERVER_TF_PYTHON, or this Python if it imports
tensorflow). That process is not marked: times are then counted from the moment the
master's RunStep handler starts, up to the next step's start. The task's HTTP/2 front
marks the bytes it reads and the calls it answers: after the handler ends, the answer
going out, then (the client's own time between) the next request coming in.

`--nodes` adds a mark as each kernel starts ("node MatMul") and a second table: each
node's median wall and CPU time (the thread's clock) per run, by process and thread
(the main thread runs the event loop; others are the pool's), the heaviest first.
A stack of small dense layers then calls its members one by one (its plan, which
makes their numpy calls without calling them, is off), so that each is timed.

The marks wrap methods by name; a renamed method makes this script fail loudly
rather than print a partial timeline. Wrapping costs ~1 us a call: read the gaps
between marks, not the step time.

    .venv/bin/python scripts/trace_step.py [--protocol grpc+verbs] [--size 16M] [--seconds 6]
    .venv/bin/python scripts/trace_step.py --workload mlp [--protocol grpc+verbs]
        [--layout one] [--client tf] [--nodes]
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
from distserver.bench import ds_side, tfenv, train_side  # noqa: E402
from distserver.bench.training import TFClient  # noqa: E402
from distserver.protos.config_pb2 import ConfigProto  # noqa: E402
from distserver.testing import LocalCluster  # noqa: E402

RUN_STEP_STARTS, RUN_STEP_ENDS = "master RunStep handler starts", "master RunStep handler ends"

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
    # (TensorFlow's client runs its steps with RunStep.)
    ("distserver.runtime.master", "Master", "run_step_rpc", RUN_STEP_STARTS, RUN_STEP_ENDS),
    # TensorFlow's client's calls, read and answered by the task's HTTP/2 front: bytes
    # read from its connection (a request's, or the client's own frames), and a served
    # call from its request read whole to its answer written.
    ("distserver.transports.http2", "_Connection", "buffer_updated", "front reads bytes", None),
    ("distserver.transports.http2", "Http2Front", "serve", "front starts a call", "front has answered"),
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
        "asks a peer for a tensor",
        "has the peer's tensor",
    ),
    (
        "distserver.runtime.clients",
        "RemoteWorker",
        "recv_tensors",
        "asks a peer for a batch",
        "has the peer's batch",
    ),
    (
        "distserver.runtime.worker",
        "Worker",
        "run_graph_rpc",
        "RunGraph handler starts",
        "RunGraph handler ends",
    ),
    ("distserver.runtime.worker", "Worker", "recv_tensor", "tensor request seen", "tensor handed over"),
    ("distserver.runtime.worker", "Worker", "recv_tensors_rpc", "batched request seen", "batch answered"),
    ("distserver.transports.verbs._qp", "QueuePair", "write", "verbs copy starts", "verbs copy done"),
    (
        "distserver.transports.verbs._tensor",
        "TensorEndpoint",
        "_on_completion",
        "verbs completion seen",
        None,
    ),
    # A message between tasks over grpc+verbs leaving, and read by the other task.
    ("distserver.transports.verbs._qp", "QueuePair", "send_nowait", "verbs message sent", None),
    ("distserver.transports.verbs._qp", "QueuePair", "_on_packet", "verbs message read", None),
    ("distserver.runtime.executor", "Executor", "run", "executor starts", "executor ends"),
    # A run of nodes in a pool thread (one hop there and back for all of them).
    ("distserver.runtime.executor", "_Straight", "_run_in_thread", "thread run starts", "thread run ends"),
    # Answering a peer's RecvTensors: its values in hand (then encoded and sent).
    ("distserver.runtime.worker", "Worker", "_batched_values", None, "batch values gathered"),
    # Any call a grpc+verbs peer makes (RunGraph, RecvTensors), from its handler's
    # start to its answer going out.
    (
        "distserver.transports.verbs._calls",
        "QueuePairCalls",
        "_answer",
        "verbs call answer starts",
        "verbs call answered",
    ),
    # (the fused kernels' fast paths, which a stack of layers calls too)
    ("distserver.kernels.math", "FusedMatMulKernel", "layer", "FusedMatMul starts", "FusedMatMul ends"),
    (
        "distserver.kernels.math",
        "FusedMatMulGradKernel",
        "gradients",
        "FusedMatMulGrad starts",
        "FusedMatMulGrad ends",
    ),
    (
        "distserver.kernels.state",
        "_ApplyKernel",
        "compute",
        "optimizer update starts",
        "optimizer update ends",
    ),
    (
        "distserver.kernels.state",
        "GroupedUpdatesKernel",
        "compute",
        "grouped updates start",
        "grouped updates end",
    ),
]

TRACER = """
import atexit, functools, importlib, inspect, json, os, time
_events = []
def _marked(original, start, end):
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def wrapped(*args, **kwargs):
            if start:
                _events.append((start, time.perf_counter()))
            try:
                return await original(*args, **kwargs)
            finally:
                if end:
                    _events.append((end, time.perf_counter()))
        return wrapped
    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        if start:
            _events.append((start, time.perf_counter()))
        try:
            return original(*args, **kwargs)
        finally:
            if end:
                _events.append((end, time.perf_counter()))
    return wrapped
def _wrap(module, cls, name, start, end):
    owner = getattr(importlib.import_module(module), cls)
    original = getattr(owner, name)
    wrapped = _marked(original, start, end)
    # The executor calls a kernel's `compute.without_dereference` when it has one.
    inner = getattr(original, "without_dereference", None)
    if inner is not None:
        wrapped.without_dereference = _marked(inner, start, end)
    setattr(owner, name, wrapped)
# --nodes: every kernel the executor runs (`node.compute`, which the straight sequence
# and the ready queue call, `_compute`, a traced step's and a thread's, and the members
# of a stack of dense layers), a mark as it starts and its wall and CPU time, by node
# and thread.
_nodes = {}
def _timed(call, kernel_of):
    import threading
    main = threading.main_thread()
    def run(*args):
        kernel = kernel_of(*args)
        _events.append(("node " + kernel.op, time.perf_counter()))
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return call(*args)
        finally:
            where = "main thread" if threading.current_thread() is main else "other thread"
            _nodes.setdefault(f"{kernel.name} ({kernel.op}, {where})", []).append(
                ((time.perf_counter_ns() - wall) / 1e3, (time.thread_time_ns() - cpu) / 1e3))
    return run
try:
    for _mark in json.loads(os.environ["DISTSERVER_TRACE_MARKS"]):
        _wrap(*_mark)
    # The fused kernels' arithmetic that a stack calls without their checks (an
    # attribute of each kernel): marked as their fast paths are (`MARKS`).
    _math = importlib.import_module("distserver.kernels.math")
    for _cls, _path, _start, _end in (
        (_math.FusedMatMulKernel, "checked_layer", "FusedMatMul starts", "FusedMatMul ends"),
        (_math.FusedMatMulGradKernel, "checked_gradients", "FusedMatMulGrad starts", "FusedMatMulGrad ends"),
    ):
        def _marking_init(self, node, _init=_cls.__init__, _path=_path, _start=_start, _end=_end):
            _init(self, node)
            setattr(self, _path, _marked(getattr(self, _path), _start, _end))
        _cls.__init__ = _marking_init
    if os.environ.get("DISTSERVER_TRACE_NODES"):
        _executor = importlib.import_module("distserver.runtime.executor")
        _executor._compute = _timed(_executor._compute, lambda kernel, ctx, inputs: kernel)
        _compute_of = _executor.compute_without_dereference
        def _timed_compute(kernel):
            return _timed(_compute_of(kernel), lambda ctx, inputs: kernel)
        _executor.compute_without_dereference = _timed_compute
        # A stack calls its members' fast paths, or, for inputs like those they took
        # before, their arithmetic alone (`DenseStackKernel.compute`); its plan, which
        # makes the members' calls without calling them, is off so that each is timed.
        _stack = importlib.import_module("distserver.kernels.math").DenseStackKernel
        _stack._make_plan = lambda self, took, inputs: None
        _stack_init = _stack.__init__
        def _timed_members(self, node):
            _stack_init(self, node)
            paths = ("layer", "checked_layer") if self.forward else ("gradients", "checked_gradients")
            for member in self.members:
                for path in paths:
                    setattr(member, path, _timed(getattr(member, path), lambda *args, member=member: member))
        _stack.__init__ = _timed_members
except Exception as exc:  # sitecustomize errors are only printed: leave a record
    with open(os.path.join(os.environ["DISTSERVER_TRACE_DIR"], f"{os.getpid()}.error"), "w") as f:
        f.write(f"{type(exc).__name__}: {exc}")
    raise
@atexit.register
def _dump():
    if _events:
        with open(os.path.join(os.environ["DISTSERVER_TRACE_DIR"], f"{os.getpid()}.json"), "w") as f:
            json.dump(_events, f)
    if _nodes:
        with open(os.path.join(os.environ["DISTSERVER_TRACE_DIR"], f"{os.getpid()}.nodes"), "w") as f:
            json.dump(_nodes, f)
"""

MiB = 1 << 20


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def run_steps(
    workload: str, protocol: str, nbytes: int, seconds: float, trace_dir: Path, layout: str, client: str
) -> None:
    """The traced child: a LocalCluster and back-to-back steps for `seconds`."""
    env = {"DISTSERVER_VERBS_STRICT": "1"} if protocol == "grpc+verbs" else {}
    jobs = {"ps": 1, "worker": 1} if layout == "cluster" else {"worker": 1}
    with LocalCluster(jobs, protocol=protocol, env=env) as cluster:
        pids = {job: cluster.process(job).pid for job in jobs}
        pids["client"] = os.getpid()
        (trace_dir / "processes.json").write_text(json.dumps({str(pid): who for who, pid in pids.items()}))
        deadline = time.monotonic() + seconds + 120
        if workload != "recv":
            if client == "tf":
                run_tf_training(workload, layout, cluster.target("worker"), seconds)
            else:
                run_training(workload, layout, cluster.target("worker"), seconds)
            return
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


def run_training(workload: str, layout: str, target: str, seconds: float) -> None:
    graph, init, fetches, feeds, values = ds_side.build(workload, layout)
    with ds.Session(target, graph=graph, config=ConfigProto(operation_timeout_in_ms=60_000)) as session:
        session.run(init)
        step = session.make_callable(fetches, feed_list=feeds)
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            step(*values)


def run_tf_training(workload: str, layout: str, target: str, seconds: float) -> None:
    """Steps from TensorFlow's client (`train_side.py`), which runs unmarked: the marks'
    site directory is left off its PYTHONPATH (the tasks, started before, keep it)."""
    site = os.environ["DISTSERVER_TRACE_SITE"]
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    tf_client = TFClient(tfenv.find_installed(None).python)
    try:
        tf_client.request("prepare", id="traced", target=target, workload=workload, layout=layout, warmup=20)
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            tf_client.request("block", id="traced", repeat=50)
    finally:
        tf_client.stop()


def node_times(trace_dir: Path, steps: int) -> list[tuple[str, float, float, float]]:
    """(process: node (op, thread), runs a step, median wall µs, median CPU µs) of the
    kernels timed with --nodes, the heaviest (runs x CPU) first."""
    processes = json.loads((trace_dir / "processes.json").read_text())
    rows = []
    for path in trace_dir.glob("*.nodes"):
        who = processes.get(path.stem, f"pid {path.stem}")
        for kernel, times in json.loads(path.read_text()).items():
            cpu = statistics.median(t[1] for t in times)
            rows.append((f"{who}: {kernel}", len(times) / steps, statistics.median(t[0] for t in times), cpu))
    return sorted(rows, key=lambda row: -row[1] * row[3])


def _ordinal(n: int) -> str:
    return {1: "", 2: " (2nd)", 3: " (3rd)"}.get(n, f" ({n}th)")


def timeline(
    trace_dir: Path, anchors: tuple[str, str], to_next: bool = False
) -> tuple[list[tuple[str, float, int]], int]:
    """(process: mark, median µs after a step's start, steps seen) in time order, and the
    number of steps run; a step starts at the mark `anchors[0]` and ends at `anchors[1]`,
    or, with `to_next`, where the next one starts (what happens between them is seen)."""
    processes = json.loads((trace_dir / "processes.json").read_text())
    events: list[tuple[str, float]] = []
    for path in trace_dir.glob("*.json"):
        if path.stem.isdigit():
            who = processes.get(path.stem, f"pid {path.stem}")
            events += [(f"{who}: {mark}", t) for mark, t in json.loads(path.read_text())]
    events.sort(key=lambda e: e[1])
    times = [t for _, t in events]
    starts = [t for mark, t in events if mark == anchors[0]]
    ends = [t for mark, t in events if mark == anchors[1]]
    if not starts:
        raise RuntimeError("no step was traced")
    offsets: dict[str, list[float]] = collections.defaultdict(list)
    first = len(starts) // 4
    steps = list(zip(starts[first:], starts[first + 1 :] if to_next else ends[first:], strict=False))
    for start, end in steps:
        seen: collections.Counter[str] = collections.Counter()
        for i in range(bisect.bisect_left(times, start), bisect.bisect_right(times, end)):
            mark = events[i][0]
            seen[mark] += 1
            offsets[mark + _ordinal(seen[mark])].append((events[i][1] - start) * 1e6)
    # Marks seen in at least half the steps (a rare one would show a misleading median).
    rows = [
        (mark, statistics.median(values), len(values))
        for mark, values in offsets.items()
        if 2 * len(values) >= len(steps)
    ]
    return sorted(rows, key=lambda row: row[1]), len(starts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload", default="recv", choices=["recv", *train_side.WORKLOADS], help="the step (recv)"
    )
    parser.add_argument("--protocol", default="grpc+verbs", choices=["grpc", "grpc+verbs"])
    parser.add_argument("--size", type=parse_size, default=16 * MiB, help="tensor bytes (16M)")
    parser.add_argument("--seconds", type=float, default=6.0, help="how long to run steps (6)")
    parser.add_argument(
        "--layout",
        default="cluster",
        choices=["cluster", "one"],
        help="a ps and a worker, or one task (cluster)",
    )
    parser.add_argument(
        "--client", default="ds", choices=["ds", "tf"], help="distserver's client or TensorFlow's (ds)"
    )
    parser.add_argument(
        "--nodes",
        action="store_true",
        help="mark every kernel run, and print each kernel's wall and CPU time in the step",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_steps(
            args.workload,
            args.protocol,
            args.size,
            args.seconds,
            Path(os.environ["DISTSERVER_TRACE_DIR"]),
            args.layout,
            args.client,
        )
        return
    if args.seconds <= 0 or args.size < 4:
        parser.error("--seconds must be > 0 and --size at least 4 bytes")
    if args.workload == "recv" and (args.layout != "cluster" or args.client != "ds"):
        parser.error(
            "--workload recv runs on a ps and a worker from distserver's client; "
            "--layout one and --client tf trace a training workload (mlp, embedding, small)"
        )
    if args.client == "tf":
        try:
            tfenv.find_installed(None)
        except tfenv.TFUnavailable as exc:
            parser.error(f"--client tf needs TensorFlow's Python: {exc}")
    with tempfile.TemporaryDirectory(prefix="distserver-trace-") as tmp:
        site, trace_dir = Path(tmp, "site"), Path(tmp, "events")
        site.mkdir()
        trace_dir.mkdir()
        (site / "sitecustomize.py").write_text(TRACER)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "DISTSERVER_TRACE_DIR": str(trace_dir),
            "DISTSERVER_TRACE_SITE": str(site),
            "DISTSERVER_TRACE_MARKS": json.dumps(MARKS),
        }
        if args.nodes:
            env["DISTSERVER_TRACE_NODES"] = "1"
        command = [
            sys.executable,
            __file__,
            "--child",
            "--workload",
            args.workload,
            "--protocol",
            args.protocol,
            "--layout",
            args.layout,
            "--client",
            args.client,
        ]
        command += ["--size", str(args.size)]
        subprocess.run(
            [*command, "--seconds", str(args.seconds)], env=env, check=True, timeout=args.seconds + 300
        )
        failures = [path.read_text() for path in trace_dir.glob("*.error")]
        if failures:
            raise SystemExit(f"could not install the marks (see MARKS): {failures[0]}")
        if args.client == "tf":
            anchors = (f"worker: {RUN_STEP_STARTS}", f"worker: {RUN_STEP_ENDS}")
            start = "the master's RunStep handler started"
        else:
            anchors = (f"client: {MARKS[0][3]}", f"client: {MARKS[0][4]}")
            start = "the client started"
        # TensorFlow's client is not marked: a step runs to the next one's start, so that
        # its answer going out and the next request coming in show (the front's marks).
        rows, steps = timeline(trace_dir, anchors, to_next=args.client == "tf")
        kernels = node_times(trace_dir, steps) if args.nodes else []
    step = (
        f"RecvTensor step, {args.size:,} bytes,"
        if args.workload == "recv"
        else f"{args.workload} training step"
    )
    where = "" if args.layout == "cluster" else ", one task"
    client = "" if args.client == "ds" else ", TensorFlow's client"
    print(f"{step} over {args.protocol}{where}{client}: median time of each mark after {start}")
    to_next = ", up to the next step's start (after the handler's end: the next request)"
    print(f"the step (the last three quarters of the steps){to_next if args.client == 'tf' else ''}\n")
    print("| µs | mark | steps |")
    print("|---:|---|---:|")
    for mark, offset, count in rows:
        print(f"| {offset:,.0f} | {mark} | {count} |")
    if kernels:
        print("\nKernels, the heaviest first (runs a step x CPU time): median wall and CPU time of a run")
        print("(CPU below wall: the thread waited, for the GIL, a core or another thread)\n")
        print("| node (op, thread) | runs a step | wall µs | CPU µs |")
        print("|---|---:|---:|---:|")
        for kernel, runs, wall, cpu in kernels:
            print(f"| {kernel} | {runs:.1f} | {wall:,.1f} | {cpu:,.1f} |")


if __name__ == "__main__":
    main()
