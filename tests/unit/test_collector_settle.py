"""`serve` settles the garbage collector once it listens (rollout/collector.settle_after_start).

Why: every full collection re-scanned the ~70,000 objects a started replica holds for its whole
life, and young collections ran ten times as often as streaming needs; measured at 512 streams
the collector took ~5.6 % of the service's CPU (bench/profile_notes.md, eleventh pass).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from rollout_grpc.server.rollout import collector


@pytest.fixture
def restored_collector() -> Iterator[None]:
    """The test process's collector as it was (freezing is process-wide)."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_settling_freezes_what_exists_and_raises_the_first_threshold(restored_collector: None) -> None:
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    kept = [[i] for i in range(1000)]  # objects alive at the call: frozen with the rest
    frozen, threshold = collector.settle_after_start()
    assert frozen == gc.get_freeze_count() >= len(kept)
    assert threshold == collector.GEN0_THRESHOLD == gc.get_threshold()[0]
    assert gc.get_threshold()[1:] == (10, 10)  # the older generations' ratios are left alone


def test_a_higher_threshold_set_by_the_operator_is_kept(restored_collector: None) -> None:
    gc.set_threshold(50_000, 10, 10)
    assert collector.settle_after_start()[1] == 50_000 == gc.get_threshold()[0]
