"""Who is calling: a transport-neutral caller identity, set per call by the auth interceptor.

The interceptor (`auth.py`) authenticates the call and stores a `Caller` in a context variable for
the duration of the RPC; the domain (`inflight.py`, `control.py`) reads it to decide ownership and
scope. Nothing here knows gRPC, tokens or certificates, and the servicer never checks credentials.

Without authentication every call runs as `ANONYMOUS`, which has the admin role: a replica with
auth off (the loopback default) behaves as a single-tenant service.
"""

from __future__ import annotations

import contextvars
import enum
from dataclasses import dataclass


class Role(enum.StrEnum):
    """What a caller may do (see docs/security.md for the method table)."""

    #: Generate, Render, GetServerInfo (engine URLs redacted), Abort of its own generations.
    TRAINER = "trainer"
    #: Everything: Pause, Resume, Abort(all) and any caller's generations, engine details.
    ADMIN = "admin"
    #: Another replica of the fleet: only `ReplicaService.AbortLocal`.
    PEER = "peer"


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller: a stable identity (owner of its generations) and a role."""

    identity: str
    role: Role

    @property
    def is_admin(self) -> bool:
        """Admins reach every caller's generations and see engine details."""
        return self.role is Role.ADMIN


#: The caller of a replica whose authentication is off.
ANONYMOUS = Caller(identity="anonymous", role=Role.ADMIN)

_current: contextvars.ContextVar[Caller] = contextvars.ContextVar("rollout_caller", default=ANONYMOUS)


def current_caller() -> Caller:
    """The caller of the RPC being served (ANONYMOUS outside an authenticated call)."""
    return _current.get()


def set_caller(caller: Caller) -> contextvars.Token[Caller]:
    """Bind `caller` to the current call (the interceptor resets it with the returned token)."""
    return _current.set(caller)


def reset_caller(token: contextvars.Token[Caller]) -> None:
    """Undo `set_caller`."""
    _current.reset(token)
