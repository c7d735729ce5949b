"""A serving replica has its garbage collector settled: startup objects frozen, first threshold raised.

`serve` (one process) and every worker of `serve --workers N` call
`collector.settle_after_start()` once they listen and log `collector_settled`; without it the
collector's scans took ~5.6 % of the service's CPU at 512 streams (bench/profile_notes.md,
eleventh pass). The log line is read from the real process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_grpc.server.rollout.collector import GEN0_THRESHOLD
from tests.support.processes import Processes, start_replica, wait_until


def _settled(log: str) -> list[dict[str, object]]:
    lines = []
    for line in log.splitlines():
        if '"collector_settled"' in line:
            lines.append(json.loads(line[line.index("{") :]))
    return lines


@pytest.mark.parametrize("workers", [1, 2])
def test_every_serving_process_settles_its_collector(tmp_path: Path, workers: int) -> None:
    with Processes(tmp_path) as procs:
        replica = start_replica(procs, "replica", [], ["--sim", "1", "--workers", str(workers)])
        wait_until(
            f"{workers} collector_settled lines",
            lambda: len(_settled(replica.proc.log_text())) >= workers,
            replica.proc,
        )
        lines = _settled(replica.proc.log_text())
    assert len(lines) == workers
    for line in lines:
        assert line["gen0_threshold"] == GEN0_THRESHOLD
        # The imported modules, descriptors and wiring of a started replica: tens of thousands.
        assert isinstance(line["frozen_objects"], int) and line["frozen_objects"] > 10_000
