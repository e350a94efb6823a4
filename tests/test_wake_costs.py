"""scripts/wake_costs.py: every measurement runs and lands in the table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wake_costs_table_has_a_row_per_measurement() -> None:
    command = [sys.executable, str(ROOT / "scripts" / "wake_costs.py"), "--rounds", "30"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and "µs" not in line]
    measured = {row[0].lstrip("| "): float(row[1].replace(",", "")) for row in rows}
    expected = [
        "process round trip, both on one CPU",
        "event loop -> pool thread",
        "pool thread -> event loop",
        "small work, back to back",
        "small work, after a 0.5 ms sleep",
    ]
    if len(os.sched_getaffinity(0)) > 1:
        expected.append("process round trip, two CPUs")
    assert sorted(measured) == sorted(expected), done.stdout
    assert all(value > 0 for value in measured.values()), done.stdout
