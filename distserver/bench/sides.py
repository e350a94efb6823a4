"""The sides of a benchmark: one runtime or baseline each, timed in interleaved blocks.

A side speaks one protocol (`measure` drives it): ``prepare(kind, nbytes, warmup,
deadline, workers=1)`` (session open, initialised, warmed up), ``block(repeat,
deadline, settle_ms)`` (time that many steps), ``finish()``, ``stop()``, plus
``name``, ``pids``, ``dead`` and ``lost_process()``.

* `ClusterSide`: distserver, a `LocalCluster` (one OS process per task) over one
  protocol, or a cluster that is already running (`target`), and a `ds.Session` here.
* `TFSide`: TensorFlow's runtime (`tf_side.py` under TensorFlow's Python, with its
  own ps and worker servers, in a network namespace when one can be made).
* `MemcpySide`: ``np.copyto`` of the same bytes: the ceiling of one copy.
* `GrpcioSide` (`grpcio_baseline.py`): raw grpcio moving the same bytes from a server
  process, unary or streamed in 1 MiB messages: the floor a gRPC transport starts from.
"""

from __future__ import annotations

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
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

import distserver as ds
from distserver.bench import report, tfenv, timing
from distserver.bench.timing import MiB
from distserver.protos.config_pb2 import ConfigProto
from distserver.testing import LocalCluster

HERE = Path(__file__).resolve().parent
OPERATION_TIMEOUT_MS = 60_000
TF_START_TIMEOUT_S = 120.0
SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": MiB, "MB": MiB, "MIB": MiB}
SIZE_UNITS["G"] = SIZE_UNITS["GB"] = SIZE_UNITS["GIB"] = 1 << 30


class SizeError(ValueError):
    """A size on the command line that is not one."""


_log_to: Callable[[str], None] | None = None


def set_log(write: Callable[[str], None] | None) -> None:
    """Send the benchmarks' progress and error lines to `write` (None: stderr)."""
    global _log_to
    _log_to = write


def log(message: str) -> None:
    if _log_to is not None:
        _log_to(message)
    else:
        print(f"[bench] {message}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    """Bytes of "4K", "4KiB", "1M", "64MiB", "1GiB", "4096" (a positive multiple of 4)."""
    text = text.strip().upper()
    digits = text.rstrip("KMGIB")
    unit = SIZE_UNITS.get(text[len(digits) :])
    if not digits.isdigit() or unit is None:
        raise SizeError(f"size {text!r} is not a number of bytes like 4096, 4KiB, 1MiB or 1GiB")
    nbytes = int(digits) * unit
    if nbytes < 4 or nbytes % 4:
        raise SizeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return nbytes


def parse_size_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else parse_size(text)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def memory_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (what can be allocated without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


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
        "loadavg_start": loadavg(),
    }


def loadavg() -> str:
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


class ClusterSide:
    """distserver: a `LocalCluster` over `protocol` (or the running cluster whose worker 0
    is `target`) and a `ds.Session` in this process, its target on worker 0."""

    def __init__(
        self,
        name: str = "ours",
        protocol: str = "grpc",
        env: Mapping[str, str] | None = None,
        *,
        jobs: Mapping[str, int] | None = None,
        target: str | None = None,
        ps_target: str | None = None,
    ) -> None:
        self.name, self.protocol, self.env = name, protocol, dict(env or {})
        self.jobs = dict(jobs or {"ps": 1, "worker": 1})
        self.external_target, self.external_ps_target = target, ps_target
        self.cluster: LocalCluster | None = None
        self.config = ConfigProto(operation_timeout_in_ms=OPERATION_TIMEOUT_MS)
        self._prepared: timing.Prepared | None = None
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
        if self.external_target is None:
            self.cluster = LocalCluster(self.jobs, protocol=self.protocol, env=self.env).start()

    def target(self, job: str = "worker") -> str:
        """The session target: worker 0 (ps 0 for `job` "ps")."""
        if self.cluster is not None:
            return self.cluster.target(job)
        target = self.external_ps_target if job == "ps" else self.external_target
        if target is None:
            raise RuntimeError(f"{self.name}: not started")
        return target

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.finish()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    @property
    def pids(self) -> dict[str, int]:
        """The processes whose CPU time and faults are counted (ps 0 and worker 0 when local)."""
        if self.cluster is None:
            return {"client": os.getpid()}
        return {
            "ps": self.cluster.process("ps").pid,
            "worker": self.cluster.process("worker").pid,
            "client": os.getpid(),
        }

    def memory(self) -> dict[str, Any]:
        return {role: timing.proc_memory(pid) for role, pid in self.pids.items()}

    def prepare(self, kind: str, nbytes: int, warmup: int, deadline: float, workers: int = 1) -> None:
        self.finish()
        self._prepared = timing.Prepared(
            ds,
            self.config,
            self.target("ps" if kind == "push" else "worker"),
            kind,
            nbytes=nbytes,
            workers=workers,
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
        return timing.run_once(
            ds,
            self.config,
            self.target("worker"),
            kind,
            nbytes=nbytes,
            warmup=warmup,
            repeat=repeat,
            pids=self.pids,
            deadline=deadline,
        )


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
            env=tfenv.quiet_tf_env(),
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
                raise timing.BudgetExceeded(f"TF side gave no {prefix.strip()} line in time")
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

    def prepare(self, kind: str, nbytes: int, warmup: int, deadline: float, workers: int = 1) -> None:
        if kind == "push":
            raise ValueError("TensorFlow's side has one worker: no push benchmark")
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


def find_tf(find: Callable[[], tfenv.TFEnv], allow_wildcard_bind: bool) -> dict[str, Any]:
    """Which TensorFlow to run (`find` returns it), and how: python, command prefix, or
    why it is skipped."""
    setup: dict[str, Any] = {"python": None, "prefix": [], "skipped": None, "machine": {}}
    try:
        env = find()
    except tfenv.TFUnavailable as exc:
        setup["skipped"] = f"no TensorFlow environment: {exc}"
        return setup
    setup["machine"] = {"tensorflow": f"{env.tensorflow} ({env.source}: {env.python})", "tf_numpy": env.numpy}
    prefix = netns_prefix()
    if prefix is None:
        if not allow_wildcard_bind:
            setup["skipped"] = (
                "TensorFlow's server binds 0.0.0.0 and `unshare --net` is unavailable here "
                "(allow a wildcard bind to run it anyway)"
            )
            return setup
        log("WARNING: no network namespace; TF's servers will bind 0.0.0.0 (as TF always does)")
        prefix = []
    setup["python"], setup["prefix"] = env.python, prefix
    return setup


def measure(
    sides: list[Any],
    kind: str,
    nbytes: int,
    warmup: int,
    repeat: int,
    args: Any,
    deadline: float,
    workers: int = 1,
) -> list[tuple[Any, dict[str, Any]]]:
    """One benchmark on every side, timed in alternating blocks (A B, B A, A B, ...).

    Each side first prepares (session, initialisation, warm-up); then the timed steps
    are split into `--rounds` blocks and the sides take turns, so slow drifts in the
    machine's load hit both alike. Every block starts with `--settle-ms` of untimed
    steps (`timing.settle`). A side that fails gets an error result. `args` has
    ``rounds`` and ``settle_ms``; `workers` is for kind "push".
    """
    what = f"{kind} {report.size_label(nbytes)}" if nbytes else kind
    dead = [side for side in sides if side.dead]
    sides = [side for side in sides if not side.dead]
    all_pids = {pid for side in sides for pid in side.pids.values()}
    ours_before = _cpu_of(all_pids)
    machine_before = timing.machine_cpu()
    errors: dict[str, str] = {}
    blocks: dict[str, list[dict[str, Any]]] = {side.name: [] for side in sides}
    finished: dict[str, dict[str, Any]] = {}
    try:
        for side in sides:
            _attempt(errors, side, what, lambda s=side: s.prepare(kind, nbytes, warmup, deadline, workers))
        for i, count in enumerate(timing.split_blocks(repeat, args.rounds)):
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
            except timing.BudgetExceeded:
                raise
            except Exception as exc:
                errors.setdefault(side.name, f"{side.name} {what}: finish: {type(exc).__name__}: {exc}")
    machine = {k: v - machine_before[k] for k, v in timing.machine_cpu().items()}
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
    out: list[tuple[Any, dict[str, Any]]] = [
        (side, {"error": f"{side.name} {what}: skipped, {side.dead}"}) for side in dead
    ]
    for side in sides:
        if side.name in errors:
            lost = side.lost_process()
            if lost:  # the rest of the run would only wait for time-outs
                side.dead = lost
                log(f"{lost}: no more {side.name} figures in this run")
            out.append((side, {"error": errors[side.name]}))
        else:
            result = timing.combine(blocks[side.name], finished[side.name])
            out.append((side, {**result, **load}))
    return out


def _cpu_of(pids: set[int]) -> float:
    """CPU seconds so far of the processes in `pids` that still exist."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += timing.proc_counters(pid)["cpu_s"]
    return total


def _attempt(errors: dict[str, str], side: Any, what: str, fn: Any) -> None:
    try:
        fn()
    except timing.BudgetExceeded:
        raise
    except Exception as exc:
        message = f"{side.name} {what}: {type(exc).__name__}: {exc}"
        log(f"ERROR {message}")
        errors[side.name] = message


class MemcpySide:
    """``np.copyto`` of `nbytes` into a preallocated, pre-faulted array, in this process.

    Speaks the side protocol of `measure` (prepare, block, finish),
    so it takes its turns in the same interleaved blocks as the transports.
    """

    dead: str | None = None

    def __init__(self, name: str = "memcpy") -> None:
        self.name = name
        self.src: np.ndarray | None = None
        self.dst: np.ndarray | None = None
        self.nbytes = 0
        self.warmup = 0

    @property
    def pids(self) -> dict[str, int]:
        return {"client": os.getpid()}

    def lost_process(self) -> str | None:
        return None

    def prepare(self, kind: str, nbytes: int, warmup: int, deadline: float, workers: int = 1) -> None:
        if kind != "recv":
            raise ValueError(f"memcpy has no {kind!r} benchmark")
        self.src = np.full(nbytes // 4, 1.0, dtype=np.float32)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)  # faults every destination page in
        self.nbytes, self.warmup = nbytes, warmup
        for _ in range(warmup):
            np.copyto(self.dst, self.src)

    def block(self, repeat: int, deadline: float, settle_ms: float = 0.0) -> dict[str, Any]:
        assert self.src is not None
        assert self.dst is not None
        src, dst = self.src, self.dst
        timing.settle(lambda: np.copyto(dst, src), settle_ms, deadline)
        pid = os.getpid()
        before = timing.proc_counters(pid)
        times = []
        for _ in range(repeat):
            timing.check_deadline(deadline)
            started = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - started)
        after = timing.proc_counters(pid)
        return {"times_s": times, "counters": {"client": {k: after[k] - before[k] for k in before}}}

    def finish(self) -> dict[str, Any]:
        if self.src is None:
            return {}
        ok = bool(self.dst is not None and self.dst[0] == 1.0 and self.dst[-1] == 1.0)
        self.src = self.dst = None
        if not ok:
            raise AssertionError("memcpy destination does not hold the source")
        return {
            "kind": "recv",
            "nbytes": self.nbytes,
            "warmup": self.warmup,
            "init_s": 0.0,
            "memory_after": {"client": timing.proc_memory(os.getpid())},
        }

    def stop(self) -> None:
        self.src = self.dst = None
