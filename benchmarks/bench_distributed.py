"""Distributed-execution benchmarks, distserver side by side with TensorFlow's runtime (issue #4).

Both runtimes run the same graphs (`_shared.py` builds them through either graph
API), on a ps and a worker task, one OS process each, loopback only, with the
session's target on the worker (so the master runs there), in the same run and
timed by the same code: warm-up steps, then the timed steps in blocks that
alternate between the two runtimes (so a change in the machine's load hits both),
the median over all timed steps.

1. RecvTensor: a float32 variable on ps, read there (ReadVariableOp + Identity),
   consumed by ``x[0]`` on worker, the scalar fetched; one step moves the tensor
   ps -> worker once. Median step time and MB/s (10^6 bytes / median step seconds).
2. Trivial remote step, everything on ps: ``a + 1.0`` with ``a`` fed by the client,
   and ``s + 1.0`` with ``s`` a scalar variable (no feed).
3. Memory: VmHWM of the worker process after 256 MiB crossed from ps (fresh
   clusters), and the idle worker's RSS.

Around every timed block it reads CPU time and page faults of the ps, worker and
client processes (``/proc/<pid>/stat``), and the machine's load from ``/proc/stat``
(how much CPU other processes took meanwhile), to show where the time goes.

TensorFlow runs under its own Python (`_tfenv.py`: ``$DISTSERVER_TF_PYTHON``, else
``<repo>/.tfenv``, else it is created there); `--skip-tf`, or no TF environment,
drops the TF columns. TensorFlow's gRPC server binds ``0.0.0.0``, so the TF processes
run in a network namespace whose only interface is ``lo`` (``unshare --net``).

    DISTSERVER_TF_PYTHON=/path/to/tf/python \
    .venv/bin/python benchmarks/bench_distributed.py [--sizes 4K,64K,1M,16M,64M]
        [--repeat N] [--warmup 5] [--skip-tf] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import _shared
import _tfenv
from _shared import MiB

import distserver as ds
from distserver.protos.config_pb2 import ConfigProto
from distserver.testing import LocalCluster

HERE = Path(__file__).resolve().parent
OPERATION_TIMEOUT_MS = 60_000
TF_START_TIMEOUT_S = 120.0
SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": MiB, "MB": MiB, "MIB": MiB}
SIZE_UNITS["G"] = SIZE_UNITS["GB"] = SIZE_UNITS["GIB"] = 1 << 30


# --------------------------------------------------------------------------- helpers


def parse_size(text: str) -> int:
    text = text.strip().upper()
    digits = text.rstrip("KMGIB")
    nbytes = int(digits) * SIZE_UNITS[text[len(digits) :]]
    if nbytes < 4 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return nbytes


def parse_size_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else parse_size(text)


def size_label(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_rate(mb_per_s: float) -> str:
    if mb_per_s >= 100:
        return f"{mb_per_s:,.0f}"
    if mb_per_s >= 10:
        return f"{mb_per_s:.1f}"
    return f"{mb_per_s:.2f}"


def fmt_mib(nbytes: float) -> str:
    return f"{nbytes / MiB:,.0f} MiB"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "grpcio": _version("grpcio"),
        "protobuf": _version("protobuf"),
        "uvloop": _version("uvloop"),
        "distserver": ds.__version__,
        "loadavg_start": _loadavg(),
    }


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _kill_if_ours(pid: int, marker: str) -> None:
    """SIGKILL `pid` only if it is still a process whose command line has `marker`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if marker.encode() not in f.read():
                return
        os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass


# --------------------------------------------------------------------------- our side


class OursSide:
    """distserver: a `LocalCluster` (ps + worker processes) and a `ds.Session` in this process."""

    name = "ours"

    def __init__(self) -> None:
        self.cluster: LocalCluster | None = None
        self.config = ConfigProto(operation_timeout_in_ms=OPERATION_TIMEOUT_MS)
        self._prepared: _shared.Prepared | None = None
        self.dead: str | None = None

    def lost_process(self) -> str | None:
        """Which of our task processes has exited, if any."""
        if self.cluster is None:
            return None
        for task, proc in self.cluster.processes.items():
            if proc.poll() is not None:
                return f"our {task} exited ({proc.returncode})"
        return None

    def start(self) -> None:
        self.stop()
        self.cluster = LocalCluster({"ps": 1, "worker": 1}).start()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.finish()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    @property
    def pids(self) -> dict[str, int]:
        assert self.cluster is not None
        return {
            "ps": self.cluster.process("ps").pid,
            "worker": self.cluster.process("worker").pid,
            "client": os.getpid(),
        }

    def memory(self) -> dict[str, Any]:
        return {role: _shared.proc_memory(pid) for role, pid in self.pids.items()}

    def prepare(self, kind: str, nbytes: int, warmup: int, deadline: float) -> None:
        assert self.cluster is not None
        self.finish()
        self._prepared = _shared.Prepared(
            ds,
            self.config,
            self.cluster.target("worker"),
            kind,
            nbytes=nbytes,
            warmup=warmup,
            pids=self.pids,
            deadline=deadline,
        )

    def block(self, repeat: int, deadline: float, settle_ms: float = 0.0) -> dict[str, Any]:
        assert self._prepared is not None
        return self._prepared.block(repeat, deadline, settle_ms)

    def finish(self) -> dict[str, Any]:
        prepared, self._prepared = self._prepared, None
        return prepared.finish() if prepared is not None else {}

    def once(self, kind: str, nbytes: int, warmup: int, repeat: int, deadline: float) -> dict[str, Any]:
        assert self.cluster is not None
        return _shared.run_once(
            ds,
            self.config,
            self.cluster.target("worker"),
            kind,
            nbytes=nbytes,
            warmup=warmup,
            repeat=repeat,
            pids=self.pids,
            deadline=deadline,
        )


# --------------------------------------------------------------------------- TensorFlow's side


def netns_prefix() -> list[str] | None:
    """A command prefix that runs a program in a new network namespace, or None."""
    for prefix in (["unshare", "--net", "--"], ["unshare", "--net", "--map-root-user", "--"]):
        try:
            ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ok.returncode == 0:
            return prefix
    return None


class TFSide:
    """TensorFlow: `tf_side.py client` (TF's Python), which runs its own ps + worker servers."""

    name = "tf"

    def __init__(self, python: str, prefix: list[str], deadline: float) -> None:
        self.python = python
        self.prefix = prefix
        self.deadline = deadline
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}
        self._stderr: Any = None
        self.dead: str | None = None

    def lost_process(self) -> str | None:
        """Which TF process (client, ps, worker) has exited, if any."""
        if self.proc is None or self.proc.poll() is not None:
            return "TF client exited"
        for role, pid in self.pids.items():
            if not _running(pid):
                return f"TF {role} (pid {pid}) exited"
        return None

    def spawn(self) -> None:
        """Start the client (it starts its servers); `wait_ready` collects it."""
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        command = [*self.prefix, self.python, str(HERE / "tf_side.py"), "client"]
        if self.prefix:
            command.append("--netns")
        command += ["--deadline-s", f"{max(1.0, self.deadline - time.monotonic()):.0f}"]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=_tfenv.quiet_tf_env(),
            preexec_fn=_die_with_parent,
        )

    def wait_ready(self) -> None:
        self.info = json.loads(self._read_line("@@ready ", time.monotonic() + TF_START_TIMEOUT_S))

    @property
    def pids(self) -> dict[str, int]:
        pids: dict[str, int] = self.info["pids"]
        return pids

    def call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        assert self.proc is not None
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self._read_line("@@result ", self.deadline))
        if not reply["ok"]:
            raise RuntimeError(f"TF side: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    def _read_line(self, prefix: str, deadline: float) -> str:
        assert self.proc is not None
        assert self.proc.stdout is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _shared.BudgetExceeded(f"TF side gave no {prefix.strip()} line in time")
            readable, _, _ = select.select([self.proc.stdout], [], [], min(remaining, 1.0))
            if readable:
                line = self.proc.stdout.readline()
                if line.startswith(prefix):
                    return line[len(prefix) :]
                if line:
                    continue
            if self.proc.poll() is not None:
                raise RuntimeError(f"TF side exited ({self.proc.returncode}):\n{self.stderr_tail()}")

    def stderr_tail(self, lines: int = 15) -> str:
        if self._stderr is None:
            return ""
        self._stderr.flush()
        self._stderr.seek(0)
        return "\n".join(self._stderr.read().strip().splitlines()[-lines:])

    def restart(self) -> None:
        self.info = self.call("restart")

    def memory(self) -> dict[str, Any]:
        return self.call("memory")

    def prepare(self, kind: str, nbytes: int, warmup: int, deadline: float) -> None:
        self.call("prepare", kind=kind, nbytes=nbytes, warmup=warmup)

    def block(self, repeat: int, deadline: float, settle_ms: float = 0.0) -> dict[str, Any]:
        return self.call("block", repeat=repeat, settle_ms=settle_ms)

    def finish(self) -> dict[str, Any]:
        return self.call("finish")

    def once(self, kind: str, nbytes: int, warmup: int, repeat: int, deadline: float) -> dict[str, Any]:
        return self.call("once", kind=kind, nbytes=nbytes, warmup=warmup, repeat=repeat)

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        servers = [pid for role, pid in self.info.get("pids", {}).items() if role != "client"]
        if proc.poll() is None:
            with contextlib.suppress(Exception):
                self.call("quit")
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        for pid in servers:  # they die with the client; this is the backstop
            _kill_if_ours(pid, "tf_side.py")
        for stream in (proc.stdin, proc.stdout, self._stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self.proc = None


def _running(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _die_with_parent() -> None:
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# --------------------------------------------------------------------------- the run


def find_tf(args: argparse.Namespace) -> dict[str, Any]:
    """Which TensorFlow to run, and how: python, command prefix, or why it is skipped."""
    setup: dict[str, Any] = {"python": None, "prefix": [], "skipped": None, "machine": {}}
    if args.skip_tf:
        setup["skipped"] = "--skip-tf"
        return setup
    try:
        env = _tfenv.find_or_create(create=not args.no_create_tfenv, log=_log)
    except _tfenv.TFUnavailable as exc:
        setup["skipped"] = f"no TensorFlow environment: {exc}"
        return setup
    setup["machine"] = {"tensorflow": f"{env.tensorflow} ({env.source}: {env.python})", "tf_numpy": env.numpy}
    prefix = netns_prefix()
    if prefix is None:
        if not args.tf_allow_wildcard_bind:
            setup["skipped"] = (
                "TensorFlow's server binds 0.0.0.0 and `unshare --net` is unavailable here "
                "(pass --tf-allow-wildcard-bind to run it anyway)"
            )
            return setup
        _log("WARNING: no network namespace; TF's servers will bind 0.0.0.0 (as TF always does)")
        prefix = []
    setup["python"], setup["prefix"] = env.python, prefix
    return setup


def timing_params(args: argparse.Namespace) -> dict[str, Any]:
    """The options every side-by-side timing run reports (this script and bench_transports.py)."""
    return {name: getattr(args, name) for name in ("sizes", "warmup", "repeat", "rounds", "settle_ms")}


def run(args: argparse.Namespace, tf_setup: dict[str, Any], deadline: float) -> dict[str, Any]:
    """One full run: both sides, every benchmark; figures (and errors) in a dict."""
    machine_start = _shared.machine_cpu()
    report: dict[str, Any] = {
        "command": "benchmarks/bench_distributed.py " + " ".join(sys.argv[1:]),
        "machine": {**machine_info(), **tf_setup["machine"]},
        "params": {
            **timing_params(args),
            "trivial_steps": args.trivial_steps,
            "memory_size": args.memory_size,
            "memory_repeat": args.memory_repeat,
        },
        "tf_skipped": tf_setup["skipped"],
        "ours": {"recv": {}, "trivial": None, "trivial_var": None, "memory": None},
        "tf": {"recv": {}, "trivial": None, "trivial_var": None, "memory": None},
        "errors": [],
    }
    tf_python, prefix = tf_setup["python"], tf_setup["prefix"]

    ours = OursSide()
    tf = TFSide(tf_python, prefix or [], deadline) if tf_python else None
    sides: list[Any] = [ours] if tf is None else [ours, tf]
    try:
        if tf is not None:
            tf.spawn()  # TF imports while our cluster starts
        _log("starting our cluster (ps + worker)")
        ours.start()
        if tf is not None:
            _log("waiting for TensorFlow's client and servers")
            try:
                tf.wait_ready()
            except Exception as exc:
                _tf_failed(report, tf, exc)
                sides, tf = [ours], None
            else:
                report["machine"]["tf_netns"] = tf.info["netns"]
                report["machine"]["tf_interfaces"] = tf.info["interfaces"]

        for kind in ("trivial", "trivial_var"):
            _log(f"{kind} remote step x {args.trivial_steps}")
            for side, result in measure(sides, kind, 0, args.warmup, args.trivial_steps, args, deadline):
                report[side.name][kind] = result
        for nbytes in args.sizes:
            repeat = repeat_for(nbytes, args.repeat)
            _log(f"RecvTensor {size_label(nbytes)} x {repeat}")
            for side, result in measure(sides, "recv", nbytes, args.warmup, repeat, args, deadline):
                report[side.name]["recv"][str(nbytes)] = result
        report["errors"] += [r["error"] for s in sides for r in _all_results(report[s.name]) if "error" in r]

        if args.memory_size:
            for side in [side for side in sides if not side.dead]:
                _log(f"memory: {size_label(args.memory_size)} ps -> worker, fresh cluster ({side.name})")
                report[side.name]["memory"] = _guard(
                    report, side, "memory", lambda s=side: _memory(s, args, deadline)
                )
    except _shared.BudgetExceeded as exc:
        _log(f"ABORTED: {exc}")
        report["errors"].append(f"aborted, figures incomplete: {exc}")
    finally:
        for side in sides:
            with contextlib.suppress(Exception):
                side.stop()
        report["machine"]["loadavg_end"] = _loadavg()
        machine = {k: v - machine_start[k] for k, v in _shared.machine_cpu().items()}
        elapsed = max(1e-9, machine["total"]) / (os.cpu_count() or 1)
        report["machine"]["run_busy_cpus"] = machine["busy"] / elapsed
        report["machine"]["run_steal_cpus"] = machine["steal"] / elapsed
    return report


def repeat_for(nbytes: int, repeat: int | None) -> int:
    """Timed steps for a size: `--repeat`, else 500 up to 1 MiB (cheap, noisy) and 60 above."""
    if repeat is not None:
        return repeat
    return 500 if nbytes <= MiB else 60


def measure(
    sides: list[Any],
    kind: str,
    nbytes: int,
    warmup: int,
    repeat: int,
    args: argparse.Namespace,
    deadline: float,
) -> list[tuple[Any, dict[str, Any]]]:
    """One benchmark on every side, timed in alternating blocks (A B, B A, A B, ...).

    Each side first prepares (session, initialisation, warm-up); then the timed steps
    are split into `--rounds` blocks and the sides take turns, so slow drifts in the
    machine's load hit both alike. Every block starts with `--settle-ms` of untimed
    steps (`_shared.settle`). A side that fails gets an error result.
    """
    what = f"{kind} {size_label(nbytes)}" if nbytes else kind
    dead = [side for side in sides if side.dead]
    sides = [side for side in sides if not side.dead]
    all_pids = {pid for side in sides for pid in side.pids.values()}
    ours_before = _cpu_of(all_pids)
    machine_before = _shared.machine_cpu()
    errors: dict[str, str] = {}
    blocks: dict[str, list[dict[str, Any]]] = {side.name: [] for side in sides}
    finished: dict[str, dict[str, Any]] = {}
    try:
        for side in sides:
            _attempt(errors, side, what, lambda s=side: s.prepare(kind, nbytes, warmup, deadline))
        for i, count in enumerate(_shared.split_blocks(repeat, args.rounds)):
            for side in sides if i % 2 == 0 else sides[::-1]:
                if side.name not in errors:
                    _attempt(
                        errors,
                        side,
                        what,
                        lambda s=side, n=count: blocks[s.name].append(s.block(n, deadline, args.settle_ms)),
                    )
    finally:
        for side in sides:
            try:
                finished[side.name] = side.finish()
            except _shared.BudgetExceeded:
                raise
            except Exception as exc:
                errors.setdefault(side.name, f"{side.name} {what}: finish: {type(exc).__name__}: {exc}")
    machine = {k: v - machine_before[k] for k, v in _shared.machine_cpu().items()}
    ours_after = _cpu_of(all_pids)
    # While this benchmark ran: busy CPUs of the whole machine, of processes other than
    # the six of the benchmark (background load competing with both sides), and stolen
    # by the hypervisor.
    elapsed = max(1e-9, machine["total"]) / (os.cpu_count() or 1)
    busy = machine["busy"] / elapsed
    load = {
        "machine_busy_cpus": busy,
        "background_cpus": max(0.0, busy - (ours_after - ours_before) / elapsed),
        "steal_cpus": machine["steal"] / elapsed,
    }
    out = [(side, {"error": f"{side.name} {what}: skipped, {side.dead}"}) for side in dead]
    for side in sides:
        if side.name in errors:
            lost = side.lost_process()
            if lost:  # the rest of the run would only wait for time-outs
                side.dead = lost
                _log(f"{lost}: no more {side.name} figures in this run")
            out.append((side, {"error": errors[side.name]}))
        else:
            result = _shared.combine(blocks[side.name], finished[side.name])
            out.append((side, {**result, **load}))
    return out


def _cpu_of(pids: set[int]) -> float:
    """CPU seconds so far of the processes in `pids` that still exist."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += _shared.proc_counters(pid)["cpu_s"]
    return total


def _attempt(errors: dict[str, str], side: Any, what: str, fn: Any) -> None:
    try:
        fn()
    except _shared.BudgetExceeded:
        raise
    except Exception as exc:
        message = f"{side.name} {what}: {type(exc).__name__}: {exc}"
        _log(f"ERROR {message}")
        errors[side.name] = message


def _all_results(side_report: dict[str, Any]) -> list[dict[str, Any]]:
    results = [side_report["trivial"], side_report["trivial_var"], *side_report["recv"].values()]
    return [r for r in results if isinstance(r, dict)]


def _memory(side: Any, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    if isinstance(side, OursSide):
        side.start()
    else:
        side.restart()
    idle = side.memory()
    result = side.once("recv", args.memory_size, 1, args.memory_repeat, deadline)
    return {"idle": idle, "step": result}


def _guard(report: dict[str, Any], side: Any, what: str, fn: Any) -> Any:
    try:
        return fn()
    except _shared.BudgetExceeded:
        raise
    except Exception as exc:
        message = f"{side.name} {what}: {type(exc).__name__}: {exc}"
        _log(f"ERROR {message}")
        report["errors"].append(message)
        return {"error": message}


def _tf_failed(report: dict[str, Any], tf: TFSide, exc: Exception) -> None:
    report["tf_skipped"] = f"TensorFlow's side failed to start: {exc}"
    _log(report["tf_skipped"])
    with contextlib.suppress(Exception):
        tf.stop()


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- tables


def _ok(result: Any) -> bool:
    return isinstance(result, dict) and "error" not in result


def _verdict(met: bool) -> str:
    return "met" if met else "**missed**"


def _header(report: dict[str, Any]) -> list[str]:
    m = report["machine"]
    out = [
        f"Command: `.venv/bin/python {report['command']}`",
        "",
        f"Machine: {m['nproc']} CPUs ({m['cpu_model']}), Linux {m['kernel']}, Python {m['python']}, "
        f"numpy {m['numpy']}, grpcio {m['grpcio']}, protobuf {m['protobuf']}, uvloop {m['uvloop']}, "
        f"TensorFlow {m.get('tensorflow', '(not run)')}.",
    ]
    if report["tf_skipped"] is not None:
        out += ["", f"**TensorFlow columns skipped:** {report['tf_skipped']}"]
    return out


def _load_line(report: dict[str, Any]) -> str:
    m = report["machine"]
    return (
        f"Load average {m['loadavg_start']} at start, {m.get('loadavg_end', '?')} at end; during the run "
        f"{m.get('run_busy_cpus', 0):.2f} of {m['nproc']} CPUs busy on average (everything, benchmark "
        f"included), {m.get('run_steal_cpus', 0):.2f} CPUs stolen by the hypervisor."
    )


def tables(report: dict[str, Any], header: bool = True) -> str:
    params = report["params"]
    ours, tf = report["ours"], report["tf"]
    with_tf = report["tf_skipped"] is None
    m = report["machine"]
    out: list[str] = _header(report) if header else []
    out += ["", _load_line(report)]
    w, rounds, settle = params["warmup"], params["rounds"], params.get("settle_ms", 0)

    # 1. RecvTensor
    out += [
        "",
        f"### RecvTensor ps -> worker (median step; {w} warm-up steps, then the timed "
        f"steps in {rounds} blocks{', alternating with TF' if with_tf else ''}, "
        f"each after {settle:g} ms of untimed steps)",
        "",
    ]
    head = "| size | steps | ours step | ours MB/s |"
    rule = "|---|---:|---:|---:|"
    if with_tf:
        head += " TF step | TF MB/s | ours/TF throughput | target |"
        rule += "---:|---:|---:|---|"
    out += [head, rule]
    for nbytes in params["sizes"]:
        o, t = ours["recv"].get(str(nbytes)), tf["recv"].get(str(nbytes))
        row = f"| {size_label(nbytes)} | {repeat_for(nbytes, params['repeat'])} | " + _step_cells(o)
        if with_tf:
            row += " | " + _step_cells(t)
            if _ok(o) and _ok(t):
                row += f" | {o['mb_per_s'] / t['mb_per_s']:.2f}x | " + _recv_target(nbytes, o, t)
            else:
                row += " | - | -"
        out.append(row + " |")

    # 2. trivial step
    steps = params["trivial_steps"]
    out += [
        "",
        f"### Trivial step on a remote task (ops on ps, session on worker; median of {steps} steps "
        f"in {rounds} blocks, each after {settle:g} ms of untimed steps)",
        "",
    ]
    variants = [("`a + 1.0`, `a` fed by the client", "trivial"), ("`s + 1.0`, `s` a variable", "trivial_var")]
    if with_tf:
        out += [
            "| step | ours | TF | ours/TF | target (ours ≤ TF) | CPU/step ours | CPU/step TF | other load |",
            "|---|---:|---:|---:|---|---:|---:|---:|",
        ]
    else:
        out += ["| step | ours | CPU/step ours |", "|---|---:|---:|"]
    for label, kind in variants:
        o, t = ours.get(kind), tf.get(kind)
        if not with_tf:
            out.append(f"| {label} | {_time_cell(o)} | {_cpu_cell(o)} |")
            continue
        if _ok(o) and _ok(t):
            ratio = f"{o['median_s'] / t['median_s']:.2f}x | {_verdict(o['median_s'] <= t['median_s'])}"
        else:
            ratio = "- | -"
        background = _load_cell(o) if _ok(o) else "-"
        out.append(
            f"| {label} | {_time_cell(o)} | {_time_cell(t)} | {ratio} | {_cpu_cell(o)} | {_cpu_cell(t)} "
            f"| {background} |"
        )
    out.append("")
    out.append(
        "CPU/step: ps + worker + client processes together. Other load: CPUs taken by other processes "
        "(background) / by the hypervisor (stolen) while this benchmark ran."
    )

    # 3. memory
    size = params["memory_size"]
    if size:
        label = size_label(size)
        out += ["", f"### Peak memory of the worker while {label} crosses from ps (fresh cluster)", ""]
        cols = ["ours", "TF"] if with_tf else ["ours"]
        out += ["| | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
        mems = [ours["memory"], tf["memory"]][: len(cols)]
        rows = [
            ("idle worker VmRSS (before any step)", lambda r: fmt_mib(r["idle"]["worker"]["VmRSS"])),
            (
                f"worker VmHWM after 1 + {params['memory_repeat']} steps",
                lambda r: fmt_mib(_hwm(r)),
            ),
            (
                f"VmHWM / {label} (target ≤ 3x)",
                lambda r: _ratio_cell(_hwm(r) / size),
            ),
            (
                f"(VmHWM - idle VmRSS) / {label}",
                lambda r: f"{(_hwm(r) - r['idle']['worker']['VmRSS']) / size:.2f}x",
            ),
            ("median step", lambda r: fmt_time(r["step"]["median_s"])),
            ("MB/s", lambda r: fmt_rate(r["step"]["mb_per_s"])),
            ("worker minor faults per step", lambda r: f"{r['step']['per_step']['worker']['minflt']:,.0f}"),
            ("ps VmHWM", lambda r: fmt_mib(r["step"]["memory_after"]["ps"]["VmHWM"])),
        ]
        for name, cell in rows:
            out.append(f"| {name} | " + " | ".join(cell(r) if _ok(r) else "error" for r in mems) + " |")

    # 4. where the time goes
    out += [
        "",
        "### Where the time goes: CPU time and minor page faults per RecvTensor step, by process",
        "",
        "| size | side | step | CPU ps | CPU worker | CPU client "
        "| faults ps | faults worker | faults client | other load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for nbytes in params["sizes"]:
        for name, side in (("ours", ours), ("TF", tf)):
            r = side["recv"].get(str(nbytes))
            if not _ok(r):
                continue
            ps, wk, cl = (r["per_step"][role] for role in ("ps", "worker", "client"))
            out.append(
                f"| {size_label(nbytes)} | {name} | {fmt_time(r['median_s'])} | "
                f"{_ms(ps)} | {_ms(wk)} | {_ms(cl)} | "
                f"{ps['minflt']:,.0f} | {wk['minflt']:,.0f} | {cl['minflt']:,.0f} | "
                f"{_load_cell(r)} |"
            )
    out.append("")
    out.append(
        "CPU = user + system time of the whole process (all threads) per timed step, from "
        "/proc/<pid>/stat (10 ms ticks, averaged over the timed steps); faults = minor page faults per "
        "step; other load = CPUs (of "
        f"{m['nproc']}) kept busy by anything but the benchmark's six processes while this size ran "
        "(/proc/stat minus the six; includes kernel softirq time, some of it loopback traffic) / CPUs "
        "stolen by the hypervisor."
    )
    if report["errors"]:
        out += ["", "Errors:", *[f"- {e}" for e in report["errors"]]]
    return "\n".join(out)


def _spread(values: list[float], kind: str) -> str:
    """Median and (min-max) of per-run values: kind "time" (seconds), "rate", "ratio", "cpus"."""
    mid, low, high = statistics.median(values), min(values), max(values)
    if kind == "time":
        scale, unit = (1e6, "µs") if mid < 1e-3 else (1e3, "ms") if mid < 1.0 else (1.0, "s")
        digits = 0 if unit == "µs" else 2
        return f"{mid * scale:.{digits}f} {unit} ({low * scale:.{digits}f}-{high * scale:.{digits}f})"
    if kind == "rate":
        return f"{fmt_rate(mid)} ({fmt_rate(low)}-{fmt_rate(high)})"
    return f"{mid:.2f}x ({low:.2f}-{high:.2f})"


def summary_tables(reports: list[dict[str, Any]]) -> str:
    """Median over runs, with the range, of the headline figures; targets counted per run."""
    first = reports[0]
    params, n = first["params"], len(reports)
    with_tf = first["tf_skipped"] is None
    out = _header(first)
    out += ["", *[f"Run {i + 1}: {_load_line(r)}" for i, r in enumerate(reports)]]

    def ok_all(pick: Any) -> list[Any] | None:
        values = [pick(r) for r in reports]
        return values if all(_ok(v) for v in values) else None

    out += [
        "",
        f"### RecvTensor ps -> worker: median over {n} runs (min-max) of each run's median step",
        "",
    ]
    if with_tf:
        out += [
            "| size | ours step | TF step | ours MB/s | TF MB/s | ours/TF throughput | target met in |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
    else:
        out += ["| size | ours step | ours MB/s |", "|---|---:|---:|"]
    for nbytes in params["sizes"]:
        key = str(nbytes)
        o = ok_all(lambda r, k=key: r["ours"]["recv"].get(k))
        t = ok_all(lambda r, k=key: r["tf"]["recv"].get(k)) if with_tf else None
        if o is None:
            out.append(f"| {size_label(nbytes)} | error in some run |" + (" |" * 5 if with_tf else " |"))
            continue
        o_step = _spread([x["median_s"] for x in o], "time")
        o_rate = _spread([x["mb_per_s"] for x in o], "rate")
        if not with_tf:
            out.append(f"| {size_label(nbytes)} | {o_step} | {o_rate} |")
            continue
        if t is None:
            out.append(f"| {size_label(nbytes)} | {o_step} | error | {o_rate} | error | - | - |")
            continue
        ratios = [a["mb_per_s"] / b["mb_per_s"] for a, b in zip(o, t, strict=True)]
        if nbytes >= 16 * MiB:
            met = f"{sum(r >= 1.0 for r in ratios)} of {n} runs (MB/s ≥ TF)"
        elif nbytes <= 4 * 1024:
            met = f"{sum(a['median_s'] <= b['median_s'] for a, b in zip(o, t, strict=True))} of {n} runs "
            met += "(step ≤ TF)"
        else:
            met = "-"
        out.append(
            f"| {size_label(nbytes)} | {o_step} | {_spread([x['median_s'] for x in t], 'time')} | {o_rate} | "
            f"{_spread([x['mb_per_s'] for x in t], 'rate')} | {_spread(ratios, 'ratio')} | {met} |"
        )

    if with_tf:
        out += [
            "",
            "ours/TF: median (min-max) of the per-run ratios, so not always the ratio of the two medians.",
        ]
    out += ["", f"### Trivial step on a remote task: median over {n} runs (min-max)", ""]
    if with_tf:
        out += ["| step | ours | TF | ours/TF | target (ours ≤ TF) met in |", "|---|---:|---:|---:|---|"]
    else:
        out += ["| step | ours |", "|---|---:|"]
    for label, kind in (
        ("`a + 1.0`, `a` fed by the client", "trivial"),
        ("`s + 1.0`, `s` a variable", "trivial_var"),
    ):
        o = ok_all(lambda r, k=kind: r["ours"].get(k))
        t = ok_all(lambda r, k=kind: r["tf"].get(k)) if with_tf else None
        o_cell = _spread([x["median_s"] for x in o], "time") if o else "error"
        if not with_tf:
            out.append(f"| {label} | {o_cell} |")
            continue
        if o is None or t is None:
            out.append(f"| {label} | {o_cell} | {'error' if t is None else ''} | - | - |")
            continue
        ratios = [a["median_s"] / b["median_s"] for a, b in zip(o, t, strict=True)]
        out.append(
            f"| {label} | {o_cell} | {_spread([x['median_s'] for x in t], 'time')} | "
            f"{_spread(ratios, 'ratio')} | {sum(r <= 1.0 for r in ratios)} of {n} runs |"
        )

    size = params["memory_size"]
    if size:
        label = size_label(size)
        out += ["", f"### Peak memory of the worker, {label} from ps: median over {n} runs (min-max)", ""]
        cols = [("ours", "ours")] + ([("TF", "tf")] if with_tf else [])
        out += ["| | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---:|" * len(cols)]
        mems = {side: ok_all(lambda r, s=side: r[s]["memory"]) for _, side in cols}

        def row(name: str, pick: Any, kind: str) -> str:
            cells = [
                _spread([pick(m) for m in mems[side]], kind) if mems[side] else "error" for _, side in cols
            ]
            return f"| {name} | " + " | ".join(cells) + " |"

        mib = float(MiB)
        out += [
            row("idle worker VmRSS (MiB)", lambda m: m["idle"]["worker"]["VmRSS"] / mib, "rate"),
            row("worker VmHWM (MiB)", lambda m: _hwm(m) / mib, "rate"),
            row(f"VmHWM / {label} (target ≤ 3x)", lambda m: _hwm(m) / size, "ratio"),
            row(
                f"(VmHWM - idle VmRSS) / {label}",
                lambda m: (_hwm(m) - m["idle"]["worker"]["VmRSS"]) / size,
                "ratio",
            ),
            row(f"{label} step", lambda m: m["step"]["median_s"], "time"),
        ]
        if mems["ours"]:
            met = sum(_hwm(m) / size <= 3.0 for m in mems["ours"])
            out += ["", f"Ours met the ≤ 3x target in {met} of {n} runs."]
    return "\n".join(out)


def _load_cell(result: dict[str, Any]) -> str:
    return f"{result['background_cpus']:.2f} / {result['steal_cpus']:.2f}"


def _hwm(result: dict[str, Any]) -> int:
    hwm: int = result["step"]["memory_after"]["worker"]["VmHWM"]
    return hwm


def _step_cells(result: Any) -> str:
    if not _ok(result):
        return "error | error" if result else "- | -"
    return f"{fmt_time(result['median_s'])} | {fmt_rate(result['mb_per_s'])}"


def _time_cell(result: Any) -> str:
    return fmt_time(result["median_s"]) if _ok(result) else "error"


def _cpu_cell(result: Any) -> str:
    if not _ok(result):
        return "-"
    return fmt_time(sum(p["cpu_s"] for p in result["per_step"].values()))


def _ms(per_step: dict[str, float]) -> str:
    return f"{per_step['cpu_s'] * 1e3:.1f} ms"


def _ratio_cell(ratio: float) -> str:
    return f"{ratio:.2f}x ({_verdict(ratio <= 3.0)})"


def _recv_target(nbytes: int, ours: dict[str, Any], tf: dict[str, Any]) -> str:
    if nbytes >= 16 * MiB:
        return "MB/s ≥ TF: " + _verdict(ours["mb_per_s"] >= tf["mb_per_s"])
    if nbytes <= 4 * 1024:
        return "step ≤ TF: " + _verdict(ours["median_s"] <= tf["median_s"])
    return "-"


# --------------------------------------------------------------------------- main


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes",
        type=lambda s: [parse_size(x) for x in s.split(",") if x.strip()],
        default=[4 << 10, 64 << 10, 1 * MiB, 16 * MiB, 64 * MiB],
        help="RecvTensor sizes, comma-separated (4K,64K,1M,16M,64M)",
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help="timed steps per size (default 500 up to 1 MiB, 60 above)"
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (5)")
    parser.add_argument(
        "--rounds", type=int, default=10, help="timed steps split into this many alternating blocks (10)"
    )
    parser.add_argument(
        "--settle-ms", type=float, default=50.0, help="ms of untimed steps before each block, every side (50)"
    )
    parser.add_argument("--trivial-steps", type=int, default=2000, help="timed trivial steps (2000)")
    parser.add_argument(
        "--memory-size", type=parse_size_or_zero, default=256 * MiB, help="memory test tensor (256M; 0 skips)"
    )
    parser.add_argument("--memory-repeat", type=int, default=5, help="timed steps of the memory test (5)")
    parser.add_argument("--skip-tf", action="store_true", help="only our side")
    parser.add_argument("--no-create-tfenv", action="store_true", help="never pip-install TensorFlow")
    parser.add_argument(
        "--tf-allow-wildcard-bind",
        action="store_true",
        help="run TF even without a network namespace (its servers then bind 0.0.0.0)",
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="full runs; with >1, tables give the median of runs and range (1)"
    )
    parser.add_argument("--max-seconds", type=float, default=900.0, help="bound on the whole command (900)")
    parser.add_argument("--json", type=Path, help="also write every figure (and raw step times) here")
    args = parser.parse_args()
    if min(args.repeat or 1, args.trivial_steps, args.memory_repeat, args.rounds, args.runs) < 1:
        parser.error("--repeat, --trivial-steps, --memory-repeat, --rounds and --runs must be >= 1")
    if args.warmup < 0 or args.settle_ms < 0:
        parser.error("--warmup and --settle-ms must be >= 0")

    # SIGTERM unwinds like Ctrl-C, so every process is stopped on the way out (the
    # children also die with this process, but only a clean stop releases ports at once).
    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    deadline = started + args.max_seconds
    tf_setup = find_tf(args)
    if tf_setup["skipped"]:
        _log(f"TF columns skipped: {tf_setup['skipped']}")
    reports = []
    for index in range(args.runs):
        if args.runs > 1:
            _log(f"run {index + 1} of {args.runs}")
        run_started = time.monotonic()
        reports.append(run(args, tf_setup, deadline))
        reports[-1]["wall_s"] = time.monotonic() - run_started
        if any(e.startswith("aborted") for e in reports[-1]["errors"]):
            break
    if len(reports) == 1:
        print(tables(reports[0]))
    else:
        print(summary_tables(reports))
        print(f"\n## Last run in detail\n{tables(reports[-1], header=False)}")
    print(f"\n(whole command: {time.monotonic() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"runs": reports}, indent=1))
        _log(f"wrote {args.json}")
    if any(report["errors"] for report in reports):
        sys.exit(1)


if __name__ == "__main__":
    main()
