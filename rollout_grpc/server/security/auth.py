"""Authentication, roles and the control-RPC audit log, as one gRPC server interceptor.

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
admin and only the audit applies. The interceptor wraps the method handler (the authentication
context exists only on the servicer context), binds the `Caller` to the call
(`identity.set_caller`) before running the inner handlers, and logs one `audit` line per control
RPC with the caller, its target and the outcome, refusals included. Interceptors listed after
this one (e.g. `limits.LimitsInterceptor`) and the servicer see the caller through
`identity.current_caller()`; nothing downstream ever looks at tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.domain.identity import (
    ANONYMOUS,
    Caller,
    Role,
    current_caller,
    reset_caller,
    set_caller,
)

log = structlog.get_logger(__name__)
audit_log = structlog.get_logger("rollout_grpc.audit")

_ROLLOUT = "/rollout.v1.RolloutService/"
_REPLICA = "/rollout.v1.ReplicaService/"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")

#: Which roles may call which method. A method of these services missing here is refused.
METHOD_ROLES: dict[str, frozenset[Role]] = {
    _ROLLOUT + "Generate": frozenset({Role.TRAINER, Role.ADMIN}),
    _ROLLOUT + "Render": frozenset({Role.TRAINER, Role.ADMIN}),
    _ROLLOUT + "GetServerInfo": frozenset({Role.TRAINER, Role.ADMIN}),
    # Front-door sessions are collected by the trainer that drives the agent harness.
    _ROLLOUT + "GetTrajectory": frozenset({Role.TRAINER, Role.ADMIN}),
    # Abort(all) and other callers' generations are admin-only; control.py scopes the rest.
    _ROLLOUT + "Abort": frozenset({Role.TRAINER, Role.ADMIN}),
    _ROLLOUT + "Pause": frozenset({Role.ADMIN}),
    _ROLLOUT + "Resume": frozenset({Role.ADMIN}),
    _REPLICA + "AbortLocal": frozenset({Role.PEER, Role.ADMIN}),
}

#: The control RPCs: audited, and rate-limited per caller (`limits.py`).
CONTROL_METHODS = frozenset(
    {_ROLLOUT + "Abort", _ROLLOUT + "Pause", _ROLLOUT + "Resume", _REPLICA + "AbortLocal"}
)

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


def _auth_values(auth_context: Mapping[str, Iterable[bytes]], key: str) -> list[str]:
    return [v.decode(errors="replace") for v in auth_context.get(key, ())]


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


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, caller: Caller | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.caller = caller


def _describe_target(method: str, request: object) -> dict[str, object]:
    """What a control RPC acts on, for the audit line (never the whole request)."""
    if isinstance(request, pb.AbortRequest | pb.AbortLocalRequest):
        target = request.WhichOneof("target")
        described: dict[str, object] = {"target": target}
        if target == "request_ids":
            ids = list(request.request_ids.ids)
            described["request_ids"] = ids[:8]
            described["request_id_count"] = len(ids)
        elif target is not None:
            described[target] = getattr(request, target)
        if isinstance(request, pb.AbortLocalRequest):
            described["owner"] = request.owner
        return described
    if isinstance(request, pb.PauseRequest):
        return {
            "mode": pb.PauseMode.Name(request.mode) if request.mode in pb.PauseMode.values() else request.mode
        }
    if isinstance(request, pb.ResumeRequest):
        return {"weight_version": request.weight_version if request.HasField("weight_version") else None}
    return {}


def _describe_result(response: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for field in ("aborted", "paused_engines", "resumed_engines", "engine_errors"):
        if hasattr(response, field):
            value = getattr(response, field)
            out[field] = value if isinstance(value, int) else len(value)
    return out


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates, authorises by role, binds the caller to the call, audits control RPCs."""

    def __init__(self, config: AuthConfig) -> None:
        self._config = config

    def _open(self, method: str) -> bool:
        if method.startswith(HEALTH_PREFIX):
            return True
        if method.startswith(REFLECTION_PREFIXES):
            return self._config.reflection_open
        return False

    def _authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> Caller:
        token = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                scheme, _, rest = str(value).partition(" ")
                if scheme.lower() != "bearer" or not rest.strip():
                    raise _Refused(
                        grpc.StatusCode.UNAUTHENTICATED, "authorization: expected `Bearer <token>`"
                    )
                token = rest.strip()
                break
        if token is not None:
            caller = self._config.tokens.authenticate(token) if self._config.tokens else None
            if caller is None:
                raise _Refused(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
            return caller
        if self._config.cert_roles:
            auth = context.auth_context() or {}
            names = _auth_values(auth, "x509_subject_alternative_name") + _auth_values(
                auth, "x509_common_name"
            )
            for name in names:
                role = self._config.cert_roles.get(name)
                if role is not None:
                    return Caller(identity=name, role=role)
            if names:
                raise _Refused(
                    grpc.StatusCode.PERMISSION_DENIED, "the client certificate is not mapped to a role"
                )
        raise _Refused(
            grpc.StatusCode.UNAUTHENTICATED,
            "credentials required: send `authorization: Bearer <token>` metadata or a client certificate",
        )

    def _authorize(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> Caller:
        caller = self._authenticate(context)
        if method.startswith(REFLECTION_PREFIXES):
            return caller
        roles = METHOD_ROLES.get(method, frozenset())
        if caller.role not in roles:
            allowed = " or ".join(sorted(r.value for r in roles)) or "no role"
            raise _Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method.rsplit('/', 1)[-1]} needs the {allowed} role; "
                f"caller {caller.identity!r} has {caller.role.value}",
                caller,
            )
        return caller

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or self._open(method):
            return handler
        if not self._config.enabled and method not in CONTROL_METHODS:
            return handler
        return self._wrap(handler, method)

    def _wrap(self, handler: grpc.RpcMethodHandler[Any, Any], method: str) -> grpc.RpcMethodHandler[Any, Any]:
        """The same handler behind `_admit` (and the audit line for control methods)."""

        async def admit(context: grpc.aio.ServicerContext[Any, Any], request: object) -> Caller:
            return await self._admit(method, context, request)

        if handler.unary_unary is not None:
            return _guard_unary_unary(handler, method, admit)
        if handler.unary_stream is not None:
            return _guard_unary_stream(handler, admit)
        if handler.stream_stream is not None:
            return _guard_stream_stream(handler, admit)
        return handler

    async def _admit(
        self, method: str, context: grpc.aio.ServicerContext[Any, Any], request: object
    ) -> Caller:
        """The caller allowed to call `method`, or abort the call (with an audit line for control)."""
        if not self._config.enabled:
            return ANONYMOUS
        try:
            return self._authorize(method, context)
        except _Refused as refused:
            if method in CONTROL_METHODS:
                who = refused.caller
                audit_log.warning(
                    "audit",
                    method=method,
                    caller=who.identity if who else None,
                    role=who.role.value if who else None,
                    peer=context.peer(),
                    outcome=refused.code.name,
                    **_describe_target(method, request),
                )
            await context.abort(refused.code, refused.message)
            raise  # unreachable: abort raises


#: Admits one call: the caller it runs as, or the call is aborted.
_Admit = Callable[[grpc.aio.ServicerContext[Any, Any], object], Awaitable[Caller]]


def _guard_unary_unary(
    handler: grpc.RpcMethodHandler[Any, Any], method: str, admit: _Admit
) -> grpc.RpcMethodHandler[Any, Any]:
    """A unary call run as its admitted caller; control methods also leave an audit line."""
    inner: Any = handler.unary_unary
    audited = method in CONTROL_METHODS

    async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        caller = await admit(context, request)
        token = set_caller(caller)
        try:
            if not audited:
                return await inner(request, context)
            return await _audited(method, request, context, inner)
        finally:
            with contextlib.suppress(ValueError):
                reset_caller(token)

    return grpc.unary_unary_rpc_method_handler(
        unary_unary, handler.request_deserializer, handler.response_serializer
    )


def _guard_unary_stream(
    handler: grpc.RpcMethodHandler[Any, Any], admit: _Admit
) -> grpc.RpcMethodHandler[Any, Any]:
    """A server-streaming call run as its admitted caller."""
    inner: Any = handler.unary_stream

    async def unary_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        caller = await admit(context, request)
        token = set_caller(caller)
        try:
            async for message in inner(request, context):
                yield message
        finally:
            with contextlib.suppress(ValueError):
                reset_caller(token)

    return grpc.unary_stream_rpc_method_handler(
        unary_stream, handler.request_deserializer, handler.response_serializer
    )


def _guard_stream_stream(
    handler: grpc.RpcMethodHandler[Any, Any], admit: _Admit
) -> grpc.RpcMethodHandler[Any, Any]:
    """A bidirectional call run as its admitted caller (admitted before its first request)."""
    inner: Any = handler.stream_stream

    async def stream_stream(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        caller = await admit(context, None)
        token = set_caller(caller)
        try:
            async for message in inner(requests, context):
                yield message
        finally:
            with contextlib.suppress(ValueError):
                reset_caller(token)

    return grpc.stream_stream_rpc_method_handler(
        stream_stream, handler.request_deserializer, handler.response_serializer
    )


async def _audited(
    method: str,
    request: object,
    context: grpc.aio.ServicerContext[Any, Any],
    behavior: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]],
) -> Any:
    """Run a control RPC and log one audit line with the caller, target and outcome."""
    caller = current_caller()
    fields: dict[str, object] = {
        "method": method,
        "caller": caller.identity,
        "role": caller.role.value,
        "peer": context.peer(),
        **_describe_target(method, request),
    }
    try:
        response = await behavior(request, context)
    except BaseException as exc:
        code = context.code() if isinstance(exc, grpc.aio.AbortError) else None
        outcome = code.name if isinstance(code, grpc.StatusCode) else type(exc).__name__
        audit_log.warning("audit", outcome=outcome, **fields)
        raise
    audit_log.info("audit", outcome="OK", **fields, **_describe_result(response))
    return response
