"""Training steps, distserver side by side with TensorFlow's runtime.

A real TensorFlow client (`train_side.py`, TensorFlow's Python, `tf.compat.v1.Session`)
trains the same workloads against a distserver cluster over ``grpc``, one over
``grpc+verbs`` and a TensorFlow cluster, all started by this run, in blocks of steps
that alternate between the runtimes (the order rotates every block, so a change in
the machine's load hits all of them; the task processes of the other runtimes are
stopped while a block is timed). distserver's own client (`ds_side.py`,
distserver's graph API and `ds.Session`) trains the same workloads against the same
distserver clusters, taking turns in the same blocks: series ``grpc/ds-client`` and
``grpc+verbs/ds-client`` (its sessions isolate their state, so its variables are not
the TF client's). Workloads (`train_side.py` and `ds_side.py` build them):

* ``mlp``: 784-512-10 classifier, batch 256, Adam and a global step (~175 nodes);
* ``embedding``: a 50,000 x 32 table in two shards, ``embedding_lookup`` of 256 x 8
  ids, Adagrad with sparse updates;
* ``small``: 30 dense 32x32 layers (60 small variables), Momentum.

Layouts: ``cluster`` (ps + 2 workers; variables on ps through
`replica_device_setter`, compute and the session's target on worker 0), ``one`` (a
one-task cluster, everything local) and ``two-workers``: the cluster with both
workers training at once, as asynchronous parameter-server training does: two TF
clients, one per worker, the session's target and the compute on its worker, the same
variables on the ps, their blocks started together; the step times are both clients'.
The workers then share the machine's cores. distserver's own client has no series
in it (its sessions isolate their state, so its two clients would not share variables).
``pair``, measured only when asked for: the cluster's graph on a ps and one worker, a
task per core on a two-core machine.

For every (layout, workload, series): the median step time and the spread (10th and
90th percentiles) over all timed steps; per step, the CPU seconds of each task
process and of the client (``/proc/<pid>/stat``); the bytes and packets that crossed
loopback (the whole run is in a network namespace of its own, so ``lo`` carries only
this run's traffic: client <-> master and task <-> task; the grpc+verbs data path
moves tensors through shared memory and is not in it); and, for distserver, the calls
its tasks made to each other, by method (counted in the task processes).

`run_training_benchmark(...)` returns all of it as plain data; `distserver bench
--workload training` runs it (`run_cli`), and so does `benchmarks/bench_training.py`:

    .venv/bin/python benchmarks/bench_training.py [--workloads mlp,embedding,small]
        [--layouts cluster,one] [--runtimes grpc,grpc+verbs,tf,grpc/ds-client,grpc+verbs/ds-client]
        [--blocks 4] [--steps 15] [--warmup 10] [--tree NAME=PATH ...] [--json out.json]

``--tree base=/path/to/other/checkout`` adds that source tree's distserver (its
task processes import it) as more runtimes, ``grpc[base]`` and
``grpc+verbs[base]`` (and ``grpc[base]/ds-client``, ...: this tree's client against
that tree's servers): a before/after comparison in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from distserver._blas import blas_kernels, describe_kernels
from distserver.bench import tfenv as _tfenv
from distserver.bench import timing as _shared
from distserver.testing import LocalCluster

HERE = Path(__file__).resolve().parent  # train_side.py and tf_side.py, run as scripts

WORKLOADS = ("mlp", "embedding", "small")
LAYOUTS = ("cluster", "one", "two-workers", "pair")
# What a run measures unless told: "pair" only when asked for.
DEFAULT_LAYOUTS = ("cluster", "one", "two-workers")
PROTOCOLS = ("grpc", "grpc+verbs")
TF = "tf"
DS_CLIENT = "ds-client"
"""The suffix of a series trained by distserver's own client (`ds_side.py`): ``grpc/ds-client``."""
DS_SERIES = tuple(f"{protocol}/{DS_CLIENT}" for protocol in PROTOCOLS)
RUNTIMES = (*PROTOCOLS, TF, *DS_SERIES)
RESULT = "@@result "
READY = "@@ready "
COMMAND_TIMEOUT_S = 300.0
START_TIMEOUT_S = 120.0
JOBS = {
    "cluster": {"ps": 1, "worker": 2},
    "one": {"worker": 1},
    "two-workers": {"ps": 1, "worker": 2},
    "pair": {"ps": 1, "worker": 1},
}
# The layouts whose every worker trains, each with a client of its own; and the layout
# those clients build (`train_side.build`), each for its worker.
EVERY_WORKER_TRAINS = {"two-workers": "cluster"}
# The graph each layout's clients build (`train_side.build`): "cluster" or "one".
GRAPHS = {**EVERY_WORKER_TRAINS, "pair": "cluster"}

# Installed in our task processes (sitecustomize): counts the calls each task makes to
# other tasks, by method, and writes them to $DIR/<pid>.json on SIGUSR1.
_COUNTER = """
import collections, json, os, signal
from distserver.transports import grpc as _grpc
_counts = collections.Counter()
_dumps = [0]
_call, _recv = _grpc.GrpcChannel.call, _grpc.GrpcChannel.recv_tensor
_call_serialized = getattr(_grpc.GrpcChannel, "call_serialized", None)  # trees before it lack it
async def call(self, service, method, *args, **kwargs):
    _counts[method] += 1
    return await _call(self, service, method, *args, **kwargs)
async def call_serialized(self, service, method, *args, **kwargs):
    _counts[method] += 1
    return await _call_serialized(self, service, method, *args, **kwargs)
async def recv_tensor(self, *args, **kwargs):
    _counts["RecvTensor"] += 1
    return await _recv(self, *args, **kwargs)
_grpc.GrpcChannel.call, _grpc.GrpcChannel.recv_tensor = call, recv_tensor
if _call_serialized is not None:
    _grpc.GrpcChannel.call_serialized = call_serialized
def _dump(signum, frame):
    _dumps[0] += 1
    path = os.path.join(os.environ["DISTSERVER_BENCH_COUNTS"], f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"dumps": _dumps[0], "counts": dict(_counts)}, f)
    os.replace(path + ".tmp", path)
signal.signal(signal.SIGUSR1, _dump)
if os.environ.get("DISTSERVER_BENCH_PROFILE"):
    import cProfile
    _profile = [None]
    def _toggle_profile(signum, frame):
        # First SIGUSR2: profile the event loop thread from now; second: write the stats.
        if _profile[0] is None:
            _profile[0] = cProfile.Profile()
            _profile[0].enable()
        else:
            _profile[0].disable()
            path = os.path.join(os.environ["DISTSERVER_BENCH_PROFILE"], f"{os.getpid()}.prof")
            _profile[0].dump_stats(path + ".tmp")
            os.replace(path + ".tmp", path)
            _profile[0] = None
    signal.signal(signal.SIGUSR2, _toggle_profile)
"""


# --------------------------------------------------------------------------- counters


def loopback_counters() -> dict[str, int]:
    """Bytes and packets sent on ``lo`` (each loopback packet is sent once)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                fields = rest.split()
                return {"bytes": int(fields[8]), "packets": int(fields[9])}
    return {"bytes": 0, "packets": 0}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# --------------------------------------------------------------------------- runtimes


class Runtime:
    """One cluster of one layout: its workers' session targets and its task processes."""

    name: str
    targets: list[str]  # by worker task index
    pids: dict[str, int]

    def call_counts(self) -> dict[str, int] | None:
        return None

    def lost(self) -> str | None:
        return None

    def stop(self) -> None: ...


class OursRuntime(Runtime):
    def __init__(
        self,
        name: str,
        protocol: str,
        jobs: dict[str, int],
        tree: Path | None,
        counts_dir: Path,
        profile_dir: Path | None = None,
    ) -> None:
        self.name = name
        self.profile_dir = profile_dir
        self.counts_dir = counts_dir
        site = counts_dir / "site"
        paths = [str(site)] + ([str(tree)] if tree is not None else [])
        paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and tree is None]
        env = {"PYTHONPATH": os.pathsep.join(paths), "DISTSERVER_BENCH_COUNTS": str(counts_dir)}
        if profile_dir is not None:
            env["DISTSERVER_BENCH_PROFILE"] = str(profile_dir)
        if protocol == "grpc+verbs":
            env["DISTSERVER_VERBS_STRICT"] = "1"
        self.cluster = LocalCluster(jobs, protocol=protocol, env=env).start()
        self.targets = [self.cluster.target("worker", i) for i in range(jobs["worker"])]
        self.pids = {_role(task): proc.pid for task, proc in self.cluster.processes.items()}

    def call_counts(self) -> dict[str, int]:
        before = {pid: _read_counts(self.counts_dir, pid) for pid in self.pids.values()}
        for pid in self.pids.values():
            os.kill(pid, signal.SIGUSR1)
        total: dict[str, int] = {}
        deadline = time.monotonic() + 10
        for pid in self.pids.values():
            while True:
                now = _read_counts(self.counts_dir, pid)
                if now["dumps"] > before[pid]["dumps"]:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: task {pid} did not report its call counts")
                time.sleep(0.005)
            for method, n in now["counts"].items():
                total[method] = total.get(method, 0) + n
        return total

    def toggle_profile(self, save_as: str | None = None) -> None:
        """Start profiling the tasks' event loop threads; with `save_as`, stop and keep the
        stats as `<profile_dir>/<save_as>-<task>.prof`."""
        if self.profile_dir is None:
            return
        for role, pid in self.pids.items():
            os.kill(pid, signal.SIGUSR2)
            if save_as is None:
                continue
            written = self.profile_dir / f"{pid}.prof"
            deadline = time.monotonic() + 30
            while not written.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: task {role} did not write its profile")
                time.sleep(0.01)
            written.rename(self.profile_dir / f"{save_as}-{role}.prof")

    def lost(self) -> str | None:
        for task, proc in self.cluster.processes.items():
            if proc.poll() is not None:
                return f"{self.name}: {task} exited ({proc.returncode}): {self.cluster.stderr(task)[-500:]}"
        return None

    def stop(self) -> None:
        self.cluster.stop()


def _read_counts(directory: Path, pid: int) -> dict[str, Any]:
    try:
        counts: dict[str, Any] = json.loads((directory / f"{pid}.json").read_text())
        return counts
    except (OSError, ValueError):
        return {"dumps": 0, "counts": {}}


def _role(task: str) -> str:
    # "/job:worker/replica:0/task:1" -> "worker1"
    parts = dict(p.split(":", 1) for p in task.strip("/").split("/"))
    return f"{parts['job']}{parts['task']}"


class TFRuntime(Runtime):
    """`tf.distribute.Server`s, one process each (`tf_side.py server`)."""

    def __init__(self, python: str, jobs: dict[str, int]) -> None:
        self.name = TF
        ports = iter(_free_ports(sum(jobs.values())))
        cluster = {job: [f"localhost:{next(ports)}" for _ in range(n)] for job, n in jobs.items()}
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self._stderr: dict[str, Any] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            for job, addresses in cluster.items():
                for index in range(len(addresses)):
                    role = f"{job}{index}"
                    self._stderr[role] = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
                    self.procs[role] = subprocess.Popen(
                        [
                            *(python, str(HERE / "tf_side.py"), "server"),
                            *("--cluster", json.dumps(cluster), "--job", job, "--task", str(index)),
                        ],
                        stdout=subprocess.PIPE,
                        stderr=self._stderr[role],
                        text=True,
                        env=_tfenv.quiet_tf_env(),
                    )
            for role, proc in self.procs.items():
                _read_tagged(proc, READY, deadline, f"TF {role}")
        except BaseException:
            self.stop()
            raise
        self.targets = [f"grpc://{address}" for address in cluster["worker"]]
        self.pids = {role: proc.pid for role, proc in self.procs.items()}

    def lost(self) -> str | None:
        for role, proc in self.procs.items():
            if proc.poll() is not None:
                return f"TF {role} exited ({proc.returncode})"
        return None

    def stop(self) -> None:
        _shared.stop_processes(self.procs.values())
        for stream in self._stderr.values():
            stream.close()
        self.procs, self._stderr = {}, {}


def _free_ports(count: int) -> list[int]:
    from distserver.testing.cluster import free_ports

    return free_ports(count)


def _read_tagged(proc: subprocess.Popen[str], tag: str, deadline: float, who: str) -> dict[str, Any]:
    """The payload of the next line of `proc` that starts with `tag`."""
    assert proc.stdout is not None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"{who} did not answer in time")
        readable, _, _ = select.select([proc.stdout], [], [], min(remaining, 1.0))
        if readable:
            line = proc.stdout.readline()
            if line.startswith(tag):
                payload: dict[str, Any] = json.loads(line[len(tag) :])
                return payload
            if line:
                continue
        if proc.poll() is not None:
            raise RuntimeError(f"{who} exited ({proc.returncode})")


class Client:
    """A client process speaking `train_side.py`'s protocol: TensorFlow's client
    (`TFClient`) or distserver's own (`DSClient`, `ds_side.py`)."""

    def __init__(self, who: str, command: list[str], env: dict[str, str] | None) -> None:
        self.who = who
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        self.pid = self.proc.pid
        try:
            self.version: str = self._answer(START_TIMEOUT_S)["version"]
        except BaseException:
            self.stop()
            raise

    def _answer(self, timeout: float) -> Any:
        reply = _read_tagged(self.proc, RESULT, time.monotonic() + timeout, self.who)
        if not reply["ok"]:
            raise RuntimeError(f"{self.who}: {reply['error']}\n{self.stderr_tail()}")
        return reply.get("result")

    def request(self, op: str, **fields: Any) -> Any:
        self.send(op, **fields)
        return self.answer()

    def send(self, op: str, **fields: Any) -> None:
        """Send a command without waiting for its answer (`answer`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> Any:
        """The answer to the command sent last."""
        return self._answer(COMMAND_TIMEOUT_S)

    def stderr_tail(self) -> str:
        self._stderr.seek(0)
        return "\n".join(self._stderr.read().strip().splitlines()[-15:])

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.request("quit")
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=20)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout, self._stderr):
            if stream is not None:
                # (closing stdin flushes a "quit" a dead client could not take)
                with contextlib.suppress(BrokenPipeError):
                    stream.close()


class TFClient(Client):
    """`train_side.py` under TensorFlow's Python."""

    def __init__(self, python: str) -> None:
        super().__init__("the TF client", [python, str(HERE / "train_side.py")], _tfenv.quiet_tf_env())


class DSClient(Client):
    """`ds_side.py`: distserver's own client, under this Python and this process's
    distserver (its source tree first on the client's PYTHONPATH)."""

    def __init__(self) -> None:
        tree = str(Path(__file__).resolve().parents[2])
        paths = [tree, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        super().__init__("distserver's client", [sys.executable, "-m", "distserver.bench.ds_side"], env)


class Series:
    """One timed column: clients training against a runtime (``grpc``: the TF client on
    distserver over grpc; ``grpc/ds-client``: distserver's client on the same cluster),
    client i on worker i: one client, or one per worker (`EVERY_WORKER_TRAINS`)."""

    def __init__(self, name: str, runtime: Runtime, clients: list[Client]) -> None:
        self.name, self.runtime, self.clients = name, runtime, clients

    def ask(self, op: str, **fields: Any) -> list[Any]:
        """Send `op` to every client at once (each its worker's `target` and `worker`
        with "prepare"); their answers, in order."""
        for worker, client in enumerate(self.clients):
            if op == "prepare":
                fields.update(target=self.runtime.targets[worker], worker=worker)
            client.send(op, id=self.name, **fields)
        return [client.answer() for client in self.clients]


# --------------------------------------------------------------------------- measurement


_WARM_LOOPS = "from distserver.kernels import _compiled; _compiled.prepare(); _compiled.wait(600)"


def warm_compiled_loops(tree: Path | None) -> None:
    """Compile the numba loops (`kernels/_compiled.py`) of `tree`'s distserver (this
    process's when None) into its cache, before tasks of it start: a task that compiles
    them itself ran one-task steps 12-17% slower beside one that loaded them
    (docs/benchmarks.md, round 31). Run from an empty directory: `python -c` puts its
    working directory first on sys.path, where a source tree would shadow `tree`."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    with tempfile.TemporaryDirectory(prefix="distserver-warm-") as empty:
        subprocess.run([sys.executable, "-c", _WARM_LOOPS], env=env, cwd=empty, timeout=900, check=True)


def _measure(options: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """Everything, in this process's (network namespace's) view; see `run_training_benchmark`."""
    tf_python: str | None = options["tf_python"]
    trees: dict[str, str] = options["trees"]
    runtimes_wanted: list[str] = options["runtimes"]
    report: dict[str, Any] = {
        "options": options,
        "results": {},
        "netns": options["netns"],
        # distserver's tasks inherit this environment, so they load these kernels too.
        "openblas": {"kernels": blas_kernels(), "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE")},
    }
    if tf_python is None:
        raise RuntimeError("the training benchmark needs TensorFlow's Python for its client (see _tfenv.py)")
    here = os.getcwd()
    # TF: the TF clients, one per worker that trains at once; DS_CLIENT: distserver's.
    clients: dict[str, list[Client]] = {TF: [], DS_CLIENT: []}
    with tempfile.TemporaryDirectory(prefix="distserver-bench-training-") as tmp:
        # `python -m distserver` puts its working directory first on sys.path.
        os.chdir(tmp)
        try:
            for tree in [None, *map(Path, trees.values())]:
                warm_compiled_loops(tree)
            tf_clients = max(
                JOBS[layout]["worker"] if layout in EVERY_WORKER_TRAINS else 1
                for layout in options["layouts"]
            )
            for _ in range(tf_clients):
                clients[TF].append(TFClient(tf_python))
            report["tensorflow"] = clients[TF][0].version
            if any(name in runtimes_wanted for name in DS_SERIES):
                clients[DS_CLIENT].append(DSClient())
            for layout in options["layouts"]:
                report["results"][layout] = _measure_layout(
                    options, layout, Path(tmp), clients, trees, runtimes_wanted, log
                )
        finally:
            for client in [*clients[TF], *clients[DS_CLIENT]]:
                client.stop()
            os.chdir(here)
    return report


def _measure_layout(
    options: dict[str, Any],
    layout: str,
    tmp: Path,
    clients: dict[str, list[Client]],
    trees: dict[str, str],
    runtimes_wanted: list[str],
    log: Callable[[str], None],
) -> dict[str, Any]:
    jobs = JOBS[layout]
    # The TF clients of a series: one, or one per worker.
    tf_clients = clients[TF][: jobs["worker"]] if layout in EVERY_WORKER_TRAINS else clients[TF][:1]
    # distserver's client only where one worker trains (see the module docstring).
    ds_clients = [] if layout in EVERY_WORKER_TRAINS else clients[DS_CLIENT]
    if clients[DS_CLIENT] and not ds_clients:
        log(f"[{layout}] no */{DS_CLIENT} series: distserver's client isolates its sessions' state")
    runtimes: list[Runtime] = []
    series: list[Series] = []
    results: dict[str, Any] = {}
    try:
        specs: list[tuple[str, str, Path | None]] = []
        for protocol in PROTOCOLS:
            if protocol in runtimes_wanted or f"{protocol}/{DS_CLIENT}" in runtimes_wanted:
                specs.append((protocol, protocol, None))
                for tree_name, tree_path in trees.items():
                    specs.append((f"{protocol}[{tree_name}]", protocol, Path(tree_path)))
        for name, protocol, tree in specs:
            counts_dir = tmp / f"counts-{layout}-{len(runtimes)}"
            (counts_dir / "site").mkdir(parents=True)
            (counts_dir / "site" / "sitecustomize.py").write_text(_COUNTER)
            log(f"[{layout}] starting {name}")
            profile_dir = Path(options["profile"]).absolute() if options.get("profile") else None
            if profile_dir is not None:
                profile_dir.mkdir(parents=True, exist_ok=True)  # (the tasks write into it)
            ours = OursRuntime(name, protocol, jobs, tree, counts_dir, profile_dir)
            runtimes.append(ours)
            if protocol in runtimes_wanted:
                series.append(Series(name, ours, tf_clients))
            if f"{protocol}/{DS_CLIENT}" in runtimes_wanted and ds_clients:
                series.append(Series(f"{name}/{DS_CLIENT}", ours, ds_clients))
        if TF in runtimes_wanted:
            log(f"[{layout}] starting {TF}")
            runtimes.append(TFRuntime(options["tf_python"], jobs))
            series.append(Series(TF, runtimes[-1], tf_clients))
        for workload in options["workloads"]:
            results[workload] = _measure_workload(options, layout, workload, runtimes, series, log)
    finally:
        for runtime in runtimes:
            runtime.stop()
    return results


def _measure_workload(
    options: dict[str, Any],
    layout: str,
    workload: str,
    runtimes: list[Runtime],
    series: list[Series],
    log: Callable[[str], None],
) -> dict[str, Any]:
    log(f"[{layout}] {workload}: preparing")
    per: dict[str, dict[str, Any]] = {}
    for one in series:
        (prepared, *_) = one.ask(
            "prepare",
            workload=workload,
            layout=GRAPHS.get(layout, layout),
            warmup=options["warmup"],
        )
        per[one.name] = {
            "first_loss": prepared["first_loss"],
            "init_s": prepared["init_s"],
            "times": [],
            "cpu_s": {},
            "loopback": {"bytes": 0, "packets": 0},
            "calls": {},
        }
    ours = [r for r in runtimes if isinstance(r, OursRuntime)]
    for runtime in ours:
        runtime.toggle_profile()
    try:
        for block in range(options["blocks"]):
            shift = block % len(series)
            for one in series[shift:] + series[:shift]:
                lost = one.runtime.lost()
                if lost:
                    raise RuntimeError(lost)
                with _others_paused(runtimes, one.runtime):
                    _time_block(options, one, per[one.name])
            log(f"[{layout}] {workload}: block {block + 1}/{options['blocks']}")
        for runtime in ours:
            runtime.toggle_profile(save_as=f"{layout}-{workload}-{runtime.name}")
    finally:
        for one in series:
            with contextlib.suppress(Exception):
                one.ask("close")
    return {name: _summary(data, options["steps"]) for name, data in per.items()}


@contextlib.contextmanager
def _others_paused(runtimes: list[Runtime], running: Runtime) -> Iterator[None]:
    """The task processes of every runtime but `running` stopped (SIGSTOP) meanwhile:
    nothing of theirs takes a core from the block being timed (after a product,
    OpenBLAS's idle threads spin for ~0.1 s, longer than the next block's settle
    steps). The clients are idle between their own blocks anyway."""
    paused = [pid for runtime in runtimes if runtime is not running for pid in runtime.pids.values()]
    try:
        for pid in paused:
            with contextlib.suppress(ProcessLookupError):  # (`Runtime.lost` reports it in its turn)
                os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _time_block(options: dict[str, Any], series: Series, into: dict[str, Any]) -> None:
    """One timed block of `series`; its clients (one per training worker) start together."""
    runtime = series.runtime
    pids = dict(runtime.pids)
    for worker, client in enumerate(series.clients):
        pids["client" if worker == 0 else f"client{worker}"] = client.pid
    if options["settle"]:
        series.ask("block", repeat=options["settle"])
    calls_before = runtime.call_counts()
    cpu_before = {role: _shared.proc_counters(pid)["cpu_s"] for role, pid in pids.items()}
    lo_before = loopback_counters()
    answers = series.ask("block", repeat=options["steps"])
    lo_after = loopback_counters()
    cpu_after = {role: _shared.proc_counters(pid)["cpu_s"] for role, pid in pids.items()}
    calls_after = runtime.call_counts()
    for answer in answers:
        into["times"] += answer["times"]
    into["last_loss"] = answers[0]["loss"]
    for role in pids:
        into["cpu_s"][role] = into["cpu_s"].get(role, 0.0) + cpu_after[role] - cpu_before[role]
    for key in ("bytes", "packets"):
        into["loopback"][key] += lo_after[key] - lo_before[key]
    if calls_before is not None and calls_after is not None:
        for method, n in calls_after.items():
            into["calls"][method] = into["calls"].get(method, 0) + n - calls_before.get(method, 0)


def _summary(data: dict[str, Any], block_steps: int) -> dict[str, Any]:
    times = data["times"]
    steps = len(times)
    calls = {method: n / steps for method, n in sorted(data["calls"].items()) if n}
    return {
        "steps": steps,
        "median_ms": statistics.median(times) * 1e3,
        "p10_ms": _percentile(times, 0.1) * 1e3,
        "p90_ms": _percentile(times, 0.9) * 1e3,
        # The median of each block's i-th timed step (each client's: a block's times are
        # its clients' one after the other): how a runtime that sat idle warms up.
        "median_ms_by_step_of_block": [
            statistics.median(times[i::block_steps]) * 1e3 for i in range(min(block_steps, steps))
        ],
        "cpu_ms_per_step": {role: s / steps * 1e3 for role, s in data["cpu_s"].items()},
        "loopback_bytes_per_step": data["loopback"]["bytes"] / steps,
        "loopback_packets_per_step": data["loopback"]["packets"] / steps,
        "calls_per_step": calls,
        "first_loss": data["first_loss"],
        "last_loss": data["last_loss"],
    }


# --------------------------------------------------------------------------- entry points


def run_training_benchmark(
    *,
    workloads: Sequence[str] = WORKLOADS,
    layouts: Sequence[str] = DEFAULT_LAYOUTS,
    runtimes: Sequence[str] = RUNTIMES,
    blocks: int = 4,
    steps: int = 15,
    warmup: int = 10,
    settle: int = 12,
    trees: dict[str, str] | None = None,
    tf_python: str | None = None,
    profile: str | None = None,
    max_seconds: float = 900.0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the training benchmark; returns plain data (JSON-ready).

    Args:
        workloads: any of "mlp", "embedding", "small".
        layouts: "cluster" (ps + 2 workers), "one" (one task), "two-workers" (ps + 2
            workers, both training at once with a TF client each), "pair" (ps + 1
            worker; not by default).
        runtimes: the series: any of "grpc", "grpc+verbs" (the TF client on distserver),
            "tf" (the TF client on TensorFlow), "grpc/ds-client" and
            "grpc+verbs/ds-client" (distserver's own client on the same distserver
            clusters as the TF client).
        blocks: timed blocks per runtime (the order rotates every block).
        steps: timed steps per block.
        warmup: untimed steps after initialisation.
        settle: untimed steps before each block: a runtime that sat idle is slow for
            ten to fifteen steps, TensorFlow's as well as ours (`median_ms_by_step_of_block`
            in the results, with `settle=0`; docs/benchmarks.md).
        trees: name -> another source tree of distserver, run as more runtimes
            ("grpc[name]", ...).
        tf_python: TensorFlow's interpreter (default: `tfenv.find_installed`: $DISTSERVER_TF_PYTHON,
            or this Python if it has tensorflow).
        profile: a directory: profile the event loop thread of every distserver task
            over the timed blocks (cProfile), one `<layout>-<workload>-<runtime>-<task>.prof`
            each.
        max_seconds: the whole run is stopped after this long.

    Returns: {"results": {layout: {workload: {runtime: summary}}}, "tensorflow",
    "netns", "options", "openblas" (the kernels distserver's products ran, and
    OPENBLAS_CORETYPE when it chose them)}; a summary has median_ms, p10_ms, p90_ms,
    cpu_ms_per_step (per task and the client), loopback_bytes_per_step,
    loopback_packets_per_step, calls_per_step (distserver: the calls its tasks made to
    each other, by method), first_loss and last_loss.
    """
    for name, allowed in (("workloads", WORKLOADS), ("layouts", LAYOUTS), ("runtimes", RUNTIMES)):
        values = {"workloads": workloads, "layouts": layouts, "runtimes": runtimes}[name]
        unknown = [v for v in values if v not in allowed]
        if unknown:
            raise ValueError(f"unknown {name} {unknown}; choose from {list(allowed)}")
    if blocks < 1 or steps < 1 or warmup < 0 or settle < 0:
        raise ValueError("blocks and steps must be at least 1, warmup and settle at least 0")
    if tf_python is None:
        tf_python = _tfenv.find_installed(None).python
    options = {
        "workloads": list(workloads),
        "layouts": list(layouts),
        "runtimes": list(runtimes),
        "blocks": blocks,
        "steps": steps,
        "warmup": warmup,
        "settle": settle,
        "trees": {k: str(Path(v).resolve()) for k, v in (trees or {}).items()},
        "tf_python": tf_python,
        "profile": str(Path(profile).resolve()) if profile else None,
    }
    prefix = _netns_prefix()
    if prefix is None:
        raise RuntimeError(
            "TensorFlow's servers bind 0.0.0.0: the training benchmark runs in a network namespace "
            "(`unshare --net`), which is unavailable here"
        )
    with tempfile.TemporaryDirectory(prefix="distserver-bench-training-") as tmp:
        options_path, out_path = Path(tmp, "options.json"), Path(tmp, "report.json")
        options_path.write_text(json.dumps(options))
        command = [
            *prefix,
            sys.executable,
            "-m",
            "distserver.bench.training",
            "--in-namespace",
            str(options_path),
            str(out_path),
        ]
        proc = start_measurement(command)
        assert proc.stdout is not None
        deadline = time.monotonic() + max_seconds
        try:
            for line in proc.stdout:
                log(line.rstrip())
                if time.monotonic() > deadline:
                    raise _shared.BudgetExceeded(f"the training benchmark ran past {max_seconds:.0f} s")
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if code != 0 or not out_path.exists():
            raise RuntimeError(f"the training benchmark failed (exit {code}); see the lines above")
        report: dict[str, Any] = json.loads(out_path.read_text())
        return report


def start_measurement(command: list[str]) -> subprocess.Popen[str]:
    """Start the process that measures (`command`), its output piped, in a session of
    its own.

    It pauses the runtimes it is not timing (`SIGSTOP`). In the caller's process group,
    those paused tasks would die when the group is orphaned (the shell that started a
    background run exits: Linux sends a group's stopped processes `SIGHUP`). Ctrl-C
    reaches the caller alone, which kills this process (`run_training_benchmark`), and
    every process under it dies with its parent."""
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)


def _netns_prefix() -> list[str] | None:
    for prefix in (["unshare", "--net", "--"], ["unshare", "--net", "--map-root-user", "--"]):
        try:
            ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ok.returncode == 0:
            return prefix
    return None


def _loopback_up() -> list[str]:
    """Bring ``lo`` up (SIOCGIFFLAGS/SIOCSIFFLAGS); return the interface names."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))
    return [name for _, name in socket.if_nameindex()]


def _in_namespace(options_path: str, out_path: str) -> None:
    interfaces = _loopback_up()
    if interfaces != ["lo"]:
        raise RuntimeError(f"the network namespace has interfaces {interfaces}, expected only lo")
    options = json.loads(Path(options_path).read_text())
    options["netns"] = True

    def log(text: str) -> None:
        print(text, flush=True)

    report = _measure(options, log)
    Path(out_path).write_text(json.dumps(report))


def describe_openblas(report: dict[str, Any]) -> str:
    """Which OpenBLAS kernels distserver's products ran in this run, and why."""
    openblas = report.get("openblas") or {}
    line = "distserver's products: " + describe_kernels(
        openblas.get("kernels"), openblas.get("OPENBLAS_CORETYPE")
    )
    return line + ("; TensorFlow's kernels do not read it" if openblas.get("OPENBLAS_CORETYPE") else "")


def format_table(report: dict[str, Any]) -> str:
    """The report as a markdown table (ratios against TensorFlow when it ran).

    ``last loss``: the loss of the last timed step. Every series of one distserver
    cluster ran the same number of steps from the same initial values, so the TF
    client's and distserver's client's agree (``tf``, on TensorFlow's servers, starts
    from other numbers: its ``RandomUniform`` draws differently from the same seeds).
    """
    lines = [
        "| layout | workload | series | median ms (p10-p90) | vs TF | CPU ms/step per task | "
        "loopback KiB/step | packets/step | task-to-task calls/step | last loss |",
        "|---|---|---|---:|---:|---|---:|---:|---|---:|",
    ]
    for layout, workloads in report["results"].items():
        for workload, runtimes in workloads.items():
            tf_median = runtimes.get(TF, {}).get("median_ms")
            for name, s in runtimes.items():
                ratio = f"{s['median_ms'] / tf_median:.2f}x" if tf_median else "-"
                cpu = ", ".join(f"{role} {ms:.1f}" for role, ms in s["cpu_ms_per_step"].items())
                calls = ", ".join(f"{m} {n:g}" for m, n in s["calls_per_step"].items()) or "-"
                if name == TF:
                    calls = "n/a"
                lines.append(
                    f"| {layout} | {workload} | {name} "
                    f"| {s['median_ms']:.2f} ({s['p10_ms']:.2f}-{s['p90_ms']:.2f}) "
                    f"| {ratio} | {cpu} | {s['loopback_bytes_per_step'] / 1024:.1f} "
                    f"| {s['loopback_packets_per_step']:.1f} | {calls} | {s['last_loss']:.6g} |"
                )
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """`distserver bench --workload training`: its options mapped onto this benchmark.

    ``--protocols``: grpc, grpc+verbs and tensorflow are the runtimes (the transfer
    baselines memcpy and grpcio have no training step and are left out); each of
    grpc and grpc+verbs is measured with both clients (``grpc``: the TF client,
    ``grpc/ds-client``: distserver's own); ``--rounds``:
    blocks per runtime; ``--repeats``: timed steps per block (default 15);
    ``--warmup`` (at least 5 here: a training step's first steps are slow);
    ``--tf-python``, ``--max-seconds``, ``--json``.
    """
    wanted = [p.strip() for p in args.protocols.split(",") if p.strip()]
    known = (*PROTOCOLS, "tensorflow", "memcpy", "grpcio")
    unknown = [p for p in wanted if p not in known]
    if unknown:
        print(
            f"distserver bench: --protocols: unknown {', '.join(unknown)}; valid: {', '.join(known)}",
            file=sys.stderr,
        )
        return 2
    runtimes: list[str] = []
    for p in wanted:
        if p in PROTOCOLS:
            runtimes += [p, f"{p}/{DS_CLIENT}"]
        elif p == "tensorflow":
            runtimes.append(TF)
    if not runtimes:
        print(
            "distserver bench: --workload training measures grpc, grpc+verbs and tensorflow; "
            f"--protocols names none of them ({args.protocols})",
            file=sys.stderr,
        )
        return 2
    left_out = [p for p in wanted if p not in (*PROTOCOLS, "tensorflow")]
    if left_out:
        print(f"distserver bench: training has no {', '.join(left_out)} series (left out)", file=sys.stderr)
    try:
        tf_python = _tfenv.find_installed(args.tf_python).python
        report = run_training_benchmark(
            runtimes=runtimes,
            blocks=args.rounds,
            steps=args.repeats or 15,
            warmup=max(args.warmup, 5),
            tf_python=tf_python,
            max_seconds=args.max_seconds,
            log=lambda line: print(line, file=sys.stderr),
        )
    except (ValueError, RuntimeError, _tfenv.TFUnavailable) as exc:
        print(f"distserver bench: {exc}", file=sys.stderr)
        return 1
    print(describe_openblas(report))
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"distserver bench: wrote {args.json}", file=sys.stderr)
    return 0


def main() -> None:
    """The command line of `benchmarks/bench_training.py` (and of the network-namespace child)."""
    if len(sys.argv) == 4 and sys.argv[1] == "--in-namespace":
        _in_namespace(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help=f"any of {', '.join(LAYOUTS)}")
    parser.add_argument(
        "--runtimes",
        default=",".join(RUNTIMES),
        help="series: grpc, grpc+verbs, tf (the TF client), grpc/ds-client, grpc+verbs/ds-client "
        "(distserver's own client) (default: %(default)s)",
    )
    parser.add_argument("--blocks", type=int, default=4, help="timed blocks per runtime (4)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per block (15)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps after initialisation (10)")
    parser.add_argument("--settle", type=int, default=12, help="untimed steps before each block (12)")
    parser.add_argument(
        "--tree", action="append", default=[], metavar="NAME=PATH", help="another distserver tree"
    )
    parser.add_argument("--profile", metavar="DIR", help="cProfile our tasks' loop threads into DIR")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    trees = {}
    for item in args.tree:
        name, sep, path = item.partition("=")
        if not sep or not (Path(path) / "distserver" / "__init__.py").is_file():
            parser.error(f"--tree {item!r}: expected NAME=PATH with PATH/distserver/__init__.py")
        trees[name] = path
    try:
        report = run_training_benchmark(
            workloads=[w for w in args.workloads.split(",") if w],
            layouts=[x for x in args.layouts.split(",") if x],
            runtimes=[r for r in args.runtimes.split(",") if r],
            blocks=args.blocks,
            steps=args.steps,
            warmup=args.warmup,
            settle=args.settle,
            trees=trees,
            profile=args.profile,
            max_seconds=args.max_seconds,
        )
    except (ValueError, RuntimeError, _tfenv.TFUnavailable) as exc:
        sys.exit(f"bench_training: {exc}")
    print(f"\nTensorFlow {report['tensorflow']}; {args.blocks} blocks x {args.steps} steps per runtime")
    print(f"{describe_openblas(report)}\n")
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
