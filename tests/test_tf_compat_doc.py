"""docs/tf-compat.md lists exactly the ops that have a kernel."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from distserver.kernels import registered_ops

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "tf-compat.md"


def test_the_doc_lists_exactly_the_registered_ops():
    text = DOC.read_text()
    section = text[text.index("<!-- BEGIN GENERATED OP LIST") : text.index("<!-- END GENERATED OP LIST")]
    listed = re.findall(r"`([A-Za-z0-9_]+)`", section)
    assert len(listed) == len(set(listed))
    assert sorted(listed) == registered_ops()
    assert f"{len(registered_ops())} ops." in section


def test_the_generated_section_is_up_to_date():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_tf_compat.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
