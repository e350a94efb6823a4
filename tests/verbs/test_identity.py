"""Host identity and the viability check (same kernel, same network namespace, same user)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from distserver.transports import verbs


def test_identity_of_this_process():
    identity = verbs.host_identity()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert identity.boot_id == f.read().strip()
    assert identity.netns == os.stat("/proc/self/ns/net").st_ino
    assert identity.uid == os.getuid()
    assert verbs.is_viable(identity, verbs.host_identity())
    assert verbs.viability_problem(identity, identity) is None


def test_identity_round_trips_through_bytes():
    identity = verbs.host_identity()
    assert verbs.HostIdentity.decode(identity.encode()) == identity
    with pytest.raises(ValueError, match="not an encoded HostIdentity"):
        verbs.HostIdentity.decode(b"{}")


def _identity_of_child(python_env, override: str) -> verbs.HostIdentity:
    env = dict(python_env, **{verbs.HOST_ID_OVERRIDE_ENV: override})
    code = (
        "import sys; from distserver.transports import verbs; "
        "sys.stdout.buffer.write(verbs.host_identity().encode())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, env=env, timeout=60, check=True
    )
    return verbs.HostIdentity.decode(result.stdout)


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("boot_id=another-machine", "another host"),
        ("netns=12345", "another network namespace"),
        ("uid=4242", "another user"),
    ],
)
def test_foreign_identity_is_not_viable(python_env, override, problem):
    local = verbs.host_identity()
    remote = _identity_of_child(python_env, override)
    assert not verbs.is_viable(local, remote)
    message = verbs.viability_problem(local, remote)
    assert message is not None
    assert problem in message


def test_override_changes_only_the_named_fields(monkeypatch):
    real = verbs.host_identity()
    monkeypatch.setenv(verbs.HOST_ID_OVERRIDE_ENV, "boot_id=x, uid=7")
    fake = verbs.host_identity()
    assert (fake.boot_id, fake.netns, fake.uid) == ("x", real.netns, 7)


@pytest.mark.parametrize("override", ["nonsense", "colour=blue", "netns=notanumber"])
def test_malformed_override_is_refused(monkeypatch, override):
    monkeypatch.setenv(verbs.HOST_ID_OVERRIDE_ENV, override)
    with pytest.raises(ValueError, match=verbs.HOST_ID_OVERRIDE_ENV):
        verbs.host_identity()
