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

The sides, the timing code and TensorFlow's side live in `distserver/bench/`
(`sides.py`, `timing.py`, `tf_side.py`); this script runs them and prints the tables
of `_report.py`.

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
import signal
import sys
import time
from pathlib import Path
from typing import Any

import _report

from distserver.bench import timing as _shared
from distserver.bench.sides import ClusterSide as OursSide
from distserver.bench.sides import (
    TFSide,
    loadavg,
    log,
    machine_info,
    measure,
    parse_size,
    parse_size_or_zero,
)
from distserver.bench.sides import find_tf as _find_tf
from distserver.bench.tfenv import find_or_create
from distserver.bench.timing import MiB

REPO = Path(__file__).resolve().parent.parent
_log = log
_loadavg = loadavg
__all__ = ["OursSide", "TFSide", "machine_info", "measure", "parse_size"]


def find_tf(args: argparse.Namespace) -> dict[str, Any]:
    """Which TensorFlow to run, and how (`--skip-tf`, `--no-create-tfenv`, `--tf-allow-wildcard-bind`)."""
    if args.skip_tf:
        return {"python": None, "prefix": [], "skipped": "--skip-tf", "machine": {}}
    return _find_tf(
        lambda: find_or_create(REPO, create=not args.no_create_tfenv, log=_log), args.tf_allow_wildcard_bind
    )


# --------------------------------------------------------------------------- the run


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
