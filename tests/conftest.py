"""Shared fixtures: free ports and local multi-process clusters."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from distserver.testing import LocalCluster

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def _ctrl_c_reaches_subprocesses() -> Iterator[None]:
    """A suite started in the background by a non-interactive shell (`... &`) inherits
    SIGINT ignored, and so would every process it starts: the tests that press Ctrl-C
    in a subprocess would wait for an exit that never comes. Give SIGINT Python's
    handler here (a caught signal is reset to its default in a child, an ignored one
    stays ignored)."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def python_env() -> dict[str, str]:
    """Environment for subprocesses that import distserver from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TF_CONFIG", None)
    return env


@pytest.fixture(scope="module")
def ps_worker_cluster() -> Iterator[LocalCluster]:
    """1 ps + 2 workers, each its own OS process."""
    with LocalCluster({"ps": 1, "worker": 2}) as cluster:
        yield cluster


@pytest.fixture
def python() -> str:
    return sys.executable
