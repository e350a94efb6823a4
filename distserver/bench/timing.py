"""What every benchmark side shares: the graphs, the timing loop, /proc readers.

Standard library only: `tf_side.py` imports this module (as a sibling file) under
TensorFlow's Python, which has no distserver, and `distserver bench` and the
`benchmarks/` scripts import it under ours. The graph builders take the graph API as
an argument (`distserver` or `tf.compat.v1`, which have the same shape), so both
runtimes get the same graph, and both time their steps with the same code:

* `Prepared`: build the graph, open a session on the worker, initialise, check the
  answer, run the warm-up steps; then `block(n)` times n steps, as often as the
  caller likes (the orchestrator alternates blocks of the two runtimes, so both see
  the same background load), and `combine` merges the blocks: median step time
  over all timed steps (with min, max and quartiles), and per step the CPU time and
  page faults of each process.
* Counters around every block: minor/major page faults and CPU seconds (user +
  system, all threads) from ``/proc/<pid>/stat``; ``VmHWM`` (peak resident set) and
  ``VmRSS`` from ``/proc/<pid>/status`` after the last block.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

KiB = 1 << 10
MiB = 1 << 20

PS = "/job:ps/task:0"
WORKER = "/job:worker/task:0"

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class BudgetExceeded(RuntimeError):
    """The run went past its wall-clock bound (`--max-seconds`)."""


def check_deadline(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise BudgetExceeded("the benchmark ran past its time budget (--max-seconds)")


# --------------------------------------------------------------------------- /proc


def proc_counters(pid: int) -> dict[str, float]:
    """Minor/major faults and CPU seconds of a whole process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    # Field 2 (comm) may contain spaces; everything after the last ")" is fixed.
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): minflt = field 10, majflt = 12, utime = 14, stime = 15.
    return {
        "minflt": float(fields[7]),
        "majflt": float(fields[9]),
        "cpu_s": (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS,
    }


def proc_memory(pid: int) -> dict[str, int]:
    """``VmHWM`` and ``VmRSS`` of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def stop_processes(procs: Iterable[subprocess.Popen[Any]]) -> None:
    """Terminate `procs` (SIGTERM to all first, so they stop side by side), wait up to
    10 s each, kill what is left, and close their stdout pipes."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def machine_cpu() -> dict[str, float]:
    """CPU seconds of the whole machine since boot (``/proc/stat``): busy, steal, total.

    busy excludes idle, iowait and steal (time the hypervisor gave to someone else).
    """
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    total = sum(values)
    busy = total - values[3] - values[4] - values[7]
    return {"busy": busy / _CLOCK_TICKS, "steal": values[7] / _CLOCK_TICKS, "total": total / _CLOCK_TICKS}


# --------------------------------------------------------------------------- graphs


def build_recv_graph(api: Any, nbytes: int) -> tuple[Any, Any, Any]:
    """A float32 variable of `nbytes` on ps, read there, consumed by ``x[0]`` on worker.

    Returns (graph, initializer, fetch). The cross-task edge Identity (ps) ->
    StridedSlice (worker) is the RecvTensor the benchmark times; the fetch is a
    scalar, so the hop to the client carries 4 bytes.
    """
    graph = api.Graph()
    with graph.as_default():
        with api.device(PS):
            # Fill runs on ps at initialisation; a variable (not a constant) so
            # nothing can be constant-folded away.
            var = api.Variable(api.fill([nbytes // 4], 1.0), name=f"v{nbytes}")
            value = var.read_value()  # Read/ReadVariableOp + Identity, on ps
        with api.device(WORKER):
            first = value[0]  # StridedSlice on worker
    return graph, var.initializer, first


def build_fetch_graph(api: Any, nbytes: int) -> tuple[Any, Any, Any]:
    """A float32 variable of `nbytes` on ps whose whole value is fetched by the client.

    Returns (graph, initializer, fetch). With the session on the worker, one step
    moves the tensor ps -> master (worker) -> client.
    """
    graph = api.Graph()
    with graph.as_default(), api.device(PS):
        var = api.Variable(api.fill([nbytes // 4], 1.0), name=f"f{nbytes}")
        value = var.read_value()
    return graph, var.initializer, value


def build_feed_graph(api: Any, nbytes: int) -> tuple[Any, Any, Any]:
    """A float32 placeholder of `nbytes` the client feeds, consumed by ``x[0]`` on ps.

    Returns (graph, feed, fetch). With the session on the worker, one step moves the
    tensor client -> master (worker) -> ps; the fetch is a scalar.
    """
    graph = api.Graph()
    with graph.as_default():
        fed = api.placeholder(api.float32, shape=[nbytes // 4], name=f"x{nbytes}")
        with api.device(PS):
            first = fed[0]
    return graph, fed, first


def build_push_graph(api: Any, nbytes: int, workers: int) -> tuple[Any, Any, Any]:
    """`workers` float32 variables of `nbytes`, one per worker, each consumed on ps.

    Returns (graph, initializer, fetch): the fetch is the sum on ps of ``v[0]`` of every
    worker's variable, so one step moves `workers` x `nbytes` from the workers to ps.
    """
    graph = api.Graph()
    with graph.as_default():
        variables, firsts = [], []
        for index in range(workers):
            with api.device(f"/job:worker/task:{index}"):
                var = api.Variable(api.fill([nbytes // 4], 1.0), name=f"p{index}_{nbytes}")
                variables.append(var)
                value = var.read_value()
            with api.device(PS):
                firsts.append(value[0])
        with api.device(PS):
            total = firsts[0]
            for first in firsts[1:]:
                total = total + first
        init = api.group(*[var.initializer for var in variables])
    return graph, init, total


def build_trivial_graph(api: Any) -> tuple[Any, Any, Any]:
    """A scalar placeholder plus 1.0, both on ps. Returns (graph, feed, fetch)."""
    graph = api.Graph()
    with graph.as_default(), api.device(PS):
        a = api.placeholder(api.float32, shape=[], name="a")
        total = a + 1.0
    return graph, a, total


def build_trivial_var_graph(api: Any) -> tuple[Any, Any, Any]:
    """A scalar variable (0.0) read plus 1.0, all on ps: no feed, nothing to fold.

    Returns (graph, initializer, fetch).
    """
    graph = api.Graph()
    with graph.as_default(), api.device(PS):
        s = api.Variable(0.0, name="s")
        total = s + 1.0  # ReadVariableOp + add
    return graph, s.initializer, total


# --------------------------------------------------------------------------- timing


def settle(step: Any, settle_ms: float, deadline: float) -> None:
    """Run untimed steps for `settle_ms` (at least one when > 0).

    A side's steps are slow for a while after it sat idle while the others ran
    (16 MiB over grpc+verbs after an 80 ms pause: 6.0, 4.8, 4.1, 3.5, 3.3, 3.2 ms
    against 2.6 ms back to back; idle vCPUs wake slowly on this VM). Settling by time
    rather than by step count treats a fast side (many short steps) like a slow one.
    """
    if settle_ms <= 0:
        return
    until = time.perf_counter() + settle_ms / 1000
    while True:
        check_deadline(deadline)
        step()
        if time.perf_counter() >= until:
            return


class Prepared:
    """One benchmark, ready to time: session open on `target`, initialised, warmed up.

    kind "recv": one step moves an `nbytes` float32 tensor ps -> worker.
    kind "fetch": one step fetches an `nbytes` float32 tensor of ps to the client.
    kind "feed": one step feeds an `nbytes` float32 tensor from the client to ps.
    kind "push": one step moves `nbytes` from each of `workers` workers to ps.
    kind "trivial": one step feeds a scalar to ``a + 1.0`` on ps (master on worker).
    kind "trivial_var": one step fetches ``s + 1.0``, `s` a scalar variable on ps.
    """

    def __init__(
        self,
        api: Any,
        config: Any,
        target: str,
        kind: str,
        *,
        nbytes: int = 0,
        workers: int = 1,
        warmup: int,
        pids: Mapping[str, int],
        deadline: float,
    ) -> None:
        self.kind, self.nbytes, self.warmup, self.pids = kind, nbytes, warmup, dict(pids)
        self.workers = workers
        self.init_s = 0.0
        if kind == "recv":
            graph, init, fetch = build_recv_graph(api, nbytes)
            feeds: list[Any] = []
            expected = 1.0
        elif kind == "fetch":
            graph, init, fetch = build_fetch_graph(api, nbytes)
            feeds, expected = [], 1.0
        elif kind == "feed":
            graph, feed, fetch = build_feed_graph(api, nbytes)
            init, feeds, expected = None, [feed], 1.0
        elif kind == "push":
            graph, init, fetch = build_push_graph(api, nbytes, workers)
            feeds, expected = [], float(workers)
        elif kind == "trivial":
            graph, feed, fetch = build_trivial_graph(api)
            init, feeds, expected = None, [feed], 2.0
        elif kind == "trivial_var":
            graph, init, fetch = build_trivial_var_graph(api)
            feeds, expected = [], 1.0
        else:
            raise ValueError(f"unknown benchmark kind {kind!r}")
        self.session = api.Session(target, graph=graph, config=config)
        try:
            if init is not None:
                started = time.perf_counter()
                self.session.run(init)
                self.init_s = time.perf_counter() - started
            run = self.session.make_callable(fetch, feed_list=feeds or None)
            self.step: Callable[[], Any] = run
            first_feed: list[Any] = []
            if kind == "feed":  # the same array every step, as a training batch in memory
                array = np.ones(nbytes // 4, np.float32)
                first_feed = [array]
                self.step = lambda: run(array)
            elif feeds:
                counter = iter(range(1 << 40))  # a new value every step

                def fed_step() -> Any:
                    return run(float(next(counter) & 0xFFFF))

                self.step = fed_step
                first_feed = [1.0]
            value = run(*first_feed)
            if kind == "fetch":
                if getattr(value, "nbytes", None) != nbytes:
                    raise AssertionError(f"fetch step returned {value!r}, expected {nbytes} bytes")
                value = value[-1]
            if float(value) != expected:
                raise AssertionError(f"{kind} step returned {value!r}, expected {expected}")
            for _ in range(warmup):
                check_deadline(deadline)
                self.step()
        except BaseException:
            self.session.close()
            raise

    def block(self, repeat: int, deadline: float, settle_ms: float = 0.0) -> dict[str, Any]:
        """Time `repeat` steps after `settle_ms` of untimed ones (`settle`); the step
        times and each process's counter deltas."""
        settle(self.step, settle_ms, deadline)
        before = {role: proc_counters(pid) for role, pid in self.pids.items()}
        times = []
        for _ in range(repeat):
            check_deadline(deadline)
            started = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - started)
        after = {role: proc_counters(pid) for role, pid in self.pids.items()}
        deltas = {role: {k: after[role][k] - before[role][k] for k in before[role]} for role in self.pids}
        return {"times_s": times, "counters": deltas}

    def finish(self) -> dict[str, Any]:
        """Close the session; what `combine` needs besides the blocks."""
        self.session.close()
        return {
            "kind": self.kind,
            "nbytes": self.nbytes * (self.workers if self.kind == "push" else 1),
            "warmup": self.warmup,
            "init_s": self.init_s,
            "memory_after": {role: proc_memory(pid) for role, pid in self.pids.items()},
        }


def combine(blocks: list[dict[str, Any]], finished: dict[str, Any]) -> dict[str, Any]:
    """One result from the timed blocks of a benchmark: median over all their steps."""
    times = [t for block in blocks for t in block["times_s"]]
    if not times:
        raise ValueError("no timed steps")
    roles = blocks[0]["counters"].keys()
    per_step = {
        role: {
            key: sum(block["counters"][role][key] for block in blocks) / len(times)
            for key in blocks[0]["counters"][role]
        }
        for role in roles
    }
    median = statistics.median(times)
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [median] * 3
    result = {
        **finished,
        "repeat": len(times),
        "blocks": len(blocks),
        "times_s": times,
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "q1_s": q1,
        "q3_s": q3,
        "per_step": per_step,
    }
    if finished["nbytes"]:
        result["mb_per_s"] = finished["nbytes"] / 1e6 / median
    return result


def run_once(
    api: Any,
    config: Any,
    target: str,
    kind: str,
    *,
    nbytes: int = 0,
    warmup: int,
    repeat: int,
    pids: Mapping[str, int],
    deadline: float,
) -> dict[str, Any]:
    """Prepare, one block of `repeat` steps, finish: a whole benchmark on one runtime."""
    prepared = Prepared(api, config, target, kind, nbytes=nbytes, warmup=warmup, pids=pids, deadline=deadline)
    try:
        block = prepared.block(repeat, deadline)
    finally:
        finished = prepared.finish()
    return combine([block], finished)


def split_blocks(repeat: int, rounds: int) -> list[int]:
    """`repeat` steps as `rounds` near-equal blocks (no empty ones)."""
    rounds = max(1, min(rounds, repeat))
    base, extra = divmod(repeat, rounds)
    return [base + (1 if i < extra else 0) for i in range(rounds)]
