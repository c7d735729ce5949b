"""Render benchmark results as Markdown tables and one PNG figure.

Kept apart from `run.py` so the outputs can be regenerated from `docs/benchmarks.json` alone
(`python -m bench.report`) when only the presentation changes, without re-running the load.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench import r3, r3_e2e, sections, store
from bench.sections import num

DOCS = Path(__file__).resolve().parent.parent / "docs"
PATH_ORDER = ("direct", "service", "nginx x2", "service final_only", "service text mode")
COLORS = {
    "direct": "#4c72b0",
    "service": "#dd8452",
    "nginx x2": "#55a868",
    "service final_only": "#c44e52",
    "service text mode": "#8172b3",
    "floor": "#937860",
}
PROFILE_NOTES = Path(__file__).resolve().parent / "profile_notes.md"
#: The abort-all table's rows (the `path` of a row in `benchmarks.json`).
ABORT_PATHS = {
    "direct": "direct `/pause?mode=abort` + `/resume`",
    "service": "service `Abort(all)`",
    "floor": "floor: bare grpc.aio, held streams ended by one call",
}


def _sorted_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def key(row: dict[str, Any]) -> tuple[float, int, int]:
        order = PATH_ORDER.index(row["path"]) if row["path"] in PATH_ORDER else len(PATH_ORDER)
        return (row["token_delay_ms"], row["concurrency"], order)

    return sorted(rows, key=key)


def main_table(rows: list[dict[str, Any]]) -> list[str]:
    """The side-by-side table: one line per (workload, path)."""
    out = [
        "| engine delay | conc. | requests | path | samples/s | tokens/s | p50 e2e ms | p99 e2e ms "
        "| TTFT p50 ms | TTFT p99 ms | service CPU s / M tok | service peak RSS MiB | tokens/s vs direct "
        "| p50 vs direct | other load (cores) |",
        "|" + " ---: |" * 3 + " --- |" + " ---: |" * 11,
    ]
    for row in _sorted_rows(rows):
        errors = f" ({row['errors']} errors)" if row["errors"] else ""
        out.append(
            f"| {row['token_delay_ms']:g} ms | {row['concurrency']} | {row['requests']}{errors} "
            f"| {row['path']} "
            f"| {num(row['samples_per_s'], ',.1f')} | {num(row['tokens_per_s'])} "
            f"| {num(row['latency_p50_ms'], ',.1f')} | {num(row['latency_p99_ms'], ',.1f')} "
            f"| {num(row['ttft_p50_ms'], ',.1f')} | {num(row['ttft_p99_ms'], ',.1f')} "
            f"| {num(row['service_cpu_s_per_mtok'], ',.1f')} | {num(row['service_peak_rss_mib'], ',.0f')} "
            f"| {num(row.get('ratio_tokens_per_s'), '.2f')} | {num(row.get('ratio_latency_p50'), '.2f')} "
            f"| {num(row['other_load_cores'], '.2f')} |"
        )
    return out


def cpu_table(rows: list[dict[str, Any]]) -> list[str]:
    """Where the CPU went in each row (seconds over the measured interval)."""
    out = [
        "| engine delay | conc. | path | wall s | client CPU s | service CPU s | nginx CPU s "
        "| engines CPU s |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in _sorted_rows(rows):
        out.append(
            f"| {row['token_delay_ms']:g} ms | {row['concurrency']} | {row['path']} | {row['wall_s']:.2f} "
            f"| {row['client_cpu_s']:.2f} | {row['service_cpu_s']:.2f} | {row['nginx_cpu_s']:.2f} "
            f"| {row['engines_cpu_s']:.2f} |"
        )
    return out


def abort_table(aborts: list[dict[str, Any]]) -> list[str]:
    out = [
        "| in flight | path | call returned ms | last ABORTED sample ms | vs direct | p50 delivery ms "
        "| aborted |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    direct = {
        row["in_flight"]: row["last_delivery_s"]
        for row in aborts
        if row["path"] == "direct" and "error" not in row
    }
    for row in aborts:
        if "error" in row:
            out.append(f"| {row['in_flight']} | {row['path']} | failed: {row['error'][:120]} | | | | |")
            continue
        label = ABORT_PATHS.get(row["path"], row["path"])
        base = direct.get(row["in_flight"])
        ratio = num(row["last_delivery_s"] / base if base else None, ".2f")
        out.append(
            f"| {row['in_flight']} | {label} | {row['call_s'] * 1000:,.1f} "
            f"| {row['last_delivery_s'] * 1000:,.1f} | {ratio} "
            f"| {row['p50_delivery_s'] * 1000:,.1f} | {row['aborted']}/{row['in_flight']} |"
        )
    return out


#: Targets of issue 35 item 5 for the ratios of the floor section (`bench/floor.py`).
FLOOR_TARGETS = {"cpu_per_token": 1.5, "ttft_p50": 1.3, "abort_all": 1.5}
#: What a ratio key of `benchmarks.json` ends with: the next run compares every such key.
RATIO_SUFFIXES = ("_vs_floor", "_vs_direct")


def ratio_summary(results: dict[str, Any]) -> dict[str, float | None]:
    """Every `_vs_floor` / `_vs_direct` ratio of a run, by one flat key: the floor section's
    (`bench/floor.py`; prefixed `<variant>:` for variants other than `service`) and each
    throughput row's `tokens_per_s_vs_direct` (`<workload> | <path>:tokens_per_s_vs_direct`)."""
    out: dict[str, float | None] = {}
    for name, variant in (results.get("floor") or {}).get("variants", {}).items():
        prefix = "" if name == "service" else f"{name}:"
        for key, value in variant.get("ratios", {}).items():
            out[prefix + key] = value
    for row in results.get("rows", []):
        if row["path"] != "direct" and "tokens_per_s_vs_direct" in row:
            out[f"{row['workload']} | {row['path']}:tokens_per_s_vs_direct"] = row["tokens_per_s_vs_direct"]
    return out


def floor_table(floor: dict[str, Any]) -> list[str]:
    """The floor section (`bench/floor.py`): each ratio's median over paired repetitions, its
    spread and its target, with the medians it was made from."""
    out = [
        "| variant | ratio | median | spread (min-max) | target | service | floor (or direct) |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: |",
    ]

    def fmt(p: dict[str, Any]) -> tuple[str, str]:
        if p["median"] is None:
            return "-", "-"
        return f"{p['median']:.2f}x", f"{p['min']:.2f}-{p['max']:.2f}"

    def line(name: str, key: str, p: dict[str, Any], target: str, service: str, floor_col: str) -> str:
        med, spread = fmt(p)
        return f"| {name} | `{key}` | {med} | {spread} | {target} | {service} | {floor_col} |"

    t = FLOOR_TARGETS
    for name, result in floor["variants"].items():
        for row in result["streams"]:
            c = row["concurrency"]
            svc_cpu = f"{row['service_cpu_us_per_token_median']:.1f} us/token"
            out.append(
                line(
                    name,
                    f"cpu_per_token_c{c}_vs_floor",
                    row["cpu_per_token"],
                    f"<= {t['cpu_per_token']}x",
                    svc_cpu,
                    f"{row['floor_cpu_us_per_token_median']:.1f} us/token (grpc.aio)",
                )
            )
            if "cpu_per_token_with_http" in row:
                both = row["floor_cpu_us_per_token_median"] + row["http_client_cpu_us_per_token_median"]
                out.append(
                    line(
                        name,
                        f"cpu_per_token_with_http_c{c}_vs_floor",
                        row["cpu_per_token_with_http"],
                        "-",
                        svc_cpu,
                        f"{both:.1f} us/token (grpc.aio + aiohttp SSE client "
                        f"{row['http_client_cpu_us_per_token_median']:.1f})",
                    )
                )
            out.append(
                line(
                    name,
                    f"ttft_p50_c{c}_vs_floor",
                    row["ttft_p50"],
                    f"<= {t['ttft_p50']}x",
                    f"{row['service_ttft_p50_ms_median']:,.1f} ms",
                    f"{row['floor_ttft_p50_ms_median']:,.1f} ms",
                )
            )
            added = row["service_ttft_p50_ms_median"] - row["direct_ttft_p50_ms_median"]
            out.append(
                line(
                    name,
                    f"ttft_added_p50_c{c}_vs_floor",
                    row["ttft_added_p50"],
                    f"<= {t['ttft_p50']}x",
                    f"+{added:,.1f} ms over direct's {row['direct_ttft_p50_ms_median']:,.1f}",
                    f"{row['floor_ttft_p50_ms_median']:,.1f} ms",
                )
            )
            out.append(line(name, f"tokens_per_s_c{c}_vs_direct", row["tokens_per_s"], ">= 1.0x", "", ""))
        for row in result["aborts"]:
            n = row["in_flight"]
            out.append(
                line(
                    name,
                    f"abort_all_{n}_vs_direct",
                    row["service"],
                    f"<= {t['abort_all']}x",
                    f"{num(row['service_ms_median'], ',.1f')} ms",
                    f"direct {num(row['direct_ms_median'], ',.1f')} ms",
                )
            )
            out.append(
                line(
                    name,
                    f"abort_floor_{n}_vs_direct",
                    row["floor"],
                    "-",
                    "",
                    f"grpc.aio {num(row['floor_ms_median'], ',.1f')} ms",
                )
            )
    return out


def previous_summary(old: dict[str, Any]) -> dict[str, Any]:
    """What a later run compares itself with: the ratios, TTFTs and abort times of `old`."""
    env = old.get("environment", {})
    return {
        "commit": env.get("commit", "?"),
        "date": env.get("date", "?"),
        "rows": {
            f"{row['workload']} | {row['path']}": {
                "ratio_tokens_per_s": row.get("ratio_tokens_per_s"),
                "ttft_p50_ms": row.get("ttft_p50_ms"),
            }
            for row in old.get("rows", [])
            if row["path"] != "direct"
        },
        "abort": {
            f"{a['in_flight']} | {a['path']}": a.get("error") or round(a["last_delivery_s"] * 1000, 1)
            for a in old.get("abort", [])
        },
        "ratios": ratio_summary(old),
    }


def previous_table(results: dict[str, Any]) -> list[str]:
    """This run against the previous `docs/benchmarks.json` (ratios made within each run)."""
    prev = results["previous"]
    out = [
        "## Against the previous run",
        "",
        f"The previous `docs/benchmarks.json` (commit {prev['commit']}, {prev['date']}) against this run. "
        "Tokens/s ratios are service over direct within each run (each run's machine load cancels out); "
        "TTFT and abort times are absolute, so they also move with the load of the shared machine.",
        "",
        "| engine delay | conc. | path | tokens/s vs direct, before | now | TTFT p50 ms, before | now |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in _sorted_rows([r for r in results["rows"] if r["path"] != "direct"]):
        before = prev["rows"].get(f"{row['workload']} | {row['path']}")
        if before is None:
            continue
        out.append(
            f"| {row['token_delay_ms']:g} ms | {row['concurrency']} | {row['path']} "
            f"| {num(before['ratio_tokens_per_s'], '.2f')} | {num(row.get('ratio_tokens_per_s'), '.2f')} "
            f"| {num(before['ttft_p50_ms'], ',.1f')} | {num(row['ttft_p50_ms'], ',.1f')} |"
        )
    if results.get("abort") and prev["abort"]:
        out += [
            "",
            "| in flight | path | last ABORTED sample ms, before | now |",
            "| ---: | --- | ---: | ---: |",
        ]
        for row in results["abort"]:
            key = f"{row['in_flight']} | {row['path']}"
            before = prev["abort"].get(key, "-")
            now = row.get("error") or f"{row['last_delivery_s'] * 1000:,.1f}"
            was = before if isinstance(before, str) else f"{before:,.1f}"
            out.append(f"| {row['in_flight']} | {row['path']} | {was[:80]} | {now[:80]} |")
    before_ratios = prev.get("ratios") or {}
    now_ratios = ratio_summary(results)
    shared = [key for key in now_ratios if key in before_ratios]
    if shared:
        out += ["", "| ratio (`_vs_floor` / `_vs_direct`) | before | now |", "| --- | ---: | ---: |"]
        for key in shared:
            out.append(f"| `{key}` | {num(before_ratios[key], '.2f')} | {num(now_ratios[key], '.2f')} |")
    out.append("")
    return out


def write_markdown(results: dict[str, Any], path: Path) -> None:
    """docs/benchmarks.md: how it was measured, the tables, R3, and the profile notes if present."""
    env = results["environment"]
    settings = results["settings"]
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`python -m bench.run`); raw numbers in `benchmarks.json`, plot in "
        "`benchmarks.png`. Do not edit by hand: re-run, or re-render with `python -m bench.report`.",
        "",
        f"Code: commit {env.get('commit', '?')}. "
        f"Machine: {env['cpus']} CPUs ({env['machine']}), Python {env['python']}, grpcio {env['grpcio']}, "
        f"protobuf {env['protobuf']}, aiohttp {env['aiohttp']}; run {env['date']}, "
        f"{results.get('duration_s', '?')} s in total. Load average at start {env['load_average_at_start']}.",
        "",
        "## How it was measured",
        "",
        f"* Two simulated vLLM engines (`python -m rollout_grpc.sim`), each its own process; "
        f"{settings['prompt_tokens']}-token random prompts, {settings['max_new_tokens']}-token responses "
        "(`ignore_eos`), temperature 1, one logprob per token, streamed, token-in/token-out.",
        "* **direct**: an aiohttp client posting `/inference/v1/generate` (SSE) to the engines "
        "round-robin, as vime's streaming rollout does. **service**: the same requests through one "
        "`rollout-grpc serve` process with `AsyncRolloutClient.generate_stream` (`skip_text`; deltas: "
        f"{settings['stream_batch']}). "
        f"**nginx x2**: {results['nginx_row']}.",
        "* Extra rows at concurrency 64 without delay: **service final_only** (no deltas; what "
        "`AsyncRolloutClient.generate()` asks for) and **service text mode** (the default when "
        "`skip_text` is not set: engines detokenize and deltas carry text).",
        "* Closed loop: `conc.` workers each send the next request when theirs finishes. Engines with "
        "0 ms per token measure pure overhead (the engines run as fast as Python allows, so "
        "everything competes for the same 2 cores); 20 ms per token is a realistic decode step.",
        "* Each path ran at least twice, in alternating order (ABBA), and more often (up to 3 to 5 "
        "times) while its best repetition was disturbed by outside load; the best repetition "
        "(highest tokens/s) is shown, all of them are in `benchmarks.json` (`all_reps`). *other "
        "load* is CPU used by processes outside the benchmark during the row (the machine is "
        "shared): rows with a high value are noisy, compare those by service CPU rather than time.",
        "* Service CPU is user + system time of the service process(es) (psutil) over the row; peak "
        "RSS is sampled every 50 ms (summed over both replicas for nginx x2). Ratios are against "
        "the direct row of the same workload (tokens/s: higher is better; latency: lower is better).",
        "",
        "## Throughput and latency",
        "",
        *main_table(results["rows"]),
        "",
        "### Where the CPU went",
        "",
        *cpu_table(results["rows"]),
        "",
    ]
    if results.get("abort"):
        lines += [
            "## Abort-all latency",
            "",
            f"Engines at {settings['abort_token_delay_ms']:g} ms per token; every generation has produced "
            "tokens before the abort. Times from the abort call to the call's return and to the last "
            "generation ending with an aborted sample (service: status ABORTED with its tokens; direct: "
            "the final SSE chunk with `finish_reason: abort`). **floor**: a bare grpc.aio server in its "
            "own process (`bench/grpc_floor.py`: no engines, no HTTP, no service code) whose streams "
            "each sent one message and then all end with a two-token ABORTED sample when one call "
            "releases them, read by a bare grpc.aio client: what ending that many streams costs "
            "grpc.aio itself.",
            "",
            *abort_table(results["abort"]),
            "",
        ]
    if results.get("floor"):
        floor = results["floor"]
        env_floor = floor.get("environment") or env
        lines += [
            "## Against the floors: grpc.aio alone, and the engines' own abort",
            "",
            "`bench/floor.py`, in one run (commit "
            f"{env_floor.get('commit', '?')}, {env_floor.get('date', '?')}, load average at its start "
            f"{floor.get('load_average_at_start')}, at its end {floor.get('load_average_at_end', '?')}): "
            "at 20 ms/token, as many 256-token streams as the concurrency, all started at once, through "
            "the service (`--workers 1`); a bare grpc.aio server (`bench/grpc_floor.py`: no engines, HTTP "
            "or service code) sending the same number of messages per call as far apart, read by a bare "
            "grpc.aio client (its CPU scaled to the service's own message count of the repetition); "
            "direct HTTP to the engines as vime sends it (one SSE event per token: TTFT and tokens/s); "
            "and the HTTP floor, a bare aiohttp client reading the same streams with the engine asked "
            "for a message's tokens per event as the service asks (`stream_interval`): the second "
            "half of the service's work that is not its own code. "
            "Abort(all) at 100 ms/token against the engines' own `/pause?mode=abort` + `/resume`, and "
            "the bare server's held streams ended by one call. Paths alternate (ABBA) over "
            f"{floor['reps']} repetitions; each ratio is the median of the per-repetition ratios, with "
            "their spread.",
            "",
            *floor_table(floor),
            "",
        ]
    if results.get("previous"):
        lines += previous_table(results)
    lines += sections.render(path.parent)
    if results.get("r3_e2e"):
        lines += r3_e2e.markdown(results["r3_e2e"])
    if results.get("store"):
        lines += store.markdown(results["store"])
    if results.get("r3"):
        lines += [r3.markdown(results["r3"]), ""]
    if PROFILE_NOTES.exists():
        lines += [PROFILE_NOTES.read_text().rstrip(), ""]
    path.write_text("\n".join(lines))


def write_plot(results: dict[str, Any], path: Path) -> None:
    """A 2x3 figure: tokens/s, p50 and p99 latency, TTFT, service CPU per M tokens, abort latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    rows = results["rows"]
    workloads: list[tuple[float, int]] = sorted({(r["token_delay_ms"], r["concurrency"]) for r in rows})
    paths = [p for p in PATH_ORDER if any(r["path"] == p for r in rows)]
    index = {(r["token_delay_ms"], r["concurrency"], r["path"]): r for r in rows}
    labels = [f"{d:g} ms\nc={c}" for d, c in workloads]
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    panels = [
        ("tokens_per_s", "tokens/s, higher is better (log)", True),
        ("latency_p50_ms", "p50 end-to-end latency, ms (log)", True),
        ("latency_p99_ms", "p99 end-to-end latency, ms (log)", True),
        ("ttft_p50_ms", "TTFT p50, ms (log)", True),
        ("service_cpu_s_per_mtok", "service CPU seconds per million tokens (log)", True),
    ]
    width = 0.8 / max(1, len(paths))
    for ax, (metric, title, log) in zip(axes.flat, panels, strict=False):
        for j, name in enumerate(paths):
            xs, ys = [], []
            for i, (d, c) in enumerate(workloads):
                row = index.get((d, c, name))
                value = row.get(metric) if row else None
                if value is not None and not (isinstance(value, float) and math.isnan(value)) and value > 0:
                    xs.append(i + (j - (len(paths) - 1) / 2) * width)
                    ys.append(value)
            ax.bar(xs, ys, width, label=name, color=COLORS.get(name))
        ax.set_xticks(range(len(workloads)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(
                ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}")
            )
            ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.grid(axis="y", alpha=0.3)
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=len(names), fontsize=9, bbox_to_anchor=(0.5, 0.955))
    ax = axes.flat[5]
    aborts = [a for a in results.get("abort") or [] if "error" not in a]
    if aborts:
        counts = sorted({a["in_flight"] for a in aborts})
        paths = [p for p in ("direct", "service", "floor") if any(a["path"] == p for a in aborts)]
        width = 0.8 / len(paths)
        for j, name in enumerate(paths):
            xs = [
                i + (j - (len(paths) - 1) / 2) * width
                for i, n in enumerate(counts)
                for a in aborts
                if a["in_flight"] == n and a["path"] == name
            ]
            ys = [
                a["last_delivery_s"] * 1000
                for n in counts
                for a in aborts
                if a["in_flight"] == n and a["path"] == name
            ]
            label = {
                "service": "service Abort(all)",
                "direct": "direct pause(abort)+resume",
                "floor": "bare grpc.aio (floor)",
            }[name]
            ax.bar(xs, ys, width, label=label, color=COLORS[name])
        ax.set_xticks(range(len(counts)), [f"{n} in flight" for n in counts], fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    ax.set_title("abort-all: ms until the last aborted sample", fontsize=10)
    fig.suptitle(
        f"rollout-grpc vs direct vLLM HTTP (simulated engines, {results['settings']['max_new_tokens']}-token "
        f"responses, {results['environment']['cpus']} CPUs, shared machine)",
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    """Re-render docs/benchmarks.md and .png from docs/benchmarks.json (and the side files of
    `bench/sections.py`: benchmarks.vllm.json, benchmarks.scale.json)."""
    results = json.loads((DOCS / "benchmarks.json").read_text())
    write_plot(results, DOCS / "benchmarks.png")
    write_markdown(results, DOCS / "benchmarks.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
