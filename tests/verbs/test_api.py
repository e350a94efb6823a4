"""The public surface of distserver.transports.verbs: sorted, complete, documented."""

from __future__ import annotations

import inspect

from distserver.transports import verbs


def test_all_is_sorted_unique_and_resolvable():
    # Sorted as ruff (RUF022) sorts: CONSTANTS, then Classes, then functions.
    assert verbs.__all__ == sorted(set(verbs.__all__), key=lambda n: (not n.isupper(), n.islower(), n))
    for name in verbs.__all__:
        assert hasattr(verbs, name), name


def test_every_public_name_is_exported():
    public = {name for name in vars(verbs) if not name.startswith("_")}
    assert public == set(verbs.__all__)


def test_classes_and_functions_state_their_contract():
    for name in verbs.__all__:
        obj = getattr(verbs, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"
    for cls in (verbs.ProtectionDomain, verbs.MemoryRegion, verbs.QueuePair, verbs.CompletionQueue):
        assert "Contract" in (cls.__doc__ or ""), cls
