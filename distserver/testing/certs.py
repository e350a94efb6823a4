"""A throwaway certificate authority for TLS and mutual TLS in tests and trials.

`make_cluster_certificates(directory)` writes a CA and, signed by it, one server
certificate (valid for the hosts given, loopback by default) and one client
certificate: what `distserver.Security` and `distserver serve --tls-*` take. The
same server certificate may serve every task of a cluster on those hosts, and
tasks use it as their client certificate too.

For production use your organisation's CA; see docs/security.md. Needs the
`cryptography` package (in distserver's `dev` extra).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class ClusterCertificates:
    """Paths of the PEM files `make_cluster_certificates` wrote."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_cluster_certificates(
    directory: str | os.PathLike[str],
    hosts: Sequence[str] = LOOPBACK_HOSTS,
    *,
    valid_days: int = 30,
) -> ClusterCertificates:
    """Write a CA, a server certificate for `hosts` and a client certificate into `directory`.

    Keys are written readable by their owner only.

    Raises:
        ImportError: `cryptography` is not installed (says how to get it).
    """
    try:
        from cryptography import x509  # optional: needed here only
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:
        raise ImportError(
            "making certificates needs the 'cryptography' package: pip install 'distserver[dev]' "
            "(or pip install cryptography), or use your own CA (docs/security.md)"
        ) from exc

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(common_name: str) -> Any:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def write(stem: str, key: Any, certificate: Any) -> tuple[Path, Path]:
        cert_path, key_path = out / f"{stem}.pem", out / f"{stem}-key.pem"
        cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_bytes = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as stream:
            stream.write(key_bytes)
        return cert_path, key_path

    def issue(subject: Any, key: Any, issuer: Any, signer: Any, extensions: list[tuple[Any, bool]]) -> Any:
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=valid_days))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("distserver test CA")
    ca_cert = issue(ca_name, ca_key, ca_name, ca_key, [(x509.BasicConstraints(ca=True, path_length=0), True)])

    alt_names: list[Any] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP256R1())
    both_ways = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]  # tasks dial each other
    server_cert = issue(
        name(hosts[0] if hosts else "distserver"),
        server_key,
        ca_name,
        ca_key,
        [
            (x509.SubjectAlternativeName(alt_names), False),
            (x509.ExtendedKeyUsage(both_ways), False),
        ],
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = issue(
        name("distserver client"),
        client_key,
        ca_name,
        ca_key,
        [(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)],
    )
    ca_paths = write("ca", ca_key, ca_cert)
    server_paths = write("server", server_key, server_cert)
    client_paths = write("client", client_key, client_cert)
    return ClusterCertificates(*ca_paths, *server_paths, *client_paths)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m distserver.testing.certs DIR [--host H ...]`: write a test CA and certificates."""
    parser = argparse.ArgumentParser(prog="python -m distserver.testing.certs", description=main.__doc__)
    parser.add_argument("directory", help="where to write the PEM files")
    parser.add_argument(
        "--host",
        action="append",
        dest="hosts",
        help="a host name or IP the server certificate is valid for (repeat; default: loopback)",
    )
    parser.add_argument("--days", type=int, default=30, help="validity in days (default: %(default)s)")
    args = parser.parse_args(argv)
    made = make_cluster_certificates(args.directory, args.hosts or LOOPBACK_HOSTS, valid_days=args.days)
    for field, path in vars(made).items():
        print(f"{field}\t{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
