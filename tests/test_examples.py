"""The examples run and learn."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def run_example(name, *args, env):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("protocol", ["grpc", "grpc+verbs"])
def test_parameter_server_training_on_a_local_cluster(python_env, protocol):
    out = run_example(
        "parameter_server_training.py", "--local", "--steps", "60", "--protocol", protocol, env=python_env
    )
    match = re.search(r"final loss ([\d.]+) \(from ([\d.]+)\)", out)
    assert match, out
    final, initial = float(match.group(1)), float(match.group(2))
    assert final < initial * 0.5
    assert "worker 0  step" in out
    assert "worker 1  step" in out
    assert "cluster stopped" in out


def test_linear_regression_converges(python_env):
    out = run_example("linear_regression.py", "--steps", "80", env=python_env)
    match = re.search(r"w = ([-\d.]+) \(true 3\), b = ([-\d.]+) \(true -2\)", out)
    assert match, out
    assert abs(float(match.group(1)) - 3) < 0.05
    assert abs(float(match.group(2)) + 2) < 0.05
