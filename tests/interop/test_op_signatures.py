"""The OpDef table that function instantiation reads (`distserver/runtime/op_signatures.json`)
is TensorFlow's: `scripts/gen_op_signatures.py --check` rebuilds it from TensorFlow 2.21's own
OpDefs and compares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def test_op_signatures_match_tensorflows_opdefs(tf_client: Any) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gen_op_signatures.py"),
            "--check",
            "--tf-python",
            tf_client.python,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
