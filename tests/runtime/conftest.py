"""Fixtures of the runtime tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import distserver as ds


@pytest.fixture(scope="module")
def server() -> Iterator[ds.Server]:
    """A local server (one task, in this process) for the module's sessions."""
    server = ds.Server.create_local_server()
    yield server
    server.stop()
