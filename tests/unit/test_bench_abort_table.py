"""The abort-all table of docs/benchmarks.md names every path and compares it with direct's.

The floor row (a bare grpc.aio server) is only useful next to the others as a ratio to the
engines' own pause+resume measured in the same run.
"""

from __future__ import annotations

from bench.report import abort_table


def _row(path: str, n: int, last_ms: float) -> dict[str, object]:
    return {
        "path": path,
        "in_flight": n,
        "call_s": last_ms / 2000,
        "last_delivery_s": last_ms / 1000,
        "p50_delivery_s": last_ms / 1500,
        "aborted": n,
        "other": 0,
    }


def test_every_path_gets_its_label_and_its_ratio_to_direct() -> None:
    rows = [_row("direct", 256, 40.0), _row("service", 256, 120.0), _row("floor", 256, 20.0)]
    lines = abort_table(rows)
    assert "| 256 | direct `/pause?mode=abort` + `/resume` | 20.0 | 40.0 | 1.00 |" in lines[2]
    assert "| 256 | service `Abort(all)` | 60.0 | 120.0 | 3.00 |" in lines[3]
    floor = "| 256 | floor: bare grpc.aio, held streams ended by one call | 10.0 | 20.0 | 0.50 |"
    assert lines[4].startswith(floor)


def test_a_count_without_a_direct_row_shows_a_dash_and_a_failed_row_its_error() -> None:
    rows = [
        {"path": "direct", "in_flight": 1024, "error": "RuntimeError: did not start"},
        _row("service", 1024, 500.0),
    ]
    lines = abort_table(rows)
    assert "failed: RuntimeError: did not start" in lines[2]
    assert "| 500.0 | - |" in lines[3]
