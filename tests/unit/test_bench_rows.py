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

from bench import load, sections, store
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


def _store_times() -> dict[str, dict[int, list[float]]]:
    base = {2: [100.0, 110.0, 105.0], 16: [520.0, 530.0, 545.0]}
    return {
        "in-process": base,
        "embedded x2": {g: [t * 1.1 for t in ts] for g, ts in base.items()},  # 10 % slower throughout
        "redis": {g: [t + 20.0 for t in ts] for g, ts in base.items()},  # 10 ms more per step, none per group
    }


def test_the_store_rows_carry_paired_ratios_against_in_process() -> None:
    rows = {row["store"]: row for row in store.summarise(_store_times())}
    assert set(rows) == {"in-process", "embedded x2", "redis"}
    ratios = {"round_small_vs_in_process", "round_large_vs_in_process", "per_group_vs_in_process"}
    for name in ("embedded x2", "redis"):
        assert {k for k in rows[name] if k.endswith("_vs_in_process")} == ratios
        for key in [*ratios, "step_overhead_ms", "group_overhead_ms"]:
            assert len(rows[name][f"{key}_quartiles"]) == 2, key
    embedded, redis = rows["embedded x2"], rows["redis"]
    assert embedded["round_small_vs_in_process"] == embedded["per_group_vs_in_process"] == 1.1
    assert redis["step_overhead_ms"] == 10.0 and redis["group_overhead_ms"] == 0.0
    assert redis["per_group_vs_in_process"] == 1.0 and redis["round_small_vs_in_process"] == 1.19
    assert rows["in-process"]["per_group_ms"] == 30.0 and "per_group_vs_in_process" not in rows["in-process"]


def test_the_store_section_renders_the_ratios_the_spread_and_the_load() -> None:
    sized = {
        "groups": 16,
        "redis_bytes_per_group": 128 * 1024.0,
        "estimate_bytes_per_group": 691 * 1024.0,
        "tokens_per_group": 8 * 1046.0,
        "r3_bytes_per_token": 0.0,
        "redis_bytes_per_token": 15.7,
        "blob_bytes_per_token": 14.9,
        "estimate_bytes_per_token": 84.6,
    }
    memory = {"no_r3": sized, "r3": {**sized, "r3_bytes_per_token": 384.0, "redis_bytes_per_token": 438.6}}
    data = {
        "settings": {"samples_per_group": 8, "done_tokens": 1024, "budget": 1088, "sizes": [2, 16],
                     "token_delay_ms": 1.0, "r3": "48 layers x top-8 of 128 experts, uint8", "reps": 3},
        "rows": store.summarise(_store_times()),
        "redis_store_calls_per_round": {"2": 28, "16": 62},
        "redis_usec_per_call": 31.5,
        "memory": memory,
        "sizing": store.sizing(memory),
        "load_average_start": [7.6, 6.0, 6.3], "load_average_end": [5.1, 5.5, 6.0],
        "load_average_1m_max": 7.9, "cpus": 2, "duration_s": 80.0,
    }  # fmt: skip
    json.dumps(data, allow_nan=False)
    lines = store.markdown(data)
    redis_row = next(line for line in lines if line.startswith("| redis |"))
    assert "| 1.19 [1.19, 1.20] |" in redis_row and "| 10.0 [10.0, 10.0] |" in redis_row
    assert any("load average [7.6, 6.0, 6.3]" in line for line in lines)
    assert any("Redis ran 28 store calls a round at G=2 and 62 at G=16, 32 µs each" in line for line in lines)
    assert "| no R3 | 128 | 15.7 | 14.9 | 691 | 84.6 |" in lines
    assert any("Example, 128 groups x 8 samples x 4,096 tokens: Redis 63 MiB" in line for line in lines)
