"""A replica on a network address starts only when it is protected, or told the network is trusted.

On loopback (the default `--host 127.0.0.1`) only this machine reaches the replica: no TLS and no
authentication are fine. On any other address:

* without authentication any caller that reaches the address may Pause, Resume and Abort every
  trainer's work and read the engine URLs: the replica refuses to start;
* with bearer tokens but without TLS the tokens cross the network in plaintext, readable by anyone
  on the path (a pod network is a shared one): the replica refuses to start.

`--insecure-trusted-network` (`ServerConfig.insecure_trusted_network`) says every host that can
reach the address is trusted; the replica then starts with the old warnings
(`UNAUTHENTICATED_SERVICE_ON_NETWORK`, `PLAINTEXT_SERVICE_ON_NETWORK`). mTLS alone (client
certificates, no tokens) over TLS needs no flag.

`is_loopback` parses the host exactly (an IP address, bracketed or not, or the name `localhost`):
a prefix test counted `localhost.attacker.example` and `127.example.com` as loopback.
"""

from __future__ import annotations

import ipaddress

import structlog

log = structlog.get_logger(__name__)

FLAG = "--insecure-trusted-network"


class ExposureRefused(ValueError):
    """The replica would serve a network address unprotected; the message says what to add."""


def is_loopback(host: str) -> bool:
    """A host only this machine can reach: a loopback IP address (IPv4-mapped too) or `localhost`."""
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_exposure(host: str, *, auth: bool, tokens: bool, tls: bool, trusted: bool) -> None:
    """Refuse (`ExposureRefused`) or warn about serving `host` without authentication or TLS.

    `auth`: any credential source is configured; `tokens`: bearer tokens are (they travel in every
    call); `tls`: the ports speak TLS; `trusted`: `--insecure-trusted-network` was given."""
    if is_loopback(host):
        return
    problems: list[tuple[str, str, str]] = []
    if not auth:
        problems.append(
            (
                "UNAUTHENTICATED_SERVICE_ON_NETWORK",
                "authentication is off: any caller that reaches this address may Pause, Resume and "
                "Abort every trainer's work and see the engine URLs",
                "--auth-tokens-file and/or --tls-client-ca with --mtls-role",
            )
        )
    if not tls:
        problems.append(
            (
                "PLAINTEXT_SERVICE_ON_NETWORK",
                "TLS is off: requests, samples"
                + (" and bearer tokens" if tokens else "")
                + " cross the network unencrypted",
                "--tls-cert/--tls-key",
            )
        )
    if trusted:
        for event, risk, fix in problems:
            log.warning(event, host=host, risk=risk, fix=f"{fix} (docs/security.md)", allowed_by=FLAG)
        return
    if problems:
        reasons = "; ".join(f"{risk} (add {fix})" for _, risk, fix in problems)
        raise ExposureRefused(
            f"refusing to serve {host!r}, a network address: {reasons}. If every host that can reach "
            f"it is trusted, pass {FLAG} (docs/security.md)"
        )
