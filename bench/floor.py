"""The service against grpc.aio's own floor and the engines' own abort, side by side in one run.

Why (issue 35 item 5): the service's cost per streamed token, its time to the first message and
its Abort(all) are only meaningful next to what the same call shape costs without the service's
code, measured on the same machine in the same minutes (the machine is 2 shared cores; absolute
figures drift several-fold between runs). This runs, in alternating order (ABBA) and `--reps`
times:

* **stream rows** at 20 ms/token and `--concurrency` (64 and 512; as many calls as streams, all
  started at once, 256-token samples): each service variant through `AsyncRolloutClient`, then the
  bare grpc.aio server of `bench/grpc_floor.py` sending the *same number of messages per call, as
  far apart* as the service's latest repetition did (measured by the client: messages per call,
  and the span from the first message to the last over the gaps), read by a bare grpc.aio client,
  and direct HTTP to the engines. Paired per repetition: service CPU per token / the floor's CPU
  for the service's message count of that repetition (floor CPU per message x the service's
  messages per call: a loaded engine is slower, so the service sends more, smaller messages), the
  same over the floor plus the direct client's CPU (a bare aiohttp SSE reader of the same
  streams), the service's TTFT p50 / the floor's first-message p50 of the same burst, and
  tokens/s / direct's.
* **abort rows** at 256 and 1024 in flight (engines at 100 ms/token, as `bench.run`): the
  engines' own `/pause?mode=abort` + `/resume` (direct), each variant's Abort(all), and the floor's
  held streams ended by one call. Paired per repetition: variant / direct and floor / direct.

Each ratio is the median of the paired per-repetition ratios, with the spread (min, max) next to
it; every key ends in `_vs_floor` or `_vs_direct` so the next run compares them
(`bench.report.previous_summary`). `bench.run` runs this as its "floor" phase into
`docs/benchmarks.json`; standalone:

    python -m bench.floor --reps 3                         # this checkout, prints the table
    python -m bench.floor --variant 'base=/tmp/base' --variant new --reps 3 --json /tmp/floor.json
    python -m bench.floor --update docs/benchmarks.json    # replace that file's "floor" section

A variant is `NAME`, `NAME=SRC` or `NAME=SRC:ARGS` as in `bench.compare` (SRC empty = this
checkout; every variant runs with one process, `--workers 1`, so one PID holds its CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import grpc_floor, load, procs
from bench.compare import Variant, parse_variant
from bench.report import FLOOR_TARGETS, floor_table

TOKENS = 256
STREAM_DELAY_MS = 20.0
ABORT_DELAY_MS = 100.0  # bench.run.ABORT_TOKEN_DELAY_MS (not imported: bench.run imports this module)
ABORT_MAX_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class StreamShape:
    """What the bare server is asked to send per call: the service's measured message pattern."""

    messages: int
    interval_ms: float
    tokens_per_message: int


def shape_of(run: load.RunResult, tokens: int) -> StreamShape:
    """The median call of a service run as a floor shape: its message count and the mean gap
    between its messages (first message to the end of the call, over the gaps)."""
    messages = max(1, round(statistics.median(r.messages for r in run.results)))
    spans = [r.latency_s - (r.ttft_s or 0.0) for r in run.results]
    interval = statistics.median(spans) / (messages - 1) * 1000 if messages > 1 else 0.0
    return StreamShape(messages, round(interval, 1), max(1, tokens // messages))


def paired(nums: list[float], dens: list[float]) -> dict[str, Any]:
    """The median of per-repetition ratios and their spread; None parts when nothing was measured."""
    ratios = [n / d for n, d in zip(nums, dens, strict=False) if d]
    if not ratios:
        return {"median": None, "min": None, "max": None, "reps": []}
    return {
        "median": round(statistics.median(ratios), 3),
        "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
        "reps": [round(r, 3) for r in ratios],
    }


def ratio_keys(result: dict[str, Any]) -> dict[str, Any]:
    """{key: median ratio} of one variant's run: the keys `docs/benchmarks.json` carries.

    `cpu_per_token_c<N>_vs_floor`; `ttft_p50_c<N>_vs_floor` (the service's whole time to its first
    message over the floor's) and `ttft_added_p50_c<N>_vs_floor` (what the service adds to direct's
    TTFT, over the floor's: the issue's "adds 40 ms where grpc.aio needs 27-40");
    `tokens_per_s_c<N>_vs_direct`; `abort_all_<N>_vs_direct`, and the floor's own
    `abort_floor_<N>_vs_direct` (what grpc.aio alone needs against the engines).
    """
    out: dict[str, Any] = {}
    for row in result.get("streams", []):
        c = row["concurrency"]
        out[f"cpu_per_token_c{c}_vs_floor"] = row["cpu_per_token"]["median"]
        out[f"cpu_per_token_with_http_c{c}_vs_floor"] = row["cpu_per_token_with_http"]["median"]
        out[f"ttft_p50_c{c}_vs_floor"] = row["ttft_p50"]["median"]
        out[f"ttft_added_p50_c{c}_vs_floor"] = row["ttft_added_p50"]["median"]
        out[f"tokens_per_s_c{c}_vs_direct"] = row["tokens_per_s"]["median"]
    for row in result.get("aborts", []):
        n = row["in_flight"]
        out[f"abort_all_{n}_vs_direct"] = row["service"]["median"]
        out[f"abort_floor_{n}_vs_direct"] = row["floor"]["median"]
    return out


# ----------------------------------------------------------------------------------- the runs


def _service_stream(target: str, c: int, seed: int) -> load.RunResult:
    return asyncio.run(load.run_grpc(target, c, c, TOKENS, seed))


def _floor_stream(target: str, c: int, shape: StreamShape) -> grpc_floor.FloorRun:
    return asyncio.run(
        grpc_floor.run_calls(target, c, c, shape.messages, shape.interval_ms, shape.tokens_per_message, 1)
    )


def _metered(pid: int, run: Callable[[], Any]) -> tuple[Any, float]:
    with procs.Meter({"p": pid}, interval_s=0.5) as meter:
        result = run()
    return result, meter.cpu_s["p"]


def stream_rows(
    engines: list[str],
    services: dict[str, tuple[str, int]],
    floor: tuple[str, int],
    concurrency: int,
    reps: int,
    log: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    """Per variant: the paired CPU-per-token, TTFT and tokens/s ratios at one concurrency.

    Each repetition runs direct, every variant and the floor, in reversed order every other
    repetition; the floor sends the message pattern of the first variant's latest run (on a
    reversed repetition, the one before it).
    """
    floor_target, floor_pid = floor
    for target, _ in services.values():
        _service_stream(target, min(concurrency, 32), -1)  # warm-up: connections, engine speed
    names = ["direct", *services, "floor", "http"]
    first = next(iter(services))
    shape: StreamShape | None = None
    raw: list[dict[str, dict[str, Any]]] = []
    for rep in range(reps):
        order = names if rep % 2 == 0 or shape is None else list(reversed(names))
        rows: dict[str, dict[str, Any]] = {}
        for name in order:
            load_before = os.getloadavg()[0]
            if name == "direct":
                t0 = time.perf_counter()
                run = asyncio.run(load.run_direct(engines, concurrency, concurrency, TOKENS, rep))
                ttfts = sorted(r.ttft_s for r in run.results if r.ttft_s is not None)
                tokens = sum(r.tokens for r in run.results)
                rows[name] = {
                    "tokens_per_s": tokens / run.wall_s,
                    "ttft_p50_ms": ttfts[len(ttfts) // 2] * 1000,
                    "wall_s": time.perf_counter() - t0,
                    "errors": run.errors,
                    "load_average": load_before,
                }
            elif name == "http":
                # The HTTP floor: a bare aiohttp client (this process) reading the same streams as
                # the service's engine side, with the engine asked for a message's tokens per SSE
                # event as the service asks (`stream_interval`).
                assert shape is not None
                cpu0 = time.process_time()
                run = asyncio.run(
                    load.run_direct(
                        engines,
                        concurrency,
                        concurrency,
                        TOKENS,
                        rep,
                        stream_interval=shape.tokens_per_message,
                    )
                )
                tokens = sum(r.tokens for r in run.results)
                rows[name] = {
                    "cpu_us_per_token": (time.process_time() - cpu0) / tokens * 1e6,
                    "stream_interval": shape.tokens_per_message,
                    "load_average": load_before,
                }
            elif name == "floor":
                assert shape is not None
                floor_run = functools.partial(_floor_stream, floor_target, concurrency, shape)
                fr, cpu = _metered(floor_pid, floor_run)
                rows[name] = {
                    "cpu_us_per_token": cpu / (concurrency * TOKENS) * 1e6,
                    "cpu_us_per_message": cpu / (concurrency * shape.messages) * 1e6,
                    "ttft_p50_ms": fr.first_message_percentile(0.5) * 1000,
                    "shape": {
                        "messages": shape.messages,
                        "interval_ms": shape.interval_ms,
                        "tokens_per_message": shape.tokens_per_message,
                    },
                    "load_average": load_before,
                }
            else:
                target, pid = services[name]
                svc, cpu = _metered(pid, functools.partial(_service_stream, target, concurrency, rep))
                tokens = sum(r.tokens for r in svc.results)
                ttfts = sorted(r.ttft_s for r in svc.results if r.ttft_s is not None)
                rows[name] = {
                    "cpu_us_per_token": cpu / tokens * 1e6,
                    "tokens_per_s": tokens / svc.wall_s,
                    "ttft_p50_ms": ttfts[len(ttfts) // 2] * 1000,
                    "messages_per_call": statistics.median(r.messages for r in svc.results),
                    "errors": svc.errors,
                    "load_average": load_before,
                }
                if name == first:
                    shape = shape_of(svc, TOKENS)
        # The floor's CPU for the first variant's own message count of this repetition (a loaded
        # engine is slower, so the service sends more, smaller messages: 17-23 per call seen).
        f = rows["floor"]
        f["cpu_us_per_token_matched"] = f["cpu_us_per_message"] * rows[first]["messages_per_call"] / TOKENS
        raw.append(rows)
        d = rows["direct"]
        for name in services:
            s = rows[name]
            log(
                f"  {name:10s} c={concurrency:4d} rep {rep}: {s['cpu_us_per_token']:5.1f} us/token "
                f"ttft {s['ttft_p50_ms']:6.1f} ms ({s['messages_per_call']:.0f} msgs) "
                f"{s['tokens_per_s']:7.0f} tok/s | floor {f['cpu_us_per_token_matched']:5.1f} us/token ttft "
                f"{f['ttft_p50_ms']:6.1f} ms ({f['shape']['messages']} x {f['shape']['interval_ms']:.0f} ms) "
                f"| direct ttft {d['ttft_p50_ms']:6.1f} ms {d['tokens_per_s']:7.0f} tok/s "
                f"| load {s['load_average']:.2f}"
            )

    def col(name: str, key: str) -> list[float]:
        return [float(r[name][key]) for r in raw]

    out: dict[str, dict[str, Any]] = {}
    for name in services:
        added = [s - d for s, d in zip(col(name, "ttft_p50_ms"), col("direct", "ttft_p50_ms"), strict=True)]
        out[name] = {
            "concurrency": concurrency,
            "token_delay_ms": STREAM_DELAY_MS,
            "cpu_per_token": paired(col(name, "cpu_us_per_token"), col("floor", "cpu_us_per_token_matched")),
            # Against grpc.aio's floor plus a bare aiohttp client reading the same SSE events
            # (direct's client): the two halves of the service's work that are not its own code.
            "cpu_per_token_with_http": paired(
                col(name, "cpu_us_per_token"),
                [
                    g + h
                    for g, h in zip(
                        col("floor", "cpu_us_per_token_matched"),
                        col("http", "cpu_us_per_token"),
                        strict=True,
                    )
                ],
            ),
            "http_client_cpu_us_per_token_median": round(
                statistics.median(col("http", "cpu_us_per_token")), 2
            ),
            "ttft_p50": paired(col(name, "ttft_p50_ms"), col("floor", "ttft_p50_ms")),
            "ttft_added_p50": paired(added, col("floor", "ttft_p50_ms")),
            "tokens_per_s": paired(col(name, "tokens_per_s"), col("direct", "tokens_per_s")),
            "service_cpu_us_per_token_median": round(statistics.median(col(name, "cpu_us_per_token")), 2),
            "floor_cpu_us_per_token_median": round(
                statistics.median(col("floor", "cpu_us_per_token_matched")), 2
            ),
            "service_ttft_p50_ms_median": round(statistics.median(col(name, "ttft_p50_ms")), 1),
            "direct_ttft_p50_ms_median": round(statistics.median(col("direct", "ttft_p50_ms")), 1),
            "floor_ttft_p50_ms_median": round(statistics.median(col("floor", "ttft_p50_ms")), 1),
            "reps": [{k: r[k] for k in ("direct", name, "floor", "http")} for r in raw],
        }
    return out


def abort_rows(
    engines: list[str],
    services: dict[str, str],
    floor_target: str,
    in_flight: int,
    reps: int,
    log: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    """Per variant: the paired Abort(all) / direct pause+resume ratio and the floor's, at one count."""
    names = ["direct", *services, "floor"]
    times: dict[str, list[float | None]] = {name: [] for name in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            seed = rep * 7919 + in_flight
            try:
                if name == "direct":
                    result = asyncio.run(load.abort_direct(engines, in_flight, ABORT_MAX_TOKENS, seed))
                elif name == "floor":
                    result = asyncio.run(grpc_floor.abort_floor(floor_target, in_flight))
                else:
                    result = asyncio.run(load.abort_grpc(services[name], in_flight, ABORT_MAX_TOKENS, seed))
            except Exception as exc:  # one failed repetition on a loaded machine must not lose the run
                log(f"  abort {name} n={in_flight} rep {rep}: failed: {type(exc).__name__}: {exc}"[:300])
                times[name].append(None)
                time.sleep(3.0)  # the failed run's generations end (or are aborted)
                continue
            times[name].append(result.last_delivery_s * 1000)
            log(
                f"  abort {name:10s} n={in_flight:5d} rep {rep}: "
                f"last {result.last_delivery_s * 1000:7.1f} ms "
                f"aborted {result.aborted}/{in_flight} load {os.getloadavg()[0]:.2f}"
            )
            time.sleep(1.0)  # the engines finish the aborted requests' bookkeeping

    def pairs(name: str) -> dict[str, Any]:
        both = [(t, d) for t, d in zip(times[name], times["direct"], strict=True) if t and d]
        return paired([t for t, _ in both], [d for _, d in both])

    def med(name: str) -> float | None:
        ok = [t for t in times[name] if t is not None]
        return round(statistics.median(ok), 1) if ok else None

    return {
        name: {
            "in_flight": in_flight,
            "token_delay_ms": ABORT_DELAY_MS,
            "service": pairs(name),
            "floor": pairs("floor"),
            "service_ms_median": med(name),
            "direct_ms_median": med("direct"),
            "floor_ms_median": med("floor"),
            "reps_ms": {k: times[k] for k in ("direct", name, "floor")},
        }
        for name in services
    }


def run(
    group: procs.Processes,
    variants: list[Variant],
    reps: int,
    concurrencies: tuple[int, ...] = (64, 512),
    in_flight: tuple[int, ...] = (256, 1024),
    log: Callable[[str], None] = lambda line: print(line, flush=True),
) -> dict[str, Any]:
    """Both phases for every variant (stopping each phase's processes after it); the results by variant."""
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    port_file = procs.fresh_port_file(group.workdir / "floor.port")
    floor_proc = group.start(
        "floor", [sys.executable, "-m", "bench.grpc_floor", "--serve", str(port_file)], cwd=procs.REPO
    )
    floor = (f"127.0.0.1:{procs.read_port_file(port_file, floor_proc)}", floor_proc.popen.pid)
    asyncio.run(grpc_floor.run_calls(floor[0], 16, 32, 1, 0, 16, 1))  # warm-up
    results: dict[str, dict[str, Any]] = {v.name: {"streams": [], "aborts": []} for v in variants}

    def services(delay_ms: float, tag: str) -> tuple[list[str], dict[str, tuple[str, int]]]:
        sims = [procs.start_sim(group, f"{tag}-engine{i}", delay_ms, seed=i) for i in range(2)]
        engines = [sim.url for sim in sims]
        out = {}
        for v in variants:
            one = [] if v.src is None else ["--workers", "1"]  # this checkout's gets it from start_service
            svc = procs.start_service(group, f"{tag}-{v.name}", engines, [*one, *v.args], src=v.src)
            out[v.name] = (svc.target, svc.proc.pid)
        return engines, out

    if concurrencies:
        log(f"floor phase: streams at {STREAM_DELAY_MS:g} ms/token")
        engines, svcs = services(STREAM_DELAY_MS, "fs")
        for c in concurrencies:
            for name, row in stream_rows(engines, svcs, floor, c, reps, log).items():
                results[name]["streams"].append(row)
        for proc in [p for p in group.procs if p.name.startswith("fs-")]:
            group.stop(proc)  # by PID; the floor server stays for the abort phase
    if in_flight:
        log(f"floor phase: Abort(all) at {ABORT_DELAY_MS:g} ms/token")
        engines, svcs = services(ABORT_DELAY_MS, "fa")
        targets = {name: t for name, (t, _) in svcs.items()}
        for target in targets.values():  # warm-up
            asyncio.run(load.abort_grpc(target, 32, ABORT_MAX_TOKENS, -1))
        for n in in_flight:
            for name, row in abort_rows(engines, targets, floor[0], n, reps, log).items():
                results[name]["aborts"].append(row)
    for result in results.values():
        result["ratios"] = ratio_keys(result)
    return {
        "reps": reps,
        "load_average_at_start": load_at_start,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "targets": FLOOR_TARGETS,
        "variants": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--variant", action="append", default=None, help="NAME[=SRC[:ARGS]] (default: this checkout)"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, action="append", default=None, help="default 64 and 512")
    parser.add_argument("--in-flight", type=int, action="append", default=None, help="default 256 and 1024")
    parser.add_argument("--no-streams", action="store_true")
    parser.add_argument("--no-abort", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--update", type=Path, default=None, help="replace the 'floor' section of this benchmarks.json"
    )
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    variants = [parse_variant(v) for v in (args.variant or ["service"])]
    concurrencies = () if args.no_streams else tuple(args.concurrency or (64, 512))
    counts = () if args.no_abort else tuple(args.in_flight or (256, 1024))
    workdir = Path(tempfile.mkdtemp(prefix="rollout-floor-"))
    try:
        with procs.Processes(workdir) as group:
            result = run(group, variants, args.reps, concurrencies, counts)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(floor_table(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.update:
        from bench.report import write_markdown
        from bench.run import environment

        document = json.loads(args.update.read_text())
        result["environment"] = environment()
        document["floor"] = result
        args.update.write_text(json.dumps(document, indent=2) + "\n")
        write_markdown(document, args.update.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
