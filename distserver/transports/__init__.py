"""Transports by protocol name ("grpc", "grpc+verbs", plugins).

Built-in transports are registered on first use; third-party ones are found through
the `distserver.transports` entry-point group (name = protocol, value = an object
path to a `Transport` subclass or instance).
"""

from __future__ import annotations

import importlib.metadata
import threading

from distserver import errors
from distserver.transports.base import (
    Channel,
    ChannelStatistics,
    Listener,
    ServiceHandler,
    TensorSource,
    Transport,
)

ENTRY_POINT_GROUP = "distserver.transports"

_registry: dict[str, Transport] = {}
_lock = threading.Lock()
_builtins_loaded = False


def register_transport(protocol: str, transport: Transport) -> None:
    """Make `transport` serve servers whose `ServerDef.protocol` is `protocol`."""
    with _lock:
        _registry[protocol] = transport


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    # Imported here: the transports import this package's submodules (base, call_stream).
    from distserver.transports.grpc import GrpcTransport
    from distserver.transports.verbs._transport import VerbsTransport

    with _lock:
        _registry.setdefault("grpc", GrpcTransport())
        _registry.setdefault("grpc+verbs", VerbsTransport())
        _builtins_loaded = True


def _load_entry_point(protocol: str) -> Transport | None:
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == protocol:
            obj = entry.load()
            transport: Transport = obj() if isinstance(obj, type) else obj
            register_transport(protocol, transport)
            return transport
    return None


def available_protocols() -> list[str]:
    """Sorted protocol names that `get_transport` accepts."""
    _load_builtins()
    names = set(_registry)
    names.update(entry.name for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def get_transport(protocol: str) -> Transport:
    """The transport registered for `protocol`.

    Raises:
        NotFoundError: nothing serves `protocol`; the message lists the protocols
            that are available.
    """
    _load_builtins()
    transport = _registry.get(protocol) or _load_entry_point(protocol)
    if transport is None:
        raise errors.NotFoundError(
            f"No server factory registered for the given ServerDef: protocol {protocol!r} is not "
            f"available. The available protocols are: [ {', '.join(available_protocols())} ]"
        )
    return transport


__all__ = [
    "ENTRY_POINT_GROUP",
    "Channel",
    "ChannelStatistics",
    "Listener",
    "ServiceHandler",
    "TensorSource",
    "Transport",
    "available_protocols",
    "get_transport",
    "register_transport",
]
