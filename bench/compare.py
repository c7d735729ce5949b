"""A/B a change to the service: several service builds against the same engines, side by side.

Why: an optimisation of the server is only worth proposing with numbers, and on a small shared
machine numbers are only comparable inside one run. This starts one pair of simulated engines and
one service process per variant (each variant is a directory holding a modified copy of the
`rollout_grpc` package, put first on that process's `PYTHONPATH`, plus optional extra `serve`
arguments), then runs the same closed-loop workload over every variant in rotating order, and
prints tokens/s, latency, TTFT and service CPU per million tokens for each (best repetition, and
the median CPU per million tokens over repetitions, which is less sensitive to outside load).

    python -m bench.compare --variant base --variant 'first=/tmp/scratch/first' \\
        --variant 'iv200=:--stream-batch-interval-ms 200' --delay 20 --concurrency 64 --requests 128

A variant is `NAME`, `NAME=SRC` or `NAME=SRC:ARGS` (SRC empty = this checkout). `--sim-src` runs
the engines from another copy too (e.g. a simulator that honours `stream_interval`). `--engine URL`
(repeatable) uses running engines instead of simulated ones, e.g. a real vLLM server started with
`python -m tools.vllm.launch dense`; their CPU is then not metered.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import shlex
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import load, procs
from bench.run import SystemCpu, Workload, summarise
from rollout_grpc.client import AsyncRolloutClient


@dataclass(frozen=True, slots=True)
class Variant:
    """One service build: a name, an optional source directory and extra `serve` arguments."""

    name: str
    src: Path | None
    args: tuple[str, ...]


def parse_variant(text: str) -> Variant:
    name, _, rest = text.partition("=")
    src, _, args = rest.partition(":")
    return Variant(name, Path(src) if src else None, tuple(shlex.split(args)))


async def run_grpc_custom(
    target: str,
    concurrency: int,
    requests: int,
    max_tokens: int,
    seed: int,
    final_only: bool,
    batch_tokens: int | None,
    batch_interval_ms: int | None,
    connections: int = 1,
) -> load.RunResult:
    """`load.run_grpc` with per-request batching options, over `connections` TCP connections (a
    `serve --workers N` replica serves each connection on one worker)."""
    rng = random.Random(seed)
    parts = []
    for _ in range(requests):
        sample, params, options = load.grpc_request_parts(load.prompt(rng), max_tokens, final_only)
        if batch_tokens is not None:
            options.stream_batch_tokens = batch_tokens
        if batch_interval_ms is not None:
            options.stream_batch_interval_ms = batch_interval_ms
        parts.append((sample, params, options))
    async with AsyncRolloutClient(target, connections=connections) as client:
        return await load.closed_loop(
            concurrency, requests, lambda i: load.grpc_generate(client, parts[i], f"cmp-{seed}-{i}")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", required=True, help="NAME[=SRC[:ARGS]]")
    parser.add_argument("--sim-src", type=Path, default=None, help="rollout_grpc copy for the engines")
    parser.add_argument("--delay", type=float, default=0.0, help="engine ms per token")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--final-only", action="store_true", help="clients ask for the final sample only")
    parser.add_argument("--batch-tokens", type=int, default=None)
    parser.add_argument("--batch-interval-ms", type=int, default=None)
    parser.add_argument(
        "--connections", type=int, default=1, help="client TCP connections (>= workers for --workers N)"
    )
    parser.add_argument("--no-direct", action="store_true", help="leave out the direct HTTP row")
    parser.add_argument("--json", type=Path, default=None, help="write every repetition here")
    parser.add_argument(
        "--engine", action="append", default=[], help="a running engine's URL instead of simulators"
    )
    args = parser.parse_args(argv)

    variants = [parse_variant(v) for v in args.variant]
    workload = Workload(args.delay, args.concurrency, args.requests, args.reps)
    workdir = Path(tempfile.mkdtemp(prefix="rollout-compare-"))
    rows: list[dict[str, Any]] = []
    try:
        with procs.Processes(workdir) as group:
            sims = (
                []
                if args.engine
                else [
                    procs.start_sim(group, f"engine{i}", args.delay, seed=i, src=args.sim_src)
                    for i in range(2)
                ]
            )
            engines = list(args.engine) or [sim.url for sim in sims]
            # A real engine refuses a direct request for a model it does not serve.
            model = asyncio.run(load.served_model(engines[0])) if args.engine else load.SIM_MODEL
            engine_pids = [sim.proc.pid for sim in sims]
            targets: dict[str, tuple[str, dict[str, int]]] = {}
            for v in variants:
                service = procs.start_service(group, f"svc-{v.name}", engines, list(v.args), src=v.src)
                # A `serve --workers N` supervisor and its workers, each metered.
                workers = service.info.get("worker_pids") or []
                service_pids = {"service": service.proc.pid}
                service_pids.update({f"service-w{i}": int(pid) for i, pid in enumerate(workers)})
                targets[v.name] = (service.target, service_pids)
            names = ([] if args.no_direct else ["direct"]) + [v.name for v in variants]

            def runner(name: str, seed: int, c: int, n: int, m: int) -> Any:
                if name == "direct":
                    return load.run_direct(engines, c, n, m, seed, model)
                return run_grpc_custom(
                    targets[name][0],
                    c,
                    n,
                    m,
                    seed,
                    args.final_only,
                    args.batch_tokens,
                    args.batch_interval_ms,
                    args.connections,
                )

            for name in names:  # warm-up
                asyncio.run(runner(name, -1, min(args.concurrency, 16), 32, 16))
            for rep in range(args.reps):
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    pids = {f"engine{i}": p for i, p in enumerate(engine_pids)}
                    if name != "direct":
                        pids.update(targets[name][1])
                    system = SystemCpu()
                    with procs.Meter(pids, interval_s=0.05) as meter:
                        run = asyncio.run(
                            functools.partial(
                                runner, name, rep, args.concurrency, args.requests, args.max_tokens
                            )()
                        )
                    row = summarise(
                        "direct" if name == "direct" else "service", workload, run, meter, system.elapsed()
                    )
                    row["variant"], row["rep"] = name, rep
                    row["cpu_s_by_process"] = {k: round(v, 2) for k, v in meter.cpu_s.items()}
                    row["wall_s"] = round(run.wall_s, 2)
                    done = [r for r in run.results if r.messages]
                    row["messages_per_sample"] = (
                        round(sum(r.messages for r in done) / len(done), 1) if done else None
                    )
                    rows.append(row)
                    print(
                        f"{name:14s} rep {rep}: {row['tokens_per_s']:>9,.0f} tok/s  "
                        f"p50 {row['latency_p50_ms']:8.1f} ms  p99 {row['latency_p99_ms']:8.1f} ms  "
                        f"ttft p50 {row['ttft_p50_ms']:7.1f} ms  "
                        f"svc {row['service_cpu_s_per_mtok'] or 0:6.1f} s/Mtok  rss "
                        f"{row['service_peak_rss_mib'] or 0:5.0f} MiB  other {row['other_load_cores']}  "
                        f"msgs/sample {row['messages_per_sample']}  "
                        f"cpu s {row['cpu_s_by_process']}",
                        flush=True,
                    )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(
        "| variant | best tokens/s | p50 ms | p99 ms | TTFT p50 ms | service CPU s/Mtok (median) "
        "| peak RSS MiB |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        reps = [r for r in rows if r["variant"] == name]
        best = max(reps, key=lambda r: r["tokens_per_s"])
        cpu = [r["service_cpu_s_per_mtok"] for r in reps if r["service_cpu_s_per_mtok"]]
        print(
            f"| {name} | {best['tokens_per_s']:,.0f} | {best['latency_p50_ms']:,.1f} "
            f"| {best['latency_p99_ms']:,.1f} "
            f"| {best['ttft_p50_ms']:,.1f} | {statistics.median(cpu) if cpu else 0:,.1f} "
            f"| {best['service_peak_rss_mib'] or 0:,.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
