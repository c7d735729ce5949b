"""`serve --workers N` against engines that cost ~no CPU: does a second worker use the second core?

Why: with simulated engines on the same small machine the engines are the bottleneck, so worker
counts measure the engines (docs/workers.md). Here the engines are nginx serving a recorded vLLM
stream (`bench/static_engine.py`: 256 tokens with logprobs at once, 0 ms/token), so the cores go
to the service and the load generator. Every variant runs against the same nginx, side by side in
one run, in rotating order, at each concurrency; every process's CPU is metered (the supervisor,
each worker, nginx, each load-generator process), and the ceiling the machine allows is computed
from the measured CPU per token:

    w2/w1 <= (cores / (S + C + E)) / min(1 / S, cores / (S + C + E))

with S, C, E the service's, the clients' and the engine's CPU seconds per token (S from the
one-worker runs: one worker can use at most one core; everything shares `cores`).

    python -m bench.workers --client h2load --concurrency 64 --concurrency 256 --connections 32 --reps 3

`--client h2load` (the default is `python`, this package's asyncio client) drives the calls with
h2load, nghttp2's load generator in C (`bench/h2load.py`; Debian package nghttp2-client): it costs
~0.13 of the service's CPU per token where the Python client costs ~0.6, so the load generator no
longer takes the core a second worker is meant to use. h2load reads no gRPC trailers: each run is
checked against the service's metrics (one Generate OK and `max_tokens` tokens per call) and the
response bytes, and a run that does not add up fails the bench. h2load measures no time to first
token (its latency per call is reported instead). `--clients P` splits the Python load over P
processes; `--final-only` makes the clients (and the service) cheaper per token. The first line
printed is how much work two processes of pure Python do against one on this machine right now:
the machine's own ceiling, below 2x when the vCPUs share a core or other work runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench import h2load, load, procs, static_engine
from bench.compare import Variant, parse_variant, run_grpc_custom
from bench.run import SystemCpu, Workload, summarise
from bench.sections import num

DEFAULT_VARIANTS = ("w1=:--workers 1", "w2=:--workers 2")


@dataclass
class ServiceUnderTest:
    """One variant's replica: where to call it, what to meter, and (for h2load) how to check it."""

    target: str
    pids: dict[str, int]
    metrics_port: int
    request_file: Path
    call_bytes: int = 0


def _client_main(
    target: str,
    concurrency: int,
    requests: int,
    max_tokens: int,
    seed: int,
    final_only: bool,
    connections: int,
    go: Any,
    out: Any,
) -> None:
    """One load-generator process: waits for `go` (so the parent meters it from the start)."""
    go.wait()
    run = asyncio.run(
        run_grpc_custom(target, concurrency, requests, max_tokens, seed, final_only, None, None, connections)
    )
    out.put(run)


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


@contextlib.contextmanager
def profiled(service: ServiceUnderTest, args: argparse.Namespace, label: str) -> Iterator[None]:
    """With `--py-spy DIR`: py-spy samples every serving process of the row (collapsed stacks in
    DIR/<label>-<process>.txt, for `bench.pyspy_top`); it costs CPU, so such rows measure nothing."""
    if args.py_spy is None:
        yield
        return
    args.py_spy.mkdir(parents=True, exist_ok=True)
    binary = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    spy_cmd = [binary, "record", "--format", "raw", "--nonblocking", "--rate", "100"]
    spies = [
        subprocess.Popen(
            [*spy_cmd, "--pid", str(pid), "--output", str(args.py_spy / f"{label}-{proc}.txt")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for proc, pid in service.pids.items()
        if proc != "service" or len(service.pids) == 1  # the supervisor handles no call
    ]
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(30)


def run_h2load(
    args: argparse.Namespace,
    concurrency: int,
    service: ServiceUnderTest,
    engine_pids: dict[str, int],
    workdir: Path,
    label: str,
) -> tuple[load.RunResult, procs.Meter, float]:
    """The workload from one h2load process, metered; every call checked against the service's metrics."""
    log_file = workdir / "h2load.log"
    argv = h2load.command(
        service.target, service.request_file, args.requests, concurrency, args.connections, log_file
    )
    before = h2load.scrape(service.metrics_port)
    system = SystemCpu()
    with (
        procs.Meter({**service.pids, **engine_pids}, interval_s=0.05) as meter,
        profiled(service, args, label),
    ):
        result = h2load.run(argv, log_file)
    busy = system.elapsed()
    meter.cpu_s["client"] = result.cpu_s
    problems: list[str] = []
    for _ in range(50):  # the last calls' metrics land just after their trailers left
        counted = h2load.scrape(service.metrics_port).minus(before)
        problems = h2load.verify(result, counted, args.requests, args.max_tokens, service.call_bytes)
        if not problems:
            break
        time.sleep(0.1)
    if problems:
        raise RuntimeError("h2load run not verified: " + "; ".join(problems) + "\n" + result.output)
    results = [load.Result(lat, None, args.max_tokens, "verified") for lat in result.latencies_s]
    return load.RunResult(results, result.wall_s, args.requests - result.succeeded), meter, busy


def run_clients(
    target: str,
    args: argparse.Namespace,
    concurrency: int,
    seed: int,
    service_pids: dict[str, int],
    engine_pids: dict[str, int],
) -> tuple[load.RunResult, procs.Meter, float]:
    """The closed-loop workload from `args.clients` Python processes (1: this process), metered."""
    if args.clients == 1:
        pids = {"client": os.getpid(), **service_pids, **engine_pids}
        system = SystemCpu()
        with procs.Meter(pids, interval_s=0.05) as meter:
            run = asyncio.run(
                run_grpc_custom(
                    target,
                    concurrency,
                    args.requests,
                    args.max_tokens,
                    seed,
                    args.final_only,
                    None,
                    None,
                    args.connections,
                )
            )
        return run, meter, system.elapsed()
    ctx = multiprocessing.get_context("spawn")  # grpc does not survive fork
    go, out = ctx.Event(), ctx.Queue()
    children = [
        ctx.Process(
            target=_client_main,
            args=(target, c, n, args.max_tokens, seed * 100 + i, args.final_only, args.connections, go, out),
        )
        for i, (c, n) in enumerate(
            zip(_split(concurrency, args.clients), _split(args.requests, args.clients), strict=True)
        )
    ]
    for child in children:
        child.start()
    pids = {f"client{i}": int(child.pid or 0) for i, child in enumerate(children)}
    pids.update(service_pids)
    pids.update(engine_pids)
    time.sleep(3.0)  # let the children import grpc before the meter starts (their start-up is not load)
    system = SystemCpu()
    with procs.Meter(pids, interval_s=0.05) as meter:
        start = time.perf_counter()
        go.set()
        runs = [out.get(timeout=600) for _ in children]
        wall = time.perf_counter() - start
    for child in children:
        child.join(30)
    merged = load.RunResult([r for run in runs for r in run.results], wall, sum(run.errors for run in runs))
    return merged, meter, system.elapsed()


def _spin(n: int) -> None:
    """A fixed amount of pure-Python work (the kind a worker's event loop does)."""
    total = 0
    for i in range(n):
        total += i * i % 7


def machine_scaling(cores: int, loops: int = 10_000_000) -> float:
    """How much work `cores` processes get done at once against one alone (cores on a quiet
    machine: `cores`; less when the vCPUs share a physical core or other load runs)."""
    ctx = multiprocessing.get_context("spawn")

    def timed(n: int) -> float:
        children = [ctx.Process(target=_spin, args=(loops,)) for _ in range(n)]
        start = time.perf_counter()
        for child in children:
            child.start()
        for child in children:
            child.join()
        return time.perf_counter() - start

    one = timed(1)
    return cores * one / timed(cores)


def _softirq_s() -> float:
    """The machine's CPU seconds in soft interrupts so far."""
    return float(psutil.cpu_times().softirq)


def _per_mtok(cpu: dict[str, float], prefix: str, tokens: int) -> float:
    return sum(v for k, v in cpu.items() if k.startswith(prefix)) / tokens * 1e6 if tokens else 0.0


def ceiling(s: float, c: float, e: float, cores: int = 2) -> float:
    """The largest w2/w1 the machine allows (see the module docstring); CPU in s per token."""
    shared = cores / (s + c + e)
    return shared / min(1 / s, shared)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workers", description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", default=None, help="NAME[=SRC[:ARGS]] (w1, w2)")
    parser.add_argument("--concurrency", type=int, action="append", default=None, help="repeatable")
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="tokens per SSE event of the recorded stream (default: what the service asks once it "
        "measured the engine: 16 streaming, 64 final-only)",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8, help="per client process")
    parser.add_argument("--clients", type=int, default=1, help="load-generator processes (--client python)")
    parser.add_argument(
        "--client",
        choices=("python", "h2load"),
        default="python",
        help="the load generator: this package's asyncio client, or h2load (nghttp2-client, in C: ~no CPU; "
        "every call checked against the service's metrics)",
    )
    parser.add_argument("--final-only", action="store_true", help="clients ask for the final sample only")
    parser.add_argument("--nginx-workers", type=int, default=1)
    parser.add_argument(
        "--py-spy", type=Path, default=None, help="with --client h2load: profile every serving process here"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every repetition here")
    args = parser.parse_args(argv)
    if args.client == "h2load":
        try:
            h2load.binary()
        except h2load.H2loadMissing as exc:
            parser.error(str(exc))
        if args.clients != 1:
            parser.error("--clients applies to --client python (h2load is one process)")
    variants: list[Variant] = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    concurrencies: list[int] = args.concurrency or [64, 256]
    cores = len(os.sched_getaffinity(0))
    stream_interval = args.stream_interval or (64 if args.final_only else 16)

    scaling = machine_scaling(cores)
    print(f"machine: {cores} processes of pure-Python work do {scaling:.2f}x the work of one", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="rollout-workers-"))
    rows: list[dict[str, Any]] = []
    try:
        with procs.Processes(workdir) as group:
            engines = static_engine.start(
                group, 2, args.max_tokens, stream_interval, nginx_workers=args.nginx_workers
            )
            engine_pids = {f"nginx{i}": p for i, p in enumerate(engines.pids)}
            request_file = h2load.write_request_file(
                workdir / "request.grpc", args.max_tokens, args.final_only
            )
            targets: dict[str, ServiceUnderTest] = {}
            for v in variants:
                extra = ["--metrics-port", "0", *v.args]  # before the variant's flags: they may override it
                service = procs.start_service(group, f"svc-{v.name}", engines.urls, extra, src=v.src)
                pids = {"service": service.proc.pid}
                pids.update(
                    {f"service-w{i}": int(p) for i, p in enumerate(service.info.get("worker_pids") or [])}
                )
                targets[v.name] = ServiceUnderTest(
                    service.target, pids, int(service.info.get("metrics") or 0), request_file
                )
            for v in variants:  # warm-up: connections, the engines' measured speed (stream_interval)
                asyncio.run(
                    run_grpc_custom(
                        targets[v.name].target,
                        16,
                        64,
                        args.max_tokens,
                        -1,
                        args.final_only,
                        None,
                        None,
                        args.connections,
                    )
                )
                if args.client == "h2load":
                    targets[v.name].call_bytes = asyncio.run(
                        h2load.expected_response_bytes(
                            targets[v.name].target, args.max_tokens, args.final_only
                        )
                    )
            names = [v.name for v in variants]
            for rep in range(args.reps):
                for concurrency in concurrencies:
                    order = names[rep % len(names) :] + names[: rep % len(names)]
                    for name in order:
                        under_test = targets[name]
                        softirq = _softirq_s()
                        if args.client == "h2load":
                            run, meter, busy = run_h2load(
                                args,
                                concurrency,
                                under_test,
                                engine_pids,
                                workdir,
                                f"{name}-c{concurrency}-rep{rep}",
                            )
                        else:
                            run, meter, busy = run_clients(
                                under_test.target, args, concurrency, rep, under_test.pids, engine_pids
                            )
                        softirq = _softirq_s() - softirq
                        workload = Workload(0.0, concurrency, args.requests, args.reps)
                        row = summarise("service", workload, run, meter, busy)
                        tokens = row["tokens"]
                        cpu = meter.cpu_s
                        row.update(
                            variant=name,
                            rep=rep,
                            cpu_s_by_process={k: round(v, 2) for k, v in cpu.items()},
                            client_cpu_s_per_mtok=round(_per_mtok(cpu, "client", tokens), 2),
                            nginx_cpu_s_per_mtok=round(_per_mtok(cpu, "nginx", tokens), 2),
                            machine_busy_cores=round(busy / run.wall_s, 2),
                            # in `other`: the kernel's network work on loopback, counted to no process
                            softirq_cores=round(softirq / run.wall_s, 2),
                        )
                        rows.append(row)
                        print(
                            f"c={concurrency:<4d} {name:6s} rep {rep}: {row['tokens_per_s']:>9,.0f} tok/s  "
                            f"ttft p50 {num(row['ttft_p50_ms'], '7.1f')} ms  "
                            f"latency p50 {row['latency_p50_ms']:7.1f} ms  "
                            f"errors {row['errors']}  "
                            f"s/Mtok svc {row['service_cpu_s_per_mtok'] or 0:5.1f} "
                            f"client {row['client_cpu_s_per_mtok']:5.1f} "
                            f"nginx {row['nginx_cpu_s_per_mtok']:4.2f}  "
                            f"other {row['other_load_cores']} (softirq {row['softirq_cores']})  "
                            f"cpu s {row['cpu_s_by_process']}",
                            flush=True,
                        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    report(rows, names, concurrencies, cores)
    return 0


def report(rows: list[dict[str, Any]], names: list[str], concurrencies: list[int], cores: int) -> None:
    """The table per concurrency, the measured ratio of the last variant to the first, the ceiling."""
    print()
    print(
        "| streams | variant | tokens/s best (median) | TTFT / latency p50 ms (median; h2load: no TTFT) "
        "| CPU s/Mtok: service / "
        "clients / nginx (median) | cores used: service / clients / whole machine (median) "
        "| other load cores |"
    )
    print("| ---: | --- | ---: | ---: | --- | --- | --- |")
    med: dict[tuple[int, str], dict[str, float]] = {}
    for c in concurrencies:
        for name in names:
            reps = [r for r in rows if r["variant"] == name and r["concurrency"] == c]
            ttfts = [r["ttft_p50_ms"] for r in reps if r["ttft_p50_ms"] is not None]
            m = {
                key: statistics.median(float(r[key] or 0) for r in reps)
                for key in (
                    "tokens_per_s",
                    "latency_p50_ms",
                    "service_cpu_s_per_mtok",
                    "client_cpu_s_per_mtok",
                    "nginx_cpu_s_per_mtok",
                )
            }
            m["ttft_p50_ms"] = statistics.median(ttfts) if ttfts else math.nan
            m["best"] = max(r["tokens_per_s"] for r in reps)
            m["busy_cores"] = statistics.median(r["machine_busy_cores"] for r in reps)
            m["service_cores"] = statistics.median(r["service_cpu_s"] / r["wall_s"] for r in reps)
            m["client_cores"] = statistics.median(
                sum(v for k, v in r["cpu_s_by_process"].items() if k.startswith("client")) / r["wall_s"]
                for r in reps
            )
            med[(c, name)] = m
            other = ", ".join(f"{r['other_load_cores']:.2f}" for r in reps)
            print(
                f"| {c} | {name} | {m['best']:,.0f} ({m['tokens_per_s']:,.0f}) | {num(m['ttft_p50_ms'])} / "
                f"{m['latency_p50_ms']:,.0f} "
                f"| {m['service_cpu_s_per_mtok']:.1f} / {m['client_cpu_s_per_mtok']:.1f} / "
                f"{m['nginx_cpu_s_per_mtok']:.2f} | {m['service_cores']:.2f} / {m['client_cores']:.2f} / "
                f"{m['busy_cores']:.2f} "
                f"| {other} |"
            )
    if len(names) < 2:
        return
    first, last = names[0], names[-1]
    print()
    for c in concurrencies:
        a, b = med[(c, first)], med[(c, last)]
        s1, c1, e1 = (a[k] / 1e6 for k in PER_TOKEN)
        s2, c2, e2 = (b[k] / 1e6 for k in PER_TOKEN)
        print(
            f"c={c}: {last}/{first} = {b['best'] / a['best']:.2f}x best, "
            f"{b['tokens_per_s'] / a['tokens_per_s']:.2f}x median. Ceiling on {cores} cores from "
            f"{first}'s CPU per token (S={s1 * 1e6:.1f}, C={c1 * 1e6:.1f}, E={e1 * 1e6:.2f} s/Mtok): "
            f"{ceiling(s1, c1, e1, cores):.2f}x; {last} at every core with its own CPU per token "
            f"(S={s2 * 1e6:.1f}, C={c2 * 1e6:.1f}, E={e2 * 1e6:.2f}): {cores / (s2 + c2 + e2):,.0f} tok/s = "
            f"{cores / (s2 + c2 + e2) / a['tokens_per_s']:.2f}x {first}'s median. Machine busy "
            f"{a['busy_cores']:.2f} ({first}) and {b['busy_cores']:.2f} ({last}) of {cores} cores; "
            f"{first}'s service used {a['service_cores']:.2f}"
        )


PER_TOKEN = ("service_cpu_s_per_mtok", "client_cpu_s_per_mtok", "nginx_cpu_s_per_mtok")


if __name__ == "__main__":
    raise SystemExit(main())
