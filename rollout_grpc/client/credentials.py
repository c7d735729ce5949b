"""TLS, mTLS and bearer-token settings shared by both clients.

A PEM value may be given as bytes or as a path to a PEM file. `tls=True` alone verifies the server
with the system roots; a root certificate implies TLS; a client certificate and key add mTLS. The
bearer token travels as `authorization: Bearer <token>` metadata on every call (send it only over
TLS, or to a loopback address).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

PemLike = bytes | str | os.PathLike[str]


def read_pem(value: PemLike | None) -> bytes | None:
    """PEM bytes from bytes (as is) or from a file path."""
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    """How a client authenticates the server and itself."""

    tls: bool = False
    root_certificates: PemLike | None = None
    certificate_chain: PemLike | None = None
    private_key: PemLike | None = None
    token: str | None = None
    #: Expected server name when it differs from the target's host (e.g. dialing an IP).
    server_name: str | None = None

    @property
    def secure(self) -> bool:
        """TLS is on (asked for, or implied by a certificate)."""
        return self.tls or any(
            v is not None for v in (self.root_certificates, self.certificate_chain, self.private_key)
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """SSL channel credentials, or None for a plaintext channel."""
        if not self.secure:
            return None
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("certificate_chain and private_key go together (mTLS)")
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.root_certificates),
            private_key=read_pem(self.private_key),
            certificate_chain=read_pem(self.certificate_chain),
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        """Extra channel arguments (the TLS server-name override)."""
        if self.server_name and self.secure:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata carrying the bearer token, if any."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()
