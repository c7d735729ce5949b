"""The generations this replica has in flight, so that Abort can find and end them.

Every generation is owned by the identity of the caller that started it (`identity.py`) and is
known by (owner, request id): two callers may use the same request id, and neither learns of the
other's (a Generate with another caller's id in flight runs like any other; only the caller's own
id in flight is refused). Lookups for Abort take an `owner` and return only that caller's
generations (None = any owner, for admins), and a caller may hold at most `per_owner_limit`
generations (running or queued), so that one trainer cannot fill the whole admission queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rollout_grpc.server.domain.errors import InvalidArgument, ResourceExhausted
from rollout_grpc.server.domain.identity import ANONYMOUS, current_caller
from rollout_grpc.server.engines.pool import EngineHandle


class AbortedWhileQueued(Exception):
    """Set on a generation's admission waiter when it is aborted before it got a slot."""


@dataclass(slots=True, eq=False)
class InFlight:
    """One generation: where it runs, and whether someone asked to abort it."""

    request_id: str
    session_id: str = ""
    group_index: int = 0
    #: Identity of the caller that started the generation; only it (or an admin) may abort it.
    owner: str = ANONYMOUS.identity
    engine: EngineHandle | None = None
    #: Engine-side ids used so far (one per engine call); abort sends all of them.
    engine_request_ids: list[str] = field(default_factory=list)
    abort_requested: bool = False
    #: Called once when an abort is requested (the generation bounds its wait for the engine).
    on_abort: Callable[[], None] | None = None
    #: True once the current engine call has produced its first chunk (the engine knows the id).
    engine_started: bool = False
    #: The admission future while the generation waits for a slot.
    waiter: asyncio.Future[None] | None = None

    def request_abort(self, reason: str) -> None:
        """Mark for abort; a generation still queued for admission leaves the queue at once."""
        if not self.abort_requested:
            self.abort_requested = True
            if self.on_abort is not None:
                self.on_abort()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(AbortedWhileQueued())


class InFlightRegistry:
    """(owner, request id) -> in-flight generation, for this replica."""

    def __init__(self, per_owner_limit: int | None = None, retry_after_s: float = 1.0) -> None:
        self._by_id: dict[tuple[str, str], InFlight] = {}
        self._per_owner: dict[str, int] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        #: Most generations one authenticated caller may have here (None: no cap). The anonymous
        #: caller of an unauthenticated replica is exempt: every caller shares that identity.
        self.per_owner_limit = per_owner_limit
        self.retry_after_s = retry_after_s

    def __len__(self) -> int:
        return len(self._by_id)

    def register(
        self, request_id: str, session_id: str, group_index: int, owner: str | None = None
    ) -> InFlight:
        """Track a new generation of `owner` (default: the current caller).

        A request id of the same owner already in flight is a caller error (another owner's is
        none of its business); a caller over its fair share is refused with RESOURCE_EXHAUSTED
        naming the limit.
        """
        if owner is None:
            owner = current_caller().identity
        key = (owner, request_id)
        if key in self._by_id:
            raise InvalidArgument(
                "request_id",
                f"you already have a generation with request_id {request_id!r} in flight on this "
                "replica; use a new id for each Generate",
            )
        held = self._per_owner.get(owner, 0)
        limit = self.per_owner_limit
        if limit is not None and owner != ANONYMOUS.identity and held >= limit:
            raise ResourceExhausted(
                f"caller {owner!r} already has {held} generations in flight or queued on this replica "
                f"(limit max_in_flight_per_caller={limit}); retry later",
                self.retry_after_s,
            )
        entry = InFlight(request_id=request_id, session_id=session_id, group_index=group_index, owner=owner)
        self._by_id[key] = entry
        self._per_owner[owner] = held + 1
        self._idle.clear()
        return entry

    def unregister(self, entry: InFlight) -> None:
        """Forget a finished generation."""
        key = (entry.owner, entry.request_id)
        if self._by_id.get(key) is entry:
            del self._by_id[key]
            left = self._per_owner.get(entry.owner, 1) - 1
            if left > 0:
                self._per_owner[entry.owner] = left
            else:
                self._per_owner.pop(entry.owner, None)
            if not self._by_id:
                self._idle.set()

    def holds(self, entry: InFlight) -> bool:
        """Whether `entry` is still in flight here."""
        return self._by_id.get((entry.owner, entry.request_id)) is entry

    def owned_by(self, owner: str) -> int:
        """How many generations `owner` has here (running or queued)."""
        return self._per_owner.get(owner, 0)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is in flight; False when `timeout` seconds passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def all(self) -> list[InFlight]:
        """Every in-flight generation."""
        return list(self._by_id.values())

    def matching(
        self, *, session_id: str | None = None, group_index: int | None = None, owner: str | None = None
    ) -> list[InFlight]:
        """Generations of a session or of a prompt group, of `owner` only (None: any owner)."""
        return [
            e
            for e in self._by_id.values()
            if (owner is None or e.owner == owner)
            and (
                (session_id is not None and e.session_id == session_id)
                or (group_index is not None and e.group_index == group_index)
            )
        ]

    def select(
        self, request_ids: Iterable[str], owner: str | None = None
    ) -> tuple[list[InFlight], list[str]]:
        """Split ids into in-flight generations of `owner` (None: any) and unknown ids.

        Another caller's generation counts as unknown: its existence is not disclosed. For an admin
        (`owner` None) an id names every owner's generation of that id.
        """
        wanted = list(dict.fromkeys(request_ids))
        by_id: dict[str, list[InFlight]] = {}
        if owner is None:
            targets = set(wanted)
            for (_, rid), entry in self._by_id.items():
                if rid in targets:
                    by_id.setdefault(rid, []).append(entry)
        else:
            for rid in wanted:
                own = self._by_id.get((owner, rid))
                if own is not None:
                    by_id[rid] = [own]
        found = [entry for rid in wanted for entry in by_id.get(rid, [])]
        unknown = [rid for rid in wanted if rid not in by_id]
        return found, unknown
