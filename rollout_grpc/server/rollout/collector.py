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


#: The collector's first threshold once a replica serves: 10x CPython's 700. Streaming allocates
#: (and frees by reference counting) a few objects per token; at 700 a young collection ran every
#: ~15 ms at 512 streams, and every tenth promoted the live streams' state towards full collections.
GEN0_THRESHOLD = 7000


def settle_after_start() -> tuple[int, int]:
    """Collect once, freeze what survives, and raise the first threshold; (frozen objects, threshold).

    Why: what exists once a replica serves (modules, protobuf descriptors, the settings, the
    wiring: ~70,000 tracked objects) lives as long as the process, yet every full collection
    scanned all of it again, and the young collections ran ten times as often as the streams
    need. Measured at 512 streams x 256 tokens, 20 ms/token (bench/profile_notes.md, eleventh
    pass): the collector took ~5.6 % of the service's CPU, its full collections ~50 ms each in
    the middle of the opening burst; with this, ~3 % and TTFT p50 lower in every repetition.
    Called by `serve` (and each `--workers` worker) once it listens, never by a library user's
    process: freezing is process-wide.
    """
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    threshold = max(gen0, GEN0_THRESHOLD)
    gc.set_threshold(threshold, gen1, gen2)
    return gc.get_freeze_count(), threshold
