"""The order of weight versions, so that a sample's staleness (its lag) can be measured.

Versions are labels. Their order is the fleet's, kept in the state store (`BufferStore.
advance_version`): every `Resume(weight_version)` and `UpdateWeights` on any replica or worker
sharing the store appends to it, and it never goes backwards (an older label, or a decimal label
not above a decimal newest, is refused). When two labels both parse as integers, numeric order;
otherwise the order in which they were set, and a label never set (e.g. vLLM's initial "default")
is older than every label that was. The lag of a label is how many versions the newest one is
ahead of it (0: current, or nothing known).

`FleetVersions` reads the order from the store once per step (`refresh`, at the step's start), not
per sample: a step measures every lag against one newest version, and costs one store round trip
however many groups it has. A version set on this process is seen at once (`advance` keeps the
answer); one set on another replica mid-step is seen by the next step.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout_grpc.server.domain.errors import FailedPrecondition, InvalidArgument
from rollout_grpc.server.state.api import BufferStore
from rollout_grpc.server.state.memory import MemoryStore

#: Longest label the fleet's order takes (UpdateWeights' own bound, `weights.MAX_VERSION_CHARS`).
MAX_LABEL_CHARS = 256


def _as_int(label: str) -> int | None:
    try:
        return int(label)
    except ValueError:
        return None


class VersionOrder:
    """The versions set on this replica, oldest first."""

    def __init__(self, order: Sequence[str] = ()) -> None:
        self._order: list[str] = []
        self._position: dict[str, int] = {}
        for label in order:
            self.advance(label)

    def advance(self, label: str) -> None:
        """`label` is now the newest version (Resume set it)."""
        if self._order and self._order[-1] == label:
            return
        self._position[label] = len(self._order)
        self._order.append(label)

    @property
    def newest(self) -> str | None:
        """The newest version, or None before any Resume(weight_version)."""
        return self._order[-1] if self._order else None

    def lag(self, label: str) -> int:
        """Versions between `label` and the newest (>= 0)."""
        newest = self.newest
        if newest is None or label == newest:
            return 0
        a, b = _as_int(label), _as_int(newest)
        if a is not None and b is not None:
            return max(0, b - a)
        position = self._position.get(label)
        if position is None:
            return len(self._order)
        return len(self._order) - 1 - position


class FleetVersions:
    """The fleet's version order (in the state store) and this process's copy of it."""

    def __init__(self, store: BufferStore | None = None) -> None:
        self.store: BufferStore = store or MemoryStore()
        self._copy = VersionOrder()

    async def refresh(self) -> None:
        """Read the fleet's order (StoreUnavailable naming the store when it does not answer)."""
        self._copy = VersionOrder(await self.store.version_order())

    async def advance(self, label: str) -> None:
        """Make `label` the fleet's newest version; FAILED_PRECONDITION naming both labels when it
        would go backwards (nothing changes then)."""
        if len(label) > MAX_LABEL_CHARS:  # the store keeps thousands of labels: bounded first
            raise InvalidArgument("weight_version", f"must be at most {MAX_LABEL_CHARS} characters")
        ok, order = await self.store.advance_version(label)
        self._copy = VersionOrder(order)
        if not ok:
            raise FailedPrecondition(
                f"weight_version {label!r} goes backwards: the fleet's newest is {order[-1]!r} "
                "(versions are ordered fleet-wide; use a new label)"
            )

    @property
    def newest(self) -> str | None:
        """The newest version as last read, or None before any was set."""
        return self._copy.newest

    def lag(self, label: str) -> int:
        """Versions between `label` and the newest as last read (>= 0)."""
        return self._copy.lag(label)
