"""Fixtures of the runtime tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import distserver as ds
from distserver.runtime.executor import Executor


@pytest.fixture(scope="module")
def server() -> Iterator[ds.Server]:
    """A local server (one task, in this process) for the module's sessions."""
    server = ds.Server.create_local_server()
    yield server
    server.stop()


@pytest.fixture
def executors(monkeypatch: pytest.MonkeyPatch) -> list[Executor]:
    """Every `Executor` built during the test, in order (the partitions its sessions
    registered)."""
    made: list[Executor] = []
    build = Executor.__init__

    def recording(self: Executor, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Executor, "__init__", recording)
    return made


def assert_same_training(first: tuple[Any, Any], second: tuple[Any, Any], steps: int) -> None:
    """Two trainings' (losses, variables) the same bit for bit, and `steps` different
    losses (it trained)."""
    np.testing.assert_array_equal(first[0], second[0])
    for value, expected in zip(first[1], second[1], strict=True):
        np.testing.assert_array_equal(value, expected)
    assert len(set(map(float, first[0]))) == steps
