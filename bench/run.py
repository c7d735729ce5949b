"""`make bench`: the same workload direct to simulated engines and through rollout-grpc, side by side.

Why one run: the machine is small (2 cores) and shared, so absolute numbers drift between runs;
the comparison that matters (what the service costs on top of talking to vLLM directly) is made
row by row inside one run, with the two paths alternating (ABBA) and the better of the repetitions
kept for each path. The rows:

* `direct`   — an aiohttp client posting `/inference/v1/generate` (SSE, logprobs) to the engines
  round-robin, as vime's streaming rollout does (`bench/load.py`).
* `service`  — the same requests through one `rollout-grpc serve` process with the Python
  `AsyncRolloutClient` (token deltas, then the final sample), at the service's default stream
  batching: the first tokens at once, then a delta every 64 tokens or 200 ms
  (``GenerateOptions``; the report states the values read from the code).
* `nginx x2` — through nginx (the teammates' `deploy/nginx/rollout-grpc.conf.template`) in front
  of two replicas, when nginx and the template exist; left out otherwise (the report says so).
* `bench/agentic.py`: the agent front door vs the engines' own `/v1/chat/completions`
  (`docs/benchmarks.agentic.md`).
* `bench/r3_e2e.py`: a sample with its routed experts at 4k and 32k new tokens on a 48-layer x top-8
  MoE engine, direct vs through the service (bytes received and time to the array).
* `bench/floor.py` (the "floor" phase): the service against grpc.aio's own floor and the engines'
  own abort, paired per repetition, as ratios whose keys end in `_vs_floor` / `_vs_direct`.
* `bench/store.py`: a RolloutStep with BUFFER through the state store (embedded socket, Redis) vs
  in-process, paired ratios `*_vs_in_process`, and the bytes per buffered group (`--no-store`).
* extra service rows at concurrency 64 without delay: `final_only` (what `client.generate()` asks
  for: no deltas) and `text` mode (the service's default when the caller does not set `skip_text`).

Engines are simulated vLLM engines (`python -m rollout_grpc.sim`), two per phase, in their own
processes, with no per-token delay (pure overhead: the engines are as fast as Python allows) and
with 20 ms per token. Responses are 256 tokens (`ignore_eos`). Then abort-all latency with 256 and
1024 generations in flight: the service's `Abort(all)` vs the direct `/pause?mode=abort` +
`/resume` that vime sends, timed from the call to the last aborted sample delivered.

Service CPU comes from psutil on the service PID (user + system) over the measured interval;
peak RSS is sampled every 50 ms. "other load" is CPU used on the machine by processes that are not
part of the benchmark (teammates' jobs), in cores, so a noisy row can be recognised.

Outputs: `docs/benchmarks.json`, `docs/benchmarks.md` (tables, including the R3 encodings of
`bench/r3.py`), `docs/benchmarks.png`. Every process started here is stopped by PID in `finally`.
Run `python -m bench.run --quick` for a short smoke run (fewer requests, no repetitions).
`--vllm` runs only the real-vLLM rows (`bench/real_vllm.py`, `make bench-vllm`); `--scale` adds the
one-replica scale table (`bench/scale.py`, `make bench-scale`). Both keep their results in their own
files (`benchmarks.vllm.json`, `benchmarks.scale.json`, see `bench/sections.py`), rendered into
`benchmarks.md` by every run.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil

from bench import agentic, load, procs, r3, r3_e2e, store
from bench.report import previous_summary, write_markdown, write_plot
from bench.sections import num
from rollout_grpc.client import AsyncRolloutClient
from rollout_grpc.server.domain.model import GenerateOptions

DOCS = Path(__file__).resolve().parent.parent / "docs"
NGINX_TEMPLATE = procs.REPO / "deploy" / "nginx" / "rollout-grpc.conf.template"
MAX_TOKENS = 256


@dataclass(frozen=True, slots=True)
class Workload:
    """One row group: engine delay, closed-loop concurrency, request count, repetitions per path.

    `max_reps` > `reps` allows extra repetitions while the best one of some path was disturbed by
    outside load (see `run_workload`); cheap workloads get more of them.
    """

    token_delay_ms: float
    concurrency: int
    requests: int
    reps: int
    max_reps: int = 0

    @property
    def key(self) -> str:
        return f"delay {self.token_delay_ms:g} ms, c={self.concurrency}"


def plan(quick: bool) -> dict[float, list[Workload]]:
    """Request counts sized so the full run stays under ~10 minutes on 2 cores."""
    if quick:
        return {
            0.0: [Workload(0, 1, 4, 1), Workload(0, 64, 64, 1), Workload(0, 512, 512, 1)],
            20.0: [Workload(20, 64, 64, 1)],
        }
    return {
        0.0: [Workload(0, 1, 24, 2, 5), Workload(0, 64, 320, 2, 5), Workload(0, 512, 768, 2, 3)],
        20.0: [Workload(20, 1, 2, 2, 2), Workload(20, 64, 64, 2, 3), Workload(20, 512, 512, 2, 3)],
    }


ABORT_IN_FLIGHT = (256, 1024)
ABORT_TOKEN_DELAY_MS = 100.0  # slow enough that 1024 streams do not saturate 2 cores before the abort


# ----------------------------------------------------------------------------------- measurement


class SystemCpu:
    """Busy CPU seconds of the whole machine, to tell how much came from outside the benchmark."""

    def __init__(self) -> None:
        self._start = self._busy()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return float(t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0))

    def elapsed(self) -> float:
        return self._busy() - self._start


@dataclass
class Fleet:
    """The processes of one phase: engines, the single service, optionally nginx + 2 replicas."""

    engines: list[str]
    engine_pids: list[int]
    service_pid: int
    service_target: str
    replica_pids: list[int]
    nginx_pids: list[int]
    nginx_target: str | None

    def all_pids(self) -> dict[str, int]:
        pids = {"client": os.getpid(), "service": self.service_pid}
        pids |= {f"engine{i}": p for i, p in enumerate(self.engine_pids)}
        pids |= {f"replica{i}": p for i, p in enumerate(self.replica_pids)}
        pids |= {f"nginx{i}": p for i, p in enumerate(self.nginx_pids)}
        return pids


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarise(
    path: str, workload: Workload, run: load.RunResult, meter: procs.Meter, foreign_s: float
) -> dict[str, Any]:
    """One table row from a run and its meter."""
    tokens = sum(r.tokens for r in run.results)
    latencies = [r.latency_s * 1000 for r in run.results]
    ttfts = [r.ttft_s * 1000 for r in run.results if r.ttft_s is not None]
    cpu = meter.cpu_s
    rss = meter.peak_rss
    if path.startswith("nginx"):
        service_cpu = sum(v for k, v in cpu.items() if k.startswith("replica"))
        service_rss = sum(v for k, v in rss.items() if k.startswith("replica"))
    elif path == "direct":
        service_cpu, service_rss = 0.0, 0
    else:
        # "service" and, for `serve --workers N`, its workers ("service-w<i>").
        service_cpu = sum(v for k, v in cpu.items() if k.startswith("service"))
        service_rss = sum(v for k, v in rss.items() if k.startswith("service"))
    return {
        "path": path,
        "workload": workload.key,
        "token_delay_ms": workload.token_delay_ms,
        "concurrency": workload.concurrency,
        "requests": workload.requests,
        "completed": len(run.results),
        "errors": run.errors,
        "wall_s": round(run.wall_s, 3),
        "samples_per_s": round(len(run.results) / run.wall_s, 2),
        "tokens_per_s": round(tokens / run.wall_s, 1),
        "tokens": tokens,
        "latency_p50_ms": round(_pct(latencies, 0.5), 2),
        "latency_p99_ms": round(_pct(latencies, 0.99), 2),
        # None (JSON null) when no call reported a first token (h2load reads no gRPC messages).
        "ttft_p50_ms": round(_pct(ttfts, 0.5), 2) if ttfts else None,
        "ttft_p99_ms": round(_pct(ttfts, 0.99), 2) if ttfts else None,
        "service_cpu_s": round(service_cpu, 3),
        "service_cpu_s_per_mtok": round(service_cpu / tokens * 1e6, 2) if tokens and service_cpu else None,
        "service_peak_rss_mib": round(service_rss / 2**20, 1) if service_rss else None,
        "nginx_cpu_s": round(sum(v for k, v in cpu.items() if k.startswith("nginx")), 3),
        "engines_cpu_s": round(sum(v for k, v in cpu.items() if k.startswith("engine")), 3),
        "client_cpu_s": round(cpu.get("client", 0.0), 3),
        "other_load_cores": round(max(0.0, foreign_s - sum(cpu.values())) / run.wall_s, 2),
        "finishes": dict(_count(r.finish for r in run.results)),
    }


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def measure(
    fleet: Fleet,
    path: str,
    workload: Workload,
    rep: int,
    make: Callable[[], Coroutine[Any, Any, load.RunResult]],
) -> dict[str, Any]:
    """Run one coroutine under the meter and summarise it."""
    system = SystemCpu()
    with procs.Meter(fleet.all_pids(), interval_s=0.05) as meter:
        run = asyncio.run(make())
    row = summarise(path, workload, run, meter, system.elapsed())
    row["rep"] = rep
    print(
        f"  {workload.key:24s} {path:18s} rep {rep}: {row['tokens_per_s']:>9,.0f} tok/s  "
        f"p50 {row['latency_p50_ms']:>8.1f} ms  ttft {num(row['ttft_p50_ms'], '>7.1f')} ms  "
        f"svc cpu {row['service_cpu_s']:.2f}s  errors {row['errors']}  other load {row['other_load_cores']}",
        flush=True,
    )
    return row


Runner = Callable[[int, int, int, int], Coroutine[Any, Any, load.RunResult]]


def paths_for(fleet: Fleet, workload: Workload) -> dict[str, Runner]:
    """The paths to compare for a workload, each as `(seed, concurrency, requests, max_tokens) -> coro`."""
    engines, target = fleet.engines, fleet.service_target
    paths: dict[str, Runner] = {
        "direct": lambda seed, c, n, m: load.run_direct(engines, c, n, m, seed),
        "service": lambda seed, c, n, m: load.run_grpc(target, c, n, m, seed),
    }
    if fleet.nginx_target is not None:
        proxy = fleet.nginx_target
        paths["nginx x2"] = lambda seed, c, n, m: load.run_grpc(proxy, c, n, m, seed)
    if workload.token_delay_ms == 0 and workload.concurrency == 64:
        paths["service final_only"] = lambda seed, c, n, m: load.run_grpc(
            target, c, n, m, seed, final_only=True
        )
        paths["service text mode"] = lambda seed, c, n, m: run_grpc_text(target, c, n, m, seed)
    return paths


async def run_grpc_text(
    target: str, concurrency: int, requests: int, max_tokens: int, seed: int
) -> load.RunResult:
    """The service's default (text) mode: the engines detokenize and deltas carry text."""
    rng = random.Random(seed)
    parts = []
    for _ in range(requests):
        sample, params, options = load.grpc_request_parts(load.prompt(rng), max_tokens)
        options.skip_text = False
        parts.append((sample, params, options))
    async with AsyncRolloutClient(target) as client:
        return await load.closed_loop(
            concurrency, requests, lambda i: load.grpc_generate(client, parts[i], f"bench-t{seed}-{i}")
        )


#: Extra repetitions are only started while the run is younger than this (seconds), so a noisy
#: machine cannot push `make bench` far past ~10 minutes.
EXTRA_REP_BUDGET_S = 400.0
#: A repetition is rerun when outside processes used more than this many cores during it.
NOISY_CORES = 0.5


def run_workload(fleet: Fleet, workload: Workload, extra_deadline: float) -> list[dict[str, Any]]:
    """Every path of one workload, alternating order per repetition; returns every rep's row.

    The machine is shared: while the best repetition of some path ran under high outside load,
    one more repetition of every path is run (up to `workload.max_reps`, and only before
    `extra_deadline`, a `time.monotonic()` value), so that the best-of comparison compares
    quiet samples of each path more often.
    """
    paths = paths_for(fleet, workload)
    names = list(paths)
    rows = []
    c, n = workload.concurrency, workload.requests
    seed = int(workload.token_delay_ms * 1000 + c)
    # Warm-up of each path (engine tables, code paths, the service's engine connections): short
    # generations, not measured.
    for name in names:
        asyncio.run(paths[name](-seed, min(c, 16), min(n, 32), 16))
    reps = workload.reps
    rep = 0
    while rep < reps:
        order = names if rep % 2 == 0 else list(reversed(names))
        for name in order:
            rows.append(
                measure(
                    fleet,
                    name,
                    workload,
                    rep,
                    functools.partial(paths[name], seed * 10 + rep, c, n, MAX_TOKENS),
                )
            )
        rep += 1
        noisy = [name for name in names if _best(rows, name)["other_load_cores"] > NOISY_CORES]
        if rep == reps and rep < workload.max_reps and noisy and time.monotonic() < extra_deadline:
            print(
                f"  {workload.key}: best of {', '.join(noisy)} was disturbed; one more repetition", flush=True
            )
            reps += 1
    return rows


def _best(rows: list[dict[str, Any]], path: str) -> dict[str, Any]:
    return max((r for r in rows if r["path"] == path), key=lambda r: r["tokens_per_s"])


def best_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, path): the repetition with the highest throughput, plus every rep's tokens/s."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["path"]), []).append(row)
    out = []
    for reps in groups.values():
        best = dict(max(reps, key=lambda r: r["tokens_per_s"]))
        best["reps_tokens_per_s"] = [r["tokens_per_s"] for r in reps]
        out.append(best)
    directs = {r["workload"]: r for r in out if r["path"] == "direct"}
    for row in out:
        base = directs.get(row["workload"])
        if base is None:
            continue
        row["ratio_tokens_per_s"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        # The same ratio under the name every ratio key of benchmarks.json ends with
        # (`report.RATIO_SUFFIXES`), so the next run's comparison picks it up.
        row["tokens_per_s_vs_direct"] = row["ratio_tokens_per_s"]
        row["ratio_latency_p50"] = round(row["latency_p50_ms"] / base["latency_p50_ms"], 3)
        row["ratio_latency_p99"] = round(row["latency_p99_ms"] / base["latency_p99_ms"], 3)
        if row["ttft_p50_ms"] is not None and base["ttft_p50_ms"]:
            row["ratio_ttft_p50"] = round(row["ttft_p50_ms"] / base["ttft_p50_ms"], 3)
    return out


# ----------------------------------------------------------------------------------- fleets


def start_fleet(group: procs.Processes, token_delay_ms: float, with_nginx: bool, tag: str) -> Fleet:
    """Two engines and one service replica; plus nginx over two more replicas when asked."""
    sims = [procs.start_sim(group, f"{tag}-engine{i}", token_delay_ms, seed=i) for i in range(2)]
    engines = [sim.url for sim in sims]
    service = procs.start_service(group, f"{tag}-service", engines)
    replica_pids: list[int] = []
    nginx_pids: list[int] = []
    nginx_target = None
    if with_nginx:
        replicas = [procs.start_service(group, f"{tag}-replica{i}", engines) for i in range(2)]
        replica_pids = [r.proc.pid for r in replicas]
        binary = procs.nginx_binary()
        assert binary is not None
        nginx = procs.start_nginx(
            group, binary, [r.port for r in replicas], random.Random(), workers=1, name=f"{tag}-nginx"
        )
        nginx_target = nginx.target
        nginx_pids = [nginx.proc.pid] + [p.pid for p in psutil.Process(nginx.proc.pid).children()]
    return Fleet(
        engines,
        [sim.proc.pid for sim in sims],
        service.proc.pid,
        service.target,
        replica_pids,
        nginx_pids,
        nginx_target,
    )


def nginx_available() -> str | None:
    """Why the nginx row is left out, or None when nginx and the deploy template are present."""
    if not NGINX_TEMPLATE.exists():
        return f"{NGINX_TEMPLATE.relative_to(procs.REPO)} does not exist"
    if procs.nginx_binary() is None:
        return "no nginx binary on this machine"
    return None


# ----------------------------------------------------------------------------------- abort


def start_floor(group: procs.Processes) -> str:
    """The bare grpc.aio server of `bench.grpc_floor` (no engines, no service code); its target."""
    port_file = procs.fresh_port_file(group.workdir / "floor.port")
    floor = group.start(
        "floor", [sys.executable, "-m", "bench.grpc_floor", "--serve", str(port_file)], cwd=procs.REPO
    )
    return f"127.0.0.1:{procs.read_port_file(port_file, floor)}"


def run_aborts(group: procs.Processes, quick: bool) -> list[dict[str, Any]]:
    """Abort-all latency, service vs direct pause+resume, on slow engines; and the floor: a bare
    grpc.aio server ending as many held streams at one call (what grpc.aio alone needs)."""
    from bench import grpc_floor  # it imports this module (SystemCpu)

    fleet = start_fleet(group, ABORT_TOKEN_DELAY_MS, False, "abort")
    floor_target = start_floor(group)
    out = []
    for n in (256,) if quick else ABORT_IN_FLIGHT:
        for path in ("direct", "service", "floor"):
            try:
                if path == "direct":
                    result = asyncio.run(load.abort_direct(fleet.engines, n, 2048, n))
                elif path == "service":
                    result = asyncio.run(load.abort_grpc(fleet.service_target, n, 2048, n))
                else:
                    result = asyncio.run(grpc_floor.abort_floor(floor_target, n))
            except Exception as exc:  # record and go on: one flaky row must not lose the whole run
                print(f"  abort-all {n} in flight {path} failed: {exc!r}"[:500], flush=True)
                out.append({"path": path, "in_flight": n, "error": f"{type(exc).__name__}: {exc}"[:500]})
                time.sleep(1.0)
                continue
            row = {"path": path, **asdict(result)}
            print(
                f"  abort-all {n:5d} in flight {path:8s}: call {result.call_s * 1000:7.1f} ms, "
                f"last aborted sample {result.last_delivery_s * 1000:7.1f} ms, "
                f"p50 {result.p50_delivery_s * 1000:7.1f} ms, "
                f"aborted {result.aborted}/{n}",
                flush=True,
            )
            out.append(row)
            time.sleep(1.0)  # let the engines finish the aborted requests' bookkeeping
    return out


# ----------------------------------------------------------------------------------- store


def run_store(group: procs.Processes, quick: bool, results: dict[str, Any], out_dir: Path) -> None:
    """The state store rows (`bench/store.py`): a BUFFER round in-process vs embedded vs Redis, and
    the bytes per buffered group; in `results["store"]`, also written to benchmarks.store.md."""
    print("phase: state store (RolloutStep with BUFFER)", flush=True)
    try:
        results["store"] = store.run(group, quick)
    finally:
        group.stop_all()
    out_dir.mkdir(parents=True, exist_ok=True)
    store.write_page(results["store"], out_dir)


# ----------------------------------------------------------------------------------- main


def environment() -> dict[str, Any]:
    import aiohttp
    import google.protobuf

    commit = subprocess.run(
        ["git", "-C", str(procs.REPO), "rev-parse", "--short", "HEAD"],
        check=False,
        capture_output=True,
        text=True,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(procs.REPO), "status", "--porcelain", "rollout_grpc"],
        check=False,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "commit": commit + (" (rollout_grpc/ modified)" if dirty else ""),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "protobuf": google.protobuf.__version__,
        "aiohttp": aiohttp.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def stream_batch_description() -> str:
    """How the service batches deltas when the caller sets no options (the service rows run so)."""
    defaults = GenerateOptions()
    return (
        f"the first tokens at once, then every {defaults.stream_batch_tokens} tokens or "
        f"{defaults.stream_batch_interval_s * 1000:g} ms (the service defaults)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: few requests, no repetitions")
    parser.add_argument("--no-nginx", action="store_true", help="leave out the nginx + 2 replicas rows")
    parser.add_argument("--no-abort", action="store_true")
    parser.add_argument("--no-r3", action="store_true")
    parser.add_argument(
        "--no-floor",
        action="store_true",
        help="leave out the floor phase (bench/floor.py: the `_vs_floor` ratios, ~5 min)",
    )
    parser.add_argument("--no-agentic", action="store_true", help="leave out the agent front door rows")
    parser.add_argument(
        "--no-store",
        action="store_true",
        help="leave out the state store rows (bench/store.py, ~2 min; 30 s with --quick)",
    )
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="only the real-vLLM rows (bench/real_vllm.py): benchmarks.vllm.json, benchmarks.md re-rendered",
    )
    parser.add_argument(
        "--scale",
        action="store_true",
        help="also the one-replica scale table (bench/scale.py, ~5 min): benchmarks.scale.json",
    )
    parser.add_argument("--out-dir", type=Path, default=DOCS)
    args = parser.parse_args(argv)
    if args.vllm:  # its own file, so the simulated results stay as they are
        from bench import real_vllm

        return real_vllm.main([*(["--quick"] if args.quick else []), "--out-dir", str(args.out_dir)])

    started = time.monotonic()
    nginx_missing = "disabled with --no-nginx" if args.no_nginx else nginx_available()
    results: dict[str, Any] = {
        "benchmark": "rollout-grpc direct vs service",
        "environment": environment(),
        "settings": {
            "max_new_tokens": MAX_TOKENS,
            "prompt_tokens": load.PROMPT_LEN,
            "engines": 2,
            "quick": args.quick,
            "stream_batch": stream_batch_description(),
            "abort_token_delay_ms": ABORT_TOKEN_DELAY_MS,
        },
        "nginx_row": (
            "through nginx (`deploy/nginx/rollout-grpc.conf.template`, 1 worker process, least_conn) "
            "in front of two more `rollout-grpc serve` replicas on the same engines"
            if nginx_missing is None
            else f"left out: {nginx_missing}"
        ),
    }
    all_rows: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    workdir.chmod(0o755)
    try:
        with procs.Processes(workdir) as group:
            for delay, workloads in plan(args.quick).items():
                print(f"phase: engines with {delay:g} ms per token", flush=True)
                fleet = start_fleet(group, delay, nginx_missing is None, f"d{delay:g}")
                try:
                    for workload in workloads:
                        all_rows += run_workload(fleet, workload, started + EXTRA_REP_BUDGET_S)
                finally:
                    group.stop_all()
            if not args.no_abort:
                print("phase: abort-all", flush=True)
                try:
                    results["abort"] = run_aborts(group, args.quick)
                finally:
                    group.stop_all()
            if not args.no_floor:
                from bench import floor  # it imports this module (through bench.grpc_floor)
                from bench.compare import Variant

                print("phase: against the floors (bench/floor.py)", flush=True)
                try:
                    results["floor"] = floor.run(
                        group,
                        [Variant("service", None, ())],
                        reps=1 if args.quick else 3,
                        concurrencies=(64,) if args.quick else (64, 512),
                        in_flight=(256,) if args.quick else ABORT_IN_FLIGHT,
                    )
                finally:
                    group.stop_all()
            if not args.no_r3:
                print("phase: R3 end to end (48 layers x top-8)", flush=True)
                try:
                    results["r3_e2e"] = r3_e2e.run(group, args.quick)
                finally:
                    group.stop_all()
            if not args.no_store:
                run_store(group, args.quick, results, args.out_dir)
    except procs.StartupError as exc:
        print(f"a process did not start: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["rows"] = best_rows(all_rows)
    results["all_reps"] = all_rows
    if not args.no_r3:
        print("R3 encodings", flush=True)
        results["r3"] = r3.run(quick=args.quick)
    if not args.no_agentic:
        print("agent front door vs engine chat", flush=True)
        results["agentic"] = agentic.run(quick=args.quick)
    results["duration_s"] = round(time.monotonic() - started, 1)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    previous = args.out_dir / "benchmarks.json"
    if previous.exists() and not args.quick:
        results["previous"] = previous_summary(json.loads(previous.read_text()))
    (args.out_dir / "benchmarks.json").write_text(json.dumps(results, indent=2) + "\n")
    if "r3" in results:
        r3.write(results["r3"], args.out_dir)
    if "agentic" in results:
        agentic.write(results["agentic"], args.out_dir)
    if args.scale:
        from bench import scale

        print("phase: one replica at scale", flush=True)
        scale_results = scale.run(quick=args.quick)
        (args.out_dir / scale.RESULTS).write_text(json.dumps(scale_results, indent=2) + "\n")
        results["duration_s"] = round(time.monotonic() - started, 1)
    write_plot(results, args.out_dir / "benchmarks.png")
    write_markdown(results, args.out_dir / "benchmarks.md")
    print(f"done in {results['duration_s']} s: {args.out_dir}/benchmarks.{{json,md,png}}")
    other = statistics.median(r["other_load_cores"] for r in all_rows) if all_rows else 0.0
    print(f"median other load during rows: {other} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
