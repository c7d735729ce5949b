"""What agent sessions need of a state store: each session's recorded turns, owned by one caller.

The OpenAI front door records every turn (rollout/sessions.py encodes it; the store holds bytes,
never a `Turn`), and `GetTrajectory` reads it back, on whichever replica or worker reaches the same
store: `--state-store redis://...` for a fleet, the supervisor's store for `serve --workers N`.

Semantics every implementation keeps (tests/unit/test_trajectory_store.py runs them all):

* a session id is claimed by its first recorded turn for that turn's owner (`append_turn`); a turn
  of another owner on it is refused (`REFUSED_OWNER`), also after the session was collected
  (`remove_session`, only of the turns the collector read: its id stays its owner's, for `ttl_s`
  and among the owner's last `max_sessions_per_owner` collected ids);
* a turn is appended only when the session holds `expected` turns (`REFUSED_CONFLICT` otherwise):
  two turns of one session run at once on two replicas cannot interleave;
* per owner, at most `max_sessions_per_owner` live sessions and `max_bytes_per_owner` bytes of
  turns: a turn beyond either is refused (the refusal names the cap), nothing is evicted;
* a session expires `ttl_s` after its last turn (its bytes are given back to its owner).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

#: `append_turn` answers: "" is recorded; the others name why not.
RECORDED = ""
REFUSED_OWNER = "owner"
REFUSED_CONFLICT = "conflict"
REFUSED_SESSIONS = "max_sessions_per_owner"
REFUSED_BYTES = "max_session_bytes_per_owner"


@dataclass(frozen=True, slots=True)
class TrajectoryCaps:
    """The bounds of the recorded sessions (`FrontDoorConfig.max_sessions`, ...)."""

    #: Live (recorded, not collected, not expired) sessions per caller identity.
    max_sessions_per_owner: int = 10_000
    #: Bytes of encoded turns per caller identity.
    max_bytes_per_owner: int = 1 << 30
    #: Seconds a session lives after its last turn (and a collected id stays its owner's).
    ttl_s: float = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class StoredSession:
    """A session as the store keeps it: its owner, its encoded turns in order, its roles blob
    (empty turns: collected, the id still its owner's)."""

    owner: str
    turns: list[bytes]
    roles: bytes


class TrajectoryStore(Protocol):
    """Recorded agent sessions, shared by whoever reaches the same store."""

    #: How errors name the store ("redis://host:6379/0", "embedded").
    name: str
    trajectory_caps: TrajectoryCaps

    async def read_session(self, session_id: str) -> StoredSession | None:
        """The session (None: no one holds the id)."""
        ...

    async def append_turn(self, owner: str, session_id: str, expected: int, turn: bytes, roles: bytes) -> str:
        """Append `turn` (and set the session's roles) when `owner` may and the session holds
        `expected` turns: `RECORDED`, or the `REFUSED_*` reason."""
        ...

    async def remove_session(self, owner: str, session_id: str, turns: int) -> bool:
        """Forget `owner`'s session (collected) if it holds `turns` turns (False: it holds more
        now, nothing changed); the id stays `owner`'s. Another's is left alone."""
        ...

    async def usage(self, owner: str) -> tuple[int, int]:
        """(live sessions, bytes) `owner` holds now."""
        ...

    async def close(self) -> None:
        """Release connections (the sessions stay in the store)."""
        ...


@dataclass(slots=True)
class _Session:
    owner: str
    turns: list[bytes] = field(default_factory=list)
    roles: bytes = b""
    bytes: int = 0
    expires: float = 0.0


@dataclass(slots=True)
class _Owner:
    live: set[str] = field(default_factory=set)
    bytes: int = 0
    #: Collected ids, oldest first.
    retired: OrderedDict[str, None] = field(default_factory=OrderedDict)


class MemoryTrajectories:
    """`TrajectoryStore` in this process's memory (one process, or the supervisor's of
    `serve --workers N`, reached through `SocketTrajectories`)."""

    def __init__(
        self, caps: TrajectoryCaps | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name = "embedded"
        self.trajectory_caps = caps or TrajectoryCaps()
        self._clock = clock
        self._sessions: dict[str, _Session] = {}
        #: Session id -> (owner, expiry): live ids and collected ones.
        self._claims: dict[str, tuple[str, float]] = {}
        self._owners: dict[str, _Owner] = {}
        self._next_sweep = 0.0

    def _sweep(self) -> None:
        """Expired sessions give their bytes back; expired claims free their ids (at most once a
        second: a scan of every session)."""
        now = self._clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + 1.0
        for sid in [s for s, sess in self._sessions.items() if sess.expires <= now]:
            self._drop(sid)
        for sid in [s for s, (_, exp) in self._claims.items() if exp <= now]:
            owner, _ = self._claims.pop(sid)
            holder = self._owners.get(owner)
            if holder is not None:
                holder.retired.pop(sid, None)
                self._forget_owner(owner)

    def _drop(self, session_id: str) -> _Session | None:
        sess = self._sessions.pop(session_id, None)
        if sess is not None:
            holder = self._owners[sess.owner]
            holder.live.discard(session_id)
            holder.bytes -= sess.bytes
        return sess

    def _forget_owner(self, owner: str) -> None:
        holder = self._owners.get(owner)
        if holder is not None and not holder.live and not holder.retired:
            del self._owners[owner]

    def _owner_of(self, session_id: str) -> str:
        owner, expiry = self._claims.get(session_id, ("", 0.0))
        if owner and expiry <= self._clock():
            return ""
        return owner

    async def read_session(self, session_id: str) -> StoredSession | None:
        self._sweep()
        owner = self._owner_of(session_id)
        if not owner:
            return None
        sess = self._sessions.get(session_id)
        if sess is None or sess.expires <= self._clock():
            return StoredSession(owner, [], b"")
        return StoredSession(owner, list(sess.turns), sess.roles)

    async def append_turn(self, owner: str, session_id: str, expected: int, turn: bytes, roles: bytes) -> str:
        self._sweep()
        caps = self.trajectory_caps
        holder_of_id = self._owner_of(session_id)
        if holder_of_id and holder_of_id != owner:
            return REFUSED_OWNER
        sess = self._sessions.get(session_id)
        if sess is not None and sess.expires <= self._clock():
            self._drop(session_id)
            sess = None
        if (len(sess.turns) if sess is not None else 0) != expected:
            return REFUSED_CONFLICT
        holder = self._owners.setdefault(owner, _Owner())
        if sess is None and len(holder.live) >= caps.max_sessions_per_owner:
            return REFUSED_SESSIONS
        size = len(turn) + len(roles) - (len(sess.roles) if sess is not None else 0)
        if holder.bytes + size > caps.max_bytes_per_owner:
            return REFUSED_BYTES
        if sess is None:
            sess = self._sessions[session_id] = _Session(owner)
            holder.live.add(session_id)
            holder.retired.pop(session_id, None)
        sess.turns.append(turn)
        sess.roles = roles
        sess.bytes += size
        holder.bytes += size
        sess.expires = self._clock() + caps.ttl_s
        self._claims[session_id] = (owner, sess.expires)
        return RECORDED

    async def remove_session(self, owner: str, session_id: str, turns: int) -> bool:
        self._sweep()
        if self._owner_of(session_id) != owner:
            return True
        sess = self._sessions.get(session_id)
        if sess is not None and len(sess.turns) != turns:
            return False
        self._drop(session_id)
        holder = self._owners.setdefault(owner, _Owner())
        holder.retired[session_id] = None
        holder.retired.move_to_end(session_id)
        self._claims[session_id] = (owner, self._clock() + self.trajectory_caps.ttl_s)
        while len(holder.retired) > self.trajectory_caps.max_sessions_per_owner:
            oldest, _ = holder.retired.popitem(last=False)
            if oldest not in holder.live:
                self._claims.pop(oldest, None)
        return True

    async def usage(self, owner: str) -> tuple[int, int]:
        self._sweep()
        now = self._clock()
        for sid in [s for s in self._owners.get(owner, _Owner()).live if self._sessions[s].expires <= now]:
            self._drop(sid)
        holder = self._owners.get(owner)
        return (len(holder.live), holder.bytes) if holder is not None else (0, 0)

    async def close(self) -> None:
        return None
