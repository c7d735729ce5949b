"""The embedded store: one process's memory (the default for a replica of one process).

`serve --workers N` runs one `MemoryStore` in the supervisor and every worker reaches it through
`SocketStore` (socket.py), so a buffer one worker writes is the buffer the next worker reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rollout_grpc.server.state.api import (
    LOST_TTL_S,
    MAX_LOST,
    BufferCaps,
    Holding,
    StoredGroup,
    advance_order,
)


@dataclass(slots=True)
class _Buffer:
    groups: list[StoredGroup] = field(default_factory=list)
    bytes: int = 0
    expires: float = 0.0


class MemoryStore:
    """`BufferStore` in this process's memory."""

    def __init__(self, caps: BufferCaps | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = "embedded"
        self.caps = caps or BufferCaps()
        self._clock = clock
        self._buffers: dict[str, _Buffer] = {}
        self._lost: dict[str, tuple[list[int], float]] = {}
        self._total = 0
        #: owner -> lease -> expiry.
        self._leases: dict[str, dict[str, float]] = {}
        self._lease_changed = asyncio.Condition()
        #: owner -> lease -> the group indexes its step holds only in its process (`hold_groups`).
        self._held_groups: dict[str, dict[str, list[int]]] = {}
        #: Fleet leases: name -> (holder, expiry).
        self._fleet_leases: dict[str, tuple[str, float]] = {}
        #: The fleet's weight versions, oldest first.
        self._versions: list[str] = []
        #: The fleet's pause epoch (`PauseEpochs`).
        self._pause_epoch = 0

    def _sweep(self) -> None:
        """Expired buffers hand their indexes to the lost lists (never dropped silently)."""
        now = self._clock()
        for owner in [o for o, b in self._buffers.items() if b.expires <= now]:
            buf = self._buffers.pop(owner)
            self._total -= buf.bytes
            self._note_lost(owner, [g.index for g in buf.groups])
        for owner in [o for o, (_, exp) in self._lost.items() if exp <= now]:
            del self._lost[owner]

    async def put(self, owner: str, groups: Sequence[StoredGroup]) -> list[int]:
        self._sweep()
        caps = self.caps
        buf = self._buffers.setdefault(owner, _Buffer())
        refused: list[int] = []
        for i, group in enumerate(groups):
            fits = (
                not refused
                and len(buf.groups) < caps.max_groups_per_owner
                and buf.bytes + group.size <= caps.max_bytes_per_owner
                and self._total + group.size <= caps.max_bytes_total
            )
            if not fits:
                refused.append(i)
                continue
            buf.groups.append(group)
            buf.bytes += group.size
            self._total += group.size
        if buf.groups:
            buf.expires = self._clock() + caps.ttl_s
        else:
            del self._buffers[owner]
        return refused

    async def take(self, owner: str) -> list[bytes]:
        self._sweep()
        buf = self._buffers.pop(owner, None)
        if buf is None:
            return []
        self._total -= buf.bytes
        return [g.blob for g in buf.groups]

    async def take_held(self, owner: str, lease: str) -> list[bytes]:
        self._sweep()
        expiry = self._leases.get(owner, {}).get(lease)
        if expiry is None or expiry <= self._clock():
            return []  # not live: the groups stay buffered
        buf = self._buffers.pop(owner, None)
        if buf is None:
            return []
        self._total -= buf.bytes
        self._held_groups.setdefault(owner, {}).setdefault(lease, []).extend(g.index for g in buf.groups)
        return [g.blob for g in buf.groups]

    async def holding(self, owner: str) -> Holding:
        self._sweep()
        buf = self._buffers.get(owner)
        if buf is None:
            return Holding(0, 0, frozenset())
        return Holding(len(buf.groups), buf.bytes, frozenset(g.index for g in buf.groups))

    async def total_bytes(self) -> int:
        self._sweep()
        return self._total

    def _note_lost(self, owner: str, indexes: Sequence[int]) -> None:
        lost, _ = self._lost.get(owner, ([], 0.0))
        lost.extend(indexes[: max(0, MAX_LOST - len(lost))])
        self._lost[owner] = (lost, self._clock() + LOST_TTL_S)

    async def note_lost(self, owner: str, indexes: Sequence[int]) -> None:
        if indexes:
            self._note_lost(owner, indexes)

    async def take_lost(self, owner: str) -> list[int]:
        self._sweep()
        self._held(owner)  # leases that expired unended add their held groups first
        lost, _ = self._lost.pop(owner, ([], 0.0))
        return lost

    async def begin_drain(self, owner: str, lease: str) -> None:
        self._leases.setdefault(owner, {})[lease] = self._clock() + self.caps.lease_ttl_s

    async def renew_drain(self, owner: str, lease: str) -> bool:
        expiry = self._leases.get(owner, {}).get(lease)
        if expiry is None or expiry <= self._clock():
            return False  # ended, or expired: its held groups go to the lost list at the next sweep
        self._leases[owner][lease] = self._clock() + self.caps.lease_ttl_s
        return True

    async def end_drain(self, owner: str, lease: str) -> None:
        self._forget_groups(owner, lease)
        leases = self._leases.get(owner, {})
        leases.pop(lease, None)
        if not leases:
            self._leases.pop(owner, None)
        async with self._lease_changed:
            self._lease_changed.notify_all()

    def _held(self, owner: str) -> float | None:
        """The latest expiry of `owner`'s live leases (None: it holds none)."""
        now = self._clock()
        leases = self._leases.get(owner, {})
        for lease in [k for k, exp in leases.items() if exp <= now]:
            del leases[lease]
            self._lease_died(owner, lease)
        if not leases:
            self._leases.pop(owner, None)
            return None
        return max(leases.values())

    async def hold_groups(self, owner: str, lease: str, indexes: Sequence[int]) -> None:
        expiry = self._leases.get(owner, {}).get(lease)
        if expiry is None or expiry <= self._clock():
            return  # not live: an ended lease names nothing, an expired one was reported already
        if indexes:
            self._held_groups.setdefault(owner, {})[lease] = list(indexes)
        else:
            self._forget_groups(owner, lease)

    def _forget_groups(self, owner: str, lease: str) -> list[int]:
        """Drop `lease`'s held groups; what they were."""
        by_lease = self._held_groups.get(owner, {})
        groups = by_lease.pop(lease, [])
        if not by_lease:
            self._held_groups.pop(owner, None)
        return groups

    def _lease_died(self, owner: str, lease: str) -> None:
        """`lease` expired unended (its replica died): its held groups, less those buffered since,
        go to the owner's lost list."""
        buf = self._buffers.get(owner)
        buffered = {g.index for g in buf.groups} if buf is not None else set()
        lost = [i for i in self._forget_groups(owner, lease) if i not in buffered]
        if lost:
            self._note_lost(owner, lost)

    async def wait_drains(self, owner: str, timeout_s: float) -> bool:
        deadline = self._clock() + timeout_s
        async with self._lease_changed:
            while (latest := self._held(owner)) is not None:
                # Woken by end_drain; otherwise at the latest lease's expiry (or the timeout).
                wait = min(latest, deadline) - self._clock()
                if wait <= 0 and self._clock() >= deadline:
                    return False
                try:
                    await asyncio.wait_for(self._lease_changed.wait(), max(wait, 0.0) + 0.001)
                except TimeoutError:
                    if self._clock() >= deadline and self._held(owner) is not None:
                        return False
        return True

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def _lease_holder(self, name: str) -> str:
        holder, expiry = self._fleet_leases.get(name, ("", 0.0))
        if holder and expiry <= self._clock():
            del self._fleet_leases[name]
            return ""
        return holder

    async def take_lease(self, name: str, holder: str, ttl_s: float) -> str:
        current = self._lease_holder(name)
        if current and current != holder:
            return current
        self._fleet_leases[name] = (holder, self._clock() + ttl_s)
        return ""

    async def renew_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        if self._lease_holder(name) != holder:
            return False
        self._fleet_leases[name] = (holder, self._clock() + ttl_s)
        return True

    async def release_lease(self, name: str, holder: str) -> None:
        if self._lease_holder(name) == holder:
            del self._fleet_leases[name]

    async def advance_version(self, label: str) -> tuple[bool, list[str]]:
        return advance_order(self._versions, label), list(self._versions)

    async def version_order(self) -> list[str]:
        return list(self._versions)

    async def bump_pause_epoch(self) -> int:
        self._pause_epoch += 1
        return self._pause_epoch

    async def pause_epoch(self) -> int:
        return self._pause_epoch
