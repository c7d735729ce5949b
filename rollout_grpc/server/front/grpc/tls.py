"""gRPC TLS credentials from the replica's certificate files, reloaded without restart.

`server_credentials` builds grpc's *dynamic* SSL credentials: before each new TLS handshake gRPC
asks a fetcher for the current certificate configuration, and the fetcher re-reads the files only
when their modification times changed. A rotated certificate (cert-manager renewing a Kubernetes
Secret) is used by the next connection; existing connections keep theirs until
`max_connection_age` closes them. A half-written or mismatched pair is logged and the previous one
kept. `peer_channel_credentials` is the client side, for calls to the other replicas.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import structlog

from rollout_grpc.server.security.tls import TlsConfig

log = structlog.get_logger(__name__)


class _ReloadingCertificates:
    """The grpc certificate-configuration fetcher: re-reads the PEM files when they change."""

    def __init__(self, config: TlsConfig, with_client_ca: bool) -> None:
        self._config = config
        self._with_client_ca = with_client_ca
        self._stamp = self._file_stamp()
        self.initial = self._load()

    def _file_stamp(self) -> tuple[int, ...]:
        return self._config.file_stamp(self._with_client_ca)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        cert = Path(self._config.cert_file).read_bytes()
        key = Path(self._config.key_file).read_bytes()
        if b"PRIVATE KEY" not in key or b"CERTIFICATE" not in cert:
            raise ValueError(
                f"{self._config.cert_file} / {self._config.key_file}: not a PEM certificate and key"
            )
        root = None
        if self._with_client_ca and self._config.client_ca_file:
            root = Path(self._config.client_ca_file).read_bytes()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=root)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before a handshake: a new configuration, or None to keep the current one."""
        try:
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return None
            loaded = self._load()
        except (OSError, ValueError) as exc:
            log.error("tls_reload_failed", error=str(exc), action="kept the current certificate")
            return None
        self._stamp = stamp
        log.info("tls_certificate_reloaded", cert=self._config.cert_file)
        return loaded


def server_credentials(
    config: TlsConfig, *, require_client_cert: bool | None = None
) -> grpc.ServerCredentials:
    """Dynamic TLS credentials for a listening port (mTLS when the config has a client CA).

    `require_client_cert=False` serves the same certificate without asking for a client one (the
    health port).
    """
    mutual = config.mutual if require_client_cert is None else require_client_cert and config.mutual
    fetcher = _ReloadingCertificates(config, with_client_ca=mutual)
    # grpc's stub types the fetcher as never returning None; the runtime documents None as
    # "keep the current configuration".
    return grpc.dynamic_ssl_server_credentials(
        fetcher.initial,
        fetcher,  # type: ignore[arg-type]
        require_client_authentication=mutual,
    )


def peer_channel_credentials(config: TlsConfig, peer_ca_file: str | None) -> grpc.ChannelCredentials:
    """Credentials for calling the other replicas: verify them with `peer_ca_file` (or the client
    CA, or the system roots) and, under mTLS, present this replica's own certificate."""
    ca = peer_ca_file or config.client_ca_file
    root = Path(ca).read_bytes() if ca else None
    if config.mutual:
        return grpc.ssl_channel_credentials(
            root_certificates=root,
            private_key=Path(config.key_file).read_bytes(),
            certificate_chain=Path(config.cert_file).read_bytes(),
        )
    return grpc.ssl_channel_credentials(root_certificates=root)
