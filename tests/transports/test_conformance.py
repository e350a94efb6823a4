"""The transport conformance suite (`distserver.testing.conformance`) against every built-in transport.

One test per check and transport. The peer is a separate OS process per transport
(shared by the checks of that transport; the peer-death check kills one of its own).
A built-in protocol that `get_transport` does not know fails here: it is a bug, not
a reason to skip.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from distserver.testing import conformance
from distserver.testing.conformance import ConformancePeer
from distserver.testing.conformance_peer import load_transport
from distserver.transports import Transport, get_transport
from distserver.transports.verbs import VerbsTransport

pytestmark = pytest.mark.slow

PROTOCOLS = ["grpc", "grpc+verbs"]


@pytest.fixture(scope="module", params=PROTOCOLS)
def transport(request: pytest.FixtureRequest) -> Transport:
    return get_transport(request.param)


@pytest.fixture(scope="module")
def peer(transport: Transport) -> Iterator[ConformancePeer]:
    """The serving process for the checks that leave it alive."""
    with ConformancePeer(transport) as process:
        yield process
    assert process.returncode == 0, f"the peer did not stop cleanly on SIGTERM:\n{process.stderr()}"


@pytest.fixture
async def own_peer(transport: Transport) -> AsyncIterator[ConformancePeer]:
    """A serving process for one check that kills it."""
    async with ConformancePeer(transport) as process:
        yield process


SHARED_PEER_CHECKS = [name for name in conformance.CHECKS if name not in conformance.OWN_PEER_CHECKS]


@pytest.mark.parametrize("check", SHARED_PEER_CHECKS)
async def test_check(transport: Transport, peer: ConformancePeer, check: str) -> None:
    await conformance.CHECKS[check](transport, peer)


async def test_peer_death(transport: Transport, own_peer: ConformancePeer) -> None:
    await conformance.check_peer_death(transport, own_peer)


async def test_a_transport_that_is_not_registered_can_be_checked() -> None:
    # A strict grpc+verbs is no registered transport (the registry holds the default one);
    # the peer builds its own from the class.
    unregistered = VerbsTransport(strict=True)
    assert all(get_transport(name) is not unregistered for name in PROTOCOLS)
    durations = await conformance.check_transport(unregistered, ["dtypes", "control_calls", "statistics"])
    assert set(durations) == {"dtypes", "control_calls", "statistics"}


def test_the_peer_refuses_what_is_not_a_transport() -> None:
    with pytest.raises(TypeError, match="is not a distserver Transport"):
        load_transport("distserver.errors:OK")
