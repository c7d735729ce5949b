"""The generations this replica has in flight, so that Abort can find and end them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rollout_grpc.server.engines import EngineHandle
from rollout_grpc.server.errors import InvalidArgument


class AbortedWhileQueued(Exception):
    """Set on a generation's admission waiter when it is aborted before it got a slot."""


@dataclass(slots=True, eq=False)
class InFlight:
    """One generation: where it runs, and whether someone asked to abort it."""

    request_id: str
    session_id: str = ""
    group_index: int = 0
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
    """Request id -> in-flight generation, for this replica."""

    def __init__(self) -> None:
        self._by_id: dict[str, InFlight] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._by_id)

    def register(self, request_id: str, session_id: str, group_index: int) -> InFlight:
        """Track a new generation; a request id already in flight is a caller error."""
        if request_id in self._by_id:
            raise InvalidArgument("request_id", f"a generation with id {request_id!r} is already in flight")
        entry = InFlight(request_id=request_id, session_id=session_id, group_index=group_index)
        self._by_id[request_id] = entry
        self._idle.clear()
        return entry

    def unregister(self, entry: InFlight) -> None:
        """Forget a finished generation."""
        if self._by_id.get(entry.request_id) is entry:
            del self._by_id[entry.request_id]
            if not self._by_id:
                self._idle.set()

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

    def matching(self, *, session_id: str | None = None, group_index: int | None = None) -> list[InFlight]:
        """Generations of a session or of a prompt group."""
        return [
            e
            for e in self._by_id.values()
            if (session_id is not None and e.session_id == session_id)
            or (group_index is not None and e.group_index == group_index)
        ]

    def select(self, request_ids: Iterable[str]) -> tuple[list[InFlight], list[str]]:
        """Split ids into in-flight generations and unknown ids."""
        found: list[InFlight] = []
        unknown: list[str] = []
        for rid in request_ids:
            entry = self._by_id.get(rid)
            if entry is None:
                unknown.append(rid)
            else:
                found.append(entry)
        return found, unknown
