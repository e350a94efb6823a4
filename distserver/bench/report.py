"""Formatting shared by every benchmark report: sizes, times, rates, verdicts."""

from __future__ import annotations

from typing import Any

from distserver.bench.timing import MiB


def size_label(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def fmt_time(seconds: float) -> str:
    if seconds < 1e-5:
        return f"{seconds * 1e6:.1f} µs"
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


def ok(result: Any) -> bool:
    return isinstance(result, dict) and "error" not in result


def verdict(met: bool) -> str:
    return "met" if met else "**missed**"


def load_cell(result: dict[str, Any]) -> str:
    return f"{result['background_cpus']:.2f} / {result['steal_cpus']:.2f}"
