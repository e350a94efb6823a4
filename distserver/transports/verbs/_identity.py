"""Which peers can share memory with us: the host identity and the viability check.

Two processes can use the verbs data plane only when they run on the same kernel
(same boot id: a memfd cannot cross machines), in the same network namespace (the
queue-pair socket lives in the abstract Unix namespace, which is per network
namespace), and as the same user (the queue pair refuses peers of another uid, see
`SO_PEERCRED` in `_qp.py`). This is TensorPipe's "domain descriptor" idea.

Each side computes `host_identity()` once and sends it over the control plane (gRPC);
`is_viable(local, remote)` then decides between the verbs path and the gRPC fallback,
and `viability_problem` says why in a sentence fit for a log line.

Test hook: the environment variable `DISTSERVER_VERBS_HOST_ID_OVERRIDE` replaces
parts of the identity, as comma-separated `field=value` pairs (`boot_id`, `netns`,
`uid`), e.g. `DISTSERVER_VERBS_HOST_ID_OVERRIDE=boot_id=elsewhere` makes a process
look like it runs on another machine. It exists for tests only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

__all__ = ["HOST_ID_OVERRIDE_ENV", "HostIdentity", "host_identity", "is_viable", "viability_problem"]

HOST_ID_OVERRIDE_ENV = "DISTSERVER_VERBS_HOST_ID_OVERRIDE"

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_NETNS_PATH = "/proc/self/ns/net"


@dataclass(frozen=True)
class HostIdentity:
    """Where a process runs, as far as sharing memory is concerned.

    Attributes:
        boot_id: The kernel's boot id (`/proc/sys/kernel/random/boot_id`); equal boot
            ids mean the same running kernel, hence the same machine.
        netns: The inode of the process's network namespace.
        uid: The real user id of the process.
    """

    boot_id: str
    netns: int
    uid: int

    def encode(self) -> bytes:
        """A compact byte form, to send over the control plane."""
        return json.dumps({"boot_id": self.boot_id, "netns": self.netns, "uid": self.uid}).encode()

    @classmethod
    def decode(cls, data: bytes) -> HostIdentity:
        """The identity `encode` produced.

        Raises:
            ValueError: `data` is not an encoded identity.
        """
        try:
            fields = json.loads(data)
            return cls(boot_id=str(fields["boot_id"]), netns=int(fields["netns"]), uid=int(fields["uid"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not an encoded HostIdentity: {data[:80]!r}") from exc


def host_identity() -> HostIdentity:
    """The identity of the calling process (see the module docstring for the test hook).

    Raises:
        ValueError: the override variable is set but malformed.
    """
    with open(_BOOT_ID_PATH, encoding="ascii") as f:
        boot_id = f.read().strip()
    identity = HostIdentity(boot_id=boot_id, netns=os.stat(_NETNS_PATH).st_ino, uid=os.getuid())
    override = os.environ.get(HOST_ID_OVERRIDE_ENV, "").strip()
    return _apply_override(identity, override) if override else identity


def _apply_override(identity: HostIdentity, override: str) -> HostIdentity:
    changes: dict[str, str | int] = {}
    for item in override.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in ("boot_id", "netns", "uid"):
            raise ValueError(
                f"{HOST_ID_OVERRIDE_ENV}={override!r}: expected comma-separated boot_id=..., netns=..., "
                f"uid=... pairs, got {item!r}"
            )
        try:
            changes[name] = value.strip() if name == "boot_id" else int(value)
        except ValueError as exc:
            raise ValueError(f"{HOST_ID_OVERRIDE_ENV}: {name} must be an integer, got {value!r}") from exc
    return replace(identity, **changes)  # type: ignore[arg-type]


def viability_problem(local: HostIdentity, remote: HostIdentity) -> str | None:
    """Why the verbs path cannot connect `local` and `remote`, or None when it can."""
    if local.boot_id != remote.boot_id:
        return f"the peer runs on another host (boot id {remote.boot_id} vs ours {local.boot_id})"
    if local.netns != remote.netns:
        return f"the peer runs in another network namespace (inode {remote.netns} vs ours {local.netns})"
    if local.uid != remote.uid:
        return f"the peer runs as another user (uid {remote.uid} vs ours {local.uid})"
    return None


def is_viable(local: HostIdentity, remote: HostIdentity) -> bool:
    """True when the two processes can share memory through the verbs path."""
    return viability_problem(local, remote) is None
