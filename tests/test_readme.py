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
