"""A/B of Abort(all) latency: the service's Abort(all) against the engines' own pause+resume.

Why: Abort(all) is what a trainer waits on at every weight update, so its cost over the direct
`/pause?mode=abort` + `/resume` (what vime sends) is the service's overhead on every step. The
numbers of different builds are only comparable inside one run on a small shared machine, so this
starts one pair of simulated engines (100 ms per token, as `bench.run`'s abort phase) and one
service process per variant (as `bench.compare`: `NAME`, `NAME=SRC` or `NAME=SRC:ARGS`, SRC a
directory holding a copy of the `rollout_grpc` package), then times `direct` and every variant at
each in-flight count, in rotating order, `--reps` times. With `--busy`, another process spins on
a core during every measurement (a trainer's data loader, another helper's job), and is stopped
by its PID afterwards.

    python -m bench.abort_all --variant base=/tmp/base --variant new --reps 5 --busy
    python -m bench.abort_all --variant 'w1=/tmp/base:--workers 1' \
        --variant 'w2=/tmp/base:--workers 2' --connections w2=4

A variant runs as one process (`--workers 1`) when it is this checkout's code; a variant with a
SRC gets `serve`'s default (the cores of the machine) unless its ARGS say otherwise, so give
`--workers` explicitly when comparing copies. `--connections NAME=K` makes that variant's client
open K TCP connections (with `--workers N`, the kernel hands each connection to one worker).

It prints, per variant and in-flight count, the median and best time from the abort call to the
last aborted sample, the ratio of the medians to `direct`'s, and the medians of the service's CPU
seconds (its workers included), the client's (this process), and the load from outside the
benchmark's processes in cores (the `--busy` spinner included). The CPU columns cover the whole
repetition (starting the streams too) and move much less than the latencies on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from bench import grpc_floor, load, procs
from bench.compare import Variant, parse_variant
from bench.run import ABORT_TOKEN_DELAY_MS, SystemCpu

#: Tokens each generation may make: far more than it makes before the abort.
MAX_TOKENS = 2048
#: The path of `--floor`: a bare grpc.aio server whose held streams one call ends (bench/grpc_floor.py).
FLOOR = "grpc.aio floor"


@contextlib.contextmanager
def busy_core(enabled: bool) -> Iterator[None]:
    """Another process spinning on one core while the block runs (stopped by its PID)."""
    if not enabled:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # let it reach the run queue
        yield
    finally:
        spinner.kill()
        spinner.wait()


def measure(
    name: str, engines: list[str], targets: dict[str, str], n: int, seed: int, connections: int = 1
) -> load.AbortResult | None:
    """One abort-all of `n` generations by `name` (`direct` or a variant, its client on
    `connections` channels); None when it failed (printed: one failed repetition on a loaded
    machine must not lose the run)."""
    try:
        if name == "direct":
            return asyncio.run(load.abort_direct(engines, n, MAX_TOKENS, seed))
        if name == FLOOR:
            return asyncio.run(grpc_floor.abort_floor(targets[name], n, connections))
        return asyncio.run(load.abort_grpc(targets[name], n, MAX_TOKENS, seed, connections))
    except Exception as exc:
        print(f"{name} n={n}: failed: {type(exc).__name__}: {exc}"[:300], flush=True)
        return None


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their children (a `--workers N`
    supervisor's workers) so far; a process that is gone counts 0."""
    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            family = [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for member in family:
            try:
                times = member.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
    return total


def parse_connections(values: list[str], names: list[str]) -> dict[str, int]:
    """`NAME=K` options as {variant name: channels}; SystemExit naming the bad value."""
    out: dict[str, int] = {}
    for value in values:
        name, sep, count = value.partition("=")
        if not sep or name not in names or not count.isdigit() or int(count) < 1:
            raise SystemExit(f"--connections: expected NAME=K (a variant and K >= 1), got {value!r}")
        out[name] = int(count)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.abort_all", description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", required=True, help="NAME[=SRC[:ARGS]]")
    parser.add_argument("--in-flight", type=int, action="append", default=None, help="default 256 and 1024")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--busy", action="store_true", help="spin another process on a core meanwhile")
    parser.add_argument(
        "--floor",
        action="store_true",
        help=f"add the path {FLOOR!r}: a bare grpc.aio server (no engines, no service code) whose "
        "streams each sent a message and all end at one call, the least an Abort(all) through "
        "grpc.aio can take",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every repetition here")
    parser.add_argument(
        "--connections",
        action="append",
        default=[],
        metavar="NAME=K",
        help="the client of variant NAME opens K channels (default 1); with `--workers N` each "
        "connection is served by one worker",
    )
    args = parser.parse_args(argv)

    variants: list[Variant] = [parse_variant(v) for v in args.variant]
    counts: list[int] = args.in_flight or [256, 1024]
    connections = parse_connections(args.connections, [v.name for v in variants])
    workdir = Path(tempfile.mkdtemp(prefix="rollout-abort-"))
    rows: list[dict[str, Any]] = []
    try:
        with procs.Processes(workdir) as group:
            sims = [procs.start_sim(group, f"engine{i}", ABORT_TOKEN_DELAY_MS, seed=i) for i in range(2)]
            engines = [sim.url for sim in sims]
            targets: dict[str, str] = {}
            service_pids: dict[str, list[int]] = {"direct": []}
            engine_pids = [sim.proc.pid for sim in sims]
            for v in variants:
                service = procs.start_service(group, f"svc-{v.name}", engines, list(v.args), src=v.src)
                targets[v.name] = service.target
                service_pids[v.name] = [service.proc.pid]
            names = ["direct"] + [v.name for v in variants]
            if args.floor:
                port_file = procs.fresh_port_file(workdir / "floor.port")
                floor = group.start(
                    "floor",
                    [sys.executable, "-m", "bench.grpc_floor", "--serve", str(port_file)],
                    cwd=procs.REPO,
                )
                targets[FLOOR] = f"127.0.0.1:{procs.read_port_file(port_file, floor)}"
                service_pids[FLOOR] = [floor.popen.pid]
                names.append(FLOOR)
            for name in names:  # warm-up: connections, imports, first-call paths
                measure(name, engines, targets, 32, -1, connections.get(name, 1))
                time.sleep(0.5)
            for rep in range(args.reps):
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for n in counts:
                    for name in order:
                        system = SystemCpu()
                        service_before = cpu_seconds(service_pids[name])
                        engines_before = cpu_seconds(engine_pids)
                        client_before = time.process_time()
                        with busy_core(args.busy):
                            started = time.perf_counter()
                            result = measure(
                                name, engines, targets, n, rep * 7919 + n, connections.get(name, 1)
                            )
                            wall = time.perf_counter() - started
                        service_cpu = cpu_seconds(service_pids[name]) - service_before
                        engines_cpu = cpu_seconds(engine_pids) - engines_before
                        client_cpu = time.process_time() - client_before
                        if result is None:
                            time.sleep(5.0)  # the failed run's generations end (or are aborted)
                            continue
                        row = {"variant": name, "rep": rep, "busy": args.busy, **asdict(result)}
                        row["other_load_cores"] = round(system.elapsed() / max(wall, 1e-9), 2)
                        # Over the whole repetition (the streams' start too), not the abort alone.
                        row["service_cpu_s"] = round(service_cpu, 3)
                        row["engines_cpu_s"] = round(engines_cpu, 3)
                        row["client_cpu_s"] = round(client_cpu, 3)
                        # What the machine did besides this benchmark's own processes (the busy
                        # core's spinner included).
                        outside = system.elapsed() - service_cpu - engines_cpu - client_cpu
                        row["other_load_outside_cores"] = round(max(0.0, outside) / max(wall, 1e-9), 2)
                        rows.append(row)
                        print(
                            f"{name:14s} n={n:5d} rep {rep}: call {result.call_s * 1000:7.1f} ms  "
                            f"last {result.last_delivery_s * 1000:7.1f} ms  "
                            f"p50 {result.p50_delivery_s * 1000:7.1f} ms  "
                            f"aborted {result.aborted}/{n}  machine busy {row['other_load_cores']} cores  "
                            f"service CPU {service_cpu:.2f} s  client {client_cpu:.2f} s  "
                            f"other {row['other_load_outside_cores']} cores",
                            flush=True,
                        )
                        time.sleep(1.0)  # the engines finish the aborted requests' bookkeeping
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(f"busy core: {'yes' if args.busy else 'no'}")
    print(
        "| in flight | path | last ABORTED ms, median | best | call ms, median | x direct (median) "
        "| aborted | reps | service CPU s | client CPU s | other load, cores |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in counts:
        base: float | None = None
        for name in names:
            reps = [r for r in rows if r["variant"] == name and r["in_flight"] == n]
            if not reps:
                print(f"| {n} | {name} | failed | | | | | 0 | | | |")
                continue
            last = statistics.median(r["last_delivery_s"] for r in reps) * 1000
            call = statistics.median(r["call_s"] for r in reps) * 1000
            best = min(r["last_delivery_s"] for r in reps) * 1000
            aborted = min(r["aborted"] for r in reps)
            service_cpu = statistics.median(r["service_cpu_s"] for r in reps)
            client_cpu = statistics.median(r["client_cpu_s"] for r in reps)
            other = statistics.median(r["other_load_outside_cores"] for r in reps)
            if name == "direct":
                base = last
            ratio = last / base if base else float("nan")
            print(
                f"| {n} | {name} | {last:.1f} | {best:.1f} | {call:.1f} | {ratio:.2f} | {aborted}/{n} "
                f"| {len(reps)} | {service_cpu:.2f} | {client_cpu:.2f} | {other:.2f} |"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
