"""The transfer workload of `distserver bench`: how fast tensors move, by protocol.

For every size, every series (a distserver protocol, or a baseline) is timed in the
same interleaved blocks (`sides.measure`):

* RecvTensor ps -> worker (`timing.build_recv_graph`): median step time and MB/s;
  series: ``grpc``, ``grpc+verbs`` (each a `LocalCluster`, one OS process per task;
  or the running cluster of ``--cluster``/``TF_CONFIG``), ``memcpy`` (one copy, the
  ceiling), ``grpcio unary``/``grpcio stream`` (the same bytes over raw grpcio, the
  floor), ``tensorflow`` (TensorFlow's runtime, same graph and timing code).
* Fetch to the client (`timing.build_fetch_graph`): the whole tensor of ps fetched by
  the session (distserver series and TensorFlow).
* Feed from the client (`timing.build_feed_graph`): a tensor the session feeds,
  consumed on ps (distserver series and TensorFlow).

Then, for the distserver series, at ``--concurrency-size``:

* concurrent steps: 1..N threads running the RecvTensor step on one session;
  aggregate MB/s over the wall time, and the median step time;
* workers pushing to one ps: a cluster of 1 ps and N workers, 1..N of them each
  sending one tensor to the ps per step (`timing.build_push_graph`).

Series whose tensors would not fit in the memory available together are measured in
groups that do, one after the other; one that does not fit alone is skipped, saying so.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import distserver as ds
from distserver.bench import report, sides, tfenv, timing
from distserver.bench.progress import Progress
from distserver.bench.timing import MiB

GiB = 1 << 30
DISTSERVER_PROTOCOLS = ("grpc", "grpc+verbs")
BASELINES = ("memcpy", "grpcio", "tensorflow")
PROTOCOLS = DISTSERVER_PROTOCOLS + BASELINES
MAX_SIZE = GiB
# Copies of a tensor alive at once, per series, for the memory check: a cluster holds
# the variable and the value read on ps, the received value (and a step's staging) on
# the worker, and for a fetch the client's copy.
COPIES = {"cluster": 5, "tensorflow": 5, "memcpy": 2, "grpcio": 3}
MEMORY_HEADROOM = 0.8  # use at most this share of MemAvailable


@dataclass
class Options:
    protocols: list[str]
    sizes: list[int]
    warmup: int = 2
    repeats: int | None = None
    rounds: int = 3
    settle_ms: float = 20.0
    concurrency: int = 4
    concurrency_size: int = MiB
    cluster: dict[str, list[str]] | None = None
    cluster_source: str = ""
    tf_python: str | None = None
    max_seconds: float = 1800.0
    command: str = "distserver bench"
    skipped: list[str] = field(default_factory=list)


def repeats_for(nbytes: int, repeats: int | None) -> int:
    """Timed steps per size: `--repeats`, else 50 up to 1 MiB, 10 up to 64 MiB, 3 above."""
    if repeats is not None:
        return repeats
    if nbytes <= MiB:
        return 50
    return 10 if nbytes <= 64 * MiB else 3


def machine() -> dict[str, Any]:
    """CPU count, memory, Python and the versions that matter, for the JSON report."""
    info = sides.machine_info()
    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.strip()}
    versions: dict[str, str | None] = {}
    for dist in ("distserver", "grpcio", "protobuf", "numpy", "uvloop", "matplotlib", "tqdm"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    versions["distserver"] = ds.__version__
    return {
        **info,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_total": meminfo.get("MemTotal"),
        "memory_available": meminfo.get("MemAvailable"),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "versions": versions,
    }


class _Run:
    """One `distserver bench --workload transfer` run: its sides, its report."""

    def __init__(self, options: Options, progress_factory: Callable[[int], Progress]) -> None:
        self.options = options
        self.deadline = time.monotonic() + options.max_seconds
        self.report: dict[str, Any] = {
            "workload": "transfer",
            "command": options.command,
            "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "params": {
                "protocols": options.protocols,
                "sizes": options.sizes,
                "warmup": options.warmup,
                "repeats": {str(n): repeats_for(n, options.repeats) for n in options.sizes},
                "rounds": options.rounds,
                "settle_ms": options.settle_ms,
                "concurrency": options.concurrency,
                "concurrency_size": options.concurrency_size,
                "cluster": options.cluster,
                "cluster_source": options.cluster_source or None,
            },
            "series": {},
            "recv": {},
            "fetch": {},
            "feed": {},
            "concurrent_steps": {},
            "push_to_ps": {},
            "skipped": list(options.skipped),
            "errors": [],
        }
        self.cluster_sides: list[sides.ClusterSide] = []
        self.baselines: list[Any] = []
        self.tf: sides.TFSide | None = None
        self.progress_factory = progress_factory
        self.progress: Progress | None = None

    # ----------------------------------------------------------------- set-up

    def _series(self, side: Any, protocol: str, description: str) -> None:
        self.report["series"][side.name] = {"protocol": protocol, "description": description}
        self.report["recv"][side.name] = {}

    def _skip(self, reason: str) -> None:
        self.report["skipped"].append(reason)
        sides.log(f"skipped: {reason}")

    def start_sides(self) -> None:
        options = self.options
        wanted = options.protocols
        if options.cluster is not None:
            target = f"grpc://{options.cluster['worker'][0]}"
            ps_target = f"grpc://{options.cluster['ps'][0]}"
            side = sides.ClusterSide("cluster", "external", target=target, ps_target=ps_target)
            self._series(
                side, "external", f"the running cluster of {options.cluster_source}, worker 0 {target}"
            )
            self.cluster_sides.append(side)
            for protocol in DISTSERVER_PROTOCOLS:
                if protocol in wanted:
                    self._skip(f"{protocol}: no local cluster, {options.cluster_source} gives the cluster")
        else:
            for protocol in DISTSERVER_PROTOCOLS:
                if protocol in wanted:
                    # Strict verbs: a silent fallback to gRPC would be an error, not a gRPC figure.
                    env = {"DISTSERVER_VERBS_STRICT": "1"} if protocol == "grpc+verbs" else {}
                    side = sides.ClusterSide(protocol, protocol, env)
                    self._series(side, protocol, f"distserver {protocol}: LocalCluster, 1 ps + 1 worker")
                    self.cluster_sides.append(side)
        if "memcpy" in wanted:
            memcpy = sides.MemcpySide("memcpy")
            self._series(memcpy, "memcpy", "np.copyto into a preallocated, faulted array (one copy)")
            self.baselines.append(memcpy)
        if "grpcio" in wanted:
            from distserver.bench.grpcio_baseline import GrpcioSide

            for mode in ("unary", "stream"):
                side_ = GrpcioSide(f"grpcio {mode}", mode)
                what = "one unary response" if mode == "unary" else "a stream of 1 MiB messages"
                self._series(side_, "grpcio", f"raw grpcio, the bytes in {what}, from a server process")
                self.baselines.append(side_)
        if "tensorflow" in wanted:
            setup = sides.find_tf(lambda: tfenv.find_installed(options.tf_python), allow_wildcard_bind=False)
            if setup["skipped"]:
                self._skip(f"tensorflow: {setup['skipped']}")
            else:
                self.report["machine"].update(setup["machine"])
                self.tf = sides.TFSide(setup["python"], setup["prefix"], self.deadline)
                self.tf.spawn()  # TensorFlow imports while the rest starts
        for side in self.cluster_sides:
            sides.log(
                f"starting {side.name}" + (" (ps + worker processes)" if side.protocol != "external" else "")
            )
            side.start()
        for baseline in self.baselines:
            if hasattr(baseline, "start"):
                baseline.start()
        if self.tf is not None:
            sides.log("waiting for TensorFlow's client and servers")
            try:
                self.tf.wait_ready()
            except Exception as exc:
                self._skip(f"tensorflow: its side failed to start: {exc}")
                with contextlib.suppress(Exception):
                    self.tf.stop()
                self.tf = None
            else:
                self.tf.name = "tensorflow"
                self._series(self.tf, "tensorflow", f"TensorFlow {self.tf.info['tensorflow']} gRPC runtime")

    def stop_sides(self) -> None:
        for side in [*self.cluster_sides, *self.baselines, *([self.tf] if self.tf else [])]:
            with contextlib.suppress(Exception):
                side.stop()

    # ----------------------------------------------------------------- measuring

    def fits(self, what: str, nbytes: int, series: list[Any]) -> bool:
        """Whether `nbytes` fits in memory for `series` at once; if not, say so and skip `what`."""
        shortfall = memory_shortfall(nbytes, series, sides.memory_available())
        if shortfall is not None:
            self._skip(f"{what}: {shortfall}")
        return shortfall is None

    def _measure(self, label: str, series: list[Any], kind: str, nbytes: int, repeats: int, **kw: Any) -> Any:
        assert self.progress is not None
        self.progress.start(label)
        try:
            return sides.measure(
                series, kind, nbytes, self.options.warmup, repeats, self.options, self.deadline, **kw
            )
        finally:
            self.progress.done()

    def _measure_in_memory(
        self, label: str, series: list[Any], kind: str, nbytes: int, repeats: int
    ) -> list[tuple[Any, dict[str, Any]]]:
        """`_measure` on `series`, all at once when their copies of `nbytes` fit in memory,
        else in groups that fit, one after the other; a series that does not fit alone
        is skipped, saying so."""
        groups, too_big = memory_groups(nbytes, series, sides.memory_available())
        for side in too_big:
            self._skip(
                f"{label} on {side.name}: {memory_shortfall(nbytes, [side], sides.memory_available())}"
            )
        if len(groups) > 1:
            names = " | ".join(", ".join(side.name for side in group) for group in groups)
            sides.log(f"{label}: not all at once in memory; measuring in turn: {names}")
        assert self.progress is not None
        self.progress.start(label)
        results: list[tuple[Any, dict[str, Any]]] = []
        try:
            for group in groups:
                shortfall = memory_shortfall(nbytes, group, sides.memory_available())
                if shortfall is not None:  # the memory went elsewhere meanwhile
                    self._skip(f"{label} on {', '.join(side.name for side in group)}: {shortfall}")
                    continue
                results += sides.measure(
                    group, kind, nbytes, self.options.warmup, repeats, self.options, self.deadline
                )
        finally:
            self.progress.done()
        return results

    def run(self) -> dict[str, Any]:
        options = self.options
        machine_start = timing.machine_cpu()
        started = time.monotonic()
        try:
            self.start_sides()
            sweep = [*self.cluster_sides, *self.baselines, *([self.tf] if self.tf else [])]
            fetchers: list[Any] = [*self.cluster_sides, *([self.tf] if self.tf else [])]
            client_kinds = ("fetch", "feed") if fetchers else ()
            for kind in client_kinds:
                self.report[kind] = {side.name: {} for side in fetchers}
            levels = list(range(1, options.concurrency + 1))
            total = len(options.sizes) * (1 + len(client_kinds)) + 2 * len(levels) * len(self.cluster_sides)
            self.progress = self.progress_factory(total)
            sides.set_log(self.progress.write)
            for nbytes in options.sizes:
                size = report.size_label(nbytes)
                repeats = repeats_for(nbytes, options.repeats)
                for side, result in self._measure_in_memory(
                    f"RecvTensor {size}", sweep, "recv", nbytes, repeats
                ):
                    self._record("recv", side.name, str(nbytes), result)
                for kind in client_kinds:
                    for side, result in self._measure_in_memory(
                        f"{kind} {size}", fetchers, kind, nbytes, repeats
                    ):
                        self._record(kind, side.name, str(nbytes), result)
            if levels and self.cluster_sides:
                # The push cluster holds a tensor on every worker at once.
                peak = options.concurrency_size * levels[-1]
                what = f"concurrency and push to ps, {levels[-1]} x {report.size_label(peak // levels[-1])}"
                if self.fits(what, peak, self.cluster_sides):
                    self.concurrency(levels)
                else:
                    for _ in range(2 * len(levels) * len(self.cluster_sides)):
                        self.progress.done()
        except timing.BudgetExceeded as exc:
            self.report["errors"].append(f"aborted, figures incomplete: {exc}")
            sides.log(f"ABORTED: {exc}")
        finally:
            if self.progress is not None:
                self.progress.close()
            sides.set_log(None)
            self.stop_sides()
            machine_used = {k: v - machine_start[k] for k, v in timing.machine_cpu().items()}
            elapsed = max(1e-9, machine_used["total"]) / (os.cpu_count() or 1)
            self.report["machine"]["loadavg_end"] = sides.loadavg()
            self.report["machine"]["run_busy_cpus"] = machine_used["busy"] / elapsed
            self.report["machine"]["run_steal_cpus"] = machine_used["steal"] / elapsed
            self.report["wall_s"] = time.monotonic() - started
        return self.report

    def _record(self, table: str, series: str, key: str, result: dict[str, Any]) -> None:
        self.report[table].setdefault(series, {})[key] = result
        if "error" in result:
            self.report["errors"].append(result["error"])

    def concurrency(self, levels: list[int]) -> None:
        nbytes = self.options.concurrency_size
        size = report.size_label(nbytes)
        repeats = repeats_for(nbytes, self.options.repeats)
        assert self.progress is not None
        for side in self.cluster_sides:
            self.report["concurrent_steps"][side.name] = {}
            for level in levels:
                self.progress.start(f"{side.name}: {level} concurrent steps, {size}")
                try:
                    result = concurrent_steps(
                        side, nbytes, level, self.options.warmup, repeats, self.deadline
                    )
                except timing.BudgetExceeded:
                    raise
                except Exception as exc:
                    result = {
                        "error": f"{side.name} {level} concurrent steps {size}: {type(exc).__name__}: {exc}"
                    }
                    sides.log(f"ERROR {result['error']}")
                self._record("concurrent_steps", side.name, str(level), result)
                self.progress.done()
        for side in self.cluster_sides:
            self.report["push_to_ps"][side.name] = {}
            workers = levels[-1]
            if side.protocol == "external":
                available = len((self.options.cluster or {}).get("worker", []))
                if available < workers:
                    self._skip(f"push to ps: the cluster has {available} workers, not {workers}")
                    workers = available
                push_side = side
            else:
                # The sweep's cluster is no longer needed: free its processes first.
                side.stop()
                push_side = sides.ClusterSide(
                    side.name, side.protocol, side.env, jobs={"ps": 1, "worker": workers}
                )
                sides.log(f"starting {side.name} with 1 ps + {workers} workers")
                push_side.start()
            try:
                for level in levels:
                    label = f"{side.name}: {level} workers pushing {size} to ps"
                    if level > workers:
                        self.progress.start(label)
                        self.progress.done()
                        continue
                    [(_, result)] = self._measure(label, [push_side], "push", nbytes, repeats, workers=level)
                    if "error" not in result:
                        result["workers"] = level
                    self._record("push_to_ps", side.name, str(level), result)
            finally:
                if push_side is not side:
                    push_side.stop()


def memory_groups(nbytes: int, series: list[Any], available: int) -> tuple[list[list[Any]], list[Any]]:
    """`series` split, in order, into groups whose copies of `nbytes` fit in `available`
    together (one group when all fit), and the series that do not fit even alone."""
    groups: list[list[Any]] = []
    too_big = []
    for side in series:
        if memory_shortfall(nbytes, [side], available) is not None:
            too_big.append(side)
        elif groups and memory_shortfall(nbytes, [*groups[-1], side], available) is None:
            groups[-1].append(side)
        else:
            groups.append([side])
    return groups, too_big


def memory_shortfall(nbytes: int, series: list[Any], available: int) -> str | None:
    """Why `nbytes` cannot be measured on `series` at once with `available` bytes, or None.

    Every series holds its copies (`COPIES`) while the interleaved blocks run; a
    running cluster of ``--cluster`` counts one, the client's.
    """
    copies = 0
    for side in series:
        if isinstance(side, sides.ClusterSide):
            copies += 1 if side.protocol == "external" else COPIES["cluster"]
        elif isinstance(side, sides.TFSide):
            copies += COPIES["tensorflow"]
        elif isinstance(side, sides.MemcpySide):
            copies += COPIES["memcpy"]
        else:
            copies += COPIES["grpcio"]
    needed = copies * nbytes
    if needed <= available * MEMORY_HEADROOM:
        return None
    return (
        f"needs about {needed / GiB:.1f} GiB ({copies} copies of {report.size_label(nbytes)} across "
        f"{len(series)} series), {available / GiB:.1f} GiB available"
    )


def concurrent_steps(
    side: sides.ClusterSide, nbytes: int, level: int, warmup: int, repeats: int, deadline: float
) -> dict[str, Any]:
    """`level` threads each run `repeats` RecvTensor steps of `nbytes` on one session at once."""
    graph, init, fetch = timing.build_recv_graph(ds, nbytes)
    with ds.Session(side.target(), graph=graph, config=side.config) as session:
        session.run(init)
        step = session.make_callable(fetch)
        for _ in range(max(1, warmup)):
            timing.check_deadline(deadline)
            if float(step()) != 1.0:
                raise AssertionError("the RecvTensor step returned a wrong value")
        times: list[list[float]] = [[] for _ in range(level)]
        failures: list[BaseException] = []
        gate = threading.Barrier(level + 1)

        def run_steps(index: int) -> None:
            try:
                gate.wait()
                for _ in range(repeats):
                    if time.monotonic() > deadline:
                        raise timing.BudgetExceeded("the benchmark ran past its time budget (--max-seconds)")
                    began = time.perf_counter()
                    step()
                    times[index].append(time.perf_counter() - began)
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=run_steps, args=(i,), daemon=True) for i in range(level)]
        for thread in threads:
            thread.start()
        gate.wait()
        began = time.perf_counter()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - began
    if failures:
        raise failures[0]
    flat = [t for per_thread in times for t in per_thread]
    median = statistics.median(flat)
    q1, _, q3 = statistics.quantiles(flat, n=4, method="inclusive") if len(flat) > 1 else [median] * 3
    return {
        "concurrency": level,
        "nbytes": nbytes,
        "steps": len(flat),
        "wall_s": wall,
        "median_s": median,
        "min_s": min(flat),
        "max_s": max(flat),
        "q1_s": q1,
        "q3_s": q3,
        "times_s": flat,
        "mb_per_s": len(flat) * nbytes / 1e6 / wall,
        "steps_per_s": len(flat) / wall,
    }


def run(options: Options, progress_factory: Callable[[int], Progress] = Progress) -> dict[str, Any]:
    """Measure everything `options` asks for; the report (JSON-able)."""
    return _Run(options, progress_factory).run()


# --------------------------------------------------------------------------- the table


def _cell(result: Any, rate: bool = True) -> str:
    if result is None:
        return "-"
    if not report.ok(result):
        return "error"
    spread = f"{report.fmt_time(result['min_s'])}-{report.fmt_time(result['max_s'])}"
    text = f"{report.fmt_time(result['median_s'])} ({spread})"
    return f"{report.fmt_rate(result['mb_per_s'])} MB/s, {text}" if rate else text


def tables(data: dict[str, Any]) -> str:
    """The run as markdown tables (also what the terminal shows)."""
    params, m = data["params"], data["machine"]
    out = [
        f"Command: `{data['command']}`",
        "",
        f"Machine: {m['cpus_usable']} CPUs ({m['cpu_model']}), {m['memory_total'] / GiB:.0f} GiB memory, "
        f"Linux {m['kernel']}; Python {m['python']}; "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
        + (f"; TensorFlow {m['tensorflow']}" if "tensorflow" in m else ""),
        "",
        f"Started {data['started_utc']}, {data.get('wall_s', 0):.0f} s. Load: load average "
        f"{m['loadavg_start']} at start, {m.get('loadavg_end', '?')} at end; "
        f"{m.get('run_busy_cpus', 0):.2f} of {m['cpus_usable']} CPUs busy on average during the run "
        "(benchmark included).",
        "",
        "Cells: MB/s (10^6 bytes per second, of the median step), median step (min-max); "
        f"{params['warmup']} warm-up steps, then the timed steps in {params['rounds']} blocks that take "
        "turns between the series.",
    ]
    sizes = params["sizes"]
    for key, title in (
        ("recv", "RecvTensor ps -> worker"),
        ("fetch", "Fetch to the client (the whole tensor of ps, session on the worker)"),
        ("feed", "Feed from the client (consumed on ps, session on the worker)"),
    ):
        names = list(data[key])
        if not names:
            continue
        out += ["", f"### {title}", "", "| size | steps | " + " | ".join(names) + " |"]
        out.append("|---|---:|" + "---:|" * len(names))
        for nbytes in sizes:
            row = [data[key][name].get(str(nbytes)) for name in names]
            if all(r is None for r in row):
                continue
            steps = params["repeats"][str(nbytes)]
            out.append(
                f"| {report.size_label(nbytes)} | {steps} | " + " | ".join(_cell(r) for r in row) + " |"
            )
    size = report.size_label(params["concurrency_size"])
    for key, title, what in (
        ("concurrent_steps", f"Concurrent steps, RecvTensor of {size} (one session)", "steps"),
        ("push_to_ps", f"Workers pushing {size} each to one ps (aggregate)", "workers"),
    ):
        names = [name for name, results in data[key].items() if results]
        if not names:
            continue
        out += ["", f"### {title}", "", f"| {what} | " + " | ".join(names) + " |"]
        out.append("|---:|" + "---:|" * len(names))
        for level in range(1, params["concurrency"] + 1):
            row = [data[key][name].get(str(level)) for name in names]
            if all(r is None for r in row):
                continue
            out.append(f"| {level} | " + " | ".join(_cell(r) for r in row) + " |")
    if data["skipped"]:
        out += ["", "Skipped:", *[f"- {reason}" for reason in data["skipped"]]]
    if data["errors"]:
        out += ["", "Errors:", *[f"- {error}" for error in data["errors"]]]
    return "\n".join(out)


# --------------------------------------------------------------------------- the plot


def plot(data: dict[str, Any], path: Path) -> None:
    """PNG: throughput vs size and step time vs size (log axes), one line per series;
    below them, when measured, the concurrency panels. Needs matplotlib (``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrency = any(data[key].get(name) for key in ("concurrent_steps", "push_to_ps") for name in data[key])
    rows = 2 if concurrency else 1
    fig, axes = plt.subplots(rows, 2, figsize=(13, 5 * rows), squeeze=False)
    rate_ax, time_ax = axes[0]
    # One colour per series; RecvTensor solid, fetch dashed, feed dotted in the series' colour.
    colours = {name: f"C{i % 10}" for i, name in enumerate(data["series"])}
    styles = {"recv": ("-", "o", ""), "fetch": ("--", "s", " fetch"), "feed": (":", "^", " feed")}
    sizes_seen: set[int] = set()
    for key, (line, marker, suffix) in styles.items():
        for name, results in data[key].items():
            points = sorted((int(n), r) for n, r in results.items() if report.ok(r))
            if not points:
                continue
            sizes = [n for n, _ in points]
            sizes_seen.update(sizes)
            style = {
                "linestyle": line,
                "marker": marker,
                "color": colours.get(name),
                "label": f"{name}{suffix}",
            }
            rate_ax.plot(sizes, [r["mb_per_s"] for _, r in points], **style)
            medians = [r["median_s"] for _, r in points]
            low = [r["median_s"] - r["min_s"] for _, r in points]
            high = [r["max_s"] - r["median_s"] for _, r in points]
            time_ax.errorbar(sizes, medians, yerr=[low, high], capsize=3, **style)
    rate_ax.set(xscale="log", yscale="log", xlabel="tensor size", ylabel="MB/s (10^6 bytes/s, median step)")
    rate_ax.set_title(
        "Throughput: RecvTensor ps -> worker (solid), fetch (dashed), feed (dotted)", fontsize="medium"
    )
    time_ax.set(xscale="log", yscale="log", xlabel="tensor size", ylabel="step time (s)")
    time_ax.set_title("Step latency: median, bars min-max", fontsize="medium")
    ticks = sorted(sizes_seen)
    for ax in (rate_ax, time_ax):
        ax.set_xticks(ticks, [report.size_label(n) for n in ticks], rotation=30)
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if concurrency:
        size = report.size_label(data["params"]["concurrency_size"])
        for ax, key, xlabel, title in (
            (axes[1][0], "concurrent_steps", "concurrent steps", f"Concurrent RecvTensor steps of {size}"),
            (axes[1][1], "push_to_ps", "workers", f"Workers pushing {size} each to one ps"),
        ):
            for name, results in data[key].items():
                points = sorted((int(k), r) for k, r in results.items() if report.ok(r))
                if points:
                    levels = [k for k, _ in points]
                    rates = [r["mb_per_s"] for _, r in points]
                    ax.plot(levels, rates, "-o", color=colours.get(name), label=name)
            ax.set(xlabel=xlabel, ylabel="aggregate MB/s", title=title)
            ax.set_ylim(bottom=0)
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle(f"distserver bench ({data['machine']['cpus_usable']} CPUs)")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
