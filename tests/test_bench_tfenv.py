"""Finding TensorFlow's interpreter for the benchmarks (`distserver.bench.tfenv`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from distserver.bench import tfenv


def test_a_relative_interpreter_path_is_made_absolute(monkeypatch):
    # The benchmarks start the interpreter from other directories (a network namespace's
    # child), so `DISTSERVER_TF_PYTHON=.tfenv/bin/python` must not stay relative.
    interpreter = Path(sys.executable)
    monkeypatch.chdir(interpreter.parent.parent)
    relative = os.path.join(interpreter.parent.name, interpreter.name)
    found = tfenv.probe(relative)
    expected = os.path.abspath(relative)
    if isinstance(found, str):  # this Python has no tensorflow: the reason names the full path
        assert found.startswith(expected)
    else:
        assert found.python == expected


def test_a_missing_interpreter_is_named():
    assert tfenv.probe("no/such/python") == f"{os.path.abspath('no/such/python')} does not exist"
