"""The README's example runs and prints what it says."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_readme_example_runs(python_env):
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None
    result = subprocess.run(
        [sys.executable, "-c", code.group(1)], capture_output=True, text=True, timeout=120, env=python_env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[[4.]", "[8.]]"]


def test_training_doc_examples_run_and_print_what_they_say(python_env):
    # Each snippet of docs/training.md runs; the text says what it prints.
    text = (ROOT / "docs" / "training.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", text, re.S)
    expected = [["300", "[", "2.", "-1.", "0.5]", "True"], ["[1", "1", "3]", "(3,", "3)"]]
    assert len(snippets) == len(expected)
    for code, output in zip(snippets, expected, strict=True):
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=python_env
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == output
