"""RecvTensor throughput by transport, side by side in one run.

For each size, one float32 tensor crosses ps -> worker per step (the RecvTensor
graph of `bench_distributed.py`: a variable on ps read there, ``x[0]`` on worker,
the scalar fetched, session target on the worker), on:

* ``grpc``: distserver, a `LocalCluster` (ps + worker processes) with protocol "grpc";
* ``grpc+verbs``: the same with protocol "grpc+verbs" (same-host shared-memory data
  plane), strict (``DISTSERVER_VERBS_STRICT=1``), so a silent fallback to gRPC would
  be an error here, not a fast-looking gRPC figure;
* ``memcpy``: ``np.copyto`` of the same bytes into a preallocated, already-faulted
  destination, in this process: the bandwidth ceiling of one copy;
* ``TF``: TensorFlow's gRPC runtime (`distserver/bench/tf_side.py`, in a network
  namespace with only ``lo``), when a TensorFlow environment is available
  (`_tfenv.py`); otherwise the TF column is skipped with the reason.

The sides live in `distserver/bench/sides.py` (shared with `distserver bench`).

Warm-up steps, then the timed steps in blocks (each after ``--settle-ms`` of untimed
steps) that take turns between the transports (forward, then reverse order, ...), so
background load is shared fairly; median step time over all timed steps and MB/s =
10^6 bytes / median step seconds.

Targets: at 16 MiB and above, grpc+verbs >= 50% of memcpy bandwidth and
>= 5x TensorFlow's gRPC throughput; at 4 KiB, grpc+verbs step time <= grpc's.

    DISTSERVER_TF_PYTHON=/path/to/tf/python \
    .venv/bin/python benchmarks/bench_transports.py [--sizes 4K,64K,1M,16M,64M,256M]
        [--skip-tf] [--json out.json]
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
import bench_distributed as bd

from distserver.bench import timing as _shared
from distserver.bench.sides import ClusterSide, MemcpySide
from distserver.bench.timing import MiB

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
BIG = 16 * MiB
COLUMNS = [("grpc", "grpc"), ("verbs", "grpc+verbs"), ("memcpy", "memcpy"), ("tf", "TF gRPC")]


# --------------------------------------------------------------------------- run


def repeat_for(nbytes: int, repeat: int | None) -> int:
    """Timed steps per size: `--repeat`, else 300 up to 1 MiB, 60 at 16 MiB, 20 above."""
    if repeat is not None:
        return repeat
    if nbytes <= MiB:
        return 300
    return 60 if nbytes <= 16 * MiB else 20


def run(args: argparse.Namespace, tf_setup: dict[str, Any], deadline: float) -> dict[str, Any]:
    machine_start = _shared.machine_cpu()
    report: dict[str, Any] = {
        "command": "benchmarks/bench_transports.py " + " ".join(sys.argv[1:]),
        "machine": {**bd.machine_info(), **tf_setup["machine"]},
        "params": bd.timing_params(args),
        "tf_skipped": tf_setup["skipped"],
        "results": {name: {} for name, _ in COLUMNS},
        "errors": [],
    }
    grpc = ClusterSide("grpc", "grpc")
    verbs = ClusterSide("verbs", "grpc+verbs", {"DISTSERVER_VERBS_STRICT": "1"})
    memcpy = MemcpySide()
    tf = bd.TFSide(tf_setup["python"], tf_setup["prefix"] or [], deadline) if tf_setup["python"] else None
    sides: list[Any] = [grpc, verbs, memcpy]
    started: list[Any] = [memcpy]
    try:
        if tf is not None:
            tf.spawn()  # TensorFlow imports while our clusters start
            started.append(tf)
        for side in (grpc, verbs):
            bd._log(f"starting distserver cluster, protocol {side.protocol!r} (ps + worker)")
            started.append(side)
            side.start()
        if tf is not None:
            bd._log("waiting for TensorFlow's client and servers")
            try:
                tf.wait_ready()
            except Exception as exc:
                report["tf_skipped"] = f"TensorFlow's side failed to start: {exc}"
                bd._log(report["tf_skipped"])
                with contextlib.suppress(Exception):
                    tf.stop()
            else:
                sides.append(tf)
                report["machine"]["tf_netns"] = tf.info["netns"]
                report["machine"]["tf_interfaces"] = tf.info["interfaces"]
        for nbytes in args.sizes:
            repeat = repeat_for(nbytes, args.repeat)
            bd._log(f"RecvTensor {_report.size_label(nbytes)} x {repeat} per transport")
            for side, result in bd.measure(sides, "recv", nbytes, args.warmup, repeat, args, deadline):
                report["results"][side.name][str(nbytes)] = result
                if "error" in result:
                    report["errors"].append(result["error"])
    except _shared.BudgetExceeded as exc:
        bd._log(f"ABORTED: {exc}")
        report["errors"].append(f"aborted, figures incomplete: {exc}")
    finally:
        for side in reversed(started):
            with contextlib.suppress(Exception):
                side.stop()
        report["machine"]["loadavg_end"] = bd._loadavg()
        machine = {k: v - machine_start[k] for k, v in _shared.machine_cpu().items()}
        elapsed = max(1e-9, machine["total"]) / (os.cpu_count() or 1)
        report["machine"]["run_busy_cpus"] = machine["busy"] / elapsed
        report["machine"]["run_steal_cpus"] = machine["steal"] / elapsed
    return report


# --------------------------------------------------------------------------- tables


def tables(report: dict[str, Any]) -> str:
    m, params = report["machine"], report["params"]
    res = report["results"]
    with_tf = report["tf_skipped"] is None
    cols = [(name, label) for name, label in COLUMNS if with_tf or name != "tf"]
    out = [
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m['nproc']} CPUs ({m['cpu_model']}), Linux {m['kernel']}; Python {m['python']}, "
        f"numpy {m['numpy']}, grpcio {m['grpcio']}, distserver {m['distserver']}"
        + (f"; TensorFlow {m['tensorflow']}" if with_tf else ""),
        "",
        f"Load: load average {m['loadavg_start']} at start, {m['loadavg_end']} at end; during the run "
        f"{m['run_busy_cpus']:.2f} of {m['nproc']} CPUs busy on average (everything, benchmark included), "
        f"{m['run_steal_cpus']:.2f} stolen by the hypervisor.",
    ]
    if not with_tf:
        out += ["", f"TF column skipped: {report['tf_skipped']}"]
    out += [
        "",
        f"### RecvTensor ps -> worker: median step / MB/s ({params['warmup']} warm-up steps, then the timed "
        f"steps in {params['rounds']} interleaved blocks, each after {params.get('settle_ms', 0):g} ms "
        "of untimed steps)",
        "",
        "| size | steps | "
        + " | ".join(label for _, label in cols)
        + " | verbs/memcpy | "
        + ("verbs/TF | " if with_tf else "")
        + "verbs/grpc | other load |",
        "|---|---:|" + "---:|" * len(cols) + "---:|" + ("---:|" if with_tf else "") + "---:|---:|",
    ]
    for nbytes in params["sizes"]:
        key = str(nbytes)
        row = [_report.size_label(nbytes)]
        first = next((res[n][key] for n, _ in cols if _report.ok(res[n].get(key))), None)
        row.append(str(first["repeat"]) if first else "-")
        for name, _ in cols:
            r = res[name].get(key)
            row.append(
                f"{_report.fmt_time(r['median_s'])} / {_report.fmt_rate(r['mb_per_s'])}"
                if _report.ok(r)
                else "error"
            )
        v = res["verbs"].get(key)
        ratios = [("memcpy", "mb_per_s")] + ([("tf", "mb_per_s")] if with_tf else []) + [("grpc", "mb_per_s")]
        for other, field in ratios:
            o = res[other].get(key)
            row.append(f"{v[field] / o[field]:.2f}x" if _report.ok(v) and _report.ok(o) else "-")
        row.append(_report.load_cell(first) if first else "-")
        out.append("| " + " | ".join(row) + " |")
    out += [
        "",
        "Cells: median step / MB/s (10^6 B per second). Ratios are of throughput (MB/s). Other load: CPUs "
        "kept busy by processes other than the benchmark's / stolen by the hypervisor, while that size ran.",
        "",
        "### Targets",
        "",
        "| target | size | measured | verdict |",
        "|---|---|---:|---|",
    ]
    for nbytes in params["sizes"]:
        if nbytes < BIG:
            continue
        key = str(nbytes)
        v, mc, t = res["verbs"].get(key), res["memcpy"].get(key), res["tf"].get(key)
        label = _report.size_label(nbytes)
        if _report.ok(v) and _report.ok(mc):
            ratio = v["mb_per_s"] / mc["mb_per_s"]
            met = _report.verdict(ratio >= 0.5)
            out.append(f"| grpc+verbs ≥ 50% of memcpy MB/s | {label} | {ratio:.0%} | {met} |")
        else:
            out.append(f"| grpc+verbs ≥ 50% of memcpy MB/s | {label} | error | - |")
        if not with_tf:
            out.append(f"| grpc+verbs ≥ 5x TF gRPC MB/s | {label} | TF skipped | not evaluated |")
        elif _report.ok(v) and _report.ok(t):
            ratio = v["mb_per_s"] / t["mb_per_s"]
            out.append(
                f"| grpc+verbs ≥ 5x TF gRPC MB/s | {label} | {ratio:.2f}x | {_report.verdict(ratio >= 5.0)} |"
            )
        else:
            out.append(f"| grpc+verbs ≥ 5x TF gRPC MB/s | {label} | error | - |")
    key = str(4 << 10)
    if key in res["verbs"] or key in res["grpc"]:
        v, g = res["verbs"].get(key), res["grpc"].get(key)
        if _report.ok(v) and _report.ok(g):
            measured = f"{_report.fmt_time(v['median_s'])} vs {_report.fmt_time(g['median_s'])}"
            verdict = _report.verdict(v["median_s"] <= g["median_s"])
            out.append(f"| grpc+verbs step ≤ grpc step | 4 KiB | {measured} | {verdict} |")
        else:
            out.append("| grpc+verbs step ≤ grpc step | 4 KiB | error | - |")

    out += [
        "",
        "### Where the time goes: CPU per step (ps + worker + client) and worker minor faults per step",
        "",
        "| size | " + " | ".join(label for name, label in cols if name != "memcpy") + " |",
        "|---|" + "---:|" * (len(cols) - 1),
    ]
    for nbytes in params["sizes"]:
        key = str(nbytes)
        cells = []
        for name, _ in cols:
            if name == "memcpy":
                continue
            r = res[name].get(key)
            if not _report.ok(r):
                cells.append("error")
                continue
            cpu = sum(p["cpu_s"] for p in r["per_step"].values())
            cells.append(f"{_report.fmt_time(cpu)}, {r['per_step']['worker']['minflt']:,.0f} faults")
        out.append(f"| {_report.size_label(nbytes)} | " + " | ".join(cells) + " |")
    if report["errors"]:
        out += ["", "Errors:", *[f"- {e}" for e in report["errors"]]]
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes",
        type=lambda s: [bd.parse_size(x) for x in s.split(",") if x.strip()],
        default=DEFAULT_SIZES,
        help="sizes, comma-separated (4K,64K,1M,16M,64M,256M)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="timed steps per size (default 300 to 1 MiB, 60 at 16 MiB, 20 above)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    parser.add_argument("--rounds", type=int, default=10, help="timed steps split into this many blocks (10)")
    parser.add_argument(
        "--settle-ms", type=float, default=50.0, help="ms of untimed steps before each block, every side (50)"
    )
    parser.add_argument("--skip-tf", action="store_true", help="no TensorFlow column")
    parser.add_argument("--no-create-tfenv", action="store_true", help="never pip-install TensorFlow")
    parser.add_argument(
        "--tf-allow-wildcard-bind",
        action="store_true",
        help="run TF even without a network namespace (its servers then bind 0.0.0.0)",
    )
    parser.add_argument("--max-seconds", type=float, default=600.0, help="bound on the whole command (600)")
    parser.add_argument("--json", type=Path, help="also write every figure (and raw step times) here")
    args = parser.parse_args()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)  # now: not lose a run to it
    if min(args.repeat or 1, args.rounds) < 1 or min(args.warmup, args.settle_ms) < 0:
        parser.error("--repeat and --rounds must be >= 1, --warmup and --settle-ms >= 0")

    signal.signal(signal.SIGTERM, bd._terminate)
    started = time.monotonic()
    deadline = started + args.max_seconds
    tf_setup = bd.find_tf(args)
    if tf_setup["skipped"]:
        bd._log(f"TF column skipped: {tf_setup['skipped']}")
    report = run(args, tf_setup, deadline)
    report["wall_s"] = time.monotonic() - started
    print(tables(report))
    print(f"\n(whole command: {report['wall_s']:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        bd._log(f"wrote {args.json}")
    if report["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
