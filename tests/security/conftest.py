"""Fixtures of the security tests: a throwaway PKI and a tokens file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.security.certs import CertAuthority
from tests.security.credentials import ADMIN, PEER, TRAINER_A, TRAINER_B, Pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """Certificates minted for this test only."""
    ca = CertAuthority(tmp_path)
    return Pki(
        ca=ca,
        server=ca.issue("rollout-replica", server=True, file_stem="server"),
        alice=ca.issue("alice.trainers.example", server=False),
        ops=ca.issue("ops.admins.example", server=False),
    )


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    """Two trainers, an admin (its token stored hashed) and the replicas' peer token."""
    import hashlib

    path = tmp_path / "tokens"
    admin_digest = hashlib.sha256(ADMIN.encode()).hexdigest()
    path.write_text(
        "# identity role token\n"
        f"trainer-a trainer {TRAINER_A}\n"
        f"trainer-b trainer {TRAINER_B}\n"
        f"ops admin sha256:{admin_digest}\n"
        f"replicas peer {PEER}\n"
    )
    return path
