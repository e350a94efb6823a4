"""Distributed-execution benchmarks, distserver side by side with TensorFlow's runtime.

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
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import _report
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
            "steps_per_size": {str(n): repeat_for(n, args.repeat) for n in args.sizes},
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
            _log(f"RecvTensor {_report.size_label(nbytes)} x {repeat}")
            for side, result in measure(sides, "recv", nbytes, args.warmup, repeat, args, deadline):
                report[side.name]["recv"][str(nbytes)] = result
        report["errors"] += [r["error"] for s in sides for r in _all_results(report[s.name]) if "error" in r]

        if args.memory_size:
            for side in [side for side in sides if not side.dead]:
                size = _report.size_label(args.memory_size)
                _log(f"memory: {size} ps -> worker, fresh cluster ({side.name})")
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
    what = f"{kind} {_report.size_label(nbytes)}" if nbytes else kind
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
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)  # now: not lose a run to it
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
        print(_report.tables(reports[0]))
    else:
        print(_report.summary_tables(reports))
        print(f"\n## Last run in detail\n{_report.tables(reports[-1], header=False)}")
    print(f"\n(whole command: {time.monotonic() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"runs": reports}, indent=1))
        _log(f"wrote {args.json}")
    if any(report["errors"] for report in reports):
        sys.exit(1)


if __name__ == "__main__":
    main()
