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

from rollout_grpc.server.domain.identity import Caller, Role
from rollout_grpc.server.front.openai.protocol import OpenAIError
from rollout_grpc.server.security.auth import AuthConfig, Presented, Refused, Wording
from rollout_grpc.server.security.auth import authenticate as authenticate_presented

#: Roles that may call the front door (the roles of Generate).
FRONT_DOOR_ROLES = frozenset({Role.TRAINER, Role.ADMIN})

_WORDING = Wording(
    header="Authorization",
    missing=(
        "credentials required: send `Authorization: Bearer <token>` (the client's api_key) "
        "or a client certificate"
    ),
    bearer_needs_tokens=True,
)


def certificate_names(peercert: Mapping[str, Any] | None) -> list[str]:
    """DNS/URI SANs, then the subject common name, of a verified peer certificate (the dict of
    `ssl.SSLObject.getpeercert()`), in the order the gRPC port looks them up."""
    if not peercert:
        return []
    names = [str(value) for kind, value in peercert.get("subjectAltName", ()) if kind in ("DNS", "URI")]
    for rdn in peercert.get("subject", ()):
        names += [str(value) for key, value in rdn if key == "commonName"]
    return names


def authenticate(config: AuthConfig, authorization: str | None, peercert: Mapping[str, Any] | None) -> Caller:
    """The caller of one HTTP request, or an OpenAIError (401 no/bad credentials, 403 wrong role)."""
    presented = Presented(authorization, certificate_names(peercert) if config.cert_roles else ())
    try:
        caller = authenticate_presented(config, presented, _WORDING)
    except Refused as refused:
        if refused.code == "PERMISSION_DENIED":
            raise OpenAIError(403, refused.message, etype="permission_denied") from None
        err = OpenAIError(401, refused.message, etype="invalid_request_error")
        err.headers["WWW-Authenticate"] = 'Bearer realm="rollout-grpc"'
        raise err from None
    if caller.role not in FRONT_DOOR_ROLES:
        raise OpenAIError(
            403,
            f"the front door needs the trainer or admin role; caller {caller.identity!r} has "
            f"{caller.role.value}",
            etype="permission_denied",
        )
    return caller
