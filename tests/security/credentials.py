"""The tokens and the certificate bundle the security tests use (imported by tests and fixtures)."""

from __future__ import annotations

from dataclasses import dataclass

from tests.security.certs import CertAuthority, Issued

TRAINER_A = "token-of-trainer-a"
TRAINER_B = "token-of-trainer-b"
ADMIN = "token-of-the-admin"
PEER = "token-of-the-replicas"


@dataclass(frozen=True)
class Pki:
    """A CA with a server certificate and two client certificates."""

    ca: CertAuthority
    server: Issued
    alice: Issued
    ops: Issued
