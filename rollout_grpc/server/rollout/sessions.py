"""Agent sessions in the state store: any replica or worker continues a session or returns it.

The OpenAI front door records every turn here and `GetTrajectory` reads the session back, both
through the facade. The turns live in the store the wiring chose (server/state/trajectories.py:
this process, the supervisor of `serve --workers N`, or the Redis every replica shares), encoded
by this module: the store holds bytes and never imports the domain, the domain never a store.

Ownership is the store's claim on the session id (the caller whose turn first recorded in it),
checked when a request opens the session and again, atomically, when its turn is recorded. A turn
is recorded whole or not at all, and only on the turns it was generated after: a turn of the same
session recorded meanwhile elsewhere (two replicas, one session, at once) refuses the later one
(FAILED_PRECONDITION), rather than interleaving two conversations. Within this process a
session's turns still run one at a time (a lock per session id), and `GetTrajectory` here waits
for a running turn of this process, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from rollout_grpc.server.domain.errors import FailedPrecondition, PermissionDenied, ResourceExhausted
from rollout_grpc.server.domain.identity import Caller
from rollout_grpc.server.domain.trajectory import Session, Turn
from rollout_grpc.server.rollout.pickled import RestrictedPickle
from rollout_grpc.server.state.trajectories import (
    RECORDED,
    REFUSED_BYTES,
    REFUSED_CONFLICT,
    REFUSED_OWNER,
    REFUSED_SESSIONS,
    TrajectoryStore,
)

#: What a recorded turn's pickle may name: the domain's dataclasses and enums, numpy arrays
#: (routed experts) and plain containers.
_TURNS = RestrictedPickle(Turn, "a recorded turn", ("rollout_grpc.server.domain.",))
encode_turn = _TURNS.encode
decode_turn = _TURNS.decode

#: Seconds a caller at a session cap is told to wait (the cap frees when it collects a session).
_CAP_RETRY_S = 5.0


def _encode_roles(roles: list[str]) -> bytes:
    return "\n".join(roles).encode()


def _decode_roles(blob: bytes) -> list[str]:
    return blob.decode().split("\n") if blob else []


def _taken(session_id: str) -> PermissionDenied:
    return PermissionDenied(f"session {session_id!r} belongs to another caller; use a session id of your own")


class Sessions:
    """The recorded agent sessions of the fleet, in `store`."""

    def __init__(self, store: TrajectoryStore) -> None:
        self.store = store
        #: Session id -> (its lock in this process, requests holding or waiting for it).
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def _local(self, session_id: str) -> AsyncIterator[None]:
        """One request of this process at a time on `session_id` (its turns stay in order)."""
        lock, users = self._locks.get(session_id, (asyncio.Lock(), 0))
        self._locks[session_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[session_id]
            if users <= 1:
                del self._locks[session_id]
            else:
                self._locks[session_id] = (lock, users - 1)

    async def _load(self, session_id: str) -> tuple[str, Session] | None:
        stored = await self.store.read_session(session_id)
        if stored is None:
            return None
        session = Session(
            session_id,
            stored.owner,
            turns=[decode_turn(t) for t in stored.turns],
            roles=_decode_roles(stored.roles),
        )
        return stored.owner, session

    @contextlib.asynccontextmanager
    async def opened(self, session_id: str, owner: str) -> AsyncIterator[Session]:
        """`owner`'s session for one request, as recorded now (new when nothing is); nothing is
        stored until a turn generated (`record`). PermissionDenied when another caller owns the
        id; ResourceExhausted naming the cap when a new session would pass `owner`'s."""
        async with self._local(session_id):
            loaded = await self._load(session_id)
            if loaded is not None and loaded[0] != owner:
                raise _taken(session_id)
            session = loaded[1] if loaded is not None else Session(session_id, owner)
            if not session.turns:
                count, size = await self.store.usage(owner)
                caps = self.store.trajectory_caps
                if count >= caps.max_sessions_per_owner:
                    raise self._cap(REFUSED_SESSIONS, caps.max_sessions_per_owner)
                if size >= caps.max_bytes_per_owner:
                    raise self._cap(REFUSED_BYTES, caps.max_bytes_per_owner)
            yield session

    def _cap(self, reason: str, limit: int) -> ResourceExhausted:
        what = "sessions" if reason == REFUSED_SESSIONS else "bytes of recorded turns"
        return ResourceExhausted(
            f"{reason}: this caller holds its {limit} {what} in the state store {self.store.name}; "
            "collect sessions (GetTrajectory with remove=true) or wait for them to expire",
            _CAP_RETRY_S,
        )

    async def record(self, session: Session, turn: Turn, roles: list[str]) -> None:
        """Record a generated turn after the session's turns (the store refuses it when another
        caller owns the id, a turn was recorded meanwhile elsewhere, or a cap is reached)."""
        answer = await self.store.append_turn(
            session.owner, session.session_id, len(session.turns), encode_turn(turn), _encode_roles(roles)
        )
        if answer == REFUSED_OWNER:
            raise _taken(session.session_id)
        if answer == REFUSED_CONFLICT:
            raise FailedPrecondition(
                f"session {session.session_id!r}: another turn of it was recorded meanwhile (on "
                "another replica or worker); this turn was not recorded: send it again"
            )
        caps = self.store.trajectory_caps
        if answer == REFUSED_SESSIONS:
            raise self._cap(answer, caps.max_sessions_per_owner)
        if answer == REFUSED_BYTES:
            raise self._cap(answer, caps.max_bytes_per_owner)
        if answer != RECORDED:
            raise FailedPrecondition(f"session {session.session_id!r}: the store refused the turn: {answer}")
        session.turns.append(turn)
        session.roles = roles

    async def get(self, session_id: str, reader: Caller, *, remove: bool = False) -> Session | None:
        """The recorded session if `reader` may read it (its owner or an admin; another caller's
        session reads as missing), after a running turn of this process; `remove` collects it."""
        async with self._local(session_id):
            loaded = await self._load(session_id)
            if loaded is None:
                return None
            owner, session = loaded
            if not session.turns or not (reader.is_admin or reader.identity == owner):
                return None
            if remove and not await self.store.remove_session(owner, session_id, len(session.turns)):
                raise FailedPrecondition(
                    f"session {session_id!r}: a turn was recorded while it was collected (on another "
                    "replica or worker); nothing was removed: collect it again"
                )
            return session
