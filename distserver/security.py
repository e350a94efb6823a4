"""`Security`: TLS, mutual TLS and a shared token for a cluster's connections.

One object describes both sides of every connection a process makes or serves: a
server uses it for its port and for the channels it opens to its peers, a session
for its channel to the master. What each part does:

* `cert_file` + `key_file`: serve TLS with this certificate; as a client, present it
  when the server asks (mutual TLS).
* `ca_file`: the certificates to trust. Clients verify the server against it (TLS
  to a server needs it, or the system's roots); with `require_client_cert` servers
  verify clients against it.
* `token`: a shared secret every call carries (`authorization: Bearer <token>`
  metadata) and every server checks; a call without it is refused with
  `UnauthenticatedError`. When not given, `DISTSERVER_AUTH_TOKEN` is used if set.

Without certificates connections are plaintext; a token then authenticates calls
but anyone on the path can read it and the data. See docs/security.md.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

TOKEN_ENV = "DISTSERVER_AUTH_TOKEN"
# The call metadata that carries the token (lowercase: gRPC metadata keys are).
TOKEN_METADATA_KEY = "authorization"
_BEARER = "Bearer "


@dataclass(frozen=True)
class Credentials:
    """The PEM bytes a TLS endpoint needs, read from `Security`'s files."""

    certificate_chain: bytes | None
    private_key: bytes | None
    root_certificates: bytes | None


@dataclass(frozen=True)
class Security:
    """How a process authenticates its connections; see the module docstring.

    Args:
        cert_file: PEM certificate (chain) of this process; needs `key_file`.
        key_file: PEM private key of `cert_file`.
        ca_file: PEM certificates to trust for peers.
        require_client_cert: Servers refuse clients without a certificate signed by
            `ca_file` (mutual TLS); needs `cert_file`, `key_file` and `ca_file`.
        token: Shared secret checked on every call; None: `DISTSERVER_AUTH_TOKEN`,
            if set.

    Raises:
        ValueError: a file is missing or unreadable, or the options do not fit
            together; the message names what to change.
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    require_client_cert: bool = False
    token: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("Security: cert_file and key_file go together; give both or neither")
        if self.require_client_cert and (self.cert_file is None or self.ca_file is None):
            raise ValueError(
                "Security: require_client_cert needs cert_file, key_file (this server's certificate) "
                "and ca_file (to verify the clients' certificates)"
            )
        for option in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, option)
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"Security: {option} {path!r} does not exist or cannot be read")
        if self.token is None and os.environ.get(TOKEN_ENV):
            object.__setattr__(self, "token", os.environ[TOKEN_ENV])
        if self.token is not None and (not self.token or self.token != self.token.strip()):
            raise ValueError(
                f"Security: the token must be non-empty without surrounding whitespace (from {TOKEN_ENV} "
                "or token=)"
            )

    @property
    def tls(self) -> bool:
        """Whether connections use TLS (a server needs a certificate, a client a CA or the system's)."""
        return self.cert_file is not None or self.ca_file is not None

    def credentials(self) -> Credentials:
        """The certificate files' contents (read now, so rotated files take effect on restart)."""

        def read(path: str | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return Credentials(read(self.cert_file), read(self.key_file), read(self.ca_file))

    @property
    def token_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata a client adds to every call (empty without a token)."""
        return () if self.token is None else ((TOKEN_METADATA_KEY, _BEARER + self.token),)

    def admits(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """Whether a call's metadata carries this token (always true without one)."""
        if self.token is None:
            return True
        expected = (_BEARER + self.token).encode()
        for key, value in metadata or ():
            if key == TOKEN_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, expected)
        return False


def from_environment(security: Security | None) -> Security | None:
    """`security`, or when None a `Security` with `DISTSERVER_AUTH_TOKEN`'s token if that is set."""
    if security is None and os.environ.get(TOKEN_ENV):
        return Security()
    return security
