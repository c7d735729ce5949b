"""The order of weight versions, so that a sample's staleness (its lag) can be measured.

Versions are labels. Their order on a replica: when two labels both parse as integers, numeric
order; otherwise the order in which `Resume(weight_version)` set them on this replica, and a label
never set here (e.g. vLLM's initial "default") is older than every label that was. The lag of a
label is how many versions the newest one is ahead of it (0: current, or nothing known).
"""

from __future__ import annotations


def _as_int(label: str) -> int | None:
    try:
        return int(label)
    except ValueError:
        return None


class VersionOrder:
    """The versions set on this replica, oldest first."""

    def __init__(self) -> None:
        self._order: list[str] = []
        self._position: dict[str, int] = {}

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
