"""What the step needs of a state store: per-owner buffers of opaque groups, and drain leases.

The store holds bytes, never domain objects: the step encodes its groups (rollout/step/buffer.py)
so that the store has no reason to import the step, and a store client never reaches the step.

Semantics every implementation keeps (tests/unit/test_state_store.py runs them all on one suite):

* `put` stores groups in order while they fit under the caps (groups and bytes per owner, bytes in
  all); from the first group that does not fit, that group and every later one are refused and
  their positions returned: the caller hands them back, a group is never dropped;
* an owner's buffer expires `ttl_s` after its last write; its groups are then not dropped
  silently: their indexes move to the owner's lost list, which the owner's next step reports
  (`lost_group_indexes`), kept `LOST_TTL_S`;
* a drain lease (`begin_drain`) says "a step of this owner may still add groups": an owner's
  `continue_buffered` step waits until it holds none. A lease expires `lease_ttl_s` after its
  last renewal, so a replica killed with its lease held delays the next step by at most that.
* a lease may name the groups its step holds only in its own process (`hold_groups`: in flight,
  or taken from the buffer and not yet started). When the lease expires without `end_drain` (its
  replica died), those indexes move to the owner's lost list, less the ones the owner has
  buffered meanwhile: a group is reported, never silently gone. `end_drain` forgets them.
* `take_held` takes an owner's buffered groups and names them held by a lease in one atomic
  operation, so that no instant exists (a kill between a `take` and a `hold_groups`) in which they
  are neither buffered nor held: a continue step's taken groups are reported lost if it dies.

And what the fleet's weight updates need (rollout/weights/, rollout/step/versions.py):

* a fleet lease (`take_lease`): one holder at a time per name, expiring `ttl_s` after its last
  renewal, so a replica killed while holding it blocks the others for at most that; only its
  holder renews or releases it;
* the fleet's weight-version order (`advance_version`, `version_order`): labels oldest first,
  never going backwards: a label already in the order (other than the newest), or a decimal label
  not above a decimal newest, is refused and the order left as it was.

And what fleet control needs (rollout/resumes.py, `PauseEpochs`):

* the fleet's pause epoch: a counter every Pause on any replica bumps (`bump_pause_epoch`) before
  it pauses the engines, read (`pause_epoch`) by a replica's background resume of an engine whose
  resume did not answer, which stops once it moved: a pause on another replica is not undone.
  It starts at 0 and only grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rollout_grpc.server.domain.errors import Unavailable

#: How long a lost list (groups that expired or did not fit when their owner was gone) is kept.
LOST_TTL_S = 7 * 24 * 3600
#: Most lost group indexes kept per owner (the oldest).
MAX_LOST = 100_000
#: Most weight versions the fleet's order keeps (the newest; an older label counts as unknown).
MAX_VERSIONS = 4096


class StoreUnavailable(Unavailable):
    """The state store did not answer: the call that needs it fails UNAVAILABLE naming it."""

    def __init__(self, store: str, detail: str) -> None:
        super().__init__(f"the state store {store} is unavailable: {detail}")


@dataclass(frozen=True, slots=True)
class BufferCaps:
    """The bounds of the step buffers (`--step-buffer-*`)."""

    max_groups_per_owner: int = 10_000
    max_bytes_per_owner: int = 256 << 20
    max_bytes_total: int = 512 << 20
    #: Seconds an owner's buffer lives after its last write.
    ttl_s: float = 3600.0
    #: Seconds a drain lease lives after its last renewal (its holder renews it every third).
    lease_ttl_s: float = 15.0


@dataclass(frozen=True, slots=True)
class StoredGroup:
    """One encoded group: its index (the owner's name for it), its estimated size, its bytes."""

    index: int
    size: int
    blob: bytes


@dataclass(frozen=True, slots=True)
class Holding:
    """What an owner holds now."""

    count: int
    bytes: int
    indexes: frozenset[int]


class PauseEpochs(Protocol):
    """The fleet's pause epoch (module docstring): how a late resume on one replica learns that
    another replica paused the shared engines since it started."""

    async def bump_pause_epoch(self) -> int:
        """A Pause starts: the epoch grows by one; the new epoch."""
        ...

    async def pause_epoch(self) -> int:
        """The current epoch (0 before any Pause)."""
        ...


class BufferStore(PauseEpochs, Protocol):
    """Per-owner step buffers and drain leases, shared by whoever reaches the same store."""

    #: How errors name the store ("redis://host:6379/0", "embedded").
    name: str
    caps: BufferCaps

    async def put(self, owner: str, groups: Sequence[StoredGroup]) -> list[int]:
        """Store `groups` in order while they fit; the positions (in `groups`) refused."""
        ...

    async def take(self, owner: str) -> list[bytes]:
        """Every buffered group of `owner`, oldest first (the buffer empties)."""
        ...

    async def take_held(self, owner: str, lease: str) -> list[bytes]:
        """`take`, and the taken groups' indexes added to `lease`'s held groups (`hold_groups`), in
        one operation. A lease that is not live takes nothing: the groups stay buffered for the
        owner's next step."""
        ...

    async def holding(self, owner: str) -> Holding:
        """How many groups and bytes `owner` holds, and their indexes."""
        ...

    async def total_bytes(self) -> int:
        """The bytes every owner's buffer holds together."""
        ...

    async def note_lost(self, owner: str, indexes: Sequence[int]) -> None:
        """Remember group indexes of `owner` that could not be buffered (its next step reports them)."""
        ...

    async def take_lost(self, owner: str) -> list[int]:
        """The indexes noted lost for `owner` (forgotten once taken)."""
        ...

    async def begin_drain(self, owner: str, lease: str) -> None:
        """Hold lease `lease` for `owner` (a step that may still buffer groups)."""
        ...

    async def renew_drain(self, owner: str, lease: str) -> bool:
        """Extend `lease` by `caps.lease_ttl_s`; False when it is not live any more (it expired, so
        its held groups are or will be reported lost, or it ended): it is not revived."""
        ...

    async def end_drain(self, owner: str, lease: str) -> None:
        """Release `lease` (its step has put everything it will put) and forget its held groups."""
        ...

    async def hold_groups(self, owner: str, lease: str, indexes: Sequence[int]) -> None:
        """Name the group indexes `lease`'s step holds only in its process now (replacing the ones
        named before); they are noted lost if the lease expires unended. A lease that is not live
        (ended, expired) names none."""
        ...

    async def wait_drains(self, owner: str, timeout_s: float) -> bool:
        """Wait until `owner` holds no lease (True) or `timeout_s` passed (False)."""
        ...

    async def ping(self) -> None:
        """Reach the store once (StoreUnavailable when it does not answer)."""
        ...

    async def close(self) -> None:
        """Release connections (the store's data stays)."""
        ...

    async def take_lease(self, name: str, holder: str, ttl_s: float) -> str:
        """Hold the fleet lease `name` for `holder` (for `ttl_s`) when it is free or already
        `holder`'s: ""; otherwise the holder that has it (nothing changes)."""
        ...

    async def renew_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Extend `holder`'s lease `name` by `ttl_s`; False when `holder` does not hold it (expired)."""
        ...

    async def release_lease(self, name: str, holder: str) -> None:
        """Give up lease `name` if `holder` holds it (someone else's is left alone)."""
        ...

    async def advance_version(self, label: str) -> tuple[bool, list[str]]:
        """Make `label` the fleet's newest weight version unless that goes backwards (see the
        module docstring); (whether it is now the newest, the order oldest first)."""
        ...

    async def version_order(self) -> list[str]:
        """The fleet's weight versions, oldest first (empty before any was set)."""
        ...


def decimal_backwards(new: str, newest: str) -> bool:
    """Both labels are decimal integers ("7", "12") and `new` is not above `newest`."""
    if not (new.isascii() and new.isdigit() and newest.isascii() and newest.isdigit()):
        return False
    return int(new) <= int(newest)


def advance_order(order: list[str], label: str) -> bool:
    """`advance_version` on a plain list (the in-memory stores' rule; Redis runs it in Lua)."""
    if order and order[-1] == label:
        return True
    if label in order or (order and decimal_backwards(label, order[-1])):
        return False
    order.append(label)
    del order[: max(0, len(order) - MAX_VERSIONS)]
    return True
