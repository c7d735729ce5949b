"""Python's cyclic garbage collector held off while an Abort(all) runs.

Why: an Abort(all) ends every stream of the replica in the same moment, and the trainer waits for
the last one. A full (generation 2) collection that starts in that moment scans every object of a
replica holding a thousand samples: traced at 1024 generations in flight, one took 410 ms of a
~1.1 s abort (and a generation 1 collection another 73 ms). Held off for the abort's few hundred
milliseconds (never longer than the control deadline, which bounds `Control.abort_all`), the
collector runs once the streams have ended instead. Reference counting frees everything but cycles
meanwhile, so memory grows only by the cycles made in that time.
"""

from __future__ import annotations

import gc
from types import TracebackType


class CollectorHold:
    """The collector is off while anyone holds it (holds nest, e.g. two concurrent aborts), and
    back on when the last holder lets go, unless it was already off before the first."""

    __slots__ = ("_holders", "_was_enabled")

    def __init__(self) -> None:
        self._holders = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        if self._holders == 0:
            self._was_enabled = gc.isenabled()
            gc.disable()
        self._holders += 1

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._holders -= 1
        if self._holders == 0 and self._was_enabled:
            gc.enable()


#: The one hold of this process (the collector is process-wide).
HOLD = CollectorHold()
