"""Benchmark rows stay valid JSON when a client measures no time to first token.

h2load reads no gRPC messages, so its rows have no TTFT; they used to carry NaN, which
`json.dumps` writes as a bare `NaN` token that strict parsers (jq, JavaScript) refuse.
"""

from __future__ import annotations

import json
import math
import types
from pathlib import Path
from typing import Any

import pytest

from bench import floor, load, sections, step_slime, store
from bench import report as bench_report
from bench.run import Workload, best_rows, summarise
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


def _floor_variant() -> dict[str, object]:
    """One variant of `bench/floor.py`'s results, built by its own summarising functions."""
    run = load.RunResult(
        [load.Result(5.5, 0.05, 256, "length", 17), load.Result(5.7, 0.07, 256, "length", 17)], 6.0, 0
    )
    shape = floor.shape_of(run, 256)
    stream = {
        "concurrency": 512,
        "cpu_per_token": floor.paired([18.0, 16.0], [6.0, 8.0]),
        "cpu_per_token_with_http": floor.paired([18.0, 16.0], [12.0, 14.0]),
        "http_client_cpu_us_per_token_median": 6.0,
        "ttft_p50": floor.paired([360.0, 300.0], [250.0, 250.0]),
        "ttft_added_p50": floor.paired([110.0, 60.0], [250.0, 250.0]),
        "tokens_per_s": floor.paired([21000.0, 20000.0], [20000.0, 20000.0]),
        "service_cpu_us_per_token_median": 17.0,
        "floor_cpu_us_per_token_median": 7.0,
        "service_ttft_p50_ms_median": 330.0,
        "direct_ttft_p50_ms_median": 250.0,
        "floor_ttft_p50_ms_median": 250.0,
    }
    abort = {
        "in_flight": 1024,
        "service": floor.paired([600.0], [200.0]),
        "floor": floor.paired([100.0], [200.0]),
        "service_ms_median": 600.0,
        "direct_ms_median": 200.0,
        "floor_ms_median": 100.0,
    }
    variant: dict[str, object] = {"streams": [stream], "aborts": [abort], "shape": shape}
    variant["ratios"] = floor.ratio_keys(variant)
    return variant


def test_the_floor_shape_is_the_median_calls_messages_and_spacing() -> None:
    shape = _floor_variant()["shape"]
    assert isinstance(shape, floor.StreamShape)
    # 17 messages; (5.6 - 0.06) s from the first message to the end over 16 gaps.
    assert (shape.messages, shape.interval_ms, shape.tokens_per_message) == (17, 346.2, 15)


def test_paired_ratios_are_the_median_of_per_repetition_ratios_with_their_spread() -> None:
    assert floor.paired([18.0, 16.0, 30.0], [6.0, 8.0, 10.0]) == {
        "median": 3.0,
        "min": 2.0,
        "max": 3.0,
        "reps": [3.0, 2.0, 3.0],
    }
    assert floor.paired([1.0], [0.0])["median"] is None  # nothing measured: no ratio


def test_every_floor_ratio_key_ends_in_vs_floor_or_vs_direct_and_reaches_the_next_run() -> None:
    variant = _floor_variant()
    ratios = variant["ratios"]
    assert isinstance(ratios, dict)
    assert ratios == {
        "cpu_per_token_c512_vs_floor": 2.5,
        "cpu_per_token_with_http_c512_vs_floor": 1.321,
        "ttft_p50_c512_vs_floor": 1.32,
        "ttft_added_p50_c512_vs_floor": 0.34,
        "tokens_per_s_c512_vs_direct": 1.025,
        "abort_all_1024_vs_direct": 3.0,
        "abort_floor_1024_vs_direct": 0.5,
    }
    rows = best_rows(
        [
            {**_row(0.012), "path": "direct", "tokens_per_s": 100.0, "latency_p50_ms": 1.0},
            {**_row(0.012), "path": "service", "tokens_per_s": 120.0, "latency_p50_ms": 1.0},
        ]
    )
    results: dict[str, Any] = {
        "floor": {"reps": 2, "variants": {"service": variant, "base": variant}},
        "rows": rows,
    }
    summary = bench_report.ratio_summary(results)
    assert summary and all(key.endswith(bench_report.RATIO_SUFFIXES) for key in summary)
    assert summary["abort_all_1024_vs_direct"] == 3.0 and summary["base:abort_all_1024_vs_direct"] == 3.0
    assert summary["delay 0 ms, c=64 | service:tokens_per_s_vs_direct"] == 1.2
    # The next run reads them from `previous` and shows each before / now.
    previous = bench_report.previous_summary({"environment": {}, **results})
    assert previous["ratios"] == summary
    lines = bench_report.previous_table({**results, "previous": previous})
    assert "| `cpu_per_token_c512_vs_floor` | 2.50 | 2.50 |" in lines
    table = bench_report.floor_table(results["floor"])
    assert any(
        line.startswith("| service | `abort_all_1024_vs_direct` | 3.00x | 3.00-3.00 | <= 1.5x")
        for line in table
    )


def _step_slime_reps() -> list[dict[str, step_slime.Result]]:
    """Three repetitions of the three paths (made-up timings; the row's arithmetic is checked)."""
    walls = [(10.0, 9.0, 8.0), (12.0, 12.0, 9.0), (8.0, 6.0, 7.5)]
    return [
        {
            step_slime.LOOP: step_slime.Result(loop, 64, 32, phases={"target_s": loop - 0.1}),
            step_slime.STEP: step_slime.Result(step, 66 if i == 1 else 64, 32, phases={"setup_s": 0.05}),
            step_slime.FLOOR: step_slime.Result(floor, 64, 0),
        }
        for i, (loop, step, floor) in enumerate(walls)
    ]


def test_the_step_slime_row_has_the_paired_ratios() -> None:
    w = step_slime.Workload(32, 8, 256, 10.0)
    row = step_slime.row(w, _step_slime_reps(), ([3.0, 2.0, 1.0], [4.0, 2.5, 1.2]))
    assert row["reps"] == 3 and row["load_average"] == {"start": [3.0, 2.0, 1.0], "end": [4.0, 2.5, 1.2]}
    wall = row["wall_vs_hand_loop"]
    assert wall["per_rep"] == [0.9, 1.0, 0.75] and wall["median"] == 0.9
    assert wall["range"] == [0.75, 1.0] and len(wall["quartiles"]) == 2
    assert row["groups_vs_hand_loop"]["median"] == 1.0 and row["groups_vs_hand_loop"]["range"][1] == 1.031
    assert row["wall_vs_engine_waves"]["per_rep"] == [1.125, 1.333, 0.8]
    assert row["hand_loop_wall_vs_engine_waves"]["median"] == 1.25
    assert "wall_vs_before" not in row  # no --before path ran
    assert row["paths"][step_slime.STEP]["phases_median_s"] == {"setup_s": 0.05}
    json.loads(json.dumps(row, allow_nan=False))


def test_the_step_slime_section_renders_the_ratios(tmp_path: Path) -> None:
    w = step_slime.Workload(32, 8, 256, 10.0)
    row = step_slime.row(w, _step_slime_reps(), ([3.0, 2.0, 1.0], [4.0, 2.5, 1.2]))
    row["run"] = {"commit": "abc", "date": "2026-12-06 02:00:00 +0000"}
    settings = {"tokens": 256, "token_delay_ms": 10.0, "engines": 2, "reward_connections": 64}
    document = {"environment": {"commit": "abc"}, "settings": settings, "rows": [row]}
    (tmp_path / sections.STEP_SLIME_FILE).write_text(json.dumps(document))
    lines = sections.render(tmp_path)
    assert lines[0].startswith("## RolloutStep vs slime's loop")
    table_row = next(line for line in lines if line.startswith("| 32 |"))
    assert "| 1.00 [1.00-1.02] (1.00-1.03) | 0.90 [0.82-0.95] (0.75-1.00) |" in table_row
    assert table_row.endswith("| 9.00 / 10.00 / 8.00 |")


@pytest.mark.parametrize("target", [32, 128])
def test_the_committed_step_slime_rows_hold_the_goal_keys(target: int) -> None:
    """docs/benchmarks.step_slime.json (issue 38's bench row) has a row per target with the paired
    ratios the goal is stated in (groups and wall time vs the hand loop), its reps and the load."""
    document = json.loads((step_slime.JSON_FILE).read_text())
    row = next(r for r in document["rows"] if r["target_groups"] == target)
    assert row["n"] == 8 and row["reps"] >= 2 and len(row["load_average"]["start"]) == 3
    for key in ("groups_vs_hand_loop", "wall_vs_hand_loop"):
        ratio = row[key]
        assert len(ratio["per_rep"]) == row["reps"]
        assert ratio["range"][0] <= ratio["quartiles"][0] <= ratio["median"] <= ratio["quartiles"][1]
        assert ratio["quartiles"][1] <= ratio["range"][1]


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
