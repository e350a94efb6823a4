"""The README's example runs and prints what it says."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", (ROOT / path).read_text(), re.S)


def run_block(code, env):
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_readme_example_runs(python_env):
    out = run_block(python_blocks("README.md")[0], python_env)
    assert out.split() == ["[[4.]", "[8.]]"]


@pytest.mark.slow
def test_readme_coordinator_example_runs(python_env):
    out = run_block(python_blocks("README.md")[1], python_env)
    assert out.split() == ["10.0", "[0,", "1]"]


@pytest.mark.slow
def test_coordinator_doc_example_trains(python_env):
    out = run_block(python_blocks("docs/coordinator.md")[0], python_env)
    assert out.splitlines() == ["[0, 1, 2]", "[ 2.  -1.   0.5]"]


def test_training_doc_examples_run_and_print_what_they_say(python_env):
    # Each snippet of docs/training.md runs; the text says what it prints.
    snippets = python_blocks("docs/training.md")
    expected = [["300", "[", "2.", "-1.", "0.5]", "True"], ["[1", "1", "3]", "(3,", "3)"]]
    assert len(snippets) == len(expected)
    for code, output in zip(snippets, expected, strict=True):
        assert run_block(code, python_env).split() == output


def test_observability_doc_example_prints_what_it_says(python_env):
    (snippet,) = python_blocks("docs/observability.md")
    assert run_block(snippet, python_env).strip() == "3 {'InvalidArgumentError': 1} 0"
