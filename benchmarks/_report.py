"""The markdown tables and verdicts of a `bench_distributed.py` run.

Measurement lives in `distserver/bench/` (and `bench_distributed.py`, which hands its
JSON-able report dicts to the functions here); the cell formatting is
`distserver.bench.report`'s, re-exported here for the scripts.
"""

from __future__ import annotations

import statistics
from typing import Any

from distserver.bench.report import fmt_mib, fmt_rate, fmt_time, load_cell, ok, size_label, verdict
from distserver.bench.timing import MiB

__all__ = [
    "fmt_mib",
    "fmt_rate",
    "fmt_time",
    "load_cell",
    "ok",
    "size_label",
    "summary_tables",
    "tables",
    "verdict",
]


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
        row = f"| {size_label(nbytes)} | {params['steps_per_size'][str(nbytes)]} | " + _step_cells(o)
        if with_tf:
            row += " | " + _step_cells(t)
            if ok(o) and ok(t):
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
        if ok(o) and ok(t):
            ratio = f"{o['median_s'] / t['median_s']:.2f}x | {verdict(o['median_s'] <= t['median_s'])}"
        else:
            ratio = "- | -"
        background = load_cell(o) if ok(o) else "-"
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
            out.append(f"| {name} | " + " | ".join(cell(r) if ok(r) else "error" for r in mems) + " |")

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
            if not ok(r):
                continue
            ps, wk, cl = (r["per_step"][role] for role in ("ps", "worker", "client"))
            out.append(
                f"| {size_label(nbytes)} | {name} | {fmt_time(r['median_s'])} | "
                f"{_ms(ps)} | {_ms(wk)} | {_ms(cl)} | "
                f"{ps['minflt']:,.0f} | {wk['minflt']:,.0f} | {cl['minflt']:,.0f} | "
                f"{load_cell(r)} |"
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
        return values if all(ok(v) for v in values) else None

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


def _hwm(result: dict[str, Any]) -> int:
    hwm: int = result["step"]["memory_after"]["worker"]["VmHWM"]
    return hwm


def _step_cells(result: Any) -> str:
    if not ok(result):
        return "error | error" if result else "- | -"
    return f"{fmt_time(result['median_s'])} | {fmt_rate(result['mb_per_s'])}"


def _time_cell(result: Any) -> str:
    return fmt_time(result["median_s"]) if ok(result) else "error"


def _cpu_cell(result: Any) -> str:
    if not ok(result):
        return "-"
    return fmt_time(sum(p["cpu_s"] for p in result["per_step"].values()))


def _ms(per_step: dict[str, float]) -> str:
    return f"{per_step['cpu_s'] * 1e3:.1f} ms"


def _ratio_cell(ratio: float) -> str:
    return f"{ratio:.2f}x ({verdict(ratio <= 3.0)})"


def _recv_target(nbytes: int, ours: dict[str, Any], tf: dict[str, Any]) -> str:
    if nbytes >= 16 * MiB:
        return "MB/s ≥ TF: " + verdict(ours["mb_per_s"] >= tf["mb_per_s"])
    if nbytes <= 4 * 1024:
        return "step ≤ TF: " + verdict(ours["median_s"] <= tf["median_s"])
    return "-"
