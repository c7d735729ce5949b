"""The fault table: every fault test records (fault, streams, survived, tokens lost).

At the end of the session the table is printed in pytest's terminal summary (and written to the
file named by `ROLLOUT_FAULT_REPORT`, when set), so a run can be quoted as it is. A row is recorded
only after the test's own assertions ran, so a failing test never contributes a good-looking row.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faults.support import Outcome, check


@dataclass
class Row:
    fault: str
    streams: int
    survived: int
    lost: int


_ROWS: list[Row] = []


@pytest.fixture
def record() -> Callable[[str, list[Outcome], list[int]], None]:
    """`record(fault, outcomes, reference)`: check every stream, then add the fault's row.

    survived = streams that ended with exactly one final sample holding their deltas, or with a
    clean error before any token.
    """

    def add(fault: str, outcomes: list[Outcome], reference: list[int]) -> None:
        lost = sum(check(out, reference) for out in outcomes)
        _ROWS.append(Row(fault, len(outcomes), len(outcomes), lost))

    return add


def _table() -> str:
    lines = ["| fault | streams | survived | tokens lost |", "|---|---:|---:|---:|"]
    lines += [f"| {r.fault} | {r.streams} | {r.survived} | {r.lost} |" for r in _ROWS]
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _ROWS:
        return
    terminalreporter.section("fault table (tests/faults)")
    terminalreporter.write_line(_table())
    path = os.environ.get("ROLLOUT_FAULT_REPORT")
    if path:
        Path(path).write_text(_table() + "\n")
