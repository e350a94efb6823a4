"""The transport conformance suite (`distserver.testing.conformance`) against every transport.

One test per check and protocol. The peer is a separate OS process per protocol
(shared by the checks of that protocol; the peer-death check kills one of its own).
"grpc+verbs" is skipped only while `get_transport` does not know it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from distserver import errors
from distserver.testing import conformance
from distserver.testing.conformance import ConformancePeer
from distserver.transports import get_transport

pytestmark = pytest.mark.slow

PROTOCOLS = ["grpc", "grpc+verbs"]


@pytest.fixture(scope="module", params=PROTOCOLS)
def protocol(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    try:
        get_transport(name)
    except errors.NotFoundError as exc:
        pytest.skip(f"transport {name!r} is not registered yet: {exc.message}")
    return name


@pytest.fixture(scope="module")
def peer(protocol: str) -> Iterator[ConformancePeer]:
    """The serving process for the checks that leave it alive."""
    with ConformancePeer(protocol) as process:
        yield process
    assert process.returncode == 0, f"the peer did not stop cleanly on SIGTERM:\n{process.stderr()}"


@pytest.fixture
async def own_peer(protocol: str) -> AsyncIterator[ConformancePeer]:
    """A serving process for one check that kills it."""
    async with ConformancePeer(protocol) as process:
        yield process


SHARED_PEER_CHECKS = [name for name in conformance.CHECKS if name not in conformance.OWN_PEER_CHECKS]


@pytest.mark.parametrize("check", SHARED_PEER_CHECKS)
async def test_check(protocol: str, peer: ConformancePeer, check: str) -> None:
    await conformance.CHECKS[check](protocol, peer)


async def test_peer_death(protocol: str, own_peer: ConformancePeer) -> None:
    await conformance.check_peer_death(protocol, own_peer)
