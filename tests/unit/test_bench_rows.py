"""Benchmark rows stay valid JSON when a client measures no time to first token.

h2load reads no gRPC messages, so its rows have no TTFT; they used to carry NaN, which
`json.dumps` writes as a bare `NaN` token that strict parsers (jq, JavaScript) refuse.
"""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest

from bench import load, sections
from bench.run import Workload, summarise
from bench.sections import num
from bench.workers import report


def _row(ttft_s: float | None) -> dict[str, object]:
    run = load.RunResult([load.Result(0.5, ttft_s, 256, "length")] * 4, wall_s=1.0, errors=0)
    meter = types.SimpleNamespace(cpu_s={"service": 0.25, "client": 0.1}, peak_rss={"service": 2**26})
    row = summarise("service", Workload(0, 64, 4, 1), run, meter, foreign_s=0.35)  # type: ignore[arg-type]
    row.update(variant="w1", rep=0, cpu_s_by_process={"service": 0.25, "client": 0.1})
    row.update(client_cpu_s_per_mtok=97.7, nginx_cpu_s_per_mtok=0.0, machine_busy_cores=0.35)
    return row


def test_a_row_without_first_tokens_has_null_ttft_and_strict_json() -> None:
    row = _row(None)
    assert row["ttft_p50_ms"] is None and row["ttft_p99_ms"] is None
    assert json.loads(json.dumps(row, allow_nan=False))["ttft_p50_ms"] is None


def test_a_row_with_first_tokens_keeps_its_ttft() -> None:
    assert _row(0.012)["ttft_p50_ms"] == 12.0


def test_the_workers_table_shows_a_dash_for_a_missing_ttft(capsys: pytest.CaptureFixture[str]) -> None:
    report([_row(None)], ["w1"], [64], cores=2)
    lines = capsys.readouterr().out.splitlines()
    table_row = next(line for line in lines if line.startswith("| 64 |"))
    assert "| - / 500 |" in table_row


def test_num_renders_unmeasured_values_as_a_dash() -> None:
    assert num(None) == "-" and num(math.nan) == "-" and num(1234.5, ",.1f") == "1,234.5"


def test_the_weight_update_section_shows_the_paired_ratios(tmp_path: Path) -> None:
    row = {
        "engines": 8,
        "direct": 0.0072,
        "all_at_once_paused": 0.0075,
        "all_at_once_wall": 0.0110,
        "all_at_once_paused_vs_direct": 1.031,
        "all_at_once_paused_vs_direct_quartiles": [0.98, 1.09],
        "staged_paused": 0.0080,
        "staged_wall": 0.0120,
        "staged_paused_vs_direct": 1.08,
    }
    document = {"environment": {"commit": "abc"}, "reps": 41, "rows": [row]}
    (tmp_path / sections.WEIGHTS_FILE).write_text(json.dumps(document))
    lines = sections.render(tmp_path)
    assert lines[0].startswith("## Weight updates")
    assert "| 8 | 7.20 | 7.50 (11.0) | 1.03 [0.98-1.09] | 8.00 (12.0) | 1.08 |" in lines
