"""Who is calling the OpenAI front door: the gRPC port's credentials, presented over HTTP.

The front door accepts exactly what the gRPC port accepts (`auth.AuthConfig`), so one tokens file
(or Secret) and one mTLS role table govern both ports:

1. `Authorization: Bearer <token>` (what the `openai` client sends as its `api_key`), checked
   against the same `auth.TokenStore`: hashed, constant-time, reloaded when the file changes;
2. the verified client certificate of an mTLS connection (`--tls-client-ca`), its SANs and common
   name looked up in the `--mtls-role` table. Without a tokens file the `Authorization` header is
   ignored: OpenAI clients always send one (their `api_key`), so a certificate-only deployment
   lets them pass any placeholder key.

Trainers and admins may use the front door (it generates, like Generate); peers may not. Without
credentials, or with a bad token: 401 with an OpenAI error envelope and `WWW-Authenticate: Bearer`;
a role that may not: 403. With authentication off every request runs as the anonymous admin, as
the gRPC port does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout_grpc.server.domain.identity import ANONYMOUS, Caller, Role
from rollout_grpc.server.front.openai.protocol import OpenAIError
from rollout_grpc.server.security.auth import AuthConfig

#: Roles that may call the front door (the roles of Generate).
FRONT_DOOR_ROLES = frozenset({Role.TRAINER, Role.ADMIN})


def _unauthenticated(message: str) -> OpenAIError:
    err = OpenAIError(401, message, etype="invalid_request_error")
    err.headers["WWW-Authenticate"] = 'Bearer realm="rollout-grpc"'
    return err


def certificate_names(peercert: Mapping[str, Any] | None) -> list[str]:
    """DNS/URI SANs, then the subject common name, of a verified peer certificate (the dict of
    `ssl.SSLObject.getpeercert()`), in the order the gRPC port looks them up."""
    if not peercert:
        return []
    names = [str(value) for kind, value in peercert.get("subjectAltName", ()) if kind in ("DNS", "URI")]
    for rdn in peercert.get("subject", ()):
        names += [str(value) for key, value in rdn if key == "commonName"]
    return names


def _bearer(config: AuthConfig, authorization: str) -> Caller:
    scheme, _, rest = authorization.partition(" ")
    if scheme.lower() != "bearer" or not rest.strip():
        raise _unauthenticated("Authorization: expected `Bearer <token>`")
    caller = config.tokens.authenticate(rest.strip()) if config.tokens is not None else None
    if caller is None:
        raise _unauthenticated("invalid bearer token")
    return caller


def _certificate(config: AuthConfig, names: list[str]) -> Caller | None:
    roles = config.cert_roles or {}
    for name in names:
        role = roles.get(name)
        if role is not None:
            return Caller(identity=name, role=role)
    return None


def authenticate(config: AuthConfig, authorization: str | None, peercert: Mapping[str, Any] | None) -> Caller:
    """The caller of one HTTP request, or an OpenAIError (401 no/bad credentials, 403 wrong role)."""
    if not config.enabled:
        return ANONYMOUS
    caller: Caller | None
    if authorization is not None and config.tokens is not None:
        caller = _bearer(config, authorization)
    else:
        names = certificate_names(peercert) if config.cert_roles else []
        caller = _certificate(config, names)
        if caller is None and names:
            raise OpenAIError(
                403, "the client certificate is not mapped to a role", etype="permission_denied"
            )
        if caller is None:
            raise _unauthenticated(
                "credentials required: send `Authorization: Bearer <token>` (the client's api_key) "
                "or a client certificate"
            )
    if caller.role not in FRONT_DOOR_ROLES:
        raise OpenAIError(
            403,
            f"the front door needs the trainer or admin role; caller {caller.identity!r} has "
            f"{caller.role.value}",
            etype="permission_denied",
        )
    return caller
