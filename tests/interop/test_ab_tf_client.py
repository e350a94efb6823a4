"""scripts/ab_tf_client.py: TensorFlow's client times both trees' one-task steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_both_trees_are_timed_and_compared(tf_client) -> None:
    env = {**os.environ, "DISTSERVER_TF_PYTHON": tf_client.python}
    command = [sys.executable, str(ROOT / "scripts" / "ab_tf_client.py"), str(ROOT), str(ROOT)]
    command += ["--workload", "small", "--rounds", "2", "--steps", "5", "--settle", "1", "--warmup", "3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["A", "B", "B/A"], done.stdout
    steps = [float(re.search(r"median step ([0-9.]+) ms", line).group(1)) for line in lines[:2]]
    assert all(step > 0 for step in steps), done.stdout
    summary = r"B/A = [0-9.]+ \(rounds [0-9.]+-[0-9.]+; small, one task, TensorFlow's client\)"
    assert re.fullmatch(summary, lines[2]), done.stdout


def test_a_tree_without_distserver_is_refused(tmp_path) -> None:
    command = [sys.executable, str(ROOT / "scripts" / "ab_tf_client.py"), str(tmp_path), str(ROOT)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert f"tree A ({tmp_path}) has no distserver/ package" in done.stderr
