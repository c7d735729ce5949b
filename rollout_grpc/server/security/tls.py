"""TLS and mTLS for the replica's ports, with certificate reload without restart.

The files are described once (`TlsConfig`); the gRPC ports get dynamic credentials from them
(`front/grpc/tls.py`), the HTTP ports an `ssl.SSLContext` here; both re-read the files only when
their modification times changed (one `stat` per file per handshake). A rotated certificate
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

    def file_stamp(self, with_client_ca: bool = True) -> tuple[int, ...]:
        """Modification times of the files (one `stat` each): a reload is due when they change."""
        paths = [self.cert_file, self.key_file]
        if with_client_ca and self.client_ca_file:
            paths.append(self.client_ca_file)
        return tuple(os.stat(p).st_mtime_ns for p in paths)


class _ReloadingSSLContext:
    """An `ssl.SSLContext` whose handshakes use the current files: the ClientHello callback swaps
    in a context rebuilt when a file's modification time changed (one `stat` per file)."""

    def __init__(self, config: TlsConfig) -> None:
        self._config = config
        self._stamp = self._file_stamp()
        self.base = self._build()
        self._latest = self.base
        self.base.sni_callback = self._on_client_hello

    def _file_stamp(self) -> tuple[int, ...]:
        return self._config.file_stamp()

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
