"""The fault table: every fault test records (fault, streams, survived, tokens lost).

At the end of the session the table is printed in pytest's terminal summary (and written to the
file named by `ROLLOUT_FAULT_REPORT`, when set), so a run can be quoted as it is. A row is added
before the streams are asserted, so a failing (or expected-to-fail) test shows its real numbers
and the first problem; a test that fails before its streams ended adds no row.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faults.support import Outcome, check, problem, tokens_lost


@dataclass
class Row:
    fault: str
    streams: int
    survived: int
    lost: int
    problem: str


_ROWS: list[Row] = []


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[[str, list[Outcome], list[int]], None]:
    """`record(fault, outcomes, reference)`: check every stream, then add the fault's row.

    survived = streams that ended with exactly one final sample holding their deltas, or with a
    clean error before any token.
    """

    def add(fault: str, outcomes: list[Outcome], reference: list[int]) -> None:
        problems = [(out, problem(out, reference)) for out in outcomes]
        failed = [f"{out.request_id}: {issue}" for out, issue in problems if issue is not None]
        lost = sum(tokens_lost(out, reference) for out in outcomes)
        first = failed[0] if failed else ""
        expected_failure = request.node.get_closest_marker("xfail")
        if expected_failure is not None:
            first = f"(xfail: {expected_failure.kwargs.get('reason', '')}) {first}".strip()
        _ROWS.append(Row(fault, len(outcomes), len(outcomes) - len(failed), lost, first))
        for out in outcomes:
            check(out, reference)

    return add


def _table() -> str:
    lines = ["| fault | streams | survived | tokens lost | first problem |", "|---|---:|---:|---:|---|"]
    lines += [f"| {r.fault} | {r.streams} | {r.survived} | {r.lost} | {r.problem} |" for r in _ROWS]
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _ROWS:
        return
    terminalreporter.section("fault table (tests/faults)")
    terminalreporter.write_line(_table())
    path = os.environ.get("ROLLOUT_FAULT_REPORT")
    if path:
        Path(path).write_text(_table() + "\n")
