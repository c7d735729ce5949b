"""TLS and mTLS for the replica's ports, with certificate reload without restart.

`server_credentials` builds grpc's *dynamic* SSL credentials: before each new TLS handshake gRPC
asks a fetcher for the current certificate configuration, and the fetcher re-reads the files only
when their modification times changed (one `stat` per file per handshake). A rotated certificate
(cert-manager renewing a Kubernetes Secret) is used by the next connection, with no restart;
existing connections keep theirs until `max_connection_age` closes them. A half-written or
mismatched pair is logged and the previous one kept.

With a client CA (`--tls-client-ca`) the main port requires and verifies client certificates
(mTLS); their names can map to roles (`auth.py`). The health port uses the same certificate but
never asks for a client certificate (load-balancer probes rarely have one), or stays plaintext
with `--health-plaintext` for Kubernetes' gRPC probes, which cannot speak TLS.

The HTTP ports that need it (the OpenAI front door) get an `ssl.SSLContext` from the same files
(`server_ssl_context`), with the same rules: mTLS under a client CA, rotated files used by the next
handshake.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """PEM files of the server certificate chain and key, and the CA that signs client certificates."""

    cert_file: str
    key_file: str
    #: Clients must present a certificate signed by this CA (mTLS). None: server-side TLS only.
    client_ca_file: str | None = None

    @property
    def mutual(self) -> bool:
        """Client certificates are required."""
        return self.client_ca_file is not None


class _ReloadingCertificates:
    """The grpc certificate-configuration fetcher: re-reads the PEM files when they change."""

    def __init__(self, config: TlsConfig, with_client_ca: bool) -> None:
        self._config = config
        self._with_client_ca = with_client_ca
        self._stamp = self._file_stamp()
        self.initial = self._load()

    def _paths(self) -> list[str]:
        paths = [self._config.cert_file, self._config.key_file]
        if self._with_client_ca and self._config.client_ca_file:
            paths.append(self._config.client_ca_file)
        return paths

    def _file_stamp(self) -> tuple[int, ...]:
        return tuple(os.stat(p).st_mtime_ns for p in self._paths())

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


class _ReloadingSSLContext:
    """An `ssl.SSLContext` whose handshakes use the current files: the ClientHello callback swaps
    in a context rebuilt when a file's modification time changed (one `stat` per file)."""

    def __init__(self, config: TlsConfig) -> None:
        self._config = config
        self._stamp = self._file_stamp()
        self.base = self._build()
        self._latest = self.base
        self.base.sni_callback = self._on_client_hello

    def _paths(self) -> list[str]:
        paths = [self._config.cert_file, self._config.key_file]
        if self._config.client_ca_file:
            paths.append(self._config.client_ca_file)
        return paths

    def _file_stamp(self) -> tuple[int, ...]:
        return tuple(os.stat(p).st_mtime_ns for p in self._paths())

    def _build(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self._config.cert_file, self._config.key_file)
        if self._config.client_ca_file:
            context.load_verify_locations(cafile=self._config.client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def _on_client_hello(self, connection: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        try:
            stamp = self._file_stamp()
            if stamp != self._stamp:
                self._latest = self._build()
                self._stamp = stamp
                log.info("tls_certificate_reloaded", cert=self._config.cert_file, port="http")
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.error("tls_reload_failed", error=str(exc), action="kept the current certificate")
        if self._latest is not self.base:
            connection.context = self._latest


def server_ssl_context(config: TlsConfig) -> ssl.SSLContext:
    """A TLS server context for an HTTP port from the same PEM files (mTLS with a client CA);
    rotated files are used from the next handshake on."""
    return _ReloadingSSLContext(config).base
