"""The one extension point of fleet-wide control: `Fanout`, the other holders of generations.

An engine is shared by the whole fleet, but a generation is known only to the process serving it
(its in-flight registry: owner, session, group, engine call ids). So every control action that
names generations (abort by request id, session, group, `mine`, Abort(all)'s count) and every
action whose local part other processes must also run (Pause's epoch and ABORT, Resume's and a
weight update's relabelling) goes through one protocol: `Control` (control.py) does its own part
and hands the rest to its `Fanout`, which delivers it to every other holder and returns what they
did. Three implementations, combined by the wiring (app.py, workers/worker.py) in `Fanouts`:

* `StoreFanout` (here): the fleet's shared state store carries it (`--state-store redis://...`:
  Redis pub/sub, `state/redis_bus.py`) to every process of every replica, workers included, with
  no `--peer` list: the recommended path (docs/operations.md "Fleet control");
* the sibling workers of `serve --workers N` (`workers/siblings.Siblings`, their unix sockets):
  the pause/resume sync always, and the aborts when no store bus carries them;
* the `--peer` replicas (`front/grpc/peers.PeerAborter`, `ReplicaService.AbortLocal`): the
  hand-made mesh of replicas without a shared store.

A process that receives a forwarded abort runs `Control.abort_here` (nothing forwarded again);
the one exception is a `--peer` forward, which reaches only one process of the peer replica and so
is relayed to that replica's siblings (`within_replica=True`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from rollout_grpc.server.state.bus import FleetBus

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class AbortResult:
    """How many local generations were aborted, unknown ids, engines that failed."""

    aborted: int = 0
    unknown_request_ids: list[str] = field(default_factory=list)
    engine_errors: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class ForwardedAbort:
    """What other processes did with a forwarded abort (peer replicas, sibling workers, the
    store's subscribers): how many generations they aborted, and which of the asked request ids
    they had in flight (so that the asking process reports as unknown only the ids nobody knew)."""

    aborted: int = 0
    found_request_ids: set[str] = field(default_factory=set)

    def add(self, other: ForwardedAbort) -> None:
        """Count `other`'s answer in."""
        self.aborted += other.aborted
        self.found_request_ids.update(other.found_request_ids)


@dataclass(frozen=True, slots=True)
class AbortScope:
    """What a forwarded abort targets: one of ids, session, group or everything of `owner`
    (`all_of_owner`, a forwarded Abort{mine}), of `owner` only; or `everything` of any owner
    (the local part of Abort(all), `Control.abort_all_local`)."""

    owner: str | None
    request_ids: tuple[str, ...] = ()
    session_id: str | None = None
    group_index: int | None = None
    all_of_owner: bool = False
    everything: bool = False


class Fanout(Protocol):
    """The other holders of generations (processes, replicas), reached for a fleet-wide action."""

    async def abort(self, scope: AbortScope, *, within_replica: bool = False) -> ForwardedAbort:
        """Deliver `scope` to every other holder this fanout reaches; what they aborted and which
        asked ids they held. `within_replica`: a `--peer` forward being relayed, to reach only the
        other processes of this replica. Fails (e.g. `StoreUnavailable`) when the holders could not
        be asked at all: an abort is never reported as done on the fleet when it was not."""
        ...

    async def paused(self, mode: str) -> int:
        """A Pause(`mode`) ran on the engines: the other processes' local part; what they aborted."""
        ...

    async def resumed(
        self, weight_version: str | None, relabelled: list[str], rotation: dict[str, str] | None = None
    ) -> None:
        """A Resume or weight update ran: the engines that took `weight_version`, and the rotation
        changes of a weight update (engine -> problem, "" to rejoin)."""
        ...


class NoFanout:
    """A replica of one process without peers or a shared store: nobody else to reach."""

    async def abort(self, scope: AbortScope, *, within_replica: bool = False) -> ForwardedAbort:
        return ForwardedAbort()

    async def paused(self, mode: str) -> int:
        return 0

    async def resumed(
        self, weight_version: str | None, relabelled: list[str], rotation: dict[str, str] | None = None
    ) -> None:
        return None


class Fanouts:
    """Several fanouts as one: each asked concurrently, the answers added up. When one fails, the
    others still finish (their aborts happened), then the first failure is raised."""

    def __init__(self, members: Sequence[Fanout]) -> None:
        self.members = list(members)

    @staticmethod
    async def _all(calls: list[Awaitable[Any]]) -> list[Any]:
        results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def abort(self, scope: AbortScope, *, within_replica: bool = False) -> ForwardedAbort:
        total = ForwardedAbort()
        answers = await self._all([m.abort(scope, within_replica=within_replica) for m in self.members])
        for answer in answers:
            total.add(answer)
        return total

    async def paused(self, mode: str) -> int:
        return sum(await self._all([m.paused(mode) for m in self.members]))

    async def resumed(
        self, weight_version: str | None, relabelled: list[str], rotation: dict[str, str] | None = None
    ) -> None:
        await self._all([m.resumed(weight_version, relabelled, rotation) for m in self.members])


def scope_message(scope: AbortScope) -> dict[str, Any]:
    """`scope` as the JSON object the store's bus carries (`scope_from_message` reads it back)."""
    return {
        "owner": scope.owner,
        "request_ids": list(scope.request_ids),
        "session_id": scope.session_id,
        "group_index": scope.group_index,
        "all_of_owner": scope.all_of_owner,
        "everything": scope.everything,
    }


def scope_from_message(message: dict[str, Any]) -> AbortScope:
    """The scope of a bus message (ValueError for a message no replica of ours wrote)."""
    owner, ids, session, group = (
        message.get(k) for k in ("owner", "request_ids", "session_id", "group_index")
    )
    if owner is not None and not isinstance(owner, str):
        raise ValueError("owner is not a string")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ValueError("request_ids is not a list of strings")
    if session is not None and not isinstance(session, str):
        raise ValueError("session_id is not a string")
    if group is not None and (not isinstance(group, int) or isinstance(group, bool)):
        raise ValueError("group_index is not an integer")
    return AbortScope(
        owner=owner,
        request_ids=tuple(ids),
        session_id=session,
        group_index=group,
        all_of_owner=message.get("all_of_owner") is True,
        everything=message.get("everything") is True,
    )


class StoreFanout:
    """Aborts carried by the fleet's shared store to every process subscribed to it (every worker
    of every replica that names the same `--state-store redis://...`).

    Each process answers with what its `abort_here` aborted and which asked ids it held; an id no
    answer names is reported unknown. Pause and Resume need nothing from the other replicas (they
    act on the shared engines; a worker's siblings are synced by `Siblings`)."""

    def __init__(self, bus: FleetBus, timeout_s: float) -> None:
        self._bus = bus
        self._timeout_s = timeout_s

    async def start(self, abort_here: Callable[[AbortScope], Awaitable[AbortResult]]) -> None:
        """Answer the other processes' aborts with `abort_here` (this process's generations only)."""

        async def handle(message: dict[str, Any]) -> dict[str, Any]:
            scope = scope_from_message(message.get("abort") or {})
            result = await abort_here(scope)
            unknown = set(result.unknown_request_ids)
            return {"aborted": result.aborted, "found": [i for i in scope.request_ids if i not in unknown]}

        await self._bus.start(handle)

    async def abort(self, scope: AbortScope, *, within_replica: bool = False) -> ForwardedAbort:
        outcome = ForwardedAbort()
        if within_replica:  # every process of the fleet got it from the store itself
            return outcome
        for answer in await self._bus.ask_all({"abort": scope_message(scope)}, self._timeout_s):
            if "error" in answer:  # that process could not run it (logged there): it aborted nothing
                log.warning("store_fanout_refused", error=str(answer["error"]))
            aborted, found = answer.get("aborted"), answer.get("found")
            if isinstance(aborted, int):
                outcome.aborted += aborted
            if isinstance(found, list):
                outcome.found_request_ids.update(str(i) for i in found)
        return outcome

    async def paused(self, mode: str) -> int:
        return 0

    async def resumed(
        self, weight_version: str | None, relabelled: list[str], rotation: dict[str, str] | None = None
    ) -> None:
        return None

    async def close(self) -> None:
        """Stop answering (at shutdown)."""
        await self._bus.close()
