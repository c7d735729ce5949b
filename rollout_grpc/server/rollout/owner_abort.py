"""Owner-scoped abort windows: Abort{mine} ends every generation of one caller, including one on
the wire.

While a caller's abort runs, `Rollout.generate` ends that caller's new generations ABORTED at once
without an engine call (the owner-scoped twin of the abort-all window), so a Generate sent just
before the Abort cannot slip past it. A running RolloutStep of the caller subscribes
(`watch`): an abort of the caller stops it at once, samples not started yet included.
"""

from __future__ import annotations

from collections.abc import Callable


class OwnerAborts:
    """Open windows and abort counts per caller identity."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}
        self._epochs: dict[str, int] = {}
        self._watchers: dict[str, list[Callable[[], None]]] = {}

    def watch(self, owner: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when an abort of `owner` begins; returns the function that unwatches."""
        self._watchers.setdefault(owner, []).append(callback)

        def unwatch() -> None:
            callbacks = self._watchers.get(owner, [])
            if callback in callbacks:
                callbacks.remove(callback)
            if not callbacks:
                self._watchers.pop(owner, None)

        return unwatch

    def begin(self, owner: str) -> None:
        """Open a window for `owner` (nested windows are counted) and bump its epoch."""
        self._open[owner] = self._open.get(owner, 0) + 1
        self._epochs[owner] = self._epochs.get(owner, 0) + 1
        for callback in list(self._watchers.get(owner, [])):
            callback()

    def end(self, owner: str) -> None:
        """Close one window of `owner`."""
        left = self._open.get(owner, 0) - 1
        if left > 0:
            self._open[owner] = left
        else:
            self._open.pop(owner, None)

    def aborting(self, owner: str) -> bool:
        """True while an abort of `owner`'s generations runs."""
        return owner in self._open

    def epoch(self, owner: str) -> int:
        """How many aborts of `owner` have started on this replica."""
        return self._epochs.get(owner, 0)
