"""The sizing rule an operator reads off the scale table (`bench/scale.py`): pure arithmetic, no I/O.

Why its own module: the rule is what docs/benchmarks.md and deploy/README.md quote, so its
derivation is unit-tested (tests/unit/test_bench_sizing.py) rather than buried in the runner.

From the rows of one scale run (each a dict with `streams`, `engines`, `r3_layers`, `r3_topk`,
`service_cpu_s_per_mtok`, `service_peak_rss_mib`, `tokens_per_s`):

* **CPU**: a replica's service CPU is proportional to the tokens it relays, so cores per 100k
  tokens/s = (CPU seconds per million tokens) x 0.1. The rule takes the *highest* CPU per token of
  the streams axis (conservative: the per-token cost is not exactly flat in the stream count)
  among the rows that ran at the assumed decode speed: a row whose streams got less than
  `MIN_RATE_SHARE` of the nominal tokens/s per stream (the shared machine could not keep up) is
  left out of the CPU figure, since a slower stream sends more, smaller messages per token and
  the rule's assumption is the nominal speed. Its memory still counts.
* **Memory**: peak RSS against concurrent streams is fitted with a least-squares line over the
  streams axis; the slope x 1000 is MiB per 1k streams, the intercept the replica's fixed memory.
* **Engines** and **R3 payloads** are reported as their extra cost over the baseline row (the
  engine count and R3 shape that the streams axis uses).
* One replica is one Python process with one event loop: it cannot use more than one core, so a
  replica's ceiling is 1e6 / (CPU s per M tokens) tokens/s; the rule plans for `TARGET_CORE_SHARE`
  of that core, leaving headroom for bursts, aborts and the first-token flushes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

#: The share of its one core a replica is planned to use (the rest is headroom).
TARGET_CORE_SHARE = 0.7
#: A row counts for the CPU figure when its streams got at least this share of the nominal speed.
MIN_RATE_SHARE = 0.5


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares `(intercept, slope)` of `ys` over `xs`; needs two distinct x values."""
    if len(xs) != len(ys):
        raise ValueError(f"linear_fit: {len(xs)} x values for {len(ys)} y values")
    if len(set(xs)) < 2:
        raise ValueError(f"linear_fit: need at least two distinct x values, got {sorted(set(xs))}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    return my - slope * mx, slope


def _usable(row: dict[str, Any]) -> bool:
    return bool(row.get("service_cpu_s_per_mtok")) and bool(row.get("service_peak_rss_mib"))


def streams_axis(rows: Sequence[dict[str, Any]], engines: int) -> list[dict[str, Any]]:
    """The rows that vary only the stream count: `engines` engines, no routed experts."""
    picked = [r for r in rows if r["engines"] == engines and not r["r3_layers"] and _usable(r)]
    return sorted(picked, key=lambda r: r["streams"])


def at_nominal_speed(row: dict[str, Any]) -> bool:
    """Whether the row's streams ran at (nearly) the assumed decode speed; rows without the
    fields are taken as nominal."""
    nominal = row.get("nominal_tokens_per_s_per_stream")
    achieved = row.get("tokens_per_s_per_stream")
    if not nominal or achieved is None:
        return True
    return bool(achieved >= MIN_RATE_SHARE * nominal)


def derive(rows: Sequence[dict[str, Any]], base_engines: int, base_streams: int) -> dict[str, Any]:
    """The sizing rule from one run's rows (see the module docstring)."""
    axis = streams_axis(rows, base_engines)
    if len(axis) < 2:
        raise ValueError(
            f"sizing: need at least two usable rows with {base_engines} engines and no R3, got {len(axis)}"
        )
    nominal = [r for r in axis if at_nominal_speed(r)]
    if not nominal:
        raise ValueError(
            f"sizing: no row with {base_engines} engines and no R3 ran at {MIN_RATE_SHARE:.0%} of the "
            "nominal tokens/s per stream; rerun on a quieter machine or with fewer streams"
        )
    worst = max(nominal, key=lambda r: r["service_cpu_s_per_mtok"])
    cpu_s_per_mtok = float(worst["service_cpu_s_per_mtok"])
    intercept, slope = linear_fit(
        [float(r["streams"]) for r in axis], [float(r["service_peak_rss_mib"]) for r in axis]
    )
    ceiling = 1e6 / cpu_s_per_mtok
    base = next((r for r in axis if r["streams"] == base_streams), None)
    engines_rows = sorted(
        (r for r in rows if r["streams"] == base_streams and not r["r3_layers"] and _usable(r)),
        key=lambda r: r["engines"],
    )
    r3_rows = sorted(
        (r for r in rows if r["streams"] == base_streams and r["engines"] == base_engines and _usable(r)),
        key=lambda r: r["r3_layers"] * r["r3_topk"],
    )
    per_engine_mib = None
    if len({r["engines"] for r in engines_rows}) >= 2:
        per_engine_mib = round(
            linear_fit(
                [float(r["engines"]) for r in engines_rows],
                [float(r["service_peak_rss_mib"]) for r in engines_rows],
            )[1],
            2,
        )
    return {
        "cpu_s_per_mtok": round(cpu_s_per_mtok, 2),
        "cpu_s_per_mtok_range": [
            round(min(r["service_cpu_s_per_mtok"] for r in nominal), 2),
            round(cpu_s_per_mtok, 2),
        ],
        "cpu_from_streams": worst["streams"],
        "cpu_rows_streams": [r["streams"] for r in nominal],
        "slow_rows": [
            {
                "streams": r["streams"],
                "tokens_per_s_per_stream": r.get("tokens_per_s_per_stream"),
                "cpu_s_per_mtok": r["service_cpu_s_per_mtok"],
            }
            for r in axis
            if not at_nominal_speed(r)
        ],
        "cores_per_100k_tok_s": round(cpu_s_per_mtok * 0.1, 2),
        "replica_ceiling_tok_s": round(ceiling, -2),
        "replica_planned_tok_s": round(ceiling * TARGET_CORE_SHARE, -2),
        "target_core_share": TARGET_CORE_SHARE,
        "fixed_rss_mib": round(intercept, 1),
        "rss_mib_per_1k_streams": round(slope * 1000, 1),
        "rss_fit_streams": [r["streams"] for r in axis],
        "rss_mib_per_engine": per_engine_mib,
        "engines": [
            {
                "engines": r["engines"],
                "cpu_s_per_mtok": r["service_cpu_s_per_mtok"],
                "cpu_vs_base": _ratio(r["service_cpu_s_per_mtok"], base, "service_cpu_s_per_mtok"),
                "rss_mib": r["service_peak_rss_mib"],
            }
            for r in engines_rows
        ],
        "r3": [
            {
                "layers_x_topk": f"{r['r3_layers']}x{r['r3_topk']}" if r["r3_layers"] else "none",
                "bytes_per_token": r["r3_layers"] * r["r3_topk"],
                "cpu_s_per_mtok": r["service_cpu_s_per_mtok"],
                "cpu_vs_base": _ratio(r["service_cpu_s_per_mtok"], base, "service_cpu_s_per_mtok"),
                "rss_mib": r["service_peak_rss_mib"],
                "extra_rss_mib_per_1k_streams": (
                    round((r["service_peak_rss_mib"] - base["service_peak_rss_mib"]) / base_streams * 1000, 1)
                    if base is not None
                    else None
                ),
            }
            for r in r3_rows
        ],
    }


def _ratio(value: float, base: dict[str, Any] | None, key: str) -> float | None:
    if base is None or not base.get(key):
        return None
    return round(float(value) / float(base[key]), 2)


def replicas_for(
    tokens_per_s: float, streams: int, rule: dict[str, Any], memory_mib: float
) -> dict[str, int]:
    """Replicas needed for a fleet's `tokens_per_s` and concurrent `streams` with `memory_mib` per pod:
    the larger of the CPU bound (planned tokens/s per replica) and the memory bound."""
    if tokens_per_s < 0 or streams < 0:
        raise ValueError(
            f"replicas_for: tokens_per_s and streams must be >= 0, got {tokens_per_s}, {streams}"
        )
    by_cpu = math.ceil(tokens_per_s / rule["replica_planned_tok_s"]) if tokens_per_s else 0
    usable = memory_mib - rule["fixed_rss_mib"]
    if usable <= 0:
        raise ValueError(
            f"replicas_for: memory_mib {memory_mib} is below the fixed RSS {rule['fixed_rss_mib']}"
        )
    by_memory = math.ceil(streams * rule["rss_mib_per_1k_streams"] / 1000 / usable) if streams else 0
    return {"by_cpu": by_cpu, "by_memory": by_memory, "replicas": max(1, by_cpu, by_memory)}
