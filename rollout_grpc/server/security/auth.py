"""Authentication and roles, for both front doors: who is calling, from what they presented.

Credentials, in order:
1. a bearer token in the `authorization` metadata (`Bearer <token>`), checked against a token file
   (a Kubernetes Secret mount): one `identity role token` per line, the token given in clear or as
   `sha256:<hex>`. Tokens are held only as SHA-256 digests and compared in constant time against
   every entry (`hmac.compare_digest`, no early exit). The file is re-read when it changes (its
   mtime, checked at most once a second) and on `reload()` (SIGHUP); an unreadable or malformed
   file keeps the previous tokens;
2. the verified client certificate of an mTLS connection: its SANs and subject common name are
   looked up in a `name -> role` table (`--mtls-role`), the name becoming the identity.

No credentials: UNAUTHENTICATED. A role that may not call the method: PERMISSION_DENIED. Health is
always open (probes carry no credentials); reflection is open or needs any valid credential.

Without any credential source configured (the loopback default) every call runs as the anonymous
admin. Each door reads the credentials off its own transport (gRPC metadata and auth context,
HTTP headers and the TLS peer certificate) and calls `authenticate`; the door binds the `Caller`
to the call (`identity.set_caller`), and nothing downstream ever looks at tokens. Which roles may
call which RPC, and the audit of control RPCs, belong to the gRPC door
(`front/grpc/interceptor.py`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from rollout_grpc.server.domain.identity import ANONYMOUS, Caller, Role

log = structlog.get_logger(__name__)

_SHA256_PREFIX = "sha256:"


def token_digest(token: str) -> bytes:
    """The SHA-256 digest a token is stored and compared as."""
    return hashlib.sha256(token.encode()).digest()


class TokenFileError(ValueError):
    """The token file is malformed (the message names the line)."""


def parse_tokens(text: str, source: str = "tokens") -> list[tuple[bytes, Caller]]:
    """`identity role token` lines (token in clear or `sha256:<hex>`); # comments, blank lines."""
    entries: list[tuple[bytes, Caller]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3:
            raise TokenFileError(f"{source}:{number}: expected `identity role token`")
        identity, role_name, secret = parts
        try:
            role = Role(role_name)
        except ValueError:
            roles = ", ".join(r.value for r in Role)
            raise TokenFileError(f"{source}:{number}: unknown role {role_name!r} (one of {roles})") from None
        if secret.startswith(_SHA256_PREFIX):
            try:
                digest = bytes.fromhex(secret.removeprefix(_SHA256_PREFIX))
            except ValueError:
                raise TokenFileError(f"{source}:{number}: sha256: needs 64 hex digits") from None
            if len(digest) != 32:
                raise TokenFileError(f"{source}:{number}: sha256: needs 64 hex digits")
        else:
            digest = token_digest(secret)
        entries.append((digest, Caller(identity=identity, role=role)))
    return entries


class TokenStore:
    """Hashed bearer tokens from a file, re-read when the file changes."""

    def __init__(self, path: str | os.PathLike[str], check_interval_s: float = 1.0) -> None:
        self._path = Path(path)
        self._check_interval_s = check_interval_s
        self._entries: list[tuple[bytes, Caller]] = []
        self._stamp: tuple[int, int, int] | None = None
        self._checked_at = 0.0
        self.reload(strict=True)

    def __len__(self) -> int:
        return len(self._entries)

    def _file_stamp(self) -> tuple[int, int, int]:
        st = self._path.stat()
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def reload(self, *, strict: bool = False) -> bool:
        """Re-read the file; on error keep the current tokens (raise instead when `strict`)."""
        try:
            stamp = self._file_stamp()
            entries = parse_tokens(self._path.read_text(), str(self._path))
        except (OSError, TokenFileError) as exc:
            if strict and isinstance(exc, OSError):  # at start: one line naming the file, no traceback
                raise TokenFileError(f"auth tokens file {self._path}: {exc.strerror or exc}") from None
            if strict:
                raise
            log.error("auth_tokens_reload_failed", path=str(self._path), error=str(exc), action="kept")
            return False
        self._entries, self._stamp = entries, stamp
        log.info("auth_tokens_loaded", path=str(self._path), tokens=len(entries))
        return True

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < self._check_interval_s:
            return
        self._checked_at = now
        try:
            stamp = self._file_stamp()
        except OSError:
            return
        if stamp != self._stamp:
            self.reload()

    def authenticate(self, token: str) -> Caller | None:
        """The caller holding `token`, or None. Every entry is compared (constant time)."""
        self._maybe_reload()
        presented = token_digest(token)
        found: Caller | None = None
        for digest, caller in self._entries:
            if hmac.compare_digest(presented, digest) and found is None:
                found = caller
        return found


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Who may call: a token store and/or a certificate-name role table."""

    tokens: TokenStore | None = None
    #: Certificate SAN or common name -> role, for mTLS clients (the name is the identity).
    cert_roles: Mapping[str, Role] | None = None
    #: Let unauthenticated callers use server reflection.
    reflection_open: bool = False

    @property
    def enabled(self) -> bool:
        """Authentication is on when any credential source is configured."""
        return self.tokens is not None or bool(self.cert_roles)


class Refused(Exception):
    """Authentication or authorisation failed: `code` is `UNAUTHENTICATED` or `PERMISSION_DENIED`."""

    def __init__(self, code: str, message: str, caller: Caller | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.caller = caller


@dataclass(frozen=True, slots=True)
class Presented:
    """The credentials one call presented, read off its transport by its door."""

    #: The `authorization` metadata / `Authorization` header, None when absent.
    authorization: str | None = None
    #: Names of a verified client certificate: DNS/URI SANs, then the subject common name.
    certificate_names: Sequence[str] = ()


@dataclass(frozen=True, slots=True)
class Wording:
    """How a door names the credentials in its refusals (`authorization` metadata on gRPC, the
    `Authorization` header and the client's api_key over HTTP)."""

    header: str = "authorization"
    missing: str = (
        "credentials required: send `authorization: Bearer <token>` metadata or a client certificate"
    )
    #: Ignore the header when no tokens file is configured (OpenAI clients always send an api_key).
    bearer_needs_tokens: bool = False


def authenticate(config: AuthConfig, presented: Presented, wording: Wording = Wording()) -> Caller:
    """The caller, or `Refused`: a bearer token when one is presented, else a mapped certificate."""
    if not config.enabled:
        return ANONYMOUS
    authorization = presented.authorization
    if authorization is not None and (config.tokens is not None or not wording.bearer_needs_tokens):
        scheme, _, rest = authorization.partition(" ")
        if scheme.lower() != "bearer" or not rest.strip():
            raise Refused("UNAUTHENTICATED", f"{wording.header}: expected `Bearer <token>`")
        caller = config.tokens.authenticate(rest.strip()) if config.tokens else None
        if caller is None:
            raise Refused("UNAUTHENTICATED", "invalid bearer token")
        return caller
    names = list(presented.certificate_names) if config.cert_roles else []
    roles = config.cert_roles or {}
    for name in names:
        role = roles.get(name)
        if role is not None:
            return Caller(identity=name, role=role)
    if names:
        raise Refused("PERMISSION_DENIED", "the client certificate is not mapped to a role")
    raise Refused("UNAUTHENTICATED", wording.missing)


def authorize(caller: Caller, what: str, roles: frozenset[Role]) -> None:
    """`Refused` (PERMISSION_DENIED, naming the roles that may) unless `caller` may call `what`."""
    if caller.role in roles:
        return
    allowed = " or ".join(sorted(r.value for r in roles)) or "no role"
    raise Refused(
        "PERMISSION_DENIED",
        f"{what} needs the {allowed} role; caller {caller.identity!r} has {caller.role.value}",
        caller,
    )
