"""Shared fixtures: free ports and local multi-process clusters."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from distserver.testing import LocalCluster

ROOT = Path(__file__).resolve().parent.parent


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
